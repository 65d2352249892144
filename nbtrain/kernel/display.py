"""The live view of a run in the cell that started it: status, progress, charts, logs.

``watch(run)`` consumes ``run.events()`` on the kernel's own thread and keeps one output
of the cell up to date through a display id (``display(..., display_id=True)`` then
``handle.update(...)``): no ``clear_output``, no widget state, no background thread. The
last frame simply stays in the cell, so a saved notebook shows the final charts as a PNG
inside an HTML block, with a compact text/plain fallback in the same display data.

Frontends: a Jupyter kernel (``ZMQInteractiveShell``) gets the rich frame; a terminal
IPython or plain ``python`` gets one text progress line at most once a second, each rank's
output lines as they arrive, and the multi-line summary at the end.

Cost, bounded: a frame is sent at most four times a second and at least once a second;
the charts (the only expensive part) are redrawn only when their data changed, and no more
often than keeps drawing under ``CHART_CPU_SHARE`` of one core. What state the charts show
is bounded by :mod:`nbtrain.charts`, so the final frame of a 100k-step run is as small as
that of a short one.

Example (in a notebook cell):
    >>> import nbtrain
    >>> from nbtrain.kernel.display import watch
    >>> def train():
    ...     for step in range(100):
    ...         nbtrain.log(loss=1.0 / (step + 1))
    >>> watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=100)  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import io
import math
import sys
import time
from typing import Any, TextIO

from nbtrain import charts, config, events

FASTEST_FRAME_SECONDS = 0.25  # at most four frames a second
SLOWEST_FRAME_SECONDS = 1.0  # at least one a second while the run goes on (the clock moves)
TEXT_LINE_SECONDS = 1.0  # a terminal gets a progress line at most once a second...
TEXT_HEARTBEAT_SECONDS = 10.0  # ...and one every ten seconds even when nothing moved
CHART_CPU_SHARE = 0.1  # drawing charts may use at most this share of one core...
SLOWEST_CHART_SECONDS = 1.0  # ...but a moving run's chart is never older than this
DPI = 80
PANEL_INCHES = (3.3, 2.3)  # one chart: 264 x 184 pixels at 80 dpi
PANELS_PER_ROW = 3
MAX_LOG_RANKS = 16  # logs of more ranks than this would dwarf the charts
DRAWN_POINTS = 300  # per line: about one per pixel of a chart's width

_STATE_COLOURS = {
    charts.STARTING: "#757575",
    charts.RUNNING: "#1565c0",
    events.FINISHED: "#2e7d32",
    events.FAILED: "#c62828",
    events.STOPPED: "#ef6c00",
    events.TIMED_OUT: "#ef6c00",
}
_RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def frontend_is_rich() -> bool:
    """True inside a Jupyter kernel (it can show HTML and images); False in a terminal or plain python."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False  # plain python that never imported IPython: certainly no kernel
    shell = ipython.get_ipython()
    return shell is not None and any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__)


