"""The live view's charts drawn with matplotlib: one PNG, twice the pixels of its CSS size.

:mod:`~nbtrain.kernel.display.chartlayout` decides what is shown and how it is laid out
(sizes in CSS pixels, fonts, colours, tick labels, where value labels go); this module
only draws it. The
figure is a bare ``Figure`` on the Agg canvas: no pyplot, so no global figure state, no
GUI backend, and nothing registered that would need closing.

Readable anywhere: the PNG has ``PIXEL_RATIO`` (2) pixels per CSS pixel and the page shows
it at its CSS size (sharp on high-DPI screens), type is at least 11 CSS pixels, and the
background is transparent with one mid-grey ink and mid-luminance line colours that read
on a light and on a dark notebook theme alike. Tick labels are compact (``1.5k``,
``8.9e-6``), so no axis ever needs an offset label that could collide with its title.

Example:
    >>> from nbtrain.messages import events
    >>> from nbtrain import livestate
    >>> state = livestate.LiveState("ddp_notebook", "cpu", 1)
    >>> state.apply(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}), (2, 0.1, {"loss": 0.5}))), now=0.0)
    >>> figure = ChartFigure(state)
    >>> png = figure.draw(state)
    >>> png[:8], figure.css_size, figure.pixel_size
    (b'\\x89PNG\\r\\n\\x1a\\n', (560, 190), (1120, 380))
"""

from __future__ import annotations

import functools
import io
import threading
from typing import Any

from nbtrain import livestate
from nbtrain.kernel.display import chartlayout, livetext

DRAWN_POINTS = 300  # per line: about one per CSS pixel of a chart's width
# Figures kept between runs for the next run with the same charts: building one costs as
# much as drawing it, and a short cell's only drawing is its last frame, on the cell's way
# back. Two at most, about 5 MiB each once drawn.
SPARE_FIGURES = 2

_spare: list[ChartFigure] = []
_spare_lock = threading.Lock()  # a background run's view draws on another thread


def figure_for(state: livestate.LiveState) -> ChartFigure:
    """A figure for ``state``'s charts: one an earlier run handed back with the same charts, else a new one.

    Example:
        >>> from nbtrain.messages import events
        >>> from nbtrain import livestate
        >>> state = livestate.LiveState("ddp_notebook", "cpu", 1)
        >>> state.apply(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}),)), now=0.0)
        >>> first = figure_for(state)
        >>> hand_back(first)
        >>> figure_for(state) is first
        True
    """
    layout = ChartFigure.layout_of(state)
    with _spare_lock:
        for index, figure in enumerate(_spare):
            if figure.layout == layout:
                return _spare.pop(index)
    return ChartFigure(state)


def hand_back(figure: ChartFigure) -> None:
    """Keep ``figure`` (no longer drawn by its run) for a later run with the same charts."""
    with _spare_lock:
        kept = [f for f in _spare if f.layout != figure.layout and f is not figure]
        _spare[:] = kept[len(kept) - SPARE_FIGURES + 1 :] + [figure]


