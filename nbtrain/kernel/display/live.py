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
often than keeps drawing under ``CHART_CPU_SHARE`` of one core; the first waits until the
run has gone on for a second (a shorter cell draws them once, in its last frame). What state the charts show
is bounded by :mod:`nbtrain.livestate`, so the final frame of a 100k-step run is as small as
that of a short one.

Example (in a notebook cell):
    >>> import nbtrain
    >>> from nbtrain.kernel.display import watch
    >>> def train():
    ...     for step in range(100):
    ...         nbtrain.log(loss=1.0 / (step + 1))
    >>> watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=100)  # doctest: +ELLIPSIS
    [nbtrain] starting ...
    nbtrain · ddp_notebook · cpu · 2 ranks · finished ...
    step 100/100 [####################] 100%
    ...
"""

from __future__ import annotations

import base64
import html
import math
import sys
import time
from typing import Any, TextIO

from nbtrain import livestate
from nbtrain.kernel.display import chart, livetext, rankoutput
from nbtrain.kernel.display.chart import ChartFigure
from nbtrain.kernel.display.show import frontend_is_rich
from nbtrain.messages import events
from nbtrain.planning import config

FASTEST_FRAME_SECONDS = 0.25  # at most four frames a second
SLOWEST_FRAME_SECONDS = 1.0  # at least one a second while the run goes on (the clock moves)
TEXT_LINE_SECONDS = 1.0  # a terminal gets a progress line at most once a second...
TEXT_HEARTBEAT_SECONDS = 10.0  # ...and one every ten seconds even when nothing moved
CHART_CPU_SHARE = 0.1  # drawing charts may use at most this share of one core...
SLOWEST_CHART_SECONDS = 1.0  # ...but a moving run's chart is never older than this
MAX_LOG_RANKS = 16  # logs of more ranks than this would dwarf the charts

_STATE_COLOURS = {
    livestate.STARTING: "#757575",
    livestate.RUNNING: "#1565c0",
    events.FINISHED: "#2e7d32",
    events.FAILED: "#c62828",
    events.STOPPED: "#ef6c00",
    events.TIMED_OUT: "#ef6c00",
}


class LiveView:
    """One run's live view: feed it events with ``handle``, show it with ``refresh``.

    ``config`` is the run's :class:`nbtrain.planning.config.LaunchConfig` (``run.config``); without
    one, pass ``strategy``, ``accelerator`` and ``world_size``. ``total_steps`` adds a
    progress bar and an ETA; ``batch_size`` (per rank) adds samples/s. ``rich`` forces the
    HTML (True) or text (False) frontend; by default it follows the running shell.

    Example:
        >>> from nbtrain.messages import events
        >>> view = LiveView(strategy="ddp_notebook", accelerator="cpu", world_size=1, rich=False)
        >>> view.handle(events.Metrics(1, 0, ((1, 0.0, {"loss": 0.7}),)))
        >>> view.finish("finished")  # doctest: +ELLIPSIS
        nbtrain · ddp_notebook · cpu · 1 rank · finished · ...
        step 1
        loss  rank 0: 0.7
    """

    def __init__(
        self, config: config.LaunchConfig | None = None, *, strategy: str | None = None, accelerator: str | None = None,
        world_size: int | None = None, total_steps: int | None = None, batch_size: int | None = None,
        rich: bool | None = None, stream: TextIO | None = None, show_logs: bool = True,
        stall_warning: float | None = livestate.STALL_SECONDS,
    ) -> None:
        if config is not None:
            strategy = strategy or config.strategy.name
            accelerator = accelerator or config.plan.accelerator
            world_size = world_size or config.world_size
        self.state = livestate.LiveState(
            strategy or "", accelerator or "", world_size or 1, total_steps=total_steps, batch_size=batch_size,
            started_at=time.monotonic(), stall_seconds=stall_warning,
        )
        self.rich = frontend_is_rich() if rich is None else rich
        self.stream = stream  # where a text frontend's frames go; None: sys.stdout
        # Each rank's output has one place: this view's log tails (a terminal has none: its
        # lines are printed), or (show_logs=False) the cell's own stream lines, which the
        # caller prints (a blocking %%distributed cell). A rank's display has no place in the
        # view: it goes in the cell, below it, unless the caller shows it.
        self.show_logs = show_logs
        self._printer = rankoutput.OutputPrinter("all", world_size or 1, rich=self.rich) if show_logs else None
        self.key = f"{id(self):x}-{time.monotonic_ns():x}"  # names this view's logs in the page
        self.frames = 0  # frames shown (rich) or progress lines printed (text)
        self.chart_renders = 0
        self._handle: Any = None
        self._shown_version = -1
        self._last_frame_at = -math.inf
        self._chart_version = -1
        self._chart_png_base64 = ""
        self._keep_chart = False  # the run was stopped at once: its last frame keeps the chart as drawn
        self._chart_css_size = (0, 0)  # the PNG is shown at this size; it has twice the pixels
        self._chart_drawn_at = -math.inf
        self._chart_seconds = 0.0  # how long the last drawing took
        self._chart_figure: ChartFigure | None = None
        self._chart_drawing = False  # True while a drawing is under way (one an interrupt cut short stays True)
        self._text_progress = ""
        self._text_line_at = -math.inf

    # -- feeding -----------------------------------------------------------------------
    def handle(self, event: Any) -> None:
        """Take one event from ``run.events()``; None (an idle poll) is ignored."""
        if event is None:
            return
        self.state.apply(event, time.monotonic())
        if self._printer is not None and (isinstance(event, events.Display) or not self.rich):
            self._printer(event)  # a display anywhere; in a terminal, a rank's lines too

    # -- showing -----------------------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Show a new frame if one is due; return whether one was shown.

        Due means: something changed and the last frame is at least a quarter second
        old, or a second passed (the elapsed clock moves). ``force`` shows one now, its
        charts as their own pace allows (only the last frame, :meth:`finish`, draws them at once).
        """
        now = time.monotonic()
        since_last = now - self._last_frame_at
        changed = self.state.version != self._shown_version
        idle = not changed and (self.state.ended or since_last < SLOWEST_FRAME_SECONDS)
        if not force and (since_last < FASTEST_FRAME_SECONDS or idle):
            return False
        self._last_frame_at = now
        self._shown_version = self.state.version
        if self.rich:
            self._show_rich(now, force=False)
        else:
            self._show_text(now, force)
        return True

    def finish(self, state: str, redraw_chart: bool = True) -> None:
        """The run ended in ``state`` (finished / failed / stopped / timed out): show the last frame.

        ``redraw_chart`` False: the chart stays as last drawn (a stop the user wants now, not
        after a drawing that takes up to half a second on a loaded machine); the rest is current.
        """
        if not self.state.ended or self.state.state != state:
            self.state.finish(state, time.monotonic())
        if self._printer is not None:
            self._printer.finish()  # a rank's last bar, its open line: before the last frame
        if self._chart_drawing:  # an interrupt landed in the middle of drawing it: a fresh figure
            self._chart_figure = None
        if self.rich and not redraw_chart and self._chart_png_base64:
            self._keep_chart = True
            self._show_rich(time.monotonic(), force=False)
        elif self.rich:
            self._show_rich(time.monotonic(), force=True)
        else:
            self._write(livetext.summary_text(self.state, time.monotonic()) + "\n")
            self.frames += 1
        if self._chart_figure is not None and not self._chart_drawing:  # the next run's view draws on it
            chart.hand_back(self._chart_figure)
            self._chart_figure = None

    def draw_chart(self) -> None:
        """Every rank is done: draw the charts now, as the last frame shows them unless something comes after.

        The mean lines take the steps still waiting for a rank now, as the run's end would.
        """
        self.state.settle()
        if self.rich:
            self.chart_png_base64(force=True)

    def _show_rich(self, now: float, force: bool) -> None:
        self.publish(self.mimebundle(now, force_charts=force))
        self.frames += 1

    def publish(self, bundle: dict[str, str]) -> None:
        """Send a frame to the cell: the first as new display data, the rest as updates of it."""
        # deferred: start-up time (IPython)
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def _show_text(self, now: float, force: bool) -> None:
        line = livetext.one_line_progress(self.state, now)
        progress = livetext.progress_text(self.state) + self.state.state
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
            "text/plain": livetext.summary_text(self.state, now),
        }

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return self.mimebundle()

    def chart_png_base64(self, force: bool = False) -> str:
        """The charts as base64 PNG, redrawn only when their data changed (and not too often)."""
        state = self.state
        if not state.metrics and not state.memory:
            return ""
        if self._keep_chart:
            return self._chart_png_base64
        stale = state.chart_version != self._chart_version
        now = time.monotonic()
        # Keep drawing under CHART_CPU_SHARE of a core: after a 50 ms drawing, wait 0.5 s.
        # On a loaded machine one drawing can take 0.4 s; the cap keeps the chart moving.
        rest = min(self._chart_seconds / CHART_CPU_SHARE, SLOWEST_CHART_SECONDS)
        rested = now - self._chart_drawn_at >= rest
        # While the ranks go to a stop step the chart waits: a drawing (0.4 s on a loaded machine) would
        # hold back a second interrupt, which the cell acts on between two events.
        stopping = state.stop_step is not None and not state.ended
        # A run's first second shows no chart: a short cell then draws its charts once, in its
        # last frame, not also while its ranks start and the cell's end waits for the drawing.
        # Once it ended, every frame has them (a view shown again, a text view's saved frame).
        early = not state.ended and now - state.started_at < SLOWEST_CHART_SECONDS
        if stale and (force or (not early and ((rested and not stopping) or not self._chart_png_base64))):
            layout = ChartFigure.layout_of(state)
            if self._chart_figure is None or self._chart_figure.layout != layout:
                if self._chart_figure is not None:
                    chart.hand_back(self._chart_figure)
                self._chart_figure = chart.figure_for(state)  # may import matplotlib: not timed below
            started = time.perf_counter()
            self._chart_drawing = True
            png = self._chart_figure.draw(state)
            self._chart_drawing = False
            self._chart_seconds = time.perf_counter() - started
            self._chart_drawn_at = time.monotonic()  # the rest counts from the drawing's end
            self._chart_version = state.chart_version
            self._chart_png_base64 = base64.b64encode(png).decode("ascii")
            self._chart_css_size = self._chart_figure.css_size
            self.chart_renders += 1
        return self._chart_png_base64

    def html(self, now: float, force_charts: bool = False) -> str:
        """The frame's HTML: status line, progress bar, failure, charts as an inline PNG, log tails."""
        state = self.state
        colour = _STATE_COLOURS.get(state.state, "#000")
        status_parts = [html.escape(part) for part in livetext.status_line(state, now).split(" · ")]
        state_index = livetext.STATUS_STATE_INDEX
        status_parts[state_index] = f'<b style="color:{colour}">{status_parts[state_index]}</b>'
        status = " · ".join(status_parts)
        parts = [
            (
                '<div class="nbtrain-live" style="font-family:var(--jp-code-font-family,monospace);'
                'font-size:12px;line-height:1.5">'
            ),
            f"<div>{status}</div>",
            _progress_html(state),
        ]
        if state.failure:
            parts.append(f'<div style="color:{_STATE_COLOURS[events.FAILED]}">{html.escape(state.failure)}</div>')
        stall = state.stall(now)
        if stall:  # before any timeout: which rank to look at
            parts.append(f'<div style="color:#b26a00">{html.escape(stall)}</div>')
        png = self.chart_png_base64(force=force_charts)
        if png:
            width, height = self._chart_css_size
            parts.append(
                f'<img src="data:image/png;base64,{png}" width="{width}" height="{height}"'
                ' alt="metrics, memory and throughput per rank" style="max-width:100%;height:auto">'
            )
        if self.show_logs:
            parts.append(_logs_html(state, self.key))
        parts.append("</div>")
        return "".join(parts)


