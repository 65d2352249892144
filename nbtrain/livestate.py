"""What the live view knows about a run: metric series, memory, log tails and rates.

Pure: it reads event records and keeps bounded state; it imports no torch, no matplotlib and
no IPython, so every rule here is unit-tested without a process. ``nbtrain.kernel.display``
draws this state; nothing here draws.

Bounded by design, so a 100k-step run costs the kernel the same memory (and the saved
notebook the same bytes) as a 2k-step one:

- each (metric, rank) series keeps at most ``max_points`` buckets; when it would hold more,
  neighbouring buckets merge pairwise (keeping min, max and mean), so old history gets
  coarser while its shape survives;
- each rank keeps only its last ``LOG_LINES_PER_RANK`` output lines, each cut to
  ``LOG_LINE_CHARS`` characters;
- the step rate is measured over a sliding window of ``RATE_WINDOW_SECONDS``.

Example:
    >>> from nbtrain.messages import events
    >>> state = LiveState(strategy="ddp_notebook", accelerator="cpu", world_size=2, total_steps=100)
    >>> for rank in (0, 1):
    ...     state.apply(events.Metrics(1, rank, ((1, 10.0, {"loss": 1.0 + rank}), (2, 11.0, {"loss": 0.5}))), now=0.5)
    >>> state.state, state.current_step, state.steps_per_second
    ('running', 2, 1.0)
    >>> state.metrics["loss"].mean.last_value
    0.5
    >>> state.finish("finished", now=1.0)
    >>> from nbtrain.kernel.display.livetext import summary_text
    >>> print(summary_text(state, now=5.0))
    nbtrain · ddp_notebook · cpu · 2 ranks · finished · 1.0 s · 1 steps/s
    step 2/100 [--------------------] 2%
    loss  rank 0: 0.5  rank 1: 0.5  mean: 0.5
"""

from __future__ import annotations

import collections
import math
from typing import Any

from nbtrain.messages import events, stacktext

MAX_POINTS = 2000  # buckets per series: a full chart line, whatever the run's length
LOG_LINES_PER_RANK = 20
LOG_LINE_CHARS = 240  # a runaway line (a tensor printed whole) must not bloat the notebook
RATE_WINDOW_SECONDS = 10.0
MEAN_WAIT_SECONDS = 2.0  # ranks' batches arrive within a quarter second of each other
MAX_METRIC_CHARTS = 4  # with memory and throughput: six charts, two rows of three
STALL_SECONDS = 30.0  # a rank that logged steps and then none for this long is named
STARTING = "starting"
RUNNING = "running"
END_STATES = (events.FINISHED, events.FAILED, events.STOPPED, events.TIMED_OUT)


class _Bucket:
    """Consecutive points merged into one: their mean step, mean value, min and max."""

    __slots__ = ("count", "high", "low", "step_sum", "value_sum")

    def __init__(self, step: float, value: float) -> None:
        self.step_sum = step
        self.value_sum = value
        self.low = value
        self.high = value
        self.count = 1

    def absorb(self, other: _Bucket) -> None:
        """Merge the next bucket's points into this one (see ``DownsampledSeries._merge_pairs``)."""
        self.step_sum += other.step_sum
        self.value_sum += other.value_sum
        self.count += other.count
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)