class ChartFigure:
    """The charts' figure, kept between frames while its panels stay the same.

    Only the lines' data, limits, titles and labels change from one frame to the next;
    updating those costs a fraction of building the figure (ticks and axes are the
    expensive part). ``layout`` is the :func:`~nbtrain.kernel.display.chartlayout.chart_panels` it was built for.
    """

    def __init__(self, state: livestate.LiveState, pixel_ratio: int = chartlayout.PIXEL_RATIO) -> None:
        # deferred: start-up time (matplotlib)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.layout = self.layout_of(state)
        self.world_size = state.world_size
        columns, rows = chartlayout.grid_of(len(self.layout))
        self.key_row = chartlayout.KEY_ROW_CSS if self._needs_key() else 0
        width, height = columns * chartlayout.PANEL_CSS[0], rows * chartlayout.PANEL_CSS[1] + self.key_row
        self.css_size = (width, height)
        self.pixel_size = (width * pixel_ratio, height * pixel_ratio)
        self.dpi = chartlayout.CSS_DPI * pixel_ratio
        inches = (width / chartlayout.CSS_DPI, height / chartlayout.CSS_DPI)
        self.figure = Figure(figsize=inches, dpi=self.dpi, facecolor="none")
        self.canvas = FigureCanvasAgg(self.figure)  # becomes the figure's canvas
        self.panels: list[_Panel] = []
        for index, panel in enumerate(self.layout):
            row, column = divmod(index, columns)
            ax = self.figure.add_axes(self._rect(panel, row, column))
            self.panels.append(_PANEL_KINDS[panel.kind](ax, panel, state))
        self._labels_placed = False
        if self.key_row:
            self._draw_key()

    # What the figure's structure depends on; a new figure is built when it changes.
    layout_of = staticmethod(chartlayout.chart_panels)

    def _needs_key(self) -> bool:
        ranks = {rank for panel in self.layout for rank in panel.ranks}
        return len(ranks) > 1 or any(panel.kind == "memory" and panel.name == "cuda" for panel in self.layout)

    def _rect(self, panel: chartlayout.Panel, row: int, column: int) -> tuple[float, float, float, float]:
        """The axes' (left, bottom, width, height) in figure fractions, from CSS-pixel margins."""
        width, height = self.css_size
        cell_w, cell_h = chartlayout.PANEL_CSS
        margin = chartlayout.MARGIN_CSS
        right = margin["right_labelled"] if panel.kind == "memory" else margin["right"]
        left_px = column * cell_w + margin["left"]
        top_px = self.key_row + row * cell_h + margin["top"]
        axes_w = cell_w - margin["left"] - right
        axes_h = cell_h - margin["top"] - margin["bottom"]
        return (left_px / width, 1 - (top_px + axes_h) / height, axes_w / width, axes_h / height)

    def _draw_key(self) -> None:
        """One row above the charts naming the ranks' colours, the mean's line and GPU reserved's."""
        # deferred: start-up time (matplotlib)
        from matplotlib.lines import Line2D

        ranks = sorted({rank for panel in self.layout for rank in panel.ranks})
        entries: list[tuple[str, str, dict[str, Any]]] = []
        if len(ranks) > len(chartlayout.RANK_COLOURS):
            entries.append((f"ranks {ranks[0]}-{ranks[-1]}: one line each", chartlayout.INK, {}))
        elif len(ranks) > 1 or len(self.layout) == 1:
            entries += [(f"rank {rank}", chartlayout.rank_colour(rank), {}) for rank in ranks]
        if any(panel.kind == "metric" and len(panel.ranks) > 1 for panel in self.layout):
            entries.append(("mean of ranks", chartlayout.INK, {"linewidth": 3.2, "alpha": 0.55}))
        if any(panel.kind == "memory" and panel.name == "cuda" for panel in self.layout):
            entries.append(("GPU reserved", chartlayout.INK, {"linestyle": (0, (3, 2))}))
        width, height = self.css_size
        y = 1 - (chartlayout.KEY_ROW_CSS / 2) / height
        x_px = float(chartlayout.MARGIN_CSS["left"])
        for text, colour, style in entries:
            line_style = {"linewidth": 1.6, **style}
            xs = [x_px / width, (x_px + 18) / width]
            self.figure.add_artist(Line2D(xs, [y, y], transform=self.figure.transFigure, color=colour, **line_style))
            font = _points(chartlayout.FONT_CSS["key"])
            label = self.figure.text((x_px + 22) / width, y, text, color=chartlayout.INK, fontsize=font, va="center")
            x_px += 22 + _text_css_width(label) + 18

    def draw(self, state: livestate.LiveState) -> bytes:
        """The figure with ``state``'s data, as PNG bytes (transparent background)."""
        for panel in self.panels:
            panel.update(state)
        buffer = io.BytesIO()
        # zlib's fastest level: a third larger, a fifth less of the drawing's time.
        self.figure.savefig(buffer, format="png", dpi=self.dpi, transparent=True, pil_kwargs={"compress_level": 1})
        if not self._labels_placed:
            self._labels_placed = all(panel.place_x_label() for panel in self.panels)
        return buffer.getvalue()


