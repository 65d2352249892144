"""nbtrain.prepare and auto mode, without a kernel (the namespace logic is in test_namespace.py).

What needs a process group (DDP and FSDP2 wrapping, sharded loaders) runs on two
real ranks through nbtrain.start. Rank functions are nested so they travel by value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbtrain
from helpers.procs import collect, finish, roundtrip
from nbtrain import events
from nbtrain.errors import RankError
from nbtrain.rank import prepare as prep

# -- prepare outside a run: a single process -------------------------------------------------


def test_prepare_outside_a_run_behaves_as_one_process():
    prep.configure(None)
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


def test_loss_logging_is_off_outside_a_run():
    backward = torch.Tensor.backward
    with prep.loss_logging():
        assert torch.Tensor.backward is backward


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
            "original": prep.original_of(wrapped) is model and prep.original_of(sharded) is loader,
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


def test_fsdp_shards_parameters_and_rebinds_the_optimizer_with_its_state(launcher):
    def fn():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()  # state made before sharding must follow the parameters
        model, opt = nbtrain.prepare(model, opt)
        w = model[0].weight
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        state = opt.state[opt.param_groups[0]["params"][0]]
        return {
            "param": type(w).__name__,
            "local": tuple(w.to_local().shape),
            "full": tuple(w.shape),
            "opt_params_are_model_params": all(
                any(p is q for q in model.parameters()) for p in opt.param_groups[0]["params"]
            ),
            "step": float(state["step"]),
            "exp_avg": type(state["exp_avg"]).__name__,
        }

    result = finish(nbtrain.start(fn, devices=2, strategy="fsdp"))
    assert result["param"] == "DTensor" and result["local"] == (4, 4) and result["full"] == (8, 4)
    assert result["opt_params_are_model_params"]
    assert result["step"] == 3.0 and result["exp_avg"] == "DTensor"


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
        prep.configure("ddp")
        done = prep.auto_prepare(namespace, list(namespace))
        return done, type(namespace["model"]).__name__, namespace["head"] is model[1]

    done, model_type, head_same = finish(nbtrain.start(fn, devices=2))
    assert dict(done) == {
        "model": "DistributedDataParallel", "loss_fn": "moved", "opt": "bound", "loader": "DistributedSampler"
    }
    assert model_type == "DistributedDataParallel" and head_same



class _TwoHeads(nn.Module):
    """A model whose forward skips ``spare``: a parameter with no gradient in any step."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


def _train_three_steps():
    import sys

    torch.manual_seed(0)
    model = nbtrain.prepare(_TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"stepped {step}", flush=True)
    sys.stderr.flush()
    return model.find_unused_parameters


def _stderr_of(seen):
    from nbtrain import events

    return "".join(e.text for e in seen if isinstance(e, events.Output) and e.stream == "stderr")


def test_ddp_looks_for_no_unused_parameters_and_warns_nothing(launcher):
    def fn():
        torch.manual_seed(0)
        model = nbtrain.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
        return model.find_unused_parameters

    result, failure, seen = collect(nbtrain.start(fn, devices=2))
    assert failure is None and result is False
    assert "find_unused_parameters" not in _stderr_of(seen)  # DDP's hint about the flag never shows


def test_unused_parameters_fail_the_first_step_naming_them_and_the_fix(launcher):
    _result, failure, seen = collect(nbtrain.start(_train_three_steps, devices=2))
    assert isinstance(failure, RankError) and failure.exc_type == "UnusedParametersError", failure
    message = failure.exc_message
    assert "_TwoHeads has 2 of its 4 trainable parameters that got no gradient in the first step: " in message
    assert "spare.weight, spare.bias" in message and "body." not in message
    assert "--strategy ddp_find_unused_parameters_true" in message and "find_unused_parameters=True" in message
    printed = "".join(e.text for e in seen if isinstance(e, events.Output))
    assert "stepped" not in printed  # raised by the first backward, before the optimizer stepped


def test_ddp_find_unused_parameters_true_strategy_trains_such_a_model(launcher):
    run = nbtrain.start(_train_three_steps, devices=2, strategy="ddp_find_unused_parameters_true")
    result, failure, seen = collect(run)
    assert failure is None and result is True, failure
    printed = "".join(e.text for e in seen if isinstance(e, events.Output))
    assert printed.count("stepped 2") == 2


