"""The live view's charts laid out without matplotlib: panels, grid, sizes, colours, ticks.

What the figure looks like is decided here (display/chart.py draws it). Sizes are CSS
pixels: the PNG has PIXEL_RATIO times as many pixels and the page shows it at the CSS
size, so it is sharp on high-DPI screens and its type has a known size on every screen.

Example:
    >>> grid_of(4), rank_colour(0), fit_title("loss", "0.25")
    ((3, 2), '#3b82f6', 'loss  0.25')
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from nbtrain.livestate import MAX_METRIC_CHARTS, LiveState

PIXEL_RATIO = 2
CSS_DPI = 96  # CSS pixels per inch: the figure's size in inches is its CSS size / 96
PANEL_CSS = (280, 190)  # one chart's cell, labels included
PANELS_PER_ROW = 3
KEY_ROW_CSS = 22  # the row above the charts that names the ranks' colours
FONT_CSS = {"tick": 11.0, "label": 11.0, "title": 12.5, "key": 11.0, "value": 11.0}
# Margins of a chart inside its cell: left for the y tick labels, bottom for the x tick
# labels and the axis name, top for the title; right for the memory chart's value labels.
MARGIN_CSS = {"left": 58, "right": 16, "top": 24, "bottom": 36, "right_labelled": 62}
# One ink for text, ticks and the mean line, at equal contrast (about 4.4:1) on white and
# on JupyterLab's dark background (#111): the PNG is transparent and serves both themes.
INK = "#777777"
GRID_ALPHA = 0.25
# Mid-luminance colours that read on white and on near-black alike.
RANK_COLOURS = ("#3b82f6", "#f97316", "#22c55e", "#ef4444", "#a855f7", "#eab308", "#14b8a6", "#ec4899")
THROUGHPUT_COLOUR = "#14b8a6"
LABELLED_RANKS = 4  # the memory chart labels each rank's current value up to this many ranks


# A chart's title fits above its axes: bold DejaVu Sans averages under 0.68 em a character.
TITLE_CHARS = int((PANEL_CSS[0] - MARGIN_CSS["left"] + 8) / (0.68 * FONT_CSS["title"]))


def fit_title(name: str, value: str = "", limit: int = TITLE_CHARS) -> str:
    """``name  value`` in at most ``limit`` characters: the name gives way, the value stays.

    >>> fit_title("loss", "0.25"), fit_title("validation_loss_exponential_average", "0.25", limit=20)
    ('loss  0.25', 'validation_lo…  0.25')
    """
    tail = f"  {value}" if value else ""
    room = max(1, limit - len(tail))
    if len(name) > room:
        name = name[: max(1, room - 1)] + "…"
    return name + tail


@dataclass(frozen=True)
class Panel:
    """One chart of the figure: a metric's, the memory's or the throughput's.

    ``name`` is the metric's name, ``"rss"`` / ``"cuda"`` for memory, ``"steps/s"`` /
    ``"samples/s"`` for throughput; ``ranks`` are those with a line in it.
    """

    kind: str  # "metric" | "memory" | "throughput"
    name: str
    ranks: tuple[int, ...] = ()


def chart_panels(state: LiveState, max_metrics: int = MAX_METRIC_CHARTS) -> tuple[Panel, ...]:
    """The charts the figure shows, in order: metrics (losses first), memory, throughput.

    The figure is rebuilt only when this changes, so it holds no values.

    >>> from nbtrain.messages import events
    >>> state = LiveState(world_size=2, batch_size=8)
    >>> state.apply(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}), (2, 0.5, {"loss": 0.5}))), now=1.0)
    >>> state.apply(events.MemorySample(1, 1, 2**28), now=1.0)
    >>> [(p.kind, p.name, p.ranks) for p in chart_panels(state)]
    [('metric', 'loss', (0,)), ('memory', 'rss', (1,)), ('throughput', 'samples/s', ())]
    """
    panels = [
        Panel("metric", name, tuple(sorted(state.metrics[name].ranks)))
        for name in state.chart_metric_names(max_metrics)
    ]
    if state.memory:
        panels.append(Panel("memory", state.memory_kind, tuple(sorted(state.memory))))
    if state.throughput.count:
        panels.append(Panel("throughput", "samples/s" if state.batch_size else "steps/s"))
    return tuple(panels)


def grid_of(panels: int, per_row: int = PANELS_PER_ROW) -> tuple[int, int]:
    """(columns, rows) of a figure with ``panels`` charts.

    >>> grid_of(1), grid_of(3), grid_of(5)
    ((1, 1), (3, 1), (3, 2))
    """
    columns = min(per_row, max(1, panels))
    return columns, max(1, math.ceil(panels / columns))


def rank_colour(rank: int) -> str:
    """The line colour of ``rank`` (the palette repeats past eight ranks)."""
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, unit) to show byte counts up to ``largest`` on a chart axis.

    >>> byte_unit(300 * 2**20), byte_unit(3 * 2**30), byte_unit(100)
    ((1048576, 'MiB'), (1073741824, 'GiB'), (1048576, 'MiB'))
    """
    return (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")


def compact_number(value: float, digits: int = 3) -> str:
    """A tick label at most about six characters wide: no offset text, no long decimals.

    >>> [compact_number(v) for v in (0, 0.5, 12, 300, 1500, 25_000, 3.2e6, 8.929e-06, -0.125, 1e-3)]
    ['0', '0.5', '12', '300', '1.5k', '25k', '3.2M', '8.93e-6', '-0.125', '0.001']
    """
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    magnitude = abs(value)
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            return _trimmed(f"{value / limit:.{digits}g}") + suffix
    if magnitude >= 1e-3:  # fixed point with ``digits`` significant digits: 300, not 3e+02
        decimals = max(0, digits - 1 - math.floor(math.log10(magnitude)))
        return _trimmed(f"{value:.{decimals}f}")
    mantissa, exponent = f"{value:.{max(1, digits - 1)}e}".split("e")
    return f"{_trimmed(mantissa)}e{int(exponent)}"


def _trimmed(text: str) -> str:
    if "e" in text:  # %g switched to an exponent: keep it short
        mantissa, exponent = text.split("e")
        return f"{_trimmed(mantissa)}e{int(exponent)}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def tick_labels(values: list[float]) -> list[str]:
    """Compact labels for an axis' ticks, with as few digits as show each tick exactly.

    >>> tick_labels([0.0, 0.5, 1.0]), tick_labels([1000, 1250, 1500]), tick_labels([1.001, 1.002])
    (['0', '0.5', '1'], ['1k', '1.25k', '1.5k'], ['1.001', '1.002'])
    """
    finite = sorted(v for v in values if math.isfinite(v))
    gaps = [b - a for a, b in itertools.pairwise(finite) if b > a]
    tolerance = 1e-3 * min(gaps) if gaps else 1e-9 * max((abs(v) for v in finite), default=1.0)
    digits = 2
    while digits < 7 and any(abs(float(f"{v:.{digits}g}") - v) > tolerance for v in finite):
        digits += 1
    return [compact_number(v, digits) for v in values]


def spread_labels(positions: list[float], gap: float, low: float, high: float) -> list[float]:
    """Positions for labels wanted at ``positions``: in the same order, at least ``gap`` apart,
    within [low, high] as far as they fit, each moved as little as that allows.

    >>> spread_labels([10.0, 11.0, 50.0], gap=6.0, low=0.0, high=100.0)
    [7.5, 13.5, 50.0]
    >>> spread_labels([99.0, 99.5], gap=6.0, low=0.0, high=100.0)
    [94.0, 100.0]
    """
    order = sorted(range(len(positions)), key=lambda i: positions[i])
    placed = [min(max(positions[i], low), high) for i in order]
    # Clusters of labels closer than the gap are spread around their middle, repeatedly
    # merging neighbours until none overlap (the classic label-dodging sweep).
    clusters = [[p, 1, p] for p in placed]  # [wanted mean, size, first position]
    merged: list[list[float]] = []
    for cluster in clusters:
        merged.append(cluster)
        while len(merged) > 1 and merged[-2][2] + merged[-2][1] * gap > merged[-1][2]:
            top = merged.pop()
            below = merged[-1]
            size = below[1] + top[1]
            mean = (below[0] * below[1] + top[0] * top[1]) / size
            below[:] = [mean, size, mean - (size - 1) * gap / 2]
    result: list[float] = []
    for _mean, size, first in merged:
        first = min(max(first, low), high - (size - 1) * gap)
        result.extend(first + k * gap for k in range(int(size)))
    for index in range(1, len(result)):  # clamping a cluster may have pushed it onto a neighbour
        result[index] = max(result[index], result[index - 1] + gap)
    if result and result[-1] > high:
        result[-1] = high
        for index in range(len(result) - 2, -1, -1):
            result[index] = min(result[index], result[index + 1] - gap)
    return [position for _, position in sorted(zip(order, result, strict=True))]


def wants_log_scale(values: list[float]) -> bool:
    """A log y axis for a decaying positive quantity that spans over two decades (a loss).

    Rising ones (an accuracy climbing from 0.001) stay linear: their story is near the top.

    >>> wants_log_scale([10.0, 1.0, 0.05]), wants_log_scale([1.0, 0.5]), wants_log_scale([0.001, 0.9, 1.0])
    (True, False, False)
    >>> wants_log_scale([1.0, -1.0]), wants_log_scale([])
    (False, False)
    """
    if len(values) < 2 or values[0] <= values[-1] or min(values) <= 0:
        return False
    return max(values) > min(values) * 100