def _text_css_width(text: Any) -> float:
    """How wide ``text`` is drawn, in CSS pixels (measured, so the key's entries never overlap)."""
    figure = text.get_figure()
    extent = text.get_window_extent(figure.canvas.get_renderer())
    return float(extent.width * chartlayout.CSS_DPI / figure.dpi)


def _points(css_pixels: float) -> float:
    """A font size in points that is ``css_pixels`` tall at the figure's CSS size."""
    return css_pixels * 72 / chartlayout.CSS_DPI


class _Panel:
    """One chart: its axes styled for either theme, and how to update it from the state."""

    x_label = "step"

    def __init__(self, ax: Any, panel: chartlayout.Panel, state: livestate.LiveState) -> None:
        # deferred: start-up time (matplotlib)
        from matplotlib.ticker import MaxNLocator

        self.ax = ax
        self.panel = panel
        ax.set_facecolor("none")
        ax.spines[["top", "right"]].set_visible(False)
        ax.spines[["left", "bottom"]].set_color(chartlayout.INK)
        ax.spines[["left", "bottom"]].set_linewidth(0.8)
        tick_size = _points(chartlayout.FONT_CSS["tick"])
        ax.tick_params(colors=chartlayout.INK, labelsize=tick_size, length=3, width=0.8, pad=2)
        ax.grid(True, color=chartlayout.INK, alpha=chartlayout.GRID_ALPHA, linewidth=0.6)
        ax.xaxis.set_major_locator(MaxNLocator(4, integer=self.x_label == "step", min_n_ticks=2))
        ax.xaxis.set_major_formatter(_compact_formatter_class()())
        ax.yaxis.set_major_formatter(_compact_formatter_class()())
        # Under the tick labels, at the right end: out of the way of both.
        label_size = _points(chartlayout.FONT_CSS["label"])
        ax.set_xlabel(self.x_label, fontsize=label_size, color=chartlayout.INK, labelpad=0, loc="right")
        # No axis name on the left: placed once, so matplotlib never measures the tick labels to place it.
        ax.yaxis.set_label_coords(0.0, 0.5)
        title: dict[str, Any] = {"fontsize": _points(chartlayout.FONT_CSS["title"]), "color": chartlayout.INK}
        # An explicit y: matplotlib then skips moving the title clear of top-side ticks (there are
        # none here), which measures every tick label on every drawing: a fifth of a frame's time.
        self.title = ax.set_title("", loc="left", pad=6, y=1.0, fontweight="bold", **title)

    def place_x_label(self) -> bool:
        """Keep the x axis' name where the last drawing put it: under the tick labels, whose height never changes.

        Until then matplotlib measures every tick label to place it, on every drawing. False
        (nothing fixed) when no tick label was drawn to be under.
        """
        ax = self.ax
        if not any(label.get_text() for label in ax.xaxis.get_majorticklabels()):
            return False
        x, y_pixels = ax.xaxis.label.get_position()  # x in axes fractions, y in the figure's pixels
        ax.xaxis.set_label_coords(x, ax.transAxes.inverted().transform((0.0, y_pixels))[1])
        return True

    def update(self, state: livestate.LiveState) -> None:
        """Redraw this chart's lines and title from ``state`` (each kind of chart has its own)."""
        raise NotImplementedError

    def _rescale(self, scale: str = "linear") -> None:
        # deferred: start-up time (matplotlib)
        from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter

        ax = self.ax
        if ax.get_yscale() != scale:
            ax.set_yscale(scale)
            if scale == "log":
                ax.yaxis.set_major_locator(LogLocator(base=10, numticks=5))
                ax.yaxis.set_minor_formatter(NullFormatter())
            else:
                ax.yaxis.set_major_locator(MaxNLocator(5, steps=[1, 2, 5, 10]))  # no 2.5: labels stay short
            ax.yaxis.set_major_formatter(_compact_formatter_class()())
        ax.relim()
        ax.autoscale_view()
        low, high = ax.get_xlim()
        # auto=None: the x axis keeps following the data at the next drawing (set_xlim alone
        # would switch that off, and the axis would stay as this drawing left it).
        if self.x_label == "seconds":  # time runs from the run's start, whenever the first sample came
            ax.set_xlim(0, max(high, 1.0), auto=None)
        elif high - low < 1:  # one step so far: a step's width, not ticks a millionth apart
            ax.set_xlim(low, low + 1, auto=None)


