"""nbtrain.prepare, auto mode, and the namespace logic of %%distributed, without a kernel.

Pure logic (which names a cell uses, what comes back and how it is applied) runs in this
process. What needs a process group (DDP and FSDP2 wrapping, sharded loaders) runs on two
real ranks through nbtrain.start. Rank functions are nested so they travel by value.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nbtrain
from helpers.procs import collect, finish, roundtrip
from nbtrain import events
from nbtrain.errors import RankError, SerializationError
from nbtrain.kernel import namespace as ns
from nbtrain.rank import cell as rank_cell
from nbtrain.rank import prepare as prep

# -- which kernel globals a cell uses ---------------------------------------------------------


def test_used_names_include_nested_scopes_but_not_locals_or_parameters():
    user_ns = {n: object() for n in ("loader", "model", "scale", "thresh", "items", "f", "x", "unused", "Base")}
    code = (
        "for x, y in loader:\n"
        "    out = model(x)\n"
        "def g(f, k=1):\n"
        "    return f + [q for q in items if q > thresh]\n"
        "sq = lambda v: v * scale\n"
        "class C(Base):\n"
        "    pass\n"
    )
    names = ns.analyse_cell(code, user_ns).names
    # x is a module-level name the cell loads (it may hold the kernel's x); f is only g's parameter
    assert names == ("Base", "items", "loader", "model", "scale", "thresh", "x")


def test_used_names_follow_notebook_functions_classes_and_closures():
    user_ns: dict = {"__name__": "__main__"}
    exec(  # noqa: S102 - as a notebook cell defines it
        "import math\n"
        "LR = 0.1\n"
        "WIDTH = 3\n"
        "def helper(v):\n"
        "    return v * LR\n"
        "def make(k):\n"
        "    def inner(v):\n"
        "        return helper(v) + k + math.pi\n"
        "    return inner\n"
        "closure = make(2)\n"
        "class Net:\n"
        "    def size(self):\n"
        "        return WIDTH\n"
        "net = Net()\n"
        "unrelated = 5\n",
        user_ns,
    )
    analysis = ns.analyse_cell("closure(1) + net.size()", user_ns)
    assert analysis.names == ("LR", "WIDTH", "closure", "helper", "math", "net")  # Net travels with net
    assert analysis.used_by["LR"] == "closure" and analysis.used_by["closure"] is None


def test_hidden_and_ipython_names_never_travel():
    user_ns = {"In": [], "_": 1, "_3": 2, "get_ipython": print, "secret": 1, "model": 1}
    analysis = ns.analyse_cell("print(In, _, _3, secret, model)", user_ns, hidden={"secret"})
    assert analysis.names == ("model",)


def test_augmented_assignments_read_the_kernels_value():
    user_ns = {"total": 0, "count": 0, "local": 0}
    code = "total += 1\ndef bump():\n    global count\n    count += 1\ndef own():\n    local = 1\n    local += 1\n"
    assert ns.analyse_cell(code, user_ns).names == ("count", "total")


def test_deleted_names_travel_so_the_cell_can_delete_them():
    assert ns.analyse_cell("del tmp", {"tmp": 1}).names == ("tmp",)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("model = DDP(model)", ("DDP",)),
        ("from torch.nn.parallel import DistributedDataParallel as W\nm = W(model)", ("DistributedDataParallel",)),
        ("s = torch.utils.data.DistributedSampler(ds)", ("DistributedSampler",)),
        ("fully_shard(model)", ("fully_shard",)),
        ("model, opt = nbtrain.prepare(model, opt)", ("nbtrain.prepare",)),
        ("for x in loader:\n    model(x)", ()),
    ],
)
def test_cells_that_distribute_themselves_are_detected(code, expected):
    user_ns = {"model": 1, "opt": 2, "loader": [], "nbtrain": nbtrain, "torch": torch, "ds": 3}
    assert ns.analyse_cell(code, user_ns).self_distributes == expected


def test_prepare_called_inside_a_notebook_function_is_detected():
    user_ns: dict = {"__name__": "__main__", "nbtrain": nbtrain}
    exec("def setup(m):\n    return nbtrain.prepare(m)\n", user_ns)  # noqa: S102 - as a notebook cell defines it
    assert ns.analyse_cell("model = setup(model)", user_ns).self_distributes == ("nbtrain.prepare",)


def test_logging_and_shell_use_and_the_shown_value_are_detected():
    user_ns = {"nbtrain": nbtrain, "log": nbtrain.log}
    assert ns.analyse_cell("nbtrain.log(loss=1)", user_ns).calls_log
    assert ns.analyse_cell("log(loss=1)", user_ns).calls_log
    assert not ns.analyse_cell("import math\nmath.log(2)", user_ns).calls_log
    assert ns.analyse_cell("get_ipython().system('ls')", {}).needs_shell
    assert ns.analyse_cell("x = 1\nx + 1", {}).display_last
    assert not ns.analyse_cell("x = 1\nx + 1", {}, raw_cell="x = 1\nx + 1;").display_last


def test_what_notebook_functions_refer_to_and_write_is_reported():
    user_ns: dict = {"__name__": "__main__", "epochs": 3}
    exec("def setup():\n    global epochs\n    epochs = 5\ndef train_step(loss):\n    loss.backward()\n", user_ns)  # noqa: S102 - as a notebook cell defines it
    analysis = ns.analyse_cell("setup()\nfor i in range(epochs):\n    train_step(model(x))\n", user_ns)
    assert analysis.function_writes == {"epochs"}
    assert "backward" in analysis.function_names
    assert ns.analyse_cell("for i in range(epochs):\n    pass\n", user_ns).function_writes == set()


# -- what cannot travel -----------------------------------------------------------------


def test_unpicklable_variable_is_named_with_its_type_and_a_remedy():
    lock = threading.Lock()
    user_ns: dict = {"__name__": "__main__", "lock": lock}
    exec("def helper():\n    return lock\n", user_ns)  # noqa: S102 - as a notebook cell defines it
    analysis = ns.analyse_cell("helper()", user_ns)
    error = ns.explain_unpicklable({n: user_ns[n] for n in analysis.names}, analysis.used_by)
    assert isinstance(error, SerializationError)
    message = str(error)
    assert "`lock` (a _thread.lock, used by `helper`)" in message
    assert "create it inside the cell" in message
    assert "`helper`" not in message.split("used by")[0]  # the function is not the culprit


def test_generators_and_open_files_are_named(tmp_path):
    with open(tmp_path / "f.txt", "w") as handle:
        error = ns.explain_unpicklable({"gen": (i for i in range(2)), "handle": handle, "ok": [1]}, {})
    assert "`gen` (a generator" in str(error) and "`handle` (a _io.TextIOWrapper" in str(error)
    assert "`ok`" not in str(error)
    assert ns.explain_unpicklable({"t": torch.zeros(3), "m": nn.Linear(2, 2)}, {}) is None


# -- coming back: run_cell in this process, then apply to a "kernel" namespace ------------


_travel = roundtrip  # the engine's round trip between the kernel and a rank


def _run_here(kernel_ns: dict, code: str, **spec_options):
    """Run ``code`` the way a rank would (one process, no process group) and apply the result."""
    analysis = ns.analyse_cell(code, kernel_ns)
    shipped = {n: kernel_ns[n] for n in analysis.names}
    spec = rank_cell.CellSpec(
        code=code, filename="<cell>", names=analysis.names, display_last=analysis.display_last, **spec_options
    )
    namespace, anchor = _travel((shipped, ns.anchor_function(kernel_ns)))
    result = rank_cell.run_cell(spec, namespace, anchor)
    outcome = ns.decode_result(_travel(result), shipped, kernel_ns)
    report = ns.apply_result(outcome, shipped, kernel_ns, result.deleted)
    return outcome, report, result


def test_namespace_out_updates_kernel_objects_in_place():
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()  # the kernel's dtype stays, whatever the rank sends
    kernel_ns: dict = {
        "__name__": "__main__",
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "history": [],
        "tmp": 1,
        "torch": torch,
    }
    history, opt, before = kernel_ns["history"], kernel_ns["opt"], model.weight.detach().clone()
    code = (
        "x = torch.ones(4, 3, dtype=torch.float64)\n"
        "loss = model(x).pow(2).mean()\n"
        "opt.zero_grad(); loss.backward(); opt.step()\n"
        "history.append(round(loss.item(), 6))\n"
        "model.eval()\n"
        "del tmp\n"
        "def twice(v):\n"
        "    return 2 * v + len(history)\n"
        "alias = model\n"
        "len(history)\n"
    )
    outcome, report, _ = _run_here(kernel_ns, code)
    assert kernel_ns["model"] is model and kernel_ns["opt"] is opt and kernel_ns["history"] is history
    assert model.weight.dtype == torch.float64 and not torch.equal(model.weight, before)
    assert not model.training
    assert len(history) == 1 and "momentum_buffer" in opt.state[model.weight]
    assert "tmp" not in kernel_ns and report.deleted == ["tmp"]
    assert kernel_ns["alias"] is model  # a reference to a kernel object comes back as that object
    assert kernel_ns["twice"].__globals__ is kernel_ns and kernel_ns["twice"](1) == 3
    assert outcome["display"] == (1,)
    assert {"model", "opt", "history", "x", "loss", "twice", "alias"} <= set(report.updated)


def test_unchanged_plain_objects_are_left_alone_and_unpicklable_values_skipped():
    config = {"lr": 0.1, "nested": [1, 2]}
    kernel_ns: dict = {"__name__": "__main__", "config": config}
    nested = config["nested"]
    outcome, _report, result = _run_here(kernel_ns, "lr = config['lr']\nimport threading\nguard = threading.Lock()\n")
    assert kernel_ns["config"] is config and config["nested"] is nested  # not even copied
    assert "config" not in outcome["changed"]
    assert kernel_ns["lr"] == 0.1
    assert [(name, kind) for name, kind, _ in result.skipped] == [("guard", "_thread.lock")]
    assert "guard" not in kernel_ns


def test_module_whose_architecture_changed_is_rebound():
    model = nn.Sequential(nn.Linear(2, 2))
    kernel_ns: dict = {"__name__": "__main__", "model": model, "nn": nn}
    _run_here(kernel_ns, "model[0] = nn.Linear(2, 5)\n")
    assert kernel_ns["model"] is not model and kernel_ns["model"][0].out_features == 5


def test_update_in_place_keeps_identity_where_it_can():
    class Box:
        def __init__(self, v):
            self.v = v

    box, values, table, found = Box(1), [1], {"a": 1}, {1}
    assert ns.update_in_place(box, Box(2)) and box.v == 2
    assert ns.update_in_place(values, [1, 2]) and values == [1, 2]
    assert ns.update_in_place(table, {"b": 2}) and table == {"b": 2}
    assert ns.update_in_place(found, {3}) and found == {3}
    assert not ns.update_in_place((1,), (2,))
    assert not ns.update_in_place([1], (1,))


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
