"""The kernel's side of a rank's pdb (nbtrain.kernel.pdb_relay): prompts, output, one rank at a time.

A run handle (nbtrain.kernel.run_handle.Run) on an engine that records what it is sent
stands in for the launcher; the user's typing is ``input()``'s answer. A rank's real pdb,
through a real kernel's stdin requests, is tests/test_debugger.py.
"""

from __future__ import annotations

import queue
from typing import Any

import pytest

from nbtrain.kernel import pdb_relay, run_handle
from nbtrain.messages import events
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan
from nbtrain.system import processes

RUN = 3
CONFIG = config.make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None)


class Engine:
    """Records the lines the relay sends to the ranks."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_debug(self, message: Any) -> None:
        self.sent.append(message)


def test_the_prompt_names_the_rank_and_the_held_note_what_it_holds():
    assert pdb_relay.prompt_text(events.DebugPrompt(RUN, 1, "(Pdb) ")) == "(Pdb) [rank 1] "
    held = events.RankHeld(RUN, 0, 4242, 3 << 30, 512 << 20, 45.0, "cuda:0")
    assert pdb_relay.held_note(held) == (
        "%nbtrain_debug opens the debugger in rank 0's frames (held for 45 s; it holds 3.0 GiB of host memory "
        "and 512 MiB on cuda:0)."
    )


def test_one_ranks_session_at_a_time_and_what_others_sent_comes_after(monkeypatch, capsys):
    engine = Engine()
    run = run_handle.Run(engine, RUN, queue.Queue(), CONFIG)  # type: ignore[arg-type]
    typed = iter(["p x", "c", "c"])
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or next(typed))
    relay = pdb_relay.CellRelay(run, processes.HeldInterrupts())
    sequence = [
        events.DebugOutput(RUN, 0, "> /tmp/x.py(2)\n"),
        events.DebugPrompt(RUN, 0, "(Pdb) "),
        events.DebugOutput(RUN, 1, "> rank 1 waits\n"),  # rank 0's session is open: this waits
        events.DebugPrompt(RUN, 1, "(Pdb) "),
        events.DebugPrompt(RUN, 0, "(Pdb) "),
        events.DebugEnded(RUN, 0),  # now rank 1's turn
    ]
    assert [relay.handle(event) for event in sequence] == [True] * len(sequence)
    assert relay.handle(events.Output(RUN, 0, "stdout", "not the relay's\n")) is False
    assert asked == ["(Pdb) [rank 0] ", "(Pdb) [rank 0] ", "(Pdb) [rank 1] "]
    assert [(m.rank, m.line) for m in engine.sent] == [(0, "p x"), (0, "c"), (1, "c")]
    assert capsys.readouterr().out == "> /tmp/x.py(2)\n> rank 1 waits\n"


def test_an_interrupt_at_the_prompt_stops_the_run_instead_of_answering(monkeypatch):
    engine = Engine()
    run = run_handle.Run(engine, RUN, queue.Queue(), CONFIG)  # type: ignore[arg-type]

    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    held = processes.HeldInterrupts()
    relay = pdb_relay.CellRelay(run, held)
    assert relay.handle(events.DebugPrompt(RUN, 1, "(Pdb) "))
    assert held.received and engine.sent == []  # the cell's loop stops the run, as for any interrupt


def test_a_post_mortem_without_a_held_rank_says_how_to_get_one():
    how = r"no rank is held for a post-mortem: .*set_defaults\(debug_hold=600\)"
    with pytest.raises(pdb_relay.NoRankHeldError, match=how):
        pdb_relay.post_mortem(None)