class _MetricPanel(_Panel):
    """A logged metric: a thin line per rank, the mean of ranks in bold, its value in the title."""

    def __init__(self, ax: Any, panel: chartlayout.Panel, state: livestate.LiveState) -> None:
        super().__init__(ax, panel, state)
        many = len(panel.ranks) > 1
        self.rank_lines = {
            rank: ax.plot([], [], linewidth=1.1 if many else 1.6, color=chartlayout.rank_colour(rank), zorder=3)[0]
            for rank in panel.ranks
        }
        # Under the ranks' lines, wide and half-transparent: ranks that agree show on top of it.
        self.mean_line = ax.plot([], [], lw=3.2, alpha=0.55, color=chartlayout.INK, zorder=2)[0] if many else None
        self.band: Any = None

    def update(self, state: livestate.LiveState) -> None:
        """Each rank's line, the mean of the ranks with its range shaded, the title with the latest value."""
        history = state.metrics[self.panel.name]
        longest: list[float] = []
        for rank, line in self.rank_lines.items():
            steps, means, _, _ = history.ranks[rank].coarsened(DRAWN_POINTS)
            line.set_data(steps, means)
            longest = means if len(means) > len(longest) else longest
        latest = history.ranks[self.panel.ranks[0]].last_value
        if self.band is not None:
            self.band.remove()
            self.band = None
        if self.mean_line is not None:
            steps, means, lows, highs = history.mean.coarsened(DRAWN_POINTS)
            self.mean_line.set_data(steps, means)
            if len(steps) < history.mean.count:  # each point stands for several steps: shade their range
                self.band = self.ax.fill_between(steps, lows, highs, color=chartlayout.INK, alpha=0.15, lw=0, zorder=1)
            latest = history.mean.last_value if history.mean.count else latest
        self._rescale("log" if chartlayout.wants_log_scale(longest) else "linear")
        self.title.set_text(chartlayout.fit_title(self.panel.name, livetext.format_value(latest)))


class _TimePanel(_Panel):
    x_label = "seconds"


