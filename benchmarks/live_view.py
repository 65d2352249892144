#!/usr/bin/env python
"""Live view benchmark: what ``nbtrain.log`` costs the ranks, and what a frame costs the kernel.

Run from the repository root::

    .venv/bin/python benchmarks/live_view.py            # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/live_view.py --quick    # about 30 seconds

1. Rank side, in one run of 2 CPU ranks (gloo, DDP): a small training step (MLP
   64-256-256-10, batch 64, SGD) timed in blocks, alternately with ``nbtrain.log(loss=loss)``
   after every step and without, so drift on a busy machine hits both alike. Printed: median
   step time of each, the median of the with/without ratios of neighbouring blocks (target:
   under 1% overhead), and the time spent inside ``log`` itself, timed call by call (the
   precise figure; the ratio carries the machine's noise). Twice: (a) the kernel consumes the
   events as ``watch`` does but draws nothing, so only the ranks' cost shows; (b) the kernel
   draws every frame a notebook would get (``--no-render`` skips it): on a machine whose
   cores all train, the kernel's drawing competes with the ranks too. The kernel's CPU
   share over each run is printed.
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
import statistics
import sys
import time

import nbtrain
from nbtrain import events
from nbtrain.kernel.display import CHART_CPU_SHARE, SLOWEST_CHART_SECONDS, ChartFigure, LiveView


def train_in_blocks(blocks: int, steps_per_block: int) -> dict:
    """On each rank: per-step times of blocks with and without ``nbtrain.log``, and the time inside it."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(64, 64), torch.randint(0, 10, (64,))
    inside_log = [0.0]

    def block(steps: int, log: bool) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if log:
                entered = time.perf_counter()
                nbtrain.log(loss=loss)
                inside_log[0] += time.perf_counter() - entered
        return (time.perf_counter() - started) / steps

    block(steps_per_block, log=True)  # warm-up: allocator, gloo buffers, the first flush
    inside_log[0] = 0.0
    with_log, without_log = [], []
    for index in range(blocks):
        # Alternate which goes first, so neither always follows the other's flush.
        for log in (True, False) if index % 2 == 0 else (False, True):
            (with_log if log else without_log).append(block(steps_per_block, log))
    return {"with": with_log, "without": without_log, "inside_log": inside_log[0] / (blocks * steps_per_block)}


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


def rank_side(args: argparse.Namespace, render: bool) -> None:
    run = nbtrain.start(train_in_blocks, (args.blocks, args.steps_per_block), devices=2, accelerator="cpu")
    view, kernel_cpu = consume(run, render)
    result = run.result()
    without_log = statistics.median(result["without"])
    with_log = statistics.median(result["with"])
    # Each block against its neighbour of the other kind: drift on a busy machine cancels.
    pair_ratios = sorted(w / o for w, o in zip(result["with"], result["without"]))
    ratio = statistics.median(pair_ratios)
    quartiles = statistics.quantiles(pair_ratios, n=4)
    kernel = "draws every frame a notebook would get" if render else "consumes events, draws nothing"
    label = "1b" if render else "1a"
    print(f"{label}. nbtrain.log(loss=loss) every step, rank 0 of 2 CPU ranks (gloo); the kernel {kernel}")
    print(f"   {args.blocks} blocks of {args.steps_per_block} steps each way, alternated")
    print(f"   median step without log: {without_log * 1e3:7.3f} ms;  with log: {with_log * 1e3:7.3f} ms")
    print(f"   step-time ratio with/without (median of pairs): {ratio:.4f} ({ratio - 1:+.2%}; "
          f"quartiles {quartiles[0] - 1:+.2%} .. {quartiles[2] - 1:+.2%}); target under +1%")
    print(f"   time inside log(): {result['inside_log'] * 1e6:.2f} us per step = "
          f"{result['inside_log'] / without_log:.3%} of a step (batching and sending included)")
    print(f"   kernel CPU meanwhile: {kernel_cpu:.1%} of one core; chart draws: {view.chart_renders}")


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

        def redraw() -> None:  # new data each time, so the kept figure really redraws
            extra[0] += 1
            view.handle(events.Metrics(1, 0, ((extra[0], 0.0, {"loss": 0.1, "accuracy": 0.9}),)))
            view.chart_png_base64(force=True)

        kept = timed(redraw, args.repeats)
        fresh = timed(lambda: ChartFigure(view.state).draw(view.state), max(3, args.repeats // 3))
        unchanged = timed(lambda: view.mimebundle(), args.repeats)
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
    args.blocks, args.steps_per_block, args.repeats = (8, 200, 5) if args.quick else (30, 300, 15)
    rank_side(args, render=False)
    if not args.no_render:
        rank_side(args, render=True)
    kernel_side(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