class LiveView:
    """One run's live view: feed it events with ``handle``, show it with ``refresh``.

    ``config`` is the run's :class:`nbtrain.config.LaunchConfig` (``run.config``); without
    one, pass ``strategy``, ``accelerator`` and ``world_size``. ``total_steps`` adds a
    progress bar and an ETA; ``batch_size`` (per rank) adds samples/s. ``rich`` forces the
    HTML (True) or text (False) frontend; by default it follows the running shell.

    Example:
        >>> from nbtrain import events
        >>> view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=1, rich=False)
        >>> view.handle(events.Metrics(1, 0, ((1, 0.0, {"loss": 0.7}),)))
        >>> view.finish("finished")  # doctest: +ELLIPSIS
        nbtrain · ddp_notebook · cpu · 1 rank · finished · ...
        step 1
        loss  rank 0: 0.7
    """

    def __init__(
        self,
        config: config.LaunchConfig | None = None,
        *,
        strategy: str | None = None,
        accelerator: str | None = None,
        world_size: int | None = None,
        total_steps: int | None = None,
        batch_size: int | None = None,
        rich: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        if config is not None:
            strategy = strategy or config.strategy.name
            accelerator = accelerator or config.plan.accelerator
            world_size = world_size or config.world_size
        self.state = charts.RunState(
            strategy or "",
            accelerator or "",
            world_size or 1,
            total_steps=total_steps,
            batch_size=batch_size,
            started_at=time.monotonic(),
        )
        self.rich = frontend_is_rich() if rich is None else rich
        self.stream = stream  # text frontend only; None: sys.stdout (and stderr for ranks' stderr)
        self.frames = 0  # frames shown (rich) or progress lines printed (text)
        self.chart_renders = 0
        self._handle: Any = None
        self._shown_version = -1
        self._last_frame_at = -math.inf
        self._chart_version = -1
        self._chart_png_base64 = ""
        self._chart_drawn_at = -math.inf
        self._chart_seconds = 0.0  # how long the last drawing took
        self._chart_figure: ChartFigure | None = None
        self._text_progress = ""
        self._text_line_at = -math.inf

    # -- feeding -----------------------------------------------------------------------
    def handle(self, event: Any) -> None:
        """Take one event from ``run.events()``; None (an idle poll) is ignored."""
        if event is None:
            return
        self.state.apply(event, time.monotonic())
        if not self.rich and isinstance(event, events.Output):
            self._print_rank_output(event)

    def _print_rank_output(self, event: events.Output) -> None:
        # A terminal has no log panel: each rank's lines go straight out, tagged, as launch() prints them.
        lines = event.text.splitlines() or [""]
        text = "".join(f"{event.tag} {line}\n" for line in lines)
        if self.stream is None and event.stream == "stderr":
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            self._write(text)

    # -- showing -----------------------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Show a new frame if one is due; return whether one was shown.

        Due means: something changed and the last frame is at least a quarter second
        old, or a second passed (the elapsed clock moves). ``force`` shows one now.
        """
        now = time.monotonic()
        since_last = now - self._last_frame_at
        changed = self.state.version != self._shown_version
        if not force:
            if since_last < FASTEST_FRAME_SECONDS:
                return False
            if not changed and (self.state.ended or since_last < SLOWEST_FRAME_SECONDS):
                return False
        self._last_frame_at = now
        self._shown_version = self.state.version
        if self.rich:
            self._show_rich(now, force)
        else:
            self._show_text(now, force)
        return True

    def finish(self, state: str) -> None:
        """The run ended in ``state`` (finished / failed / stopped / timed out): show the last frame."""
        if not self.state.ended or self.state.state != state:
            self.state.finish(state, time.monotonic())
        # A fresh figure: an interrupt may have landed in the middle of drawing the old one.
        self._chart_figure = None
        if self.rich:
            self._show_rich(time.monotonic(), force=True)
        else:
            self._write(charts.summary_text(self.state, time.monotonic()) + "\n")
            self.frames += 1

    def _show_rich(self, now: float, force: bool) -> None:
        self.publish(self.mimebundle(now, force_charts=force))
        self.frames += 1

    def publish(self, bundle: dict[str, str]) -> None:
        """Send a frame to the cell: the first as new display data, the rest as updates of it."""
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def _show_text(self, now: float, force: bool) -> None:
        line = charts.one_line_progress(self.state, now)
        progress = charts.progress_text(self.state) + self.state.state
        moved = progress != self._text_progress
        due = now - self._text_line_at >= (TEXT_LINE_SECONDS if moved else TEXT_HEARTBEAT_SECONDS)
        if force or due:
            self._text_progress, self._text_line_at = progress, now
            self._write(line + "\n")
            self.frames += 1

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(text)
        stream.flush()

    # -- the frame ---------------------------------------------------------------------
    def mimebundle(self, now: float | None = None, force_charts: bool = False) -> dict[str, str]:
        """The frame as display data: {'text/html': ..., 'text/plain': ...}."""
        now = time.monotonic() if now is None else now
        return {
            "text/html": self.html(now, force_charts),
            "text/plain": charts.summary_text(self.state, now),
        }

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return self.mimebundle()

    def chart_png_base64(self, force: bool = False) -> str:
        """The charts as base64 PNG, redrawn only when their data changed (and not too often)."""
        state = self.state
        if not state.metrics and not state.memory:
            return ""
        stale = state.chart_version != self._chart_version
        now = time.monotonic()
        # Keep drawing under CHART_CPU_SHARE of a core: after a 50 ms drawing, wait 0.5 s.
        # On a loaded machine one drawing can take 0.4 s; the cap keeps the chart moving.
        rest = min(self._chart_seconds / CHART_CPU_SHARE, SLOWEST_CHART_SECONDS)
        rested = now - self._chart_drawn_at >= rest
        if stale and (force or rested or not self._chart_png_base64):
            layout = ChartFigure.layout_of(state)
            if self._chart_figure is None or self._chart_figure.layout != layout:
                self._chart_figure = ChartFigure(state)  # imports matplotlib: not timed below
            started = time.perf_counter()
            png = self._chart_figure.draw(state)
            self._chart_seconds = time.perf_counter() - started
            self._chart_drawn_at = now
            self._chart_version = state.chart_version
            self._chart_png_base64 = base64.b64encode(png).decode("ascii")
            self.chart_renders += 1
        return self._chart_png_base64

    def html(self, now: float, force_charts: bool = False) -> str:
        """The frame's HTML: status line, progress bar, failure, charts as an inline PNG, log tails."""
        state = self.state
        colour = _STATE_COLOURS.get(state.state, "#000")
        status_parts = [html.escape(part) for part in charts.status_line(state, now).split(" · ")]
        state_index = charts.STATUS_STATE_INDEX
        status_parts[state_index] = f'<b style="color:{colour}">{status_parts[state_index]}</b>'
        status = " · ".join(status_parts)
        parts = [
            '<div class="nbtrain-live" style="font-family:var(--jp-code-font-family,monospace);'
            'font-size:12px;line-height:1.5">',
            f"<div>{status}</div>",
            _progress_html(state),
        ]
        if state.failure:
            parts.append(f'<div style="color:{_STATE_COLOURS[events.FAILED]}">{html.escape(state.failure)}</div>')
        png = self.chart_png_base64(force=force_charts)
        if png:
            parts.append(
                f'<img src="data:image/png;base64,{png}" alt="metrics and memory per rank" style="max-width:100%">'
            )
        parts.append(_logs_html(state))
        parts.append("</div>")
        return "".join(parts)


def _progress_html(state: charts.RunState) -> str:
    fraction = charts.progress_fraction(state)
    step = state.current_step
    if fraction is None:
        label = "no steps logged yet" if step is None else f"step {step:,}"
        return f'<div style="color:#555">{label}</div>'
    colour = _STATE_COLOURS.get(state.state, "#1565c0")
    label = f"step {step or 0:,} / {state.known_total:,} ({fraction:.0%})"
    eta = state.eta_seconds()
    if eta is not None:
        label += f" · ETA {charts.format_duration(eta)}"
    return (
        '<div style="display:flex;align-items:center;gap:8px">'
        '<div style="flex:0 0 300px;height:10px;background:#e0e0e0;border-radius:3px;overflow:hidden">'
        f'<div style="width:{fraction * 100:.1f}%;height:100%;background:{colour}"></div></div>'
        f"<span>{label}</span></div>"
    )


def _logs_html(state: charts.RunState) -> str:
    parts = []
    ranks = sorted(state.logs)
    for rank in ranks[:MAX_LOG_RANKS]:
        tail = state.logs[rank]
        shown = len(tail.lines)
        body = "\n".join(
            f'<span style="color:#c62828">{html.escape(line)}</span>' if stream == "stderr" else html.escape(line)
            for stream, line in tail.lines
        )
        summary = f"rank {rank} output: {tail.total} line" + ("" if tail.total == 1 else "s")
        if tail.total > shown:
            summary += f", last {shown} shown"
        # Short logs are open; long ones stay folded so the charts stay in view.
        is_open = " open" if tail.total <= 5 else ""
        parts.append(
            f"<details{is_open}><summary>{summary}</summary>"
            f'<pre style="margin:0 0 4px 0;padding:4px;max-height:20em;overflow:auto;font-size:11px">{body}</pre>'
            "</details>"
        )
    if len(ranks) > MAX_LOG_RANKS:
        parts.append(f"<div>(output of {len(ranks) - MAX_LOG_RANKS} more ranks not shown)</div>")
    return "".join(parts)


def render_charts_png(state: charts.RunState, dpi: int = DPI) -> bytes:
    """One PNG: a chart per metric (losses first; a thin line per rank, a bold mean) and memory.

    Example:
        >>> from nbtrain import charts, events
        >>> state = charts.RunState("ddp_notebook", "cpu", 1)
        >>> state.apply(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}), (2, 0.1, {"loss": 0.5}))), now=0.0)
        >>> render_charts_png(state)[:8]
        b'\\x89PNG\\r\\n\\x1a\\n'
    """
    return ChartFigure(state, dpi).draw(state)


class ChartFigure:
    """The charts' matplotlib figure, kept between frames while its layout stays the same.

    Only the lines' data, titles and bars change from one frame to the next, and updating
    those costs a third of building the figure again (ticks and axes are the expensive
    part). A bare ``Figure`` on the Agg canvas: no pyplot, so no global figure state, no
    GUI backend, and nothing registered that would need closing.
    """

    def __init__(self, state: charts.RunState, dpi: int = DPI) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        self.layout = self.layout_of(state)
        self.dpi = dpi
        metric_names, memory_ranks = self.layout[0], self.layout[2]
        panels = len(metric_names) + (1 if memory_ranks else 0)
        columns = min(PANELS_PER_ROW, max(1, panels))
        rows = max(1, math.ceil(panels / columns))
        self.figure = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows), dpi=dpi)
        FigureCanvasAgg(self.figure)
        inch_w, inch_h = PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows
        self.figure.subplots_adjust(
            left=0.45 / inch_w, right=1 - 0.1 / inch_w, bottom=0.35 / inch_h, top=1 - 0.28 / inch_h,
            wspace=0.35, hspace=0.55,
        )
        axes = list(self.figure.subplots(rows, columns, squeeze=False).ravel())
        for ax in axes[panels:]:
            ax.set_visible(False)
        for ax in axes[:panels]:
            ax.tick_params(labelsize=7, length=2, pad=1)
            ax.grid(True, linewidth=0.4, alpha=0.4)
            ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
        self.metric_axes: dict[str, Any] = {}
        self.rank_lines: dict[str, dict[int, Any]] = {}
        self.mean_lines: dict[str, Any] = {}
        self.bands: dict[str, Any] = {}
        for ax, name in zip(axes, metric_names):
            self._build_metric(ax, name, state.metrics[name])
        self.memory_axes = axes[len(metric_names)] if memory_ranks else None
        if self.memory_axes is not None:
            self._build_memory(self.memory_axes, memory_ranks)

    @staticmethod
    def layout_of(state: charts.RunState) -> tuple:
        """What the figure's structure depends on; a new figure is built when it changes."""
        names = tuple(state.chart_metric_names())
        ranks = tuple(tuple(sorted(state.metrics[name].ranks)) for name in names)
        return names, ranks, tuple(sorted(state.memory))

    def _build_metric(self, ax: Any, name: str, history: charts.MetricHistory) -> None:
        many_ranks = len(history.ranks) > 1
        self.metric_axes[name] = ax
        self.rank_lines[name] = {
            rank: ax.plot(
                [], [], linewidth=0.8, alpha=0.8 if many_ranks else 0.9,
                color=_RANK_COLOURS[rank % len(_RANK_COLOURS)], label=f"rank {rank}",
            )[0]
            for rank in sorted(history.ranks)
        }
        if many_ranks:
            self.mean_lines[name] = ax.plot([], [], linewidth=1.3, color="#222", alpha=0.8, label="mean")[0]
        ax.set_xlabel("step", fontsize=7, labelpad=1)
        if len(history.ranks) <= len(_RANK_COLOURS):
            ax.legend(fontsize=6, loc="best", frameon=False, handlelength=1.2)

    def _build_memory(self, ax: Any, ranks: tuple[int, ...]) -> None:
        positions = list(range(len(ranks)))
        self.peak_bars = ax.barh(positions, [0] * len(ranks), height=0.7, color="#90caf9")
        self.current_bars = ax.barh(positions, [0] * len(ranks), height=0.45, color="#1565c0")
        ax.set_yticks(positions, [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        self.memory_labels = (
            [ax.text(0, p, "", va="center", fontsize=6) for p in positions] if len(ranks) <= 8 else []
        )

    def draw(self, state: charts.RunState) -> bytes:
        """The figure with ``state``'s data, as PNG bytes."""
        for name, ax in self.metric_axes.items():
            self._draw_metric(ax, name, state.metrics[name])
        if self.memory_axes is not None:
            self._draw_memory(self.memory_axes, state)
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=self.dpi)
        return buffer.getvalue()

    def _draw_metric(self, ax: Any, name: str, history: charts.MetricHistory) -> None:
        rank_means = []
        for rank, line in self.rank_lines[name].items():
            steps, means, _, _ = history.ranks[rank].coarsened(DRAWN_POINTS)
            rank_means.append(means)
            line.set_data(steps, means)
        latest = next(iter(history.ranks.values())).last_value
        old_band = self.bands.pop(name, None)
        if old_band is not None:
            old_band.remove()
        mean_line = self.mean_lines.get(name)
        if mean_line is not None:
            steps, means, lows, highs = history.mean.coarsened(DRAWN_POINTS)
            mean_line.set_data(steps, means)
            if len(steps) < history.mean.count:  # each point stands for several steps: shade their range
                self.bands[name] = ax.fill_between(steps, lows, highs, color="#000", alpha=0.1, linewidth=0)
            latest = history.mean.last_value
        longest = max(rank_means, key=len, default=[])
        scale = "log" if charts.wants_log_scale(longest) else "linear"
        if ax.get_yscale() != scale:
            ax.set_yscale(scale)
        ax.relim()
        ax.autoscale_view()
        ax.set_title(f"{name}  {charts.format_value(latest)}", fontsize=9, loc="left")

    def _draw_memory(self, ax: Any, state: charts.RunState) -> None:
        ranks = self.layout[2]
        peaks = [state.memory[r].peak_bytes or 0 for r in ranks]
        currents = [state.memory[r].current_bytes or 0 for r in ranks]
        scale, unit = (2**30, "GiB") if max(peaks, default=0) >= 2**30 else (2**20, "MiB")
        for bar, peak in zip(self.peak_bars, peaks):
            bar.set_width(peak / scale)
        for bar, current in zip(self.current_bars, currents):
            bar.set_width(current / scale)
        for label, position, current, peak in zip(self.memory_labels, range(len(ranks)), currents, peaks):
            label.set_position((peak / scale, position))
            label.set_text(f" {charts.format_bytes(current)} / {charts.format_bytes(peak)}")
        # Room on the right for the labels.
        ax.set_xlim(0, max(max(peaks, default=0) / scale * (1.7 if self.memory_labels else 1.05), 1.0))
        ax.set_xlabel(unit, fontsize=7, labelpad=1)
        kind = "GPU allocated" if state.memory_kind == "cuda" else "host RSS"
        ax.set_title(f"memory, {kind}: now / peak", fontsize=9, loc="left")


def watch(
    run: Any,
    *,
    total_steps: int | None = None,
    batch_size: int | None = None,
    rich: bool | None = None,
) -> Any:
    """Show ``run`` live in this cell until it ends; return rank 0's result (or raise its failure).

    Interrupting the kernel stops every rank, leaves the view showing "stopped" and
    re-raises KeyboardInterrupt.

    Example:
        >>> import nbtrain
        >>> from nbtrain.kernel.display import watch
        >>> def train():
        ...     for step in range(50):
        ...         nbtrain.log(loss=1.0 / (step + 1))
        ...     return "done"
        >>> watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=50)  # doctest: +SKIP
        'done'
    """
    view = LiveView(run.config, total_steps=total_steps, batch_size=batch_size, rich=rich)
    try:
        view.refresh(force=True)
        # Wake at twice the frame rate when idle, so a due frame is never a whole period late.
        for event in run.events(poll=FASTEST_FRAME_SECONDS / 2):
            view.handle(event)
            view.refresh()
    except KeyboardInterrupt:
        run.abandon()  # already done when the interrupt came while waiting for events
        view.finish(events.STOPPED)
        raise
    view.finish(run.state)
    return run.result()
