"""The live view's chart figure (nbtrain.kernel.display.chart): layout checked through matplotlib's text extents.

Every chart state below is drawn for real (Agg); then every label the PNG shows (titles,
tick labels, axis names, value labels, the key) is measured with matplotlib's own text
extents: none may overlap another or leave the image, tick labels must be at least 10
CSS pixels, and no axis may show an offset label (the ``1e-5`` that used to sit on the
title of a linear loss axis).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import pytest

from nbtrain import livestate
from nbtrain.kernel.display import chart, chartlayout
from nbtrain.kernel.display.chart import ChartFigure
from nbtrain.messages import events

RUN = 1
MIN_TICK_CSS_PX = 10.0


def text_boxes(figure: ChartFigure) -> list[tuple[str, Any]]:
    """(text, bounding box in PNG pixels) of every label ``figure``'s last ``draw`` showed.

    Tick labels count only for ticks inside the axis' view (matplotlib keeps labels of
    ticks outside it, undrawn). For layout checks: nothing overlaps, nothing is cut off.
    """
    renderer = figure.canvas.get_renderer()
    tick_labels: set[int] = set()
    shown = []
    for panel in figure.panels:
        for axis in (panel.ax.xaxis, panel.ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            slack = (high - low) * 1e-9 if axis.get_scale() == "linear" else 0.0
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                tick_labels.update((id(tick.label1), id(tick.label2)))
            for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels(), strict=False):
                if low - slack <= loc <= high + slack or _log_close(axis, loc, low, high):
                    shown.append(label)
    shown += [t for t in figure.figure.findobj(_is_visible_text) if id(t) not in tick_labels]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in shown if _is_visible_text(t)]


def _is_visible_text(artist: Any) -> bool:
    from matplotlib.text import Text

    if not isinstance(artist, Text) or not artist.get_visible() or not artist.get_text().strip():
        return False
    axes = artist.axes
    return axes is None or axes.get_visible()


def _log_close(axis: Any, loc: float, low: float, high: float) -> bool:
    if axis.get_scale() != "log" or loc <= 0 or low <= 0:
        return False
    return math.log10(low) - 1e-9 <= math.log10(loc) <= math.log10(high) + 1e-9


def run_state(
    world_size: int = 2,
    steps: int = 400,
    metric=lambda step, rank: 2 * math.exp(-step / 80) + 0.05 * math.sin(step + rank),
    names: tuple[str, ...] = ("loss",),
    memory: str = "rss",
    batch_size: int | None = 8,
) -> livestate.LiveState:
    """A state fed as a run would feed it: batches of 20 steps, memory samples beside them."""
    state = livestate.LiveState("ddp_notebook", "cpu", world_size, total_steps=steps, batch_size=batch_size)
    for first in range(1, steps + 1, 20):
        now = first / 20
        for rank in range(world_size):
            rows = tuple(
                (step, step / 20, {name: metric(step, rank) + index for index, name in enumerate(names)})
                for step in range(first, min(first + 20, steps + 1))
            )
            state.apply(events.Metrics(RUN, rank, rows), now=now)
            if memory == "cuda":
                sample = events.MemorySample(
                    RUN, rank, None, int((1 + first / steps) * 2**30), 2 * 2**30, cuda_reserved_bytes=int(2.5 * 2**30)
                )
            else:
                sample = events.MemorySample(RUN, rank, (300 + first // 10 + rank) * 2**20)
            state.apply(sample, now=now)
    return state


STATES = {
    "loss-linear": lambda: run_state(),
    # The case: a linear axis of tiny values (title "loss 8.929e-06" and the offset label clashed).
    "tiny-linear": lambda: run_state(metric=lambda s, r: 8.9e-6 + 1e-8 * math.sin(s + r)),
    "loss-log": lambda: run_state(metric=lambda s, r: 10 * math.exp(-s / 40) + 1e-4),
    "large-values": lambda: run_state(metric=lambda s, r: 3e6 + 1e5 * math.sin(s / 10 + r)),
    "negative": lambda: run_state(metric=lambda s, r: -0.125 * s),
    "flat": lambda: run_state(metric=lambda s, r: 0.5),
    "one-rank": lambda: run_state(world_size=1, batch_size=None),
    "twelve-ranks": lambda: run_state(world_size=12),
    "gpu-four-ranks-six-charts": lambda: run_state(
        world_size=4, memory="cuda", names=("loss", "validation_loss_exponential_average", "accuracy", "lr")
    ),
    "long-run": lambda: run_state(steps=20_000),
    "first-sample": lambda: run_state(steps=1),  # one point per chart: the axes still span something
}


@functools.cache  # drawn once per module: the tests only read the figure
def drawn(name: str) -> tuple[ChartFigure, bytes]:
    state = STATES[name]()
    figure = ChartFigure(state)
    return figure, figure.draw(state)


def overlap(a, b, slack: float = 0.5) -> bool:
    return a.x0 + slack < b.x1 and b.x0 + slack < a.x1 and a.y0 + slack < b.y1 and b.y0 + slack < a.y1


@pytest.mark.parametrize("name", STATES)
def test_no_label_overlaps_another_or_leaves_the_image(name):
    figure, _ = drawn(name)
    boxes = text_boxes(figure)
    width, height = figure.pixel_size
    assert len(boxes) >= 8, boxes  # titles, ticks and axis names were all measured
    for text, box in boxes:
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= width + 0.5 and box.y1 <= height + 0.5, (
            f"{text!r} is cut off: {box} in a {width}x{height} image"
        )
    clashes = [
        (a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1 :] if overlap(box_a, box_b)
    ]
    assert not clashes, f"labels overlap: {clashes}"


@pytest.mark.parametrize("name", STATES)
def test_tick_labels_are_at_least_10_css_pixels_and_no_axis_has_an_offset_label(name):
    figure, _ = drawn(name)
    for panel in figure.panels:
        for axis in (panel.ax.xaxis, panel.ax.yaxis):
            assert axis.get_offset_text().get_text() == "", f"{panel.panel}: offset label {axis.get_offset_text()}"
            for label in axis.get_majorticklabels():
                css_px = label.get_fontsize() * chartlayout.CSS_DPI / 72
                assert css_px >= MIN_TICK_CSS_PX, (label.get_text(), css_px)
    ticks = [box for text, box in text_boxes(figure) if text and text[0].isdigit()]
    assert ticks and min(box.height for box in ticks) / chartlayout.PIXEL_RATIO >= MIN_TICK_CSS_PX


@pytest.mark.parametrize("name", ["loss-linear", "gpu-four-ranks-six-charts"])
def test_the_png_has_twice_the_pixels_of_its_css_size_and_a_transparent_background(name):
    figure, png = drawn(name)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, _depth, colour_type = struct.unpack(">IIBB", png[16:26])
    assert (width, height) == figure.pixel_size == tuple(chartlayout.PIXEL_RATIO * n for n in figure.css_size)
    assert colour_type == 6, "RGBA: the page's background (light or dark) shows through"
    import numpy

    corner = numpy.asarray(figure.figure.canvas.buffer_rgba())[0, 0]
    assert corner[3] == 0, f"the top-left pixel is not transparent: {list(corner)}"


def test_memory_is_a_line_over_time_per_rank_with_each_current_value_labelled():
    state = run_state()
    figure = ChartFigure(state)
    figure.draw(state)
    memory = next(p for p in figure.panels if p.panel.kind == "memory")
    for rank in (0, 1):
        seconds, mib = memory.lines[rank][0].get_data()
        assert len(seconds) == 20 and seconds[0] < seconds[-1] and mib[0] < mib[-1]  # it grew over the run
    texts = [text for text, _ in text_boxes(figure)]
    assert "host RSS, MiB" in texts and "338.0 MiB" in texts and "339.0 MiB" in texts


def test_gpu_memory_shows_allocated_and_reserved_lines():
    state = run_state(world_size=2, memory="cuda")
    figure = ChartFigure(state)
    figure.draw(state)
    memory = next(p for p in figure.panels if p.panel.kind == "memory")
    allocated, reserved = memory.lines[0]
    last_allocated = 1 + 381 / 400  # GiB, at the last sample (step 381)
    assert allocated.get_ydata()[-1] == pytest.approx(last_allocated) and reserved.get_ydata()[-1] == pytest.approx(2.5)
    texts = [text for text, _ in text_boxes(figure)]
    assert "GPU allocated, GiB" in texts and "GPU reserved" in texts and "1.95 GiB" in texts


def test_throughput_is_charted_over_time_with_its_current_value():
    state = run_state()  # 20 steps every second of the run's clock, batch 8 on 2 ranks
    figure = ChartFigure(state)
    figure.draw(state)
    throughput = next(p for p in figure.panels if p.panel.kind == "throughput")
    seconds, rates = throughput.line.get_data()
    assert len(seconds) > 5 and rates[-1] == pytest.approx(20 * 8 * 2)
    assert "throughput  320 samples/s" in [text for text, _ in text_boxes(figure)]


def test_a_decaying_loss_over_decades_gets_a_log_axis_with_plain_labels():
    figure, _ = drawn("loss-log")
    loss = figure.panels[0]
    assert loss.ax.get_yscale() == "log"
    labels = [t.get_text() for t in loss.ax.yaxis.get_majorticklabels() if t.get_text()]
    assert labels and all("$" not in label for label in labels), labels  # no mathtext 10^x


def test_the_figure_is_kept_while_its_charts_stay_the_same():
    state = run_state()
    assert ChartFigure.layout_of(state) == ChartFigure.layout_of(run_state(steps=800))
    state.apply(events.Metrics(RUN, 0, ((401, 30.0, {"accuracy": 0.5}),)), now=30.0)
    assert len(ChartFigure.layout_of(state)) == len(ChartFigure.layout_of(run_state())) + 1


def test_every_axis_follows_the_run_from_one_drawing_to_the_next():
    # The memory and throughput axes (seconds) and a loss axis first drawn at one step: each
    # drawing sets their limits, which must not stop the next drawing from following the data.
    state = run_state(steps=1)
    figure = ChartFigure(state)
    figure.draw(state)
    later = run_state(steps=400)
    figure.draw(later)
    for panel in figure.panels:
        seen = max(max(line.get_xdata(), default=0.0) for line in panel.ax.get_lines())
        assert panel.ax.get_xlim()[1] >= seen > 1.0, (panel.panel, panel.ax.get_xlim(), seen)


NEXT_RUNS = {  # a run, then another with the same charts and other data
    "log-then-linear": ("loss-log", "loss-linear"),
    "gpu": (
        "gpu-four-ranks-six-charts",
        lambda: run_state(
            world_size=4,
            steps=90,
            memory="cuda",
            names=("loss", "validation_loss_exponential_average", "accuracy", "lr"),
            metric=lambda s, r: 1e4 * math.exp(-s / 9) + r,
        ),
    ),
}


@pytest.mark.parametrize("name", NEXT_RUNS)
def test_a_figure_handed_back_draws_the_next_run_exactly_as_a_new_figure_would(name):
    first, then = NEXT_RUNS[name]
    earlier = STATES[first]()
    figure = chart.figure_for(earlier)
    figure.draw(earlier)
    chart.hand_back(figure)
    state = STATES[then]() if isinstance(then, str) else then()
    assert ChartFigure.layout_of(state) == figure.layout
    reused = chart.figure_for(state)
    assert reused is figure and chart.figure_for(state) is not figure  # taken: one run draws on it at a time
    assert reused.draw(state) == ChartFigure(state).draw(state)