class DownsampledSeries:
    """(step, value) points kept as at most ``max_points`` buckets of equal size.

    Every bucket holds ``points_per_bucket`` consecutive points (the newest may hold fewer).
    When a new bucket would exceed ``max_points``, neighbours merge pairwise and the bucket
    size doubles: memory and drawing cost stay bounded, appending stays O(1) amortised.
    Values that are not finite (a NaN loss) are not charted but are still the ``last_value``.

    Example:
        >>> series = DownsampledSeries(max_points=4)
        >>> for step in range(1, 11):
        ...     series.append(step, float(step))
        >>> len(series), series.points_per_bucket, series.count
        (3, 4, 10)
        >>> series.steps(), series.means(), series.lows()
        ([2.5, 6.5, 9.5], [2.5, 6.5, 9.5], [1.0, 5.0, 9.0])
    """

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, not {max_points}")
        self.max_points = max_points
        self.points_per_bucket = 1
        self.count = 0  # points appended, charted or not
        self.last_step: float | None = None
        self.last_value: float | None = None
        self._buckets: list[_Bucket] = []

    def __len__(self) -> int:
        return len(self._buckets)

    def append(self, step: float, value: float) -> None:
        """Add one point; a value that is not finite is counted and kept as ``last_value``, not charted."""
        self.count += 1
        self.last_step = step
        self.last_value = value
        if not math.isfinite(value):
            return
        buckets = self._buckets
        if buckets and buckets[-1].count < self.points_per_bucket:
            buckets[-1].absorb(_Bucket(step, value))
            return
        buckets.append(_Bucket(step, value))
        if len(buckets) > self.max_points:
            self._merge_pairs()

    def _merge_pairs(self) -> None:
        buckets = self._buckets
        for first, second in zip(buckets[::2], buckets[1::2], strict=False):  # an odd last one stays as it is
            first.absorb(second)
        self._buckets = buckets[::2]
        self.points_per_bucket *= 2

    def steps(self) -> list[float]:
        """Each bucket's mean step: the x values of the chart's line."""
        return [b.step_sum / b.count for b in self._buckets]

    def means(self) -> list[float]:
        """Each bucket's mean value: the chart's line."""
        return [b.value_sum / b.count for b in self._buckets]

    def lows(self) -> list[float]:
        """Each bucket's lowest value: the bottom of the band around the line."""
        return [b.low for b in self._buckets]

    def highs(self) -> list[float]:
        """Each bucket's highest value: the top of the band around the line."""
        return [b.high for b in self._buckets]

    def coarsened(self, max_points: int) -> tuple[list[float], list[float], list[float], list[float]]:
        """(steps, means, lows, highs) in at most ``max_points`` groups of whole buckets.

        For drawing: a chart a few hundred pixels wide gains nothing from 2,000 points, and
        a noisy loss averaged over a pixel's worth of steps shows its trend.

        >>> series = DownsampledSeries()
        >>> for step in range(1, 7):
        ...     series.append(step, float(step % 2))
        >>> series.coarsened(3)
        ([1.5, 3.5, 5.5], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
        >>> series.coarsened(10) == (series.steps(), series.means(), series.lows(), series.highs())
        True
        """
        buckets = self._buckets
        group = max(1, math.ceil(len(buckets) / max_points))
        steps, means, lows, highs = [], [], [], []
        for start in range(0, len(buckets), group):
            members = buckets[start : start + group]
            count = sum(b.count for b in members)
            steps.append(sum(b.step_sum for b in members) / count)
            means.append(sum(b.value_sum for b in members) / count)
            lows.append(min(b.low for b in members))
            highs.append(max(b.high for b in members))
        return steps, means, lows, highs


