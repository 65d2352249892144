#!/usr/bin/env python
"""Live view benchmark: what ``nbtrain.log`` costs the ranks, and what a frame costs the kernel.

Run from the repository root::

    .venv/bin/python benchmarks/live_view.py            # about 2.5 minutes on 2 cores
    .venv/bin/python benchmarks/live_view.py --quick    # about 40 seconds

1. Rank side, in runs of 2 CPU ranks (gloo, DDP). Training steps are timed in blocks,
   alternately with ``nbtrain.log(loss=loss)`` after every step and without, so drift on
   a busy machine hits both alike. Printed (target: the view costs the ranks under 1% of
   step time): the time spent inside ``log`` itself, timed call by call, as a share of a
   step. That is the whole of the ranks' cost: ``log`` is the only view code a rank runs
   (memory is sampled by the launcher, from /proc) and it never waits for the kernel.
   Beside it, as a check: the median with/without ratio of neighbouring blocks, for the
   rank's CPU time per step and for wall time, each with a 95% bootstrap interval, which
   shows how far this machine's noise reaches; and the CPU the kernel and the launcher
   used meanwhile.
   (a) one rank on one thread (MLP 64-256-256-10, batch 320, ~2 ms steps), a core left
       for the kernel and the launcher, the kernel consuming the events as ``watch`` does
       but drawing nothing: the ranks' own cost, without their competing with the view's
       other processes for cores. The one measurement here precise enough to show <1%.
   (b) 2 ranks, every core training (MLP 64-256-256-10, batch 64, ~2.5 ms steps); the
       kernel consumes the events as ``watch`` does but draws nothing.
   (c) the same, the kernel drawing: where all cores train, the kernel's drawing and the
       launcher's relaying take cores from the ranks, and a rank held up holds up the other.
   (d) the steady-state workload of benchmarks/launch.py (MLP 784-2048-2048-10, batch 64,
       ~50 ms steps), 2 ranks, the kernel drawing. ``--no-render`` skips (c) and (d).
2. Kernel side, no processes: a ``LiveView`` holding 2 ranks x N steps of two metrics,
   memory and logs. Printed per N: time to draw the charts (figure kept between frames,
   as in a run; and built afresh, as the first frame), time of a frame whose charts did not
   change, and the size of the frame's display data.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any

from launch import mlp  # benchmarks/launch.py, beside this script

import nbtrain
from nbtrain.kernel import launcher_connection
from nbtrain.kernel.display.chart import ChartFigure
from nbtrain.kernel.display.live import CHART_CPU_SHARE, SLOWEST_CHART_SECONDS, LiveView
from nbtrain.messages import events

WORKLOADS = {
    # (layer widths, batch): steps of ~2.5 ms, a worst case for logging every step (2 ranks)
    "small": ((64, 256, 256, 10), 64),
    # the same on one rank and one thread (~2 ms per step)
    "small-one-rank": ((64, 256, 256, 10), 320),
    # the steady-state workload of benchmarks/launch.py: ~50 ms per step here
    "mlp-2048": ((784, 2048, 2048, 10), 64),
}


def train_in_blocks(blocks: int, steps_per_block: int, workload: str) -> dict:
    """On each rank: per-step wall and CPU times of blocks with and without ``nbtrain.log``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    widths, batch = WORKLOADS[workload]
    model = nn.parallel.DistributedDataParallel(mlp(widths))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    inside_log = [0.0]

    def block(steps: int, log: bool) -> tuple[float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if log:
                entered = time.perf_counter()
                nbtrain.log(loss=loss)
                inside_log[0] += time.perf_counter() - entered
        return (time.perf_counter() - started) / steps, (time.process_time() - cpu_started) / steps

    block(steps_per_block, log=True)  # warm-up: allocator, gloo buffers, the first flush
    inside_log[0] = 0.0
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for index in range(blocks):
        # Alternate which goes first, so neither always follows the other's flush.
        for log in (True, False) if index % 2 == 0 else (False, True):
            times[log].append(block(steps_per_block, log))
    return {
        "wall": ([w for w, _ in times[True]], [w for w, _ in times[False]]),
        "cpu": ([c for _, c in times[True]], [c for _, c in times[False]]),
        "inside_log": inside_log[0] / (blocks * steps_per_block),
    }


def paired_overhead(
    with_log: list[float], without_log: list[float], resamples: int = 4000
) -> tuple[float, float, float]:
    """Median of the with/without ratios of neighbouring blocks, minus 1, and its 95% interval.

    Each block is compared with its neighbour of the other kind, so drift on a busy machine
    cancels; the interval comes from resampling the pairs (bootstrap), so it says how far
    the machine's noise lets the figure move.
    """
    ratios = [w / o for w, o in zip(with_log, without_log, strict=False)]
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return statistics.median(ratios) - 1, low - 1, high - 1


class HeadlessView(LiveView):
    """A notebook's view (same frames, same pacing) that sends its frames nowhere."""

    def publish(self, bundle: dict[str, str]) -> None:
        pass


def consume(run: nbtrain.Run, render: bool) -> tuple[LiveView, float]:
    """Feed a view as ``watch`` does; return it and the kernel's CPU share meanwhile."""
    view = HeadlessView(run.config, rich=True) if render else LiveView(run.config, rich=False, stream=io.StringIO())
    cpu_started, wall_started = time.process_time(), time.monotonic()
    for event in run.events(poll=0.125):
        view.handle(event)
        view.refresh()
    view.finish(run.state)
    cpu_share = (time.process_time() - cpu_started) / (time.monotonic() - wall_started)
    return view, cpu_share


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rank_side(label: str, workload: str, blocks: int, steps_per_block: int, render: bool, ranks: int = 2) -> None:
    launcher = launcher_connection.get_client()
    if not launcher.ready.wait(120):  # its start-up (importing torch) must not count as its work
        raise RuntimeError("the nbtrain launcher did not become ready in 120 s")
    launcher_cpu, started = cpu_seconds(launcher.process.pid), time.monotonic()
    run = nbtrain.start(train_in_blocks, (blocks, steps_per_block, workload), devices=ranks, accelerator="cpu")
    view, kernel_cpu = consume(run, render)
    result = run.result()
    launcher_share = (cpu_seconds(launcher.process.pid) - launcher_cpu) / (time.monotonic() - started)
    kernel = "draws every frame a notebook would get" if render else "consumes events, draws nothing"
    widths, batch = WORKLOADS[workload]
    who = "one CPU rank on one thread, a core left for the kernel and launcher" if ranks == 1 else (
        f"rank 0 of {ranks} CPU ranks (gloo), every core training")
    print(f"{label}. nbtrain.log(loss=loss) every step, {who}; "
          f"MLP {'-'.join(map(str, widths))} batch {batch}; the kernel {kernel}")
    print(f"   {blocks} pairs of blocks of {steps_per_block} steps, with and without log, alternated")
    wall_with, wall_without = result["wall"]
    print(f"   median step without log: {statistics.median(wall_without) * 1e3:7.3f} ms;  "
          f"with log: {statistics.median(wall_with) * 1e3:7.3f} ms")
    for name, (with_log, without_log), what in (
        ("CPU time", result["cpu"], "the rank's own work; with every core busy, time spent waiting in gloo counts too"),
        ("wall time", result["wall"], "includes waiting for other ranks and the machine's noise"),
    ):
        median, low, high = paired_overhead(with_log, without_log)
        print(f"   {name} per step, with/without log: {median:+.2%} (95% interval {low:+.2%} .. {high:+.2%}); "
              f"{what}")
    print(f"   time inside log(): {result['inside_log'] * 1e6:.2f} us per step = "
          f"{result['inside_log'] / statistics.median(wall_without):.3%} of a step (batching and sending included); "
          "target: the view costs under 1% of step time")
    print(f"   CPU meanwhile: kernel {kernel_cpu:.1%} of one core (chart draws: {view.chart_renders}), "
          f"launcher {launcher_share:.1%} of one core (relays events, samples memory)")


def synthetic_view(steps: int) -> LiveView:
    view = LiveView(
        strategy="ddp_notebook", accelerator="cpu", world_size=2, total_steps=steps, rich=False, stream=io.StringIO()
    )
    batch = 100
    for first in range(1, steps + 1, batch):
        for rank in range(2):
            rows = tuple(
                (
                    s,
                    s / 500,
                    {
                        "loss": 2 * math.exp(-s / (steps / 4)) + 0.05 * math.sin(s * 7.1 + rank),
                        "accuracy": 1 - math.exp(-s / (steps / 5)),
                    },
                )
                for s in range(first, min(first + batch, steps + 1))
            )
            view.handle(events.Metrics(1, rank, rows))
            view.handle(events.MemorySample(1, rank, (300 + first // 1000) * 2**20))
            view.handle(events.Output(1, rank, "stdout", f"step {first} loss {rows[-1][2]['loss']:.4f}\n"))
    return view


def timed(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kernel_side(args: argparse.Namespace) -> None:
    print("2. kernel side: one frame (2 ranks, metrics loss + accuracy, memory, logs)")
    ChartFigure(synthetic_view(100).state).draw(synthetic_view(100).state)  # import matplotlib off the clock
    for steps in (1_000, 10_000, 100_000):
        view = synthetic_view(steps)
        view.chart_png_base64(force=True)
        extra = [steps]

        def redraw(view: Any = view, extra: list[int] = extra) -> None:  # new data each time: a real redraw
            extra[0] += 1
            view.handle(events.Metrics(1, 0, ((extra[0], 0.0, {"loss": 0.1, "accuracy": 0.9}),)))
            view.chart_png_base64(force=True)

        kept = timed(redraw, args.repeats)
        fresh = timed(lambda view=view: ChartFigure(view.state).draw(view.state), max(3, args.repeats // 3))
        unchanged = timed(view.mimebundle, args.repeats)
        size = len(json.dumps(view.mimebundle()))
        print(
            f"   {steps:>7,} steps: charts {kept * 1e3:6.1f} ms (first frame {fresh * 1e3:6.1f} ms), "
            f"frame with unchanged charts {unchanged * 1e3:5.2f} ms, frame {size / 1024:5.1f} KiB"
        )
    print(f"   charts are redrawn at most 4/s and rest {1 / CHART_CPU_SHARE:.0f}x their drawing time, "
          f"at most {SLOWEST_CHART_SECONDS:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repetitions")
    parser.add_argument("--no-render", action="store_true", help="skip the run whose kernel draws frames")
    args = parser.parse_args()
    blocks, args.repeats = (16, 5) if args.quick else (80, 15)
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the rank's threads; the caller's setting wins, as documented
    try:
        rank_side("1a", "small-one-rank", blocks, 100, render=False, ranks=1)
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    rank_side("1b", "small", blocks, 100, render=False)
    if not args.no_render:
        rank_side("1c", "small", blocks, 100, render=True)
        rank_side("1d", "mlp-2048", max(4, blocks // 8), 20, render=True)
    kernel_side(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
