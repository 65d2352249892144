"""nbtrain.prepare and auto mode, without a kernel (the namespace logic is in test_namespace.py).

Each kind of object has its own tests: test_wrapping.py (modules), test_boundoptimizers.py,
test_preparedloaders.py, test_losslogging.py, test_ledger.py (the registry); here what
prepare orchestrates: everything at once, twice, and auto mode.

What needs a process group (DDP and FSDP2 wrapping, sharded loaders) runs on two
real ranks through nbtrain.start. Rank functions are nested so they travel by value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbtrain
from helpers.procs import finish, roundtrip
from nbtrain.rank.auto import ledger, prepare, preparedloaders, wrapping

# -- prepare outside a run: a single process -------------------------------------------------


def test_prepare_outside_a_run_behaves_as_one_process():
    ledger.configure()
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    got_model, got_opt, got_loader = nbtrain.prepare(model, opt, loader)
    assert got_model is model and got_opt is opt and got_loader is loader
    assert model.weight.device == nbtrain.device()
    assert nbtrain.prepare(model) is model
    assert nbtrain.prepare("not a model") == "not a model"
    with pytest.raises(TypeError, match="needs something to prepare"):
        nbtrain.prepare()



# -- prepare on two ranks --------------------------------------------------------------------


def test_prepare_wraps_ddp_transparently_and_shards_the_loader(launcher):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.frozen = nn.Linear(2, 2).requires_grad_(False)
            self.n_classes = 2

        def forward(self, x):
            return self.frozen(self.fc(x))

        def describe(self):
            return f"net with {self.n_classes} classes"

    def collate(batch):
        return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])

    def fn():
        torch.manual_seed(0)
        model = Net()
        loss_fn = nn.MSELoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TensorDataset(torch.arange(40.0).reshape(10, 4), torch.zeros(10, 2))
        loader = DataLoader(data, batch_size=3, shuffle=True, drop_last=True, collate_fn=collate)
        wrapped, opt2, sharded, same = nbtrain.prepare(model, opt, loader, "other")
        wrapped.n_classes = 3  # set through the wrapper: lands on the model
        orders = [[tuple(x[:, 0].tolist()) for x, _ in sharded] for _ in range(2)]
        for x, y in sharded:
            loss_fn(wrapped(x), y).backward()
        with wrapped.no_sync():
            pass
        return {
            "type": type(wrapped).__name__,
            "is_ddp": isinstance(wrapped, torch.nn.parallel.DistributedDataParallel),
            "fc": tuple(wrapped.fc.weight.shape),
            "describe": wrapped.describe(),
            "keys": sorted(wrapped.state_dict()),
            "opt_same": opt2 is opt,
            "again": nbtrain.prepare(model) is wrapped and nbtrain.prepare(wrapped) is wrapped,
            "loss_fn": nbtrain.prepare(loss_fn) is loss_fn,  # no trainable parameters: not wrapped
            "batch": sharded.batch_size,
            "drop_last": sharded.drop_last,
            "collate": sharded.collate_fn is collate,
            "sampler": type(sharded.sampler).__name__,
            "shuffle": sharded.sampler.shuffle,
            "length": len(sharded),
            "orders": orders,
            "same": same,
            "original": wrapping.original_of(wrapped) is model and wrapping.original_of(sharded) is loader,
        }

    result = finish(nbtrain.start(fn, devices=2))
    assert result["type"] == "DistributedDataParallel" and result["is_ddp"]
    assert result["fc"] == (2, 4) and result["describe"] == "net with 3 classes"
    assert result["keys"] == ["fc.bias", "fc.weight", "frozen.bias", "frozen.weight"]
    assert result["opt_same"] and result["again"] and result["loss_fn"] and result["original"]
    assert (result["batch"], result["drop_last"], result["collate"]) == (3, True, True)
    assert (result["sampler"], result["shuffle"], result["length"]) == ("DistributedSampler", True, 1)
    assert result["orders"][0] != result["orders"][1] or len(result["orders"][0][0]) == 0  # set_epoch each pass
    assert result["same"] == "other"



def test_auto_prepare_wraps_root_modules_only(launcher):
    def fn():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        namespace = {
            "model": model,
            "head": model[1],  # inside model: moved with it, not wrapped on its own
            "loss_fn": nn.MSELoss(),
            "opt": torch.optim.SGD(model.parameters(), lr=0.1),
            "loader": DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2),
            "n": 3,
        }
        ledger.configure()
        done = prepare.auto_prepare(namespace, list(namespace))
        return done, type(namespace["model"]).__name__, namespace["head"] is model[1]

    done, model_type, head_same = finish(nbtrain.start(fn, devices=2))
    assert dict(done) == {
        "model": "DistributedDataParallel", "loss_fn": "moved", "opt": "bound", "loader": "DistributedSampler"
    }
    assert model_type == "DistributedDataParallel" and head_same


def test_evaluation_choice_outside_a_run_is_remembered_and_checked():
    loader = DataLoader(TensorDataset(torch.zeros(200, 1)), batch_size=16)
    assert preparedloaders.batches_per_rank(loader, 2, "ddp", evaluation=True) == 13  # read whole
    assert nbtrain.prepare(loader, evaluation="shard") is loader  # in the kernel: nothing to rebuild
    assert preparedloaders.batches_per_rank(loader, 2, "ddp", evaluation=True) == 7  # the ranks will shard it
    assert roundtrip(loader)._nbtrain_evaluation == "shard"  # the choice travels with the loader
    with pytest.raises(ValueError, match=r"prepare\(evaluation='all'\): .* either 'whole' .* or 'shard'"):
        nbtrain.prepare(loader, evaluation="all")


def test_all_reduce_outside_a_run_gives_the_value_back_and_names_bad_input():
    tensor = torch.ones(2)
    assert nbtrain.all_reduce(tensor) is tensor and nbtrain.all_reduce(7, op="min") == 7
    with pytest.raises(TypeError, match="takes a number or a tensor, not list: reduce each number"):
        nbtrain.all_reduce([1, 2])
    with pytest.raises(ValueError, match=r"all_reduce\(op='avg'\) is not a reduction .* sum, mean, max, min"):
        nbtrain.all_reduce(1.0, op="avg")
