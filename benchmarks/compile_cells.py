#!/usr/bin/env python
"""torch.compile in a cell of 2 ranks: compile workers per rank, compile time, the cache on a re-run.

Run from the repository root::

    .venv/bin/python benchmarks/compile_cells.py   # about 1 min on 2 cores

One Jupyter kernel (ipykernel, driven as the tests drive it) with a fresh temporary
directory and user cache directory (``TMPDIR``, ``XDG_CACHE_HOME``): inductor's cache
starts empty wherever it is. The same ``%%distributed --devices 2 --accelerator cpu`` cell
runs twice: it compiles an MLP 64-128-10 in DDP (CPU inductor: C++ kernels built by gcc) and
takes 5 SGD steps; ``--no-auto``, so that the figures are torch.compile's alone. Each rank reports:

- ``compile_threads``: inductor's setting on the rank (its pool of compile workers: threads
  that each run a compiler on CPU, processes for Triton on a GPU);
- the compile workers it started: the threads of inductor's pool, and the most compiler
  processes it ran at once (its children, sampled every 5 ms);
- its first step's time (the compile) and the mean of the 4 steps after;
- inductor's counters: FX graph cache hits and misses, AOT autograd cache hits and misses.

No target: before nbtrain shared the host's cores, each rank's pool was sized from all of
them; before it shared a cache, the re-run's ranks found theirs only where inductor's
default (``/tmp/torchinductor_<user>``) survived.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' kernel driver

from kernel_helpers import NotebookKernel

SETUP = """
%load_ext nbtrain
import os, threading, time, psutil, torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

def compiled_steps(model, steps=5):
    # On a rank: the pool's size and what it started, the steps' times, inductor's counters.
    # A function: what it makes stays on the rank, so a re-run's cell meets the same globals.
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor import async_compile
    counters.clear()
    me, peak, done = psutil.Process(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], len(me.children()))
            done.wait(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    compiled = torch.nn.parallel.DistributedDataParallel(torch.compile(model))  # DDP's hooks stay eager
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        loss = nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - began)
    done.set()
    sampler.join()
    pool = async_compile.AsyncCompile.pool
    return dict(
        compile_threads=inductor_config.compile_threads,
        pool_threads=len(pool()._threads) if pool.cache_info().currsize else 0,
        peak_compilers=peak[0],
        first_step_s=times[0],
        later_step_ms=1e3 * sum(times[1:]) / (steps - 1),
        fx_hit=counters["inductor"]["fxgraph_cache_hit"],
        fx_miss=counters["inductor"]["fxgraph_cache_miss"],
        aot_hit=counters["aot_autograd"]["autograd_cache_hit"],
        aot_miss=counters["aot_autograd"]["autograd_cache_miss"],
        cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        cores=len(os.sched_getaffinity(0)),
    )
"""

CELL = """%%distributed --devices 2 --accelerator cpu --no-auto
import torch.distributed as dist
stats = [None] * dist.get_world_size()
dist.all_gather_object(stats, compiled_steps(model))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--torch-defaults",
        action="store_true",
        help="as before nbtrain chose them: a pool per rank sized from all the cores, a cache in TMPDIR",
    )
    torch_defaults = parser.parse_args().torch_defaults
    with tempfile.TemporaryDirectory() as temporary, tempfile.TemporaryDirectory() as cache:
        env = {"TMPDIR": temporary, "XDG_CACHE_HOME": cache}
        if torch_defaults:  # a pool per rank sized from all the cores; the cache in the temporary directory
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(min(32, len(os.sched_getaffinity(0))))
            # Named apart from inductor's default (torchinductor_<user>), which nbtrain takes for unset.
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(temporary, "torchinductor-shared")
        with NotebookKernel(env=env) as kernel:
            kernel.client.timeout = 600  # a cell's bound: compiling on a busy small machine takes minutes
            kernel.run_ok(SETUP)
            runs = []
            for _ in ("first run", "re-run"):
                kernel.run_ok(CELL)
                runs.append(kernel.value("stats"))
    print("2 CPU ranks, torch.compile of an MLP 64-128-10, 5 SGD steps; per rank:")
    for name, stats in zip(("first run", "re-run"), runs, strict=True):
        for rank, s in enumerate(stats):
            print(
                f"  {name:9s} rank {rank}: compile_threads {s['compile_threads']} (of {s['cores']} cores), "
                f"pool threads {s['pool_threads']}, compilers at once {s['peak_compilers']}, "
                f"first step {s['first_step_s']:.2f} s, later steps {s['later_step_ms']:.2f} ms, "
                f"FX graph cache {s['fx_hit']} hit / {s['fx_miss']} miss, "
                f"AOT autograd cache {s['aot_hit']} hit / {s['aot_miss']} miss"
            )
    print(f"  cache directory: {runs[0][0]['cache_dir']}")


if __name__ == "__main__":
    main()
