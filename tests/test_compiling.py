"""torch.compile on a rank (nbtrain.rank.machinery.compiling): a share of the cores, one private cache.

The rules alone first; then a real kernel whose 2-rank cell compiles a tiny MLP twice (once
for the module: a CPU compile is tens of seconds on a small machine): the first run's ranks
compile together into one cache, and the re-run's find everything there.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kernel_helpers import NotebookKernel
from nbtrain import patches
from nbtrain.rank.machinery import compiling

COMPILE_SECONDS = 400  # a cell's bound: two ranks compiling on a busy 2-core machine took ~90 s

# -- the rules ---------------------------------------------------------------------------------


def test_each_rank_gets_its_share_of_the_cores_for_compile_workers(tmp_path: Any) -> None:
    added = compiling.variables({"LOCAL_WORLD_SIZE": "2", "XDG_CACHE_HOME": str(tmp_path)}, cores=16)
    assert added[compiling.THREADS_VARIABLE] == "8"
    assert compiling.worker_share(3, 4) == 1  # more ranks than cores: each compiles in its own thread
    assert compiling.worker_share(256, 4) == compiling.MOST_THREADS  # inductor's own ceiling


def test_what_the_caller_set_is_kept(tmp_path: Any) -> None:
    environ = {"LOCAL_WORLD_SIZE": "2", compiling.THREADS_VARIABLE: "6", compiling.CACHE_VARIABLE: str(tmp_path)}
    assert compiling.variables(environ, cores=16) == {}


def test_inductors_own_default_in_the_environment_is_not_taken_for_the_callers(tmp_path: Any) -> None:
    import getpass

    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")  # dynamo's import wrote it
    environ = {"LOCAL_WORLD_SIZE": "1", "XDG_CACHE_HOME": str(tmp_path), compiling.CACHE_VARIABLE: default}
    assert compiling.variables(environ, cores=2)[compiling.CACHE_VARIABLE] == compiling.cache_location(environ)


def test_the_cache_is_a_private_directory_in_the_users_cache_dir(tmp_path: Any) -> None:
    added = compiling.variables({"LOCAL_WORLD_SIZE": "1", "XDG_CACHE_HOME": str(tmp_path)}, cores=2)
    directory = added[compiling.CACHE_VARIABLE]
    assert directory == str(tmp_path / "nbtrain" / "torch-compile")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_cache_others_may_enter_is_not_used_and_rank_0_says_what_to_do(tmp_path: Any, capsys: Any) -> None:
    directory = tmp_path / "nbtrain" / "torch-compile"
    directory.mkdir(parents=True)
    directory.chmod(0o775)
    environ = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "XDG_CACHE_HOME": str(tmp_path)}
    assert compiling.CACHE_VARIABLE not in compiling.variables(environ, cores=2)
    note = capsys.readouterr().err
    assert f"torch.compile's cache {directory} is not private" in note
    assert f"chmod 700 {directory}" in note


def test_inductors_setting_is_decided_again_from_the_ranks_environment(monkeypatch: Any) -> None:
    import torch._inductor.config as inductor_config

    monkeypatch.setenv(compiling.THREADS_VARIABLE, "3")
    assert compiling.threads_from_environment(inductor_config.compile_threads) == 3
    assert compiling.threads_from_environment(None) is None  # inductor decides later, itself
    rows = [patch for patch in patches.TABLE if patch.group == "compiling"]
    assert [(row.target, row.attribute, row.lifetime) for row in rows] == [
        ("torch._inductor.config", "compile_threads", patches.Lifetime.RANK)
    ]


# -- a real kernel, real ranks -----------------------------------------------------------------

SETUP = """
import os, threading, psutil, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
before = [p.detach().clone() for p in model.parameters()]
x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))

