"""A stop at a step across a cluster's nodes: the kernel's choice of one step for all of them.

On one machine the launcher sees every rank's step count on one shared page and chooses the
stop step itself (:mod:`nbtrain.launch_server.stopatstep`). A cluster's ranks count on one page
per node, so each node's launcher would choose a step of its own. Instead:

1. The kernel's relay asks every node to stop at a step (``StopRun(graceful=True)``); a node
   whose own ``--timeout`` ran out asks on its own, and the relay then asks the others.
2. Each node's launcher marks its page ``PENDING`` (its ranks wait at their next optimizer step)
   and reports its highest step begun and the grace its step times ask for (``StepsBegun``).
3. When every node still running has reported, :meth:`CrossNodeStop.choose` takes the highest
   step over the nodes (no rank is past it: each waits at most one step past its node's count)
   and the longest grace; the relay sends it to every node (``StepChosen``), whose ranks end
   their cell there. A node that is late makes it a hard stop, as on one machine, and its note
   names the rank.

Pure: no Ray, no processes.

Example:
    >>> from nbtrain.messages import events, stacktext
    >>> stop = CrossNodeStop(asked_at=0.0)
    >>> stop.take(0, events.StepsBegun(1, 41, 2.0, "stopped"))
    >>> stop.choose({0, 1}) is None  # node 1 has not reported yet
    True
    >>> stop.take(1, events.StepsBegun(1, 42, 2.4, "stopped"))
    >>> stop.choose({0, 1})
    StepChosen(run_id=1, step=42, grace=2.4)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nbtrain.launch_server.lifecycle import SECOND_STOP, names_late
from nbtrain.messages import events, stacktext

# From the request until every node has reported its highest step: a Ray call each way and a
# launcher tick, seconds on a loaded machine. Past this the relay stops the run hard.
CHOICE_SECONDS = 5.0


@dataclass
class CrossNodeStop:
    """One run's stop at a step across its nodes, as the kernel's relay follows it."""

    asked_at: float
    reports: dict[int, events.StepsBegun] = field(default_factory=dict)  # node index -> its report
    chosen: events.StepChosen | None = None

    def take(self, index: int, report: events.StepsBegun) -> None:
        """Keep node ``index``'s report of its highest step begun (a later one replaces it)."""
        self.reports[index] = report

    def choose(self, running: set[int]) -> events.StepChosen | None:
        """The step for every node, once each of ``running`` (the nodes not done nor ended) has reported."""
        if self.chosen is not None or not running <= set(self.reports) or not self.reports:
            return None
        reports = list(self.reports.values())
        self.chosen = events.StepChosen(
            reports[0].run_id, max(r.highest for r in reports), max(r.grace for r in reports)
        )
        return self.chosen

    def overdue(self, now: float) -> bool:
        """Whether the nodes' reports took too long (the run is then stopped hard)."""
        return self.chosen is None and now - self.asked_at > CHOICE_SECONDS


def stop_note(ended: list[events.RunEnded]) -> str:
    """Which node's note says why a stop at a step could not keep the state.

    A node's late rank is the cause; the others' "asked to stop a second time" is its consequence.

    >>> late = events.RunEnded(1, events.STOPPED, stop_note="stopped hard (rank 1 did not reach step 9 within 2.0 s)")
    >>> second = events.RunEnded(1, events.STOPPED, stop_note="stopped hard at once (asked to stop a second time)")
    >>> stop_note([second, late])
    'stopped hard (rank 1 did not reach step 9 within 2.0 s)'
    """
    notes = [e.stop_note for e in ended if e.stop_note]
    # Each node names its own late rank; one whose late ranks only waited for the others (a rank of
    # another node asleep) names a consequence: the node with a rank not waiting comes first.
    late = sorted((e for e in ended if names_late(e.stop_note)), key=_only_waited)
    causes = [e.stop_note for e in late]
    others = [note for note in notes if SECOND_STOP not in note]
    return (causes or others or notes or [""])[0]


def _only_waited(ended: events.RunEnded) -> bool:
    """Whether every rank of a node that was stopped hard was waiting for other ranks (its stack dumps)."""
    dumps = [text for _rank, text in ended.stacks if text]
    return bool(dumps) and all(stacktext.waits_on_peers(stacktext.parse_dump(text)) for text in dumps)