def _progress_html(state: livestate.LiveState) -> str:
    fraction = livetext.progress_fraction(state)
    step = state.current_step
    if fraction is None:
        label = "no steps logged yet" if step is None else f"step {step:,}"
        return f'<div style="color:#555">{label}</div>'
    colour = _STATE_COLOURS.get(state.state, "#1565c0")
    label = f"step {step or 0:,} / {state.known_total:,} ({fraction:.0%})"
    eta = state.eta_seconds()
    if eta is not None:
        label += f" · ETA {livetext.format_duration(eta)}"
    return (
        '<div style="display:flex;align-items:center;gap:8px">'
        '<div style="flex:0 0 300px;height:10px;background:#e0e0e0;border-radius:3px;overflow:hidden">'
        f'<div style="width:{fraction * 100:.1f}%;height:100%;background:{colour}"></div></div>'
        f"<span>{label}</span></div>"
    )


# Each frame replaces the view's HTML, so an opened <details> would close again. Where the
# frontend runs a trusted output's handlers and scripts (JupyterLab, Notebook, VS Code,
# Colab), the user's choice is kept in the page under the log's name and put back on every
# frame; elsewhere (a saved notebook) the attributes are dropped and the log is static.
# A click on the summary (mouse or keyboard) is the user's choice; the new state is the opposite
# of the current one. (A toggle event would also fire when a frame's <details open> is parsed.)
_KEEP_TOGGLE = "(window.nbtrainLogs=window.nbtrainLogs||{})[this.parentNode.dataset.nbtrainLog]=!this.parentNode.open"
_RESTORE_TOGGLES = (
    "<script>(function(){var kept=window.nbtrainLogs||{};"
    "document.querySelectorAll('details[data-nbtrain-log]').forEach(function(d){"
    "var open=kept[d.dataset.nbtrainLog];if(open!==undefined&&d.open!==open){d.open=open;}});})();</script>"
)


