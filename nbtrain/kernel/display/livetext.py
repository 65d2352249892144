"""The live view's words: a run's state as status, progress and metric lines (display/live.py).

Pure: it reads a :class:`~nbtrain.livestate.LiveState` and returns strings; the HTML view,
the text/plain part of a frame and a terminal's progress line all read them from here, and
the charts (display/chart.py) label their values with the same formats.

Example:
    >>> from nbtrain.messages import events
    >>> from nbtrain.livestate import LiveState
    >>> state = LiveState(strategy="ddp_notebook", accelerator="cpu", world_size=1, total_steps=10)
    >>> state.apply(events.Metrics(1, 0, ((5, 1.0, {"loss": 0.25}),)), now=1.0)
    >>> progress_text(state)
    'step 5/10 [##########----------] 50%'
"""

from __future__ import annotations

from nbtrain.livestate import MAX_METRIC_CHARTS, LiveState, MetricHistory


def format_bytes(count: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number readable.

    >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(1.5 * 2**30), format_bytes(None)
    ('512 B', '3.0 MiB', '1.50 GiB', '–')
    """
    if count is None:
        return "–"
    if count < 1024:
        return f"{int(count)} B"
    if count < 2**20:
        return f"{count / 1024:.1f} KiB"
    if count < 2**30:
        return f"{count / 2**20:.1f} MiB"
    return f"{count / 2**30:.2f} GiB"


def format_duration(seconds: float | None) -> str:
    """Seconds as ``4.2 s``, ``3:07`` or ``1:02:03``.

    >>> format_duration(4.24), format_duration(187), format_duration(3723), format_duration(None)
    ('4.2 s', '3:07', '1:02:03', '–')
    """
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(per_second: float | None, unit: str) -> str:
    """A rate with three significant figures.

    >>> format_rate(12.345, "steps/s"), format_rate(0.0123, "steps/s"), format_rate(12345.6, "samples/s")
    ('12.3 steps/s', '0.0123 steps/s', '12,346 samples/s')
    """
    if per_second is None:
        return f"– {unit}"
    return f"{per_second:,.0f} {unit}" if per_second >= 1000 else f"{per_second:.3g} {unit}"


def format_value(value: float | None) -> str:
    """A metric value, short.

    >>> format_value(0.123456), format_value(1234567.0), format_value(float("nan")), format_value(None)
    ('0.1235', '1.235e+06', 'nan', '–')
    """
    return "–" if value is None else f"{value:.4g}"


STATUS_STATE_INDEX = 4  # where status_line puts the state, for a view that colours it


def status_line(state: LiveState, now: float) -> str:
    """Strategy, accelerator, ranks, state, elapsed time and rates, joined by " · "."""
    parts = [
        "nbtrain",
        state.strategy or "?",
        state.accelerator or "?",
        f"{state.world_size} rank" + ("" if state.world_size == 1 else "s"),
        state.debugger_text if state.debugger_text and state.ended_at is None else state.state_text,
        format_duration(state.elapsed(now)),
    ]
    if state.steps_per_second is not None:
        parts.append(format_rate(state.steps_per_second, "steps/s"))
    if state.samples_per_second is not None:
        parts.append(format_rate(state.samples_per_second, "samples/s"))
    return " · ".join(parts)


def progress_fraction(state: LiveState) -> float | None:
    """How far the run is, 0..1, when a total is known (and not yet overtaken: see ``known_total``).

    The logged step decides, even at the end: a run that finished at step 60 of a promised
    100 shows 60%, not a full bar.
    """
    total = state.known_total
    if total is None:
        return None
    step = state.current_step or 0
    return min(1.0, max(0.0, step / total))


def progress_text(state: LiveState, bar_width: int = 20) -> str:
    """``step 50/100 [##########----------] 50% · ETA 5.0 s`` (no bar without a total).

    >>> s = LiveState(total_steps=4)
    >>> progress_text(s), progress_text(LiveState())
    ('step 0/4 [--------------------] 0%', 'no steps logged yet')
    """
    step = state.current_step
    fraction = progress_fraction(state)
    if fraction is None:
        return "no steps logged yet" if step is None else f"step {step:,}"
    filled = round(fraction * bar_width)
    text = f"step {step or 0:,}/{state.known_total:,} [{'#' * filled}{'-' * (bar_width - filled)}] {fraction:.0%}"
    eta = state.eta_seconds()
    if eta is not None:
        text += f" · ETA {format_duration(eta)}"
    return text


def metric_line(history: MetricHistory) -> str:
    """``loss  rank 0: 0.51  rank 1: 0.49  mean: 0.5``."""
    values = "  ".join(f"rank {rank}: {format_value(v)}" for rank, v in history.last_values().items())
    if len(history.ranks) > 1 and history.mean.last_value is not None:
        values += f"  mean: {format_value(history.mean.last_value)}"
    return f"{history.name}  {values}"


def memory_line(state: LiveState) -> str | None:
    """``memory (host RSS)  rank 0: 300 MiB (peak 310 MiB)  ...`` or None before any sample."""
    if not state.memory:
        return None
    label = "GPU allocated" if state.memory_kind == "cuda" else "host RSS"
    ranks = "  ".join(
        f"rank {rank}: {format_bytes(m.current_bytes)} (peak {format_bytes(m.peak_bytes)})"
        for rank, m in sorted(state.memory.items())
    )
    return f"memory ({label})  {ranks}"


def summary_text(state: LiveState, now: float, max_metrics: int = MAX_METRIC_CHARTS) -> str:
    """The compact multi-line status: what a plain frontend shows (the text/plain part)."""
    lines = [status_line(state, now), progress_text(state), state.failure, state.stall(now)]
    lines += [metric_line(state.metrics[name]) for name in state.chart_metric_names(max_metrics)]
    lines.append(memory_line(state))
    return "\n".join(line for line in lines if line)  # no failure, stall or memory yet: no line for it


def one_line_progress(state: LiveState, now: float) -> str:
    """A single line for a terminal: state, time, step, rate and the first metric's mean."""
    rate = state.steps_per_second
    parts: list[str | None] = [f"[nbtrain] {state.state_text}", format_duration(state.elapsed(now))]
    parts += [progress_text(state), state.stall(now), None if rate is None else format_rate(rate, "steps/s")]
    names = state.chart_metric_names(1)
    if names:
        history = state.metrics[names[0]]
        shown = history.mean.last_value if len(history.ranks) > 1 else next(iter(history.ranks.values())).last_value
        where = f" (mean of {len(history.ranks)} ranks)" if len(history.ranks) > 1 else ""
        parts.append(f"{names[0]} {format_value(shown)}{where}")
    return " · ".join(part for part in parts if part)  # no stall, no rate yet: not said
