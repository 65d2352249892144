"""The live view's words (display/livetext.py): status, progress, metric and memory lines.

Pure: events are built by hand, clocks are plain numbers; no process, no drawing.
"""

from __future__ import annotations

from nbtrain.kernel.display import livetext
from nbtrain.livestate import LiveState
from nbtrain.messages import events

RUN = 1


def metrics(rank: int, steps: range, name: str = "loss", value=lambda step: 1.0 / step, start_time: float = 0.0):
    return events.Metrics(RUN, rank, tuple((s, start_time + s, {name: value(s)}) for s in steps))


def two_rank_state(**hints) -> LiveState:
    return LiveState("ddp_notebook", "cpu", 2, started_at=100.0, **hints)



def test_summary_text_has_state_step_loss_and_memory_per_rank():
    state = two_rank_state(total_steps=200)
    state.apply(events.RankStarted(RUN, 0, 1), now=100.1)
    state.apply(metrics(0, range(1, 101), value=lambda s: 0.5), now=101.0)
    state.apply(metrics(1, range(1, 101), value=lambda s: 0.25), now=101.0)
    state.apply(events.MemorySample(RUN, 0, 300 * 2**20), now=101.0)
    state.apply(events.MemorySample(RUN, 1, 310 * 2**20), now=101.0)
    lines = livetext.summary_text(state, now=112.5).splitlines()
    assert lines == [
        "nbtrain · ddp_notebook · cpu · 2 ranks · running · 12.5 s · 1 steps/s",
        "step 100/200 [##########----------] 50% · ETA 1:40",
        "loss  rank 0: 0.5  rank 1: 0.25  mean: 0.375",
        "memory (host RSS)  rank 0: 300.0 MiB (peak 300.0 MiB)  rank 1: 310.0 MiB (peak 310.0 MiB)",
    ]


def test_one_line_progress_for_terminals():
    state = LiveState("ddp_notebook", "cpu", 1, started_at=0.0)
    state.apply(metrics(0, range(1, 4), value=lambda s: 0.125), now=2.0)
    assert livetext.one_line_progress(state, now=2.0) == "[nbtrain] running · 2.0 s · step 3 · 1 steps/s · loss 0.125"


def test_a_run_that_ends_early_shows_how_far_it_got():
    state = LiveState(total_steps=100)
    state.apply(metrics(0, range(1, 61)), now=1.0)
    state.finish(events.FINISHED, now=2.0)
    assert livetext.progress_fraction(state) == 0.6


def test_a_total_that_the_steps_overtake_is_dropped_not_shown_past_100_percent():
    state = LiveState(total_steps=100)
    state.apply(metrics(0, range(1, 101)), now=1.0)
    assert livetext.progress_text(state).startswith("step 100/100 [####################] 100%")
    assert state.eta_seconds() == 0.0
    state.apply(metrics(0, range(101, 131)), now=2.0)  # the total was wrong: the run goes on
    assert state.known_total is None and state.total_steps == 100
    assert livetext.progress_fraction(state) is None and state.eta_seconds() is None
    assert livetext.progress_text(state) == "step 130"
    state.finish(events.FINISHED, now=3.0)
    assert livetext.summary_text(state, now=3.0).splitlines()[1] == "step 130"
