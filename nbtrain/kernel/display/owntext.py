"""What a cell writes as text of nbtrain's own: the run's summary, notes and warnings.

The kernel side writes to the cell's stdout and stderr only through here and through
:mod:`~nbtrain.kernel.display.rankoutput` (a rank's lines and displays, as ``--output``
chose; the live view and widgets are :mod:`~nbtrain.kernel.display.live` and its
siblings): the summary a finished cell ends with (:func:`summary`), a line of nbtrain's
own (:func:`print_line`, :func:`print_warning`) and a debugger's output as it comes
(:func:`write_text`).

Example:
    >>> print_line("nbtrain: done.")
    nbtrain: done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbtrain import livestate
from nbtrain.kernel.display import live, show
from nbtrain.messages import events


def write_text(text: str, stderr: bool = False) -> None:
    """Write ``text`` as it is to the cell's stdout (or stderr), at once (pdb's output, a prompt's lines)."""
    show.write_stream("stderr" if stderr else "stdout", text)


def print_line(text: str) -> None:
    """One line of nbtrain's own in the cell's output (a summary, a help text, a debugger's end)."""
    write_text(text + "\n")


def print_warning(text: str) -> None:
    """One line of nbtrain's own on the cell's stderr: a warning or a note the user should see."""
    write_text(text + "\n", stderr=True)


def show_summary(record: Any) -> None:
    """Print :func:`summary` of ``record`` in the cell."""
    print_line(summary(record))


class CellView:
    """The run's live view (status, progress, charts) above the cell's printed output.

    A rank's lines and displays are shown by the cell's
    :class:`~nbtrain.kernel.display.rankoutput.OutputPrinter` in every frontend, so the view
    shows none of them (``show_logs=False``).
    """

    def __init__(self, run: Any, count_steps: Callable[[], int | None] | None = None,
                 stall_warning: float | None = livestate.STALL_SECONDS):
        # The cell's stream lines (OutputPrinter) are where rank output goes: the whole of it,
        # kept in the saved notebook, chosen by --output. The view shows no second copy.
        self.view = live.LiveView(run.config, stall_warning=stall_warning, show_logs=False)
        self.poll_seconds = live.FASTEST_FRAME_SECONDS / 2
        # The first frame waits for the first event past the ranks' start, or the first poll:
        # drawn at once, it took a core from the ranks just as they start (~2 ms on 2 cores).
        # So does reading the cell's step total (count_steps, about 1 ms), needed by that frame.
        self._drawn = False
        self._count_steps = count_steps
        self._run = run
        self._chart_ahead = False  # the last frame's chart drawn while the ranks exit

    def show(self, event: Any) -> None:
        """Take ``event`` (None: nothing new, a redraw) and redraw when a frame is due.

        Called before the event's output is printed: the first frame stays above it.
        """
        self.view.handle(event)
        if not self._drawn and isinstance(event, events.RankStarted):
            return
        self._count()
        # A prompt blocks the cell's thread: "rank 1 in the debugger" must be drawn first.
        forced = not self._drawn or isinstance(event, (events.DebugPrompt, events.DebugEnded))
        self.view.refresh(force=forced)
        self._drawn = True
        if not self._chart_ahead and self._run.result_arrived:
            # Every rank is done and its metrics are in; their exits take 10 ms on a CPU and
            # about 150 ms on a GPU, in which the last frame's chart is drawn rather than after.
            self._chart_ahead = True
            self.view.draw_chart()

    def finish(self, state: str, redraw_chart: bool = True) -> None:
        """Draw the run's final state (``redraw_chart`` False: its chart as last drawn, for a stop wanted now)."""
        self._count()
        self.view.finish(state, redraw_chart)

    def _count(self) -> None:
        """Read the step total once, before the first frame that shows it."""
        if self._count_steps is not None:
            count, self._count_steps = self._count_steps, None
            total = count()
            self.view.state.total_steps = total if total is not None and total > 0 else None


def summary(record: Any) -> str:
    """The line a finished (or stopped-at-a-step, or failed) cell ends with: ranks, time, what was prepared and updated.

    ``record`` is the cell's :class:`nbtrain.kernel.cellrun.LastRun`; a failed one's state at the raise came back
    from ``record.failed_rank``.
    """
    ranks = f"{record.world_size} rank{'s' if record.world_size != 1 else ''}"
    ended = "finished" if record.stopped_at is None else f"{record.state} at step {record.stopped_at}"
    if getattr(record, "failed_rank", None) is not None:
        ended = f"failed (the state rank {record.failed_rank} held at its error came back)"
    text = f"nbtrain: {ranks} ({record.accelerator}, {record.strategy}) {ended} in {record.seconds:.1f} s."
    if record.steps_alone and record.world_size > 1:  # first: the run did not do what several ranks are for
        text += " " + alone_sentence(record.world_size, record.steps_alone)
    loaders = dict(record.loaders)
    left = [(name, how) for name, how in record.prepared if how.startswith("not prepared")]
    wrapped = [  # "model (DistributedDataParallel)", or "model: on cuda:0, not wrapped (one rank)"
        f"{name}: {how}" if how.startswith("on ") else f"{name} ({how})"
        for name, how in record.prepared
        if how not in ("moved", "bound") and name not in loaders and (name, how) not in left
    ]
    if wrapped:
        text += f" Auto-prepared: {', '.join(wrapped)}."
    if left:  # e.g. "trainer.models[0]: not prepared (a tuple cannot hold another object; ...)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in left) + "."
    if loaders:  # e.g. "test_loader: evaluated whole on every rank (iterated without gradients)"
        text += " " + "; ".join(f"{name}: {how}" for name, how in loaders.items()) + "."
    if record.updated:
        text += f" Updated in the kernel: {', '.join(record.updated)}."
    for sentence in record.derived:  # "lr_scheduler expects 240 steps; each rank runs 120 (...): ..."
        text += f" {sentence}."
    if record.log_path:
        text += f" Full output: {record.log_path}"
    return text


def alone_sentence(world_size: int, steps: int) -> str:
    """The summary's sentence for a run whose rank 0 took ``steps`` optimizer steps and joined no collective.

    >>> print(alone_sentence(2, 1))  # doctest: +ELLIPSIS
    Each of the 2 ranks trained alone: rank 0 took 1 optimizer step and joined no collective, so no gradient...
    """
    return (
        f"Each of the {world_size} ranks trained alone: rank 0 took {steps} optimizer step{'s' if steps != 1 else ''} "
        f"and joined no collective, so no gradient was averaged over the ranks: {world_size} independent trainings "
        "ran, and the kernel got rank 0's. To train one model over the ranks, let auto mode wrap it (a cell without "
        f"--no-auto), wrap it in DistributedDataParallel, or give the framework the cell's {world_size} ranks "
        f"(Lightning's Trainer or Fabric with devices={world_size}, not 1)."
    )