def _logs_html(state: livestate.LiveState, key: str = "") -> str:
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
            f'<details{is_open} data-nbtrain-log="{key}-{rank}">'
            f'<summary onclick="{_KEEP_TOGGLE}">{summary}</summary>'
            f'<pre style="margin:0 0 4px 0;padding:4px;max-height:20em;overflow:auto;font-size:11px">{body}</pre>'
            "</details>"
        )
    if len(ranks) > MAX_LOG_RANKS:
        parts.append(f"<div>(output of {len(ranks) - MAX_LOG_RANKS} more ranks not shown)</div>")
    if parts:
        parts.append(_RESTORE_TOGGLES)
    return "".join(parts)


def watch(
    run: Any, *, total_steps: int | None = None, batch_size: int | None = None, rich: bool | None = None,
    stall_warning: float | None = livestate.STALL_SECONDS,
) -> Any:
    """Show ``run`` live in this cell until it ends; return rank 0's result (or raise its failure).

    ``stall_warning``: after this many seconds without a step from a rank that logs steps,
    the view says ``no step from rank N for S s`` (None: never).

    Interrupting the kernel stops every rank, leaves the view showing "stopped" and
    re-raises KeyboardInterrupt.

    Example:
        >>> import nbtrain
        >>> from nbtrain.kernel.display import watch
        >>> def train():
        ...     for step in range(50):
        ...         nbtrain.log(loss=1.0 / (step + 1))
        ...     return "done"
        >>> watch(nbtrain.start(train, devices=2, accelerator="cpu"), total_steps=50)  # doctest: +ELLIPSIS
        [nbtrain] starting ...
        step 50/50 [####################] 100%
        ...
        'done'
    """
    view = LiveView(run.config, total_steps=total_steps, batch_size=batch_size, rich=rich, stall_warning=stall_warning)
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


class NotedLiveView(LiveView):
    """The live view with a note under it: what a background run does to the kernel, or its error."""

    note = ""

    def mimebundle(self, now: float | None = None, force_charts: bool = False) -> dict[str, str]:
        """The live view's frame with the note under it, in HTML and in plain text."""
        bundle = dict(super().mimebundle(now, force_charts))
        if self.note:
            bundle["text/html"] += (
                '<pre class="nbtrain-background" style="font-family:var(--jp-code-font-family,monospace);'
                f'font-size:12px;color:#555;white-space:pre-wrap;margin:2px 0">{html.escape(self.note)}</pre>'
            )
            bundle["text/plain"] += "\n" + self.note
        return bundle
