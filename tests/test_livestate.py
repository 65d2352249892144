"""The live view's run state (nbtrain.livestate): series, downsampling, memory, logs, rates, stalls.

Pure: events are built by hand, clocks are plain numbers; no process, no drawing.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from nbtrain.kernel.display import livetext
from nbtrain.livestate import DownsampledSeries, LiveState, LogTail, MetricHistory, StepRate
from nbtrain.messages import events

RUN = 1


def metrics(rank: int, steps: range, name: str = "loss", value=lambda step: 1.0 / step, start_time: float = 0.0):
    return events.Metrics(RUN, rank, tuple((s, start_time + s, {name: value(s)}) for s in steps))


def two_rank_state(**hints) -> LiveState:
    return LiveState("ddp_notebook", "cpu", 2, started_at=100.0, **hints)


# --- DownsampledSeries -------------------------------------------------------------------


def test_series_stays_bounded_and_keeps_mean_min_max_of_100k_points():
    series = DownsampledSeries(max_points=2000)
    values = [math.sin(step / 500) + step / 1e5 for step in range(100_000)]
    for step, value in enumerate(values):
        series.append(step, value)

    assert 1000 <= len(series) <= 2000
    assert series.count == 100_000
    assert series.points_per_bucket == 64
    assert min(series.lows()) == min(values)
    assert max(series.highs()) == max(values)
    weighted = sum(m * series.points_per_bucket for m in series.means()[:-1])
    weighted += series.means()[-1] * (100_000 - series.points_per_bucket * (len(series) - 1))
    assert weighted / 100_000 == pytest.approx(sum(values) / 100_000)
    steps = series.steps()
    assert steps == sorted(steps)
    assert (series.last_step, series.last_value) == (99_999, values[-1])


def test_series_below_its_bound_keeps_every_point():
    series = DownsampledSeries(max_points=10)
    for step in range(1, 11):
        series.append(step, step * 2.0)
    assert series.steps() == [float(s) for s in range(1, 11)]
    assert series.means() == [s * 2.0 for s in range(1, 11)]
    assert series.points_per_bucket == 1


def test_series_skips_non_finite_values_in_the_chart_but_reports_them_last():
    series = DownsampledSeries()
    series.append(1, 0.5)
    series.append(2, float("nan"))
    series.append(3, float("inf"))
    assert series.means() == [0.5]
    assert series.count == 3
    assert math.isinf(series.last_value)


def test_series_rejects_a_bound_below_two():
    with pytest.raises(ValueError, match="at least 2"):
        DownsampledSeries(max_points=1)


# --- MetricHistory: the mean over ranks ----------------------------------------------------


def test_mean_waits_for_the_lagging_rank():
    loss = MetricHistory("loss", world_size=2)
    for step in range(1, 6):
        loss.add(0, step, 1.0, now=0.0)
    for step in range(1, 3):
        loss.add(1, step, 3.0, now=0.1)
    loss.settle(now=0.1)
    assert loss.mean.means() == [2.0, 2.0]  # steps 3..5 wait for rank 1
    for step in range(3, 6):
        loss.add(1, step, 3.0, now=0.2)
    loss.settle(now=0.2)
    assert loss.mean.means() == [2.0] * 5


def test_mean_counts_a_rank_whose_first_batch_arrives_second():
    state = LiveState("ddp_notebook", "cpu", 2)
    state.apply(metrics(0, range(1, 101), value=lambda s: 0.5), now=1.0)
    state.apply(metrics(1, range(1, 101), value=lambda s: 0.25), now=1.1)
    assert state.metrics["loss"].mean.means() == [0.375] * 100


def test_mean_of_a_metric_only_rank_zero_logs_follows_after_a_wait():
    loss = MetricHistory("loss", world_size=4, wait_seconds=2.0)
    loss.add(0, 1, 1.0, now=0.0)
    loss.settle(now=1.0)
    assert loss.mean.count == 0
    loss.add(0, 2, 0.5, now=2.5)
    loss.settle(now=2.5)
    assert (loss.mean.count, loss.mean.last_value) == (1, 1.0)


def test_a_value_too_late_for_the_mean_stays_on_its_rank_line():
    loss = MetricHistory("loss", world_size=2, wait_seconds=2.0)
    loss.add(0, 1, 1.0, now=0.0)
    loss.settle(now=3.0)
    loss.add(1, 1, 3.0, now=3.0)
    loss.settle(now=3.0)
    assert loss.mean.means() == [1.0]
    assert loss.ranks[1].means() == [3.0]


def test_mean_takes_what_is_left_when_the_run_ends():
    loss = MetricHistory("loss", world_size=2)
    loss.add(0, 1, 1.0, now=0.0)
    loss.add(1, 1, 3.0, now=0.0)
    loss.add(0, 2, 5.0, now=0.0)  # rank 1 never logs step 2
    loss.settle(now=0.0)
    assert loss.mean.means() == [2.0]
    loss.settle_all()
    assert loss.mean.means() == [2.0, 5.0]


def test_waiting_steps_are_capped_in_number():
    loss = MetricHistory("loss", world_size=2, max_points=10, wait_seconds=math.inf)  # cap: 40 steps
    loss.add(1, 1, 0.0, now=0.0)
    for step in range(1, 201):
        loss.add(0, step, 1.0, now=0.0)
        loss.settle(now=0.0)
    assert len(loss._waiting) <= 40
    assert loss.mean.count >= 160


# --- LogTail -----------------------------------------------------------------------------


def test_log_tail_keeps_the_last_lines_and_counts_all():
    tail = LogTail(max_lines=3)
    tail.add("stdout", "".join(f"line {i}\n" for i in range(10)))
    assert tail.total == 10
    assert [text for _, text in tail.lines] == ["line 7", "line 8", "line 9"]


def test_log_tail_shows_a_redrawn_line_as_a_terminal_would():
    tail = LogTail()
    tail.add("stderr", " 10%|#  |\r 50%|## |\r100%|###|\n")
    tail.add("stdout", "windows line\r\n")
    tail.add("stdout", "tail without newline")
    assert list(tail.lines) == [("stderr", "100%|###|"), ("stdout", "windows line"), ("stdout", "tail without newline")]


def test_log_tail_cuts_runaway_lines():
    tail = LogTail(max_chars=50)
    tail.add("stdout", "x" * 10_000 + "\n")
    (_, line), = tail.lines
    assert len(line) == 50 and line.endswith("…")


# --- StepRate ----------------------------------------------------------------------------


def test_step_rate_follows_the_recent_window():
    rate = StepRate(window=10.0)
    assert rate.per_second() is None
    for second in range(60):
        rate.add(float(second), (1 if second < 30 else 10) * second)
    assert rate.per_second() == pytest.approx(10.0)  # the slow first half has left the window
    assert len(rate._samples) <= 12


def test_step_rate_needs_time_to_pass():
    rate = StepRate()
    rate.add(5.0, 1)
    rate.add(5.0, 2)
    assert rate.per_second() is None


# --- LiveState ----------------------------------------------------------------------------


def test_state_goes_from_starting_to_running_when_every_rank_started():
    state = two_rank_state()
    assert state.state == "starting"
    state.apply(events.RankStarted(RUN, 0, 1234), now=100.5)
    assert state.state == "starting"
    state.apply(events.RankStarted(RUN, 1, 1235), now=100.6)
    assert state.state == "running"


@pytest.mark.parametrize(
    "event",
    [metrics(0, range(1, 3)), events.Output(RUN, 1, "stdout", "hello\n")],
    ids=["metrics", "output"],
)
def test_state_is_running_once_a_rank_reports(event):
    state = two_rank_state()
    state.apply(event, now=101.0)
    assert state.state == "running"


def test_state_ends_in_the_run_s_state_and_the_clock_stops():
    state = two_rank_state()
    state.apply(metrics(0, range(1, 3)), now=101.0)
    assert state.elapsed(now=103.0) == 3.0
    state.apply(events.RunEnded(RUN, events.FINISHED), now=104.0)
    assert state.state == "finished" and state.ended
    assert state.elapsed(now=200.0) == 4.0


def test_state_rejects_an_unknown_end_state():
    with pytest.raises(ValueError, match="finished"):
        two_rank_state().finish("done", now=0.0)


def test_state_names_the_failure():
    state = two_rank_state()
    state.apply(events.RankFailed(RUN, 1, "ValueError", "bad batch", "Traceback ..."), now=101.0)
    state.apply(events.RankExited(RUN, 0, None, 15, reported=False), now=101.1)  # stopped because of rank 1
    state.apply(events.RunEnded(RUN, events.FAILED, detail="ignored: rank 1 is the cause"), now=101.2)
    assert state.failure == "rank 1 raised ValueError: bad batch"
    assert state.state == "failed"


@pytest.mark.parametrize(
    ("exited", "expected"),
    [
        (events.RankExited(RUN, 1, None, 9, reported=False), "rank 1 was killed by signal 9"),
        (events.RankExited(RUN, 0, 3, None, reported=False), "rank 0 exited with code 3 before it finished"),
    ],
)
def test_state_names_a_rank_that_died(exited, expected):
    state = two_rank_state()
    state.apply(exited, now=101.0)
    assert state.failure == expected


def test_a_rank_that_exits_after_reporting_is_no_failure():
    state = two_rank_state()
    state.apply(events.RankExited(RUN, 0, 0, None, reported=True), now=101.0)
    assert state.failure is None


def test_run_ended_detail_explains_a_run_without_a_rank_failure():
    state = two_rank_state()
    state.apply(events.RunEnded(RUN, events.FAILED, detail="the nbtrain launcher process has exited"), now=101.0)
    assert state.failure == "the nbtrain launcher process has exited"


def test_chart_version_moves_only_with_chart_data():
    state = two_rank_state()
    before = state.chart_version
    state.apply(events.Output(RUN, 0, "stdout", "hello\n"), now=101.0)
    state.apply(None, now=101.0)
    assert state.chart_version == before
    state.apply(metrics(0, range(1, 3)), now=101.0)
    after_metrics = state.chart_version
    state.apply(events.MemorySample(RUN, 0, 2**28), now=101.0)
    assert before < after_metrics < state.chart_version


def test_rates_samples_and_eta():
    state = two_rank_state(total_steps=1000, batch_size=32)
    state.apply(metrics(0, range(1, 101), start_time=0.0), now=101.0)  # one step per second
    state.apply(metrics(1, range(1, 101), start_time=0.0), now=101.0)
    assert state.current_step == 100
    assert state.steps_per_second == pytest.approx(1.0)
    assert state.samples_per_second == pytest.approx(64.0)  # 32 per rank, 2 ranks
    assert state.eta_seconds() == pytest.approx(900.0)
    state.finish(events.FINISHED, now=102.0)
    assert state.eta_seconds() is None


def test_without_hints_there_are_no_samples_or_eta():
    state = two_rank_state()
    state.apply(metrics(0, range(1, 11)), now=101.0)
    assert state.samples_per_second is None and state.eta_seconds() is None


@pytest.mark.parametrize("hints", [{"total_steps": 0}, {"batch_size": -1}])
def test_hints_must_be_positive(hints):
    with pytest.raises(ValueError, match="positive"):
        two_rank_state(**hints)


def test_progress_follows_rank_zero_even_when_it_reports_second():
    state = two_rank_state()
    state.apply(metrics(1, range(1, 51)), now=101.0)
    assert state.current_step == 50
    state.apply(metrics(0, range(1, 41), start_time=1000.0), now=101.0)
    assert state.progress_rank == 0 and state.current_step == 40
    assert state.steps_per_second == pytest.approx(1.0)  # rank 1's clock is not mixed in


def test_losses_are_charted_first_and_the_number_of_charts_is_capped():
    state = two_rank_state()
    names = ["lr", "accuracy", "loss", "grad_norm", "val_loss", "a", "b"]
    state.apply(events.Metrics(RUN, 0, ((1, 0.0, {name: 1.0 for name in names}),)), now=101.0)
    assert state.chart_metric_names() == ["loss", "val_loss", "lr", "accuracy"]


def test_memory_shows_rss_and_its_peak_on_cpu():
    state = two_rank_state()
    for rss in (300, 500, 400):
        state.apply(events.MemorySample(RUN, 0, rss), now=101.0)
    memory = state.memory[0]
    assert (memory.current_bytes, memory.peak_bytes) == (400, 500)
    assert state.memory_kind == "rss"


def test_memory_shows_cuda_allocated_and_peak_on_gpu():
    state = two_rank_state()
    state.apply(events.MemorySample(RUN, 0, 5 * 2**30), now=101.0)  # RSS from the launcher
    state.apply(events.MemorySample(RUN, 0, None, 2 * 2**30, 3 * 2**30), now=101.0)  # CUDA from the rank
    state.apply(events.MemorySample(RUN, 0, 6 * 2**30), now=101.2)
    memory = state.memory[0]
    assert (memory.current_bytes, memory.peak_bytes) == (2 * 2**30, 3 * 2**30)
    assert state.memory_kind == "cuda"
    assert "GPU allocated" in livetext.memory_line(state)


def test_memory_is_kept_over_the_run_per_rank():
    state = two_rank_state()
    for now, rss in ((100.5, 300), (101.0, 320), (101.5, 340)):
        state.apply(events.MemorySample(RUN, 1, rss * 2**20), now=now)
    series = state.memory[1].rss
    assert series.steps() == [0.5, 1.0, 1.5]  # seconds into the run
    assert series.means() == [300 * 2**20, 320 * 2**20, 340 * 2**20]
    assert state.memory[1].charted() == (series,)


def test_gpu_memory_keeps_allocated_and_reserved_over_time():
    state = two_rank_state()
    state.apply(events.MemorySample(RUN, 0, 5 * 2**30), now=100.5)  # RSS from the launcher: not charted on a GPU
    state.apply(events.MemorySample(RUN, 0, None, 2**30, 2**30, cuda_reserved_bytes=2 * 2**30), now=101.0)
    allocated, reserved = state.memory[0].charted()
    assert (allocated.steps(), allocated.means()) == ([1.0], [2**30])
    assert (reserved.steps(), reserved.means()) == ([1.0], [2 * 2**30])


def test_throughput_follows_the_step_rate_over_the_run():
    state = two_rank_state()
    state.apply(metrics(0, range(1, 11), start_time=0.0), now=101.0)  # one step a second
    faster = tuple((s, 10 + (s - 10) / 2, {"loss": 1.0}) for s in range(11, 31))  # then two a second
    state.apply(events.Metrics(RUN, 0, faster), now=102.0)
    assert state.throughput.steps() == [1.0, 2.0]
    assert state.throughput.means()[0] == pytest.approx(1.0) and state.throughput.means()[1] > 1.0
    state.apply(metrics(1, range(1, 40), start_time=0.0), now=103.0)  # another rank: not the progress rank
    assert state.throughput.count == 2


def test_livestate_imports_nothing_heavy():
    code = (
        "import sys, nbtrain.livestate; "
        "print(sorted(m for m in ('torch', 'matplotlib', 'IPython', 'numpy') if m in sys.modules))"
    )
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- stalls ------------------------------------------------------------------------------


def test_a_rank_that_stops_stepping_while_the_others_go_on_is_named():
    state = LiveState("ddp_notebook", "cpu", 3, stall_seconds=30)
    for second in range(41):
        for rank in (0, 2):
            state.apply(metrics(rank, range(second + 1, second + 2)), now=float(second))
        if second <= 5:
            state.apply(metrics(1, range(second + 1, second + 2)), now=float(second))
    assert state.stall(now=40.0) == "no step from rank 1 for 35 s (at step 6; the others are at step 41)"
    assert "no step from rank 1 for 35 s" in livetext.summary_text(state, 40.0)
    assert "no step from rank 1 for 35 s" in livetext.one_line_progress(state, 40.0)


def test_in_a_deadlock_the_rank_behind_is_named_and_nothing_before_the_limit():
    state = two_rank_state(stall_seconds=30)
    state.apply(metrics(0, range(1, 8)), now=1.0)  # rank 0 logged step 7 and waits in all_reduce
    state.apply(metrics(1, range(1, 7)), now=1.0)  # rank 1 never reached step 7
    assert state.stall(now=30.9) is None
    assert state.stall(now=31.0) == "no step from rank 1 for 30 s (at step 6; the others are at step 7)"


def test_ranks_stopped_at_the_same_step_and_runs_that_ended_or_never_log():
    state = two_rank_state(stall_seconds=5)
    assert state.stall(now=100.0) is None  # nothing logged: nothing to compare with
    state.apply(metrics(0, range(1, 4)), now=0.0)
    state.apply(metrics(1, range(1, 4)), now=0.0)
    assert state.stall(now=9.0) == "no step from any rank for 9 s"
    state.finish(events.TIMED_OUT, now=9.0)
    assert state.stall(now=20.0) == "no step from any rank for 9 s"  # the last frame keeps it
    state.finish(events.FINISHED, now=9.0)
    assert state.stall(now=20.0) is None
    assert LiveState(stall_seconds=None).stall(now=1e9) is None
    with pytest.raises(ValueError, match="stall_seconds must be a positive number of seconds or None, not 0"):
        LiveState(stall_seconds=0)



def test_settling_as_the_ranks_are_done_leaves_the_end_nothing_new_to_chart():
    state = LiveState("ddp_notebook", "cpu", 2)
    state.apply(events.Metrics(1, 0, ((1, 0.0, {"loss": 1.0}), (2, 0.1, {"loss": 0.5}))), now=0.0)
    state.apply(events.Metrics(1, 1, ((1, 0.0, {"loss": 3.0}),)), now=0.0)
    before = state.chart_version
    state.settle()
    assert state.metrics["loss"].mean.means() == [2.0, 0.5] and state.chart_version == before + 1
    state.settle()  # nothing waits now
    state.finish(events.FINISHED, now=1.0)
    assert state.chart_version == before + 1