class MetricHistory:
    """One logged scalar: a series per rank, plus the mean over ranks at each step.

    A step's mean is taken once every rank of the run has logged that step (or a later
    one), or once it has waited ``wait_seconds`` for ranks that never log this metric (code
    that logs on rank 0 only). So a rank whose batch arrives a moment later still counts,
    and a lagging rank does not drag the line. A value for a step whose mean was already
    taken stays on its rank's line only: the mean assumes steps increase. ``settle_all``
    takes the rest when the run ends; waiting steps are capped in number too.

    Example:
        >>> loss = MetricHistory("loss", world_size=2)
        >>> loss.add(0, 1, 1.0, now=0.0); loss.add(0, 2, 0.5, now=0.0); loss.settle(now=0.1)
        >>> loss.mean.count  # rank 1 has not reported yet
        0
        >>> loss.add(1, 1, 0.5, now=0.2); loss.add(1, 2, 0.25, now=0.2); loss.settle(now=0.2)
        >>> loss.mean.means()
        [0.75, 0.375]
    """

    def __init__(
        self, name: str, world_size: int = 1, max_points: int = MAX_POINTS, wait_seconds: float = MEAN_WAIT_SECONDS
    ) -> None:
        self.name = name
        self.world_size = world_size
        self.max_points = max_points
        self.wait_seconds = wait_seconds
        self.ranks: dict[int, DownsampledSeries] = {}
        self.mean = DownsampledSeries(max_points)
        self._waiting: dict[int, list[float]] = {}  # step -> [sum, count, first seen]
        self._waiting_cap = 4 * max_points
        self._settled_through = -math.inf

    def add(self, rank: int, step: int, value: float, now: float) -> None:
        """Record ``rank``'s ``value`` at ``step``, received at ``now``; its mean waits (see the class)."""
        series = self.ranks.get(rank)
        if series is None:
            series = self.ranks[rank] = DownsampledSeries(self.max_points)
        series.append(step, value)
        if step <= self._settled_through:
            return  # too late for the mean (see the class docstring)
        waiting = self._waiting.get(step)
        if waiting is None:
            self._waiting[step] = [value, 1, now]
        else:
            waiting[0] += value
            waiting[1] += 1

    def settle(self, now: float) -> None:
        """Move into ``mean`` every step that is complete or has waited long enough."""
        if not self._waiting:
            return
        # A rank's series exists once it logged, so each has a last step.
        reached = [s.last_step for s in self.ranks.values() if s.last_step is not None]
        every_rank_reached = min(reached) if len(self.ranks) >= self.world_size else -math.inf
        ordered = sorted(self._waiting)
        overflow = len(ordered) - self._waiting_cap
        for index, step in enumerate(ordered):
            _total, count, first_seen = self._waiting[step]
            ready = (
                step <= every_rank_reached
                or count >= self.world_size
                or now - first_seen >= self.wait_seconds
                or index < overflow
            )
            if ready:
                self._take(step)

    def settle_all(self) -> bool:
        """Take every waiting step into ``mean``: no rank will add to them; whether any was waiting."""
        waiting = sorted(self._waiting)
        for step in waiting:
            self._take(step)
        return bool(waiting)

    def _take(self, step: int) -> None:
        total, count, _ = self._waiting.pop(step)
        self.mean.append(step, total / count)
        self._settled_through = max(self._settled_through, step)

    def last_values(self) -> dict[int, float | None]:
        """Each rank's latest value, by rank."""
        return {rank: self.ranks[rank].last_value for rank in sorted(self.ranks)}


class RankMemory:
    """A rank's memory over the run (bytes against seconds): host RSS, and on a GPU rank
    CUDA allocated and reserved; the latest figures and the peaks seen so far.

    Example:
        >>> memory = RankMemory()
        >>> for seconds, rss in ((0.5, 300), (1.0, 500), (1.5, 400)):
        ...     memory.record(events.MemorySample(1, 0, rss), seconds)
        >>> memory.current_bytes, memory.peak_bytes, memory.rss.steps()
        (400, 500, [0.5, 1.0, 1.5])
    """

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.rss = DownsampledSeries(max_points)
        self.cuda_allocated = DownsampledSeries(max_points)
        self.cuda_reserved = DownsampledSeries(max_points)
        self.rss_peak_bytes: int | None = None
        self.cuda_peak_bytes: int | None = None

    def record(self, sample: events.MemorySample, seconds: float) -> None:
        """Add ``sample``, taken ``seconds`` into the run."""
        if sample.rss_bytes is not None:
            self.rss.append(seconds, sample.rss_bytes)
            self.rss_peak_bytes = max(self.rss_peak_bytes or 0, sample.rss_bytes)
        if sample.cuda_allocated_bytes is not None:
            self.cuda_allocated.append(seconds, sample.cuda_allocated_bytes)
        if sample.cuda_reserved_bytes is not None:
            self.cuda_reserved.append(seconds, sample.cuda_reserved_bytes)
        if sample.cuda_peak_bytes is not None:
            self.cuda_peak_bytes = max(self.cuda_peak_bytes or 0, sample.cuda_peak_bytes)

    @property
    def on_cuda(self) -> bool:
        """True once the rank reported CUDA figures."""
        return self.cuda_allocated.count > 0

    @property
    def current_bytes(self) -> int | None:
        """CUDA allocated on a GPU rank (what runs out first), host RSS otherwise (None before a sample)."""
        latest = (self.cuda_allocated if self.on_cuda else self.rss).last_value
        return None if latest is None else int(latest)

    @property
    def peak_bytes(self) -> int | None:
        """The peak of what ``current_bytes`` shows: CUDA's peak allocated on a GPU rank, RSS's otherwise."""
        return self.cuda_peak_bytes if self.on_cuda else self.rss_peak_bytes

    def charted(self) -> tuple[DownsampledSeries, ...]:
        """The lines this rank's memory chart draws: (RSS,) or (CUDA allocated, CUDA reserved)."""
        return (self.cuda_allocated, self.cuda_reserved) if self.on_cuda else (self.rss,)