class _MemoryPanel(_TimePanel):
    """Memory per rank over time; each rank's current value labelled at the right edge."""

    def __init__(self, ax: Any, panel: chartlayout.Panel, state: livestate.LiveState) -> None:
        super().__init__(ax, panel, state)
        self.lines: dict[int, list[Any]] = {}
        for rank in panel.ranks:
            colour = chartlayout.rank_colour(rank)
            lines = [ax.plot([], [], linewidth=1.6, color=colour)[0]]
            if panel.name == "cuda":  # reserved: what the caching allocator holds, dashed
                lines.append(ax.plot([], [], linewidth=1.0, linestyle=(0, (3, 2)), color=colour)[0])
            self.lines[rank] = lines
        labelled = panel.ranks if len(panel.ranks) <= chartlayout.LABELLED_RANKS else ()
        size = _points(chartlayout.FONT_CSS["value"])
        self.labels = {
            rank: ax.annotate(
                "", xy=(1, 0), xycoords="axes fraction", xytext=(4, 0), textcoords="offset points",
                va="center", ha="left", fontsize=size, color=chartlayout.rank_colour(rank), annotation_clip=False,
            )
            for rank in labelled
        }

    def update(self, state: livestate.LiveState) -> None:
        """Each rank's memory over time in MiB or GiB, its current value labelled at the right (up to four ranks)."""
        drawn = {
            rank: [series.coarsened(DRAWN_POINTS) for series in state.memory[rank].charted()] for rank in self.lines
        }
        largest = max((max(highs, default=0.0) for parts in drawn.values() for _, _, _, highs in parts), default=0.0)
        divisor, unit = chartlayout.byte_unit(largest)
        for rank, lines in self.lines.items():
            for line, (seconds, values, _, _) in zip(lines, drawn[rank], strict=False):
                line.set_data(seconds, [v / divisor for v in values])
        self._rescale()
        self.ax.set_ylim(0, max(largest / divisor * 1.08, 1e-9))
        title = f"GPU allocated, {unit}" if self.panel.name == "cuda" else f"host RSS, {unit}"
        value = ""
        if not self.labels:  # too many ranks to label each: the largest current value
            value = "max " + livetext.format_bytes(max(state.memory[rank].current_bytes or 0 for rank in self.lines))
        self.title.set_text(chartlayout.fit_title(title, value))
        self._place_labels(state)

    def _place_labels(self, state: livestate.LiveState) -> None:
        """Each rank's current value at the right edge, level with its line's end, never overlapping."""
        if not self.labels:
            return
        ax = self.ax
        low, high = ax.get_ylim()
        wanted = []
        for rank in self.labels:
            current = state.memory[rank].current_bytes or 0
            lines = self.lines[rank][0].get_ydata()
            value = lines[-1] if len(lines) else 0.0
            wanted.append((rank, current, (value - low) / (high - low) if high > low else 0.0))
        height_px = ax.get_position().height * ax.get_figure().get_figheight() * chartlayout.CSS_DPI
        gap = 1.25 * chartlayout.FONT_CSS["value"] / height_px
        spread = chartlayout.spread_labels([w[2] for w in wanted], gap, gap / 2, 1 - gap / 2)
        for (rank, current, _), y in zip(wanted, spread, strict=True):
            label = self.labels[rank]
            label.xy = (1, y)
            label.set_text(livetext.format_bytes(current))


class _ThroughputPanel(_TimePanel):
    """Steps (or samples) per second over the run, measured over a sliding window."""

    def __init__(self, ax: Any, panel: chartlayout.Panel, state: livestate.LiveState) -> None:
        super().__init__(ax, panel, state)
        self.line = ax.plot([], [], linewidth=1.6, color=chartlayout.THROUGHPUT_COLOUR)[0]

    def update(self, state: livestate.LiveState) -> None:
        """The run's step or sample rate over time, the title with the latest."""
        per_step = (state.batch_size or 1) * state.world_size if self.panel.name == "samples/s" else 1
        seconds, rates, _, _ = state.throughput.coarsened(DRAWN_POINTS)
        self.line.set_data(seconds, [rate * per_step for rate in rates])
        self._rescale()
        self.ax.set_ylim(0, max(max(rates, default=0.0) * per_step * 1.12, 1e-9))  # headroom: the line clear of the top
        latest = state.throughput.last_value
        shown = livetext.format_rate(None if latest is None else latest * per_step, self.panel.name)
        self.title.set_text(chartlayout.fit_title("throughput", shown))


_PANEL_KINDS = {"metric": _MetricPanel, "memory": _MemoryPanel, "throughput": _ThroughputPanel}


@functools.cache
def _compact_formatter_class() -> Any:
    # deferred: start-up time (matplotlib)
    from matplotlib.ticker import Formatter

    class CompactFormatter(Formatter):
        """Tick labels from :func:`~nbtrain.kernel.display.chartlayout.tick_labels`: compact, exact, never an offset."""

        def __init__(self) -> None:
            self.labels: dict[float, str] = {}

        def set_locs(self, locs: Any) -> None:
            values = [float(loc) for loc in locs]
            self.labels = dict(zip(values, chartlayout.tick_labels(values), strict=True))

        def __call__(self, x: float, pos: int | None = None) -> str:
            label = self.labels.get(x)
            return label if label is not None else chartlayout.compact_number(x)

    return CompactFormatter