def test_batches_per_rank_in_the_kernel_match_the_prepared_loaders_on_the_ranks(launcher):
    from torch.utils.data import DistributedSampler, IterableDataset, WeightedRandomSampler

    ten = TensorDataset(torch.arange(10.0))
    loaders = [
        DataLoader(ten, batch_size=3, shuffle=True),  # 4 samples a rank (two are padding): 2 batches
        DataLoader(ten, batch_size=3, drop_last=True),  # 3 samples a rank, 1 full batch
        DataLoader(ten, batch_size=2),
        DataLoader(ten, batch_size=None),  # no batching: one item at a time
        DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4),
        DataLoader(ten, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 7)),  # custom: not sharded
        DataLoader(ten, batch_size=2, sampler=DistributedSampler(ten, num_replicas=5, rank=0)),  # the user's own
    ]

    def fn(loaders):
        import torch.distributed as dist

        lengths = [len(nbtrain.prepare(loader)) for loader in loaders]
        every_rank = [None] * nbtrain.world_size()
        dist.all_gather_object(every_rank, lengths)
        return every_rank

    on_ranks = finish(nbtrain.start(fn, (loaders,), devices=3))
    in_kernel = [prep.batches_per_rank(loader, 3, "ddp") for loader in loaders]
    assert on_ranks == [in_kernel] * 3
    assert in_kernel == [2, 1, 2, 4, 1, 4, 1]
    assert [prep.batches_per_rank(loader, 3, "none") for loader in loaders] == [len(x) for x in loaders]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    assert prep.batches_per_rank(DataLoader(Stream()), 3, "ddp") is None  # each rank reads what it reads
    assert prep.batches_per_rank([1, 2, 3], 3, "ddp") is None  # not a DataLoader


# -- training passes and evaluation passes -----------------------------------------------------


def test_training_passes_read_a_share_and_passes_without_gradients_read_everything(launcher):
    def fn():
        import torch.distributed as dist

        data = TensorDataset(torch.arange(10.0))
        loader = nbtrain.prepare(DataLoader(data, batch_size=3, shuffle=True))
        ordered = nbtrain.prepare(DataLoader(data, batch_size=4), evaluation="whole")

        def items(batches):
            return [int(v) for (x,) in batches for v in x]

        seen = {"share": [items(loader) for _ in range(2)], "len_share": len(loader)}
        with torch.no_grad():
            seen["no_grad"], seen["len_no_grad"] = items(ordered), len(ordered)
            seen["shuffled_whole"] = sorted(items(loader))
        with torch.inference_mode():
            seen["inference"] = items(ordered)
        seen["third_share"] = items(loader)  # epoch 2: evaluation passes did not advance it
        shards = [None] * nbtrain.world_size()
        dist.all_gather_object(shards, seen["share"][0])
        seen["shards"] = shards
        seen["report"] = prep.describe_passes(loader), prep.describe_passes(ordered)
        return seen

    seen = finish(nbtrain.start(fn, devices=2))
    first, second = seen["share"]
    assert len(first) == 5 and first != second  # half of it, reshuffled by set_epoch
    assert sorted(seen["shards"][0] + seen["shards"][1]) == list(range(10))
    assert seen["len_share"] == 2 and seen["len_no_grad"] == 3  # 5 of 10 in batches of 3; 10 in 4s
    assert seen["no_grad"] == seen["inference"] == list(range(10))  # whole, in the loader's own order
    assert seen["shuffled_whole"] == list(range(10))
    training_and_evaluation = (
        "sharded for training (DistributedSampler, 5 of 10 per rank; effective batch 6 = 3 per rank x 2 ranks) and "
        "evaluated whole on every rank (iterated without gradients)"
    )
    assert seen["report"] == (training_and_evaluation, "evaluated whole on every rank (iterated without gradients)")


def test_evaluation_shard_keeps_evaluation_passes_sharded_and_all_reduce_adds_them_up(launcher):
    def fn():
        data = TensorDataset(torch.arange(12.0))
        loader = nbtrain.prepare(DataLoader(data, batch_size=4), evaluation="shard")
        with torch.no_grad():
            values = [float(v) for (x,) in loader for v in x]
        probe = torch.tensor([float(nbtrain.rank()), 1.0])
        return {
            "values": values,
            "sum": nbtrain.all_reduce(sum(values)),
            "count": nbtrain.all_reduce(len(values)),
            "mean": nbtrain.all_reduce(nbtrain.rank() + 1, op="mean"),
            "max": nbtrain.all_reduce(nbtrain.rank(), op="max"),
            "min": nbtrain.all_reduce(0.5 + nbtrain.rank(), op="min"),
            "tensor": nbtrain.all_reduce(probe).tolist(),
            "probe_unchanged": probe.tolist() == [float(nbtrain.rank()), 1.0],
            "report": prep.describe_passes(loader),
        }

    result = finish(nbtrain.start(fn, devices=2))
    assert result["values"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # rank 0's share, in order
    assert result["sum"] == sum(range(12)) and result["count"] == 12 and type(result["count"]) is int
    assert result["mean"] == 1.5 and result["max"] == 1 and result["min"] == 0.5
    assert result["tensor"] == [1.0, 2.0] and result["probe_unchanged"]
    assert result["report"] == "evaluated sharded (DistributedSampler, 6 of 12 per rank; evaluation='shard')"


def test_evaluation_choice_outside_a_run_is_remembered_and_checked():
    loader = DataLoader(TensorDataset(torch.zeros(200, 1)), batch_size=16)
    assert prep.batches_per_rank(loader, 2, "ddp", evaluation=True) == 13  # read whole
    assert nbtrain.prepare(loader, evaluation="shard") is loader  # in the kernel: nothing to rebuild
    assert prep.batches_per_rank(loader, 2, "ddp", evaluation=True) == 7  # the ranks will shard it
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
