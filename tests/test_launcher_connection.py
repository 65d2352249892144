"""The kernel's connection to its warm launcher (nbtrain.kernel.launcher_connection).

The session's launcher (tests/conftest.py) is a real one: these tests start runs on it and
read what its reader thread files, or hand the output bookkeeping lines as it would.
"""

from __future__ import annotations

import nbtrain
from nbtrain.kernel import launcher_connection
from nbtrain.messages import events

RUN = 9


def test_the_launcher_is_one_per_process_and_prewarm_keeps_it(launcher):
    assert launcher_connection.get_client() is launcher
    assert launcher_connection.current_client() is launcher
    launcher_connection.prewarm()  # safe to call again: the same launcher, already warm
    assert launcher_connection.get_client() is launcher and launcher.ready.wait(120)


def test_a_run_on_the_launcher_files_its_records_under_its_run(launcher):
    run = nbtrain.start(lambda: print("from a rank"), devices=1, accelerator="cpu")
    seen = [event for event in run.events() if event is not None]
    assert run.result() is None
    printed = [e for e in seen if isinstance(e, events.Output)]
    assert printed and all(e.run_id == run.run_id for e in seen if hasattr(e, "run_id"))
    assert "".join(e.text for e in printed) == "from a rank\n"
    assert isinstance(seen[-1], events.RunEnded) and seen[-1].state == events.FINISHED


def test_a_stop_for_a_run_that_ended_is_harmless_and_the_launcher_goes_on(launcher):
    run = nbtrain.start(lambda: 1, devices=1, accelerator="cpu")
    assert run.wait() == 1
    launcher.stop(run.run_id, "stopped")  # the launcher has forgotten it: nothing to stop
    assert nbtrain.launch(lambda: 2, devices=1, accelerator="cpu") == 2
    assert launcher.alive and launcher_connection.current_client() is launcher


# --- output the notebook cannot keep up with ---------------------------------------------------


def test_output_beyond_the_pending_limit_is_counted_and_reported_once_caught_up(monkeypatch):
    monkeypatch.setattr(launcher_connection, "PENDING_OUTPUT_CHARS", 10)
    pending = launcher_connection._PendingOutput("/logs/run-1.log")
    line = events.Output(RUN, 1, "stdout", "0123456789ab\n")
    assert pending.admit(line)  # the first one fits: nothing pending yet
    assert not pending.admit(line) and not pending.admit(events.Output(RUN, 1, "stdout", "a\nb\n"))
    assert pending.notes(RUN) == []  # the reader has not caught up
    pending.taken(len(line.text))
    notes = pending.notes(RUN)
    assert [n.text for n in notes] == [
        "nbtrain: 3 lines of rank 1 were not shown: the notebook could not keep up. Every line is in /logs/run-1.log.\n"
    ]
    assert notes[0].stream == "stderr" and pending.notes(RUN) == []  # said once
