"""Launching: results, DDP training, user code from __main__, events, environment, fresh code.

Rank functions are nested in the tests so that they travel by value, as notebook code does.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import nbtrain
from helpers import procs
from helpers.procs import RUN_TIMEOUT, finish
from nbtrain.messages import events

HELPERS = Path(__file__).parent / "helpers"
CPU_COUNT = len(os.sched_getaffinity(0))


def test_rank_zero_value_comes_back_by_value(launcher):
    payload = {"numbers": [1, 2, 3], "text": "héllo", "nested": {"t": (1.5, None)}}

    def fn(data):
        data["numbers"].append(nbtrain.rank())  # a rank's copy: the caller's stays as it was
        return {"rank": nbtrain.rank(), "world": nbtrain.world_size(), "data": data, "t": torch.arange(3.0)}

    result = finish(nbtrain.start(fn, (payload,), devices=2))

    assert result["rank"] == 0 and result["world"] == 2
    assert result["data"] == {"numbers": [1, 2, 3, 0], "text": "héllo", "nested": {"t": (1.5, None)}}
    assert payload["numbers"] == [1, 2, 3]
    assert torch.equal(result["t"], torch.arange(3.0))


def test_launch_returns_rank_zero_value(launcher):
    # timeout: launch() itself has no deadline; the run's own bounds the wait.
    assert nbtrain.launch(lambda k: nbtrain.rank() + k, 40, devices=2, timeout=RUN_TIMEOUT) == 40


def test_ddp_matches_one_process_with_the_combined_batch(launcher):
    """2 ranks x batch b under DDP step exactly as one process with batch 2b."""
    torch.manual_seed(0)

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    initial = make_model().state_dict()
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    batch, epochs, lr = 4, 2, 0.1

    def train(world_batch_size_factor: int, dataset, sampler_for):
        from torch.utils.data import DataLoader

        model = make_model()
        model.load_state_dict(initial)
        if torch.distributed.is_initialized():
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            net = model
        sampler = sampler_for(dataset)
        loader = DataLoader(dataset, batch_size=batch * world_batch_size_factor, sampler=sampler, drop_last=True)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        for epoch in range(epochs):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for xb, yb in loader:
                loss = torch.nn.functional.mse_loss(net(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return model.state_dict()

    def on_rank():
        from torch.utils.data import DistributedSampler, TensorDataset

        torch.manual_seed(1234 + nbtrain.rank())  # different seeds: DDP must not depend on them
        dataset = TensorDataset(x, y)
        return train(1, dataset, lambda ds: DistributedSampler(ds, shuffle=False, drop_last=True))

    distributed = finish(nbtrain.start(on_rank, devices=2))

    from torch.utils.data import SequentialSampler, TensorDataset

    single = train(2, TensorDataset(x, y), SequentialSampler)

    assert distributed.keys() == single.keys()
    for name in single:
        diff = (distributed[name] - single[name]).abs().max().item()
        assert diff < 1e-5, f"{name} differs by {diff}"
    assert any((single[n] - initial[n]).abs().max() > 1e-3 for n in single), "training did not move the weights"


def test_lambda_closure_and_class_from_main():
    """A script's own lambda, closure and class (all in __main__) work inside fn."""
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "main_objects.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=HELPERS.parent.parent,
    )
    pids = {"caller": proc.pid, "launcher": None}
    try:
        pids = procs.read_json_line(proc, timeout=120)
        out, err = procs.rest_of_output(proc, timeout=120)
    finally:
        procs.cleanup_caller(proc, [pids["launcher"]])
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    assert "RESULT rank=0 world=2 square=4 add=100 scaled=3 label=Scaler:__main__ back=Scaler(9)" in lines, out
    assert "[rank 1] rank 1: square=9 add=101 scaled=6" in lines, out
    assert "[rank 0] rank 0: square=4 add=100 scaled=3" in lines, out


def test_output_reaches_the_caller_while_running(launcher, tmp_path):
    """print, stderr, os.write on fd 1 and a child process's output all arrive, tagged, live."""
    ack = tmp_path / "ack"

    def fn():
        import sys

        r = nbtrain.rank()
        print(f"print from {r}")
        print(f"stderr from {r}", file=sys.stderr)
        os.write(1, f"fd-level from {r}\n".encode())
        os.write(2, f"fd-level stderr from {r}\n".encode())
        os.system(f"echo from-c {r}")
        print(f"waiting {r}", flush=True)
        deadline = time.monotonic() + RUN_TIMEOUT / 2
        while not ack.exists():  # proves the lines arrived while this rank still runs
            if time.monotonic() > deadline:
                return "not acknowledged"
            time.sleep(0.01)
        return "acknowledged"

    lines: dict[tuple[int, str], list[str]] = {}

    def on_event(event):
        if isinstance(event, events.Output):
            lines.setdefault((event.rank, event.stream), []).extend(event.text.splitlines())
            if all(f"waiting {r}" in lines.get((r, "stdout"), []) for r in (0, 1)):
                ack.touch()  # both ranks' lines are here, and both are still running

    assert finish(nbtrain.start(fn, devices=2), on_event=on_event) == "acknowledged"
    for r in (0, 1):
        out, err = lines.get((r, "stdout"), []), lines.get((r, "stderr"), [])
        for expected in (f"print from {r}", f"fd-level from {r}", f"from-c {r}", f"waiting {r}"):
            assert expected in out, (r, out)
        for expected in (f"stderr from {r}", f"fd-level stderr from {r}"):
            assert expected in err, (r, err)