class LogTail:
    """The last lines a rank wrote, each tagged with its stream, and how many there were.

    A carriage return means "redraw this line" (tqdm does it): only the text after the
    last one is kept, as a terminal would show it.

    Example:
        >>> tail = LogTail(max_lines=2)
        >>> tail.add("stdout", "a\\nb\\n"); tail.add("stderr", "10%\\r50%\\r100%\\n")
        >>> tail.total, list(tail.lines)
        (3, [('stdout', 'b'), ('stderr', '100%')])
    """

    def __init__(self, max_lines: int = LOG_LINES_PER_RANK, max_chars: int = LOG_LINE_CHARS) -> None:
        self.lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_lines)
        self.max_chars = max_chars
        self.total = 0

    def add(self, stream: str, text: str) -> None:
        """Add ``text`` the rank wrote on ``stream`` (``stdout``/``stderr``), line by line."""
        # Not splitlines(): it would split at every "\r" and keep each redraw as a line.
        pieces = text.split("\n")
        if pieces and pieces[-1] == "":
            pieces.pop()
        for line in pieces:
            line = line.rstrip("\r").rsplit("\r", 1)[-1]
            if len(line) > self.max_chars:
                line = line[: self.max_chars - 1] + "…"
            self.lines.append((stream, line))
            self.total += 1


    def skip(self, counted: int, latest: tuple[tuple[str, str], ...]) -> None:
        """During a flood: ``counted`` lines so far, ``latest`` the last few (not shown in the cell)."""
        total = self.total
        for stream, line in latest:
            self.add(stream, line)
        self.total = max(total, counted)


class StepRate:
    """Steps per second over the last ``window`` seconds of the ranks' own clocks.

    Rates use the time each step was logged on the rank, not the time its batch reached the
    kernel, so batching (four times a second) does not make the rate jump.

    Example:
        >>> rate = StepRate(window=10.0)
        >>> for second in range(30):
        ...     rate.add(float(second), 5 * second)
        >>> rate.per_second()
        5.0
    """

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, time: float, step: float) -> None:
        """The progress rank was at ``step`` at ``time`` (its own clock); older samples leave the window."""
        self._samples.append((time, step))
        while len(self._samples) > 2 and time - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def per_second(self) -> float | None:
        """Steps per second over the window (None until two samples at different times)."""
        if len(self._samples) < 2:
            return None
        (first_time, first_step), (last_time, last_step) = self._samples[0], self._samples[-1]
        if last_time <= first_time:
            return None
        return (last_step - first_step) / (last_time - first_time)