def compiled_steps(model):
    # On a rank: inductor's pool, the most compilers it ran at once, its cache counters, the weights.
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    counters.clear()
    me, peak, done = psutil.Process(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], len(me.children()))
            done.wait(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    net = torch.nn.parallel.DistributedDataParallel(torch.compile(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    done.set()
    sampler.join()
    return dict(
        threads=inductor_config.compile_threads,
        peak=peak[0],
        cores=len(os.sched_getaffinity(0)),
        fx_hit=counters["inductor"]["fxgraph_cache_hit"],
        fx_miss=counters["inductor"]["fxgraph_cache_miss"],
        aot_hit=counters["aot_autograd"]["autograd_cache_hit"],
        cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        weights=sum(float(p.double().sum()) for p in model.parameters()),
    )
"""

# --no-auto: the ranks' DDP is the cell's own (auto mode's wrapper is not what is tested here).
CELL = """%%distributed --devices 2 --accelerator cpu --no-auto
import torch.distributed as dist
stats = [None, None]
dist.all_gather_object(stats, compiled_steps(model))
"""


@pytest.fixture(scope="module")
def runs() -> Iterator[tuple[NotebookKernel, str, list[list[dict[str, Any]]]]]:
    """The kernel, its user cache directory, and each rank's figures from the first run and the re-run."""
    with tempfile.TemporaryDirectory() as cache:
        kernel = NotebookKernel(env={"XDG_CACHE_HOME": cache})
        try:
            kernel.client.timeout = COMPILE_SECONDS
            assert kernel.value("__import__('sys').executable") == sys.executable
            kernel.run_ok("%load_ext nbtrain\n" + SETUP)
            figures = []
            for _ in ("first run", "re-run"):
                kernel.run_ok(CELL)
                figures.append(kernel.value("stats"))
            yield kernel, cache, figures
        finally:
            kernel.shutdown()


pytestmark = pytest.mark.timeout(2 * COMPILE_SECONDS + 120)


def test_a_compiled_model_trains_on_2_ranks_and_the_kernels_model_gets_the_weights(runs: Any) -> None:
    kernel, _, figures = runs
    for ranks in figures:
        assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"])  # DDP kept them one model
    assert not kernel.value("all(torch.equal(p, q) for p, q in zip(model.parameters(), before))")
    assert kernel.value("sum(float(p.double().sum()) for p in model.parameters())") == pytest.approx(
        figures[1][0]["weights"]
    )


def test_the_ranks_compile_workers_in_all_are_no_more_than_the_cores(runs: Any) -> None:
    _, _, figures = runs
    for ranks in figures:
        cores = ranks[0]["cores"]
        assert [rank["threads"] for rank in ranks] == [compiling.worker_share(cores, 2)] * 2
        assert sum(rank["threads"] for rank in ranks) <= cores
        assert sum(rank["peak"] for rank in ranks) <= cores  # compiler processes running at once


def test_the_ranks_share_one_private_cache_and_a_re_run_compiles_nothing(runs: Any) -> None:
    _, cache, (first, again) = runs
    directory = os.path.join(cache, "nbtrain", "torch-compile")
    assert {rank["cache"] for rank in first + again} == {directory}
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert all(rank["fx_miss"] >= 1 for rank in first)  # an empty cache: both compiled, at once
    assert all(rank["fx_hit"] >= 1 and rank["fx_miss"] == 0 and rank["aot_hit"] >= 1 for rank in again)


def test_a_compile_threads_setting_of_the_callers_is_honoured(runs: Any) -> None:
    kernel, _, _ = runs
    kernel.run_ok("os.environ['TORCHINDUCTOR_COMPILE_THREADS'] = '3'")  # more than a rank's share
    try:
        kernel.run_ok(
            "%%distributed --devices 2 --accelerator cpu --no-auto\n"
            "import torch._inductor.config\n"
            "threads = torch._inductor.config.compile_threads\n"
        )
        assert kernel.value("threads") == 3
    finally:
        kernel.run_ok("del os.environ['TORCHINDUCTOR_COMPILE_THREADS']")