def _progress_and_open_lines():
    """Each rank: a line on each stream, a bar redrawn in place on stderr, a last line left open."""
    import sys

    rank = nbtrain.rank()
    print(f"hello {rank}")
    print(f"oops {rank}", file=sys.stderr)
    for step in range(1, 4):
        sys.stderr.write(f"\rbar {rank} {step}/3")
        sys.stderr.flush()
    print(f"left open {rank}", end="")


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_launch_prints_rank_output_as_a_cell_does(launcher, capfd, background):
    """Tagged lines; two ranks' bars on lines of their own; nothing left mid-line before what comes next."""
    if background:
        handle = nbtrain.launch(_progress_and_open_lines, devices=2, timeout=RUN_TIMEOUT, background=True)
        handle.wait(timeout=RUN_TIMEOUT)
    else:
        nbtrain.launch(_progress_and_open_lines, devices=2, timeout=RUN_TIMEOUT)
    out, err = capfd.readouterr()
    shown = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]  # what a terminal shows of each line
    assert all(line.count("[rank") <= 1 for line in shown), err
    for rank in (0, 1):
        assert f"[rank {rank}] hello {rank}" in out.splitlines() and f"[rank {rank}] left open {rank}" in out
        assert f"[rank {rank}] oops {rank}" in shown and f"[rank {rank}] bar {rank} 3/3" in shown, err
    assert err.count("[rank 1] bar") == 1, err  # rank 1's redraws: only the bar's last state
    assert out.endswith("\n") and err.rstrip("\n").count("\n") >= 3, (out, err)
    if background:
        assert err.splitlines()[-1].startswith("[nbtrain] background run "), err


def test_log_produces_metrics_events(launcher):
    def fn():
        r = nbtrain.rank()
        for step in range(1, 6):
            nbtrain.log(loss=torch.tensor(10.0 * r + step), lr=0.5)
        nbtrain.log(step=100, acc=0.75 + r)
        # ints, numpy and 0-d tensors of any dtype count; what is not one number is left out
        nbtrain.log(count=3, half=np.float32(0.5), flag=torch.tensor(True), vector=torch.ones(2), name="x")

    seen = []
    finish(nbtrain.start(fn, devices=2), on_event=seen.append)
    for r in (0, 1):
        rows = [row for e in seen if isinstance(e, events.Metrics) and e.rank == r for row in e.rows]
        assert [(step, values) for step, _, values in rows] == [
            *((step, {"loss": 10.0 * r + step, "lr": 0.5}) for step in range(1, 6)),
            (100, {"acc": 0.75 + r}),
            (101, {"count": 3.0, "half": 0.5, "flag": 1.0}),
        ]
        assert all(type(value) is float for _, _, values in rows for value in values.values())
        assert all(abs(t - time.time()) < 600 for _, t, _ in rows)


def test_memory_samples_arrive_during_the_run(launcher):
    def fn():
        block = torch.ones(8 << 20)  # 32 MB that the rank really holds
        time.sleep(1.5)  # the workload: a run lasting ~1.5 s
        return block.sum().item()

    seen = []
    assert finish(nbtrain.start(fn, devices=2), on_event=seen.append) == float(8 << 20)
    samples = [e for e in seen if isinstance(e, events.MemorySample)]
    for r in (0, 1):
        mine = [s for s in samples if s.rank == r]
        assert mine, f"no MemorySample for rank {r}"
        assert all(s.rss_bytes is not None and s.rss_bytes > 0 for s in mine)
    assert max(s.rss_bytes for s in samples) > 32 << 20


def test_ranks_see_torchrun_variables_and_the_callers_state(launcher, tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(tmp_path / "extra path"))
    token = uuid.uuid4().hex
    monkeypatch.setenv("NBTRAIN_TEST_TOKEN", token)  # set just before the launch
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def fn():
        import torch.distributed as dist

        mine = {
            "env": {name: os.environ.get(name) for name in names},
            "token": os.environ.get("NBTRAIN_TEST_TOKEN"),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "dist": (dist.get_rank(), dist.get_world_size()),
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone

    caller_path = list(sys.path)
    ranks = finish(nbtrain.start(fn, devices=2))

    assert "MASTER_PORT" not in os.environ and "MASTER_ADDR" not in os.environ
    # One machine's ranks meet through a store file (nbtrain.system.rendezvous): no port is listened on.
    assert {r["env"]["MASTER_PORT"] for r in ranks} == {"0"}
    for index, r in enumerate(ranks):
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(index), str(index), "2", "2"
        )
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert r["dist"] == (index, 2)
        assert r["token"] == token
        assert r["cwd"] == str(workdir)
        assert r["sys_path"] == caller_path