class LiveState:
    """Everything the live view shows about one run; fed with events, read when drawing.

    ``version`` changes whenever anything shown changes; ``chart_version`` only when the
    charts would look different, so the view redraws its PNG only then.
    ``batch_size`` is each rank's batch: samples/s = steps/s x batch_size x world_size.
    """

    def __init__(
        self,
        strategy: str = "",
        accelerator: str = "",
        world_size: int = 1,
        *,
        total_steps: int | None = None,
        batch_size: int | None = None,
        started_at: float = 0.0,
        max_points: int = MAX_POINTS,
        stall_seconds: float | None = STALL_SECONDS,
    ) -> None:
        if total_steps is not None and total_steps <= 0:
            raise ValueError(f"total_steps must be a positive number of steps, not {total_steps!r}")
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be a positive number of samples per rank, not {batch_size!r}")
        if stall_seconds is not None and not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be a positive number of seconds or None, not {stall_seconds!r}")
        self.strategy = strategy
        self.accelerator = accelerator
        self.world_size = world_size
        self.total_steps = total_steps
        self.batch_size = batch_size
        self.started_at = started_at
        self.ended_at: float | None = None
        self.max_points = max_points
        self.state = STARTING
        self.failure: str | None = None
        self.stop_step: int | None = None  # a graceful stop's step: "stopping at step N", then "stopped at step N"
        self.stopped_at: int | None = None
        self.metrics: dict[str, MetricHistory] = {}
        self.memory: dict[int, RankMemory] = {}
        self.logs: dict[int, LogTail] = {}
        self.started_ranks: set[int] = set()
        self.latest_step: dict[int, int] = {}
        self.stall_seconds = stall_seconds
        self.last_step_at: dict[int, float] = {}  # when each rank's step last moved (kernel clock)
        self.stalled: str | None = None  # the launcher's stall, in short (RanksStalled), until the ranks move
        self.in_debugger: dict[int, float] = {}  # rank -> since when it waits at a pdb prompt
        self.rate = StepRate()
        self._rate_rank: int | None = None
        self.throughput = DownsampledSeries(max_points)  # (seconds into the run, steps/s)
        self.version = 0
        self.chart_version = 0

    # -- feeding ---------------------------------------------------------------------
    def apply(self, event: Any, now: float) -> None:
        """Take one event from ``Run.events()`` (None, an idle poll, is ignored)."""
        if event is None:
            return
        if isinstance(event, events.Metrics):
            self._apply_metrics(event, now)
        elif isinstance(event, events.MemorySample):
            self.memory.setdefault(event.rank, RankMemory(self.max_points)).record(event, self.elapsed(now))
            self._changed(charts=True)
        elif isinstance(event, events.Output):
            self.logs.setdefault(event.rank, LogTail()).add(event.stream, event.text)
            self._mark_running()
            self._changed()
        elif isinstance(event, events.OutputSkipped):
            self.logs.setdefault(event.rank, LogTail()).skip(event.counted, event.latest)
            self._changed()
        elif isinstance(event, (events.DebugPrompt, events.DebugEnded)):
            self._apply_debugger(event, now)
        elif isinstance(event, events.RanksStalled):
            self.stalled = stall_summary(event) if event.seconds else None
            self._changed()
        elif isinstance(event, events.RankStarted):
            self.started_ranks.add(event.rank)
            if len(self.started_ranks) >= self.world_size:
                self._mark_running()
            self._changed()
        elif isinstance(event, events.RankFailed):
            if self.failure is None:
                self.failure = f"rank {event.rank} raised {event.exc_type}: {event.message}"
            self._changed()
        elif isinstance(event, events.RankExited):
            if self.failure is None and not event.reported and not event.stopped:
                self.failure = _describe_exit(event)
                self._changed()
        elif isinstance(event, events.StopStep):
            self.stop_step = event.step
            self._changed()
        elif isinstance(event, events.RunEnded):
            self.stopped_at = event.stopped_at
            if event.stop_note and self.failure is None:
                self.failure = event.stop_note
            # The launcher's verdict names the root cause; what was shown before was a guess.
            if isinstance(event.failure, events.RankFailed):
                self.failure = f"rank {event.failure.rank} raised {event.failure.exc_type}: {event.failure.message}"
            elif isinstance(event.failure, events.RankExited):
                self.failure = _describe_exit(event.failure)
            elif event.state != events.FINISHED and self.failure is None and event.detail:
                self.failure = event.detail
            self.finish(event.state, now)

    def _apply_debugger(self, event: events.DebugPrompt | events.DebugEnded, now: float) -> None:
        """A rank at a pdb prompt is not stalled: its stall clock (and everyone's) waits meanwhile."""
        if isinstance(event, events.DebugPrompt):
            self.in_debugger.setdefault(event.rank, now)
        elif event.rank in self.in_debugger:
            paused = now - self.in_debugger.pop(event.rank)
            if not self.in_debugger:
                self.last_step_at = {rank: at + paused for rank, at in self.last_step_at.items()}
        self._changed()

    @property
    def debugger_text(self) -> str | None:
        """``rank 1 in the debugger`` while a rank waits at a pdb prompt."""
        if not self.in_debugger:
            return None
        ranks = sorted(self.in_debugger)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        return f"{who} in the debugger"

    def _apply_metrics(self, event: events.Metrics, now: float) -> None:
        if not event.rows:
            return
        for step, _time, values in event.rows:
            for name, value in values.items():
                history = self.metrics.get(name)
                if history is None:
                    history = self.metrics[name] = MetricHistory(name, self.world_size, self.max_points)
                history.add(event.rank, step, value, now)
        for history in self.metrics.values():
            history.settle(now)
        first_step, first_time, _ = event.rows[0]
        last_step, last_time, _ = event.rows[-1]
        if last_step != self.latest_step.get(event.rank):
            self.last_step_at[event.rank] = now
        self.latest_step[event.rank] = last_step
        if event.rank == self.progress_rank:
            if self._rate_rank != event.rank:  # rank 0 showed up late: measure it alone
                self.rate, self._rate_rank = StepRate(), event.rank
            # A batch's first and last rows: a rate at once, still only two samples per batch.
            self.rate.add(first_time, first_step)
            self.rate.add(last_time, last_step)
            rate = self.rate.per_second()
            if rate is not None:
                self.throughput.append(self.elapsed(now), rate)
        self._mark_running()
        self._changed(charts=True)

    def finish(self, state: str, now: float) -> None:
        """The run ended in ``state``; the clock stops and the last mean points are taken."""
        if state not in END_STATES:
            raise ValueError(f"a run ends as one of {', '.join(END_STATES)}, not {state!r}")
        if self.ended_at is None:
            self.ended_at = now
        self.state = state
        self.settle()
        self._changed()

    def settle(self) -> None:
        """Every rank is done: the steps still waiting for a rank's value go into the mean lines now."""
        settled = [history.settle_all() for history in self.metrics.values()]
        if any(settled):
            self._changed(charts=True)

    def _mark_running(self) -> None:
        if self.state == STARTING:
            self.state = RUNNING

    def _changed(self, charts: bool = False) -> None:
        self.version += 1
        if charts:
            self.chart_version += 1

    # -- reading ---------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """True once the run ended (finished, failed, stopped or timed out)."""
        return self.state in END_STATES

    @property
    def state_text(self) -> str:
        """The state as the view says it: ``running``, ``stopping at step 412``, ``stopped at step 412``."""
        if self.stopped_at is not None:
            return f"{self.state} at step {self.stopped_at:,}"
        if self.stop_step is not None and not self.ended:
            return f"stopping at step {self.stop_step:,}"
        return "stalled" if self.stalled and not self.ended else self.state

    @property
    def progress_rank(self) -> int | None:
        """The rank whose steps count as the run's progress: the lowest that logs (rank 0)."""
        return min(self.latest_step, default=None)

    @property
    def current_step(self) -> int | None:
        """The progress rank's latest step (None before any step was logged)."""
        rank = self.progress_rank
        return None if rank is None else self.latest_step[rank]

    def stall(self, now: float) -> str | None:
        """``no step from rank 1 for 42 s`` when a rank that logged steps stopped, else None.

        A run that timed out or was stopped keeps the line as it was at the end. Only ranks
        that log count. While others still step, the quiet ones are named; when
        none steps any more (a deadlock stops everyone), the ranks behind the others are
        the ones to look at: the rest are waiting for them in a collective.

        >>> s = LiveState(world_size=2, stall_seconds=30)
        >>> s.apply(events.Metrics(1, 0, ((5, 0.0, {"loss": 1.0}),)), now=0.0)
        >>> s.apply(events.Metrics(1, 1, ((4, 0.0, {"loss": 1.0}),)), now=0.0)
        >>> s.stall(now=10.0), s.stall(now=42.0)
        (None, 'no step from rank 1 for 42 s (at step 4; the others are at step 5)')
        """
        if self.stall_seconds is None or self.state in (events.FINISHED, events.FAILED) or self.in_debugger:
            return None
        if self.stalled:  # the launcher's word: which ranks wait, and in what
            return self.stalled
        if self.ended_at is not None:  # timed out or stopped: the last frame keeps the clue
            now = self.ended_at
        quiet = {r: now - t for r, t in self.last_step_at.items() if now - t >= self.stall_seconds}
        if not quiet:
            return None
        behind = quiet
        if len(quiet) == len(self.last_step_at):
            lowest = min(self.latest_step[r] for r in quiet)
            behind = {r: t for r, t in quiet.items() if self.latest_step[r] == lowest}
            if len(behind) == len(quiet):
                return f"no step from any rank for {min(quiet.values()):.0f} s"
        ranks = sorted(behind)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        text = f"no step from {who} for {min(behind.values()):.0f} s"
        ahead = sorted({self.latest_step[r] for r in self.latest_step if r not in behind})
        if len(ahead) == 1:
            text += f" (at step {self.latest_step[ranks[0]]}; the others are at step {ahead[0]})"
        return text

    def elapsed(self, now: float) -> float:
        """Seconds since the run started, stopped at its end."""
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, end - self.started_at)

    @property
    def steps_per_second(self) -> float | None:
        """The progress rank's recent step rate (None until it can be measured)."""
        return self.rate.per_second()

    @property
    def samples_per_second(self) -> float | None:
        """Samples per second over every rank, when the batch size is known."""
        rate = self.steps_per_second
        if rate is None or self.batch_size is None:
            return None
        return rate * self.batch_size * self.world_size

    @property
    def known_total(self) -> int | None:
        """``total_steps`` while it still holds; None once rank 0 logged more steps than that.

        A total read from the cell's code, or given by the caller, can be wrong: a full bar
        with an ETA of zero while the run goes on would mislead, so the view then shows the
        step count alone.

        >>> state = LiveState(total_steps=2)
        >>> state.apply(events.Metrics(1, 0, ((1, 0.0, {}), (2, 1.0, {}))), now=1.0)
        >>> state.known_total
        2
        >>> state.apply(events.Metrics(1, 0, ((3, 2.0, {}),)), now=2.0)
        >>> from nbtrain.kernel.display.livetext import progress_text
        >>> state.known_total, progress_text(state)
        (None, 'step 3')
        """
        total, step = self.total_steps, self.current_step
        if total is None or (step is not None and step > total):
            return None
        return total

    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate, when a total holds and the run goes on."""
        rate, step, total = self.steps_per_second, self.current_step, self.known_total
        if self.ended or total is None or step is None or not rate or rate <= 0:
            return None
        return max(0.0, (total - step) / rate)

    def chart_metric_names(self, limit: int = MAX_METRIC_CHARTS) -> list[str]:
        """The metrics that get a chart: losses first, then the rest in the order logged."""
        names = list(self.metrics)
        ordered = [n for n in names if "loss" in n.lower()] + [n for n in names if "loss" not in n.lower()]
        return ordered[:limit]

    @property
    def memory_kind(self) -> str:
        """"cuda" when any rank reports CUDA figures, else "rss" (host memory)."""
        return "cuda" if any(m.on_cuda for m in self.memory.values()) else "rss"


def _describe_exit(event: events.RankExited) -> str:
    if event.signal_number is not None:
        return f"rank {event.rank} was killed by signal {event.signal_number}"
    return f"rank {event.rank} exited with code {event.exit_code} before it finished"


def stall_summary(event: events.RanksStalled) -> str:
    """A stall in one line for the live view: who waits in what, for how long.

    >>> stall_summary(events.RanksStalled(1, 31.0, ((0, "all_reduce of 4 float32 elements", 8, True),
    ...                                              (1, "all_reduce of 4 float32 elements", 7, False))))
    'stalled for 31 s: rank 0 waits in all_reduce (its 8th collective); rank 1 has not joined (see the note below)'
    """
    waiting = [(rank, what.split(" of ")[0], number) for rank, what, number, inside in event.calls if inside]
    on_peers = {rank for rank, text in event.stacks if stacktext.waits_on_peers(stacktext.parse_dump(text))}
    ranks = {rank for rank, *_ in event.calls} | {rank for rank, _ in event.stacks}
    missing = sorted(ranks - on_peers - {rank for rank, _, _ in waiting})
    said = "; ".join(f"rank {rank} waits in {what} (its {stacktext.ordinal(number)} collective)"
                     for rank, what, number in waiting)
    if missing:
        who = f"rank {missing[0]} has" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing)) + " have"
        said = f"{said}; {who} not joined" if said else f"{who} not joined"
    return f"stalled for {event.seconds:.0f} s: {said or 'the ranks wait on each other'} (see the note below)"