def test_master_port_stays_out_of_the_callers_environment(launcher, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")  # a stale value the caller happens to have
    port = finish(nbtrain.start(lambda: os.environ["MASTER_PORT"], devices=2))
    assert port != "1"
    assert os.environ["MASTER_PORT"] == "1"
    monkeypatch.delenv("MASTER_PORT")
    finish(nbtrain.start(lambda: None, devices=2))
    assert "MASTER_PORT" not in os.environ


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_threads_per_rank_divide_the_cores(launcher, monkeypatch, ranks):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def fn():
        import torch.distributed as dist

        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, torch.get_num_threads())
        return counts

    assert finish(nbtrain.start(fn, devices=ranks)) == [max(1, CPU_COUNT // ranks)] * ranks


@pytest.mark.parametrize("value", ["1", "3"])
def test_omp_num_threads_set_by_the_caller_wins(launcher, monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)  # after the launcher started
    threads = finish(nbtrain.start(lambda: (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]), devices=2))
    assert threads == (int(value), value)


def test_changed_module_is_not_stale(launcher, tmp_path, monkeypatch):
    """A module rewritten and reloaded in the caller runs as its new version in the ranks."""
    name = f"nbtrain_fresh_{uuid.uuid4().hex[:8]}"
    source = tmp_path / f"{name}.py"
    source.write_text("def version():\n    return 'first'\n\nclass Thing:\n    label = 'one'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    try:
        assert finish(nbtrain.start(lambda: (module.version(), module.Thing.label), devices=2)) == ("first", "one")
        assert finish(nbtrain.start(module.version, devices=2)) == "first"

        # A different size, so no bytecode cache can pass for the new source.
        source.write_text("def version():\n    return 'second, rewritten'\n\nclass Thing:\n    label = 'two!'\n")
        importlib.reload(module)
        assert module.version() == "second, rewritten"

        assert finish(nbtrain.start(lambda: (module.version(), module.Thing.label), devices=2)) == (
            "second, rewritten",
            "two!",
        )
        assert finish(nbtrain.start(module.version, devices=2)) == "second, rewritten"
    finally:
        sys.modules.pop(name, None)


@pytest.mark.slow
def test_ddp_spawn_runs_a_lambda_in_fresh_interpreters(launcher):
    def facts():
        import psutil
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        me = psutil.Process()
        mine = {
            "cmdline": me.cmdline()[1:3],
            "children": [" ".join(c.cmdline()) for c in me.children(recursive=True)],
            "parent": me.ppid(),
            "sum": t.item(),
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone

    weights = torch.arange(6.0)  # travels in the memfd, inherited by a fresh interpreter
    ranks = finish(nbtrain.start(lambda w: (facts(), w * 2), (weights,), devices=2, strategy="ddp_spawn"))

    ranks, doubled = ranks
    assert torch.equal(doubled, weights * 2)
    for r in ranks:
        assert r["cmdline"] == ["-m", "nbtrain.rank"]  # a fresh interpreter, not a fork
        assert r["parent"] == launcher.process.pid
        assert r["sum"] == 3.0
        assert r["children"] == [], "a spawned rank must not start a launcher of its own"


@pytest.mark.slow
def test_ddp_spawn_reports_a_rank_failure(launcher):
    def fn():
        if nbtrain.rank() == 1:
            raise LookupError("spawned rank failed")
        import torch.distributed as dist

        dist.barrier()

    with pytest.raises(nbtrain.RankError, match="rank 1 raised LookupError: spawned rank failed"):
        finish(nbtrain.start(fn, devices=2, strategy="ddp_spawn"))


def test_destroy_process_group_at_the_end_does_not_hang(launcher):
    """Code written for torchrun tears its group down; the rank still finishes and exits."""

    def fn():
        import torch.distributed as dist

        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.ones(3, 4)).sum().backward()
        dist.barrier()
        dist.destroy_process_group()
        return "finished"

    seen = []
    started = time.monotonic()
    assert finish(nbtrain.start(fn, devices=2), timeout=30, on_event=seen.append) == "finished"
    assert time.monotonic() - started < 15
    exits = {e.rank: e for e in seen if isinstance(e, events.RankExited)}
    assert {r: (e.exit_code, e.signal_number) for r, e in exits.items()} == {0: (0, None), 1: (0, None)}


def test_one_rank_runs_without_a_process_group_surprise(launcher):
    def fn():
        import torch.distributed as dist

        return dist.is_initialized(), dist.get_world_size(), nbtrain.world_size()

    assert finish(nbtrain.start(fn, devices=1)) == (True, 1, 1)
