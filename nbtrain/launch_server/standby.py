"""Standby ranks: the next run's ranks, forked and waiting before its cell is sent.

After a run, the launcher forks the ranks of a run with the same plan (ranks and devices,
backend, threads, strategy, and the caller's environment, cwd and sys.path): fresh from the
clean launcher, as for any run. The rest of what the options ask of a rank (precision, BatchNorm
sync: ``StartRun.rank_settings``) is not the plan's: it comes with the run that takes them, so a
cell that changes only those still takes them. Each adopts the plan's state and settings,
sets its device (on CUDA: its context, cuDNN and cuBLAS loaded, NCCL's communicator built
when there are several ranks),
joins its process group (rank 0 hosting the store on a socket the launcher bound) and waits
(``nbtrain.rank.machinery.runtime.run_standby``). A run with the same plan takes them: its
``StartRun`` and the payload's memfd go to each over its channel, and from then on they are
that run's ranks like any others. Until then they belong to no run: no failure, stop or
timeout of a run looks at them, and their output waits in their pipes.

A run with another plan, ``nbtrain.release()``, the idle limit the kernel gave with the last
run (``LaunchOptions.standby_idle``) or the launcher's end discards them (SIGKILL to their process
groups; the pidfds reap them). One that dies while waiting takes its generation with it, and
a generation that had joined its group is replaced; one that never did is not (the next run
forks fresh ranks and reports what failed). Every change is told to the kernel
(``StandbyChanged``) and written to the run registry (state ``standby``), so the sidebar and
``nbtrain.runs()`` show them and their memory.

Warm-up, before a standby rank says ``StandbyReady``: on CUDA it takes three training steps of
a tiny conv net built from constants (cuDNN, cuBLAS and the kernels most first steps use get
loaded), then frees cuBLAS's workspace, empties the allocator's cache and resets the memory
statistics, so a cell starts at 0 bytes allocated; a lone rank builds no communicator. It then
goes once, with nothing of a run's, the way a run takes to a cell's first line (RNG states
set, a payload unpickled, a trivial cell run): the pages of the launcher's objects it copies
on first write are paid here (2-4 ms off a re-run's first line on 2 cores). Then it imports
the libraries among the notebook's imports (and those a cell imports while it waits:
``NotebookModules``) and the library modules the last run's payload needed
(``StartRun.preimport``: rank 0 sends them with its ``RankDone``); the user's own modules are
left to the run. The ``StartRun`` that takes them is pickled once for every rank, and the
kernel hears ``RankStarted`` once every rank has its run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbtrain.messages import wire
from nbtrain.messages.events import NotebookModules, StandbyChanged, StandbyReady, StartRun
from nbtrain.system import processes

Key = tuple[Any, ...]
RELEASE_SECONDS = 2.0  # the longest the launcher waits for SIGKILLed standby ranks to be reaped


def plan_key(start: StartRun) -> Key | None:
    """What a waiting rank was prepared for; None for a run no standby ranks follow.

    Cluster runs (their agents' launchers) and ``ddp_spawn`` (fresh interpreters) have none.

    >>> from nbtrain.messages.events import RankSpec
    >>> spec = RankSpec(0, 0, 1, "cpu", None)
    >>> start = StartRun(1, b"", (spec,), "fork", {"A": "1"}, "/", ("/x",), {}, None, standby_seconds=600)
    >>> plan_key(start) == plan_key(dataclasses.replace(start, run_id=2, payload=b"other"))
    True
    >>> plan_key(start) == plan_key(dataclasses.replace(start, environ={"A": "2"}))
    False
    """
    if start.node is not None or start.start_method != "fork" or not start.standby_seconds:
        return None
    return (
        start.ranks,
        start.rank_settings.backend,
        tuple(sorted(start.environ.items())),
        start.cwd,
        start.sys_path,
        start.rank_settings.threads_per_rank,  # what the waiting ranks set up
        start.strategy,
    )


def plan_of(start: StartRun) -> StartRun:
    """The run's plan without what belongs to its cell (the payload, its sources, its log)."""
    return dataclasses.replace(start, run_id=0, payload=b"", source_lines={}, has_tensor_file=False, log_path=None)


def plan_summary(plan: StartRun) -> str:
    """``2 cpu ranks, gloo``: what the sidebar and ``nbtrain.runs()`` say they wait for."""
    count = len(plan.ranks)
    kind = plan.ranks[0].device_type if plan.ranks else "cpu"
    return f"{count} {kind} rank{'s' if count != 1 else ''}, {plan.rank_settings.backend}"


@dataclass
class Generation:
    """One set of standby ranks, forked together for one plan; ranks are the launcher's RankProcess."""

    key: Key
    plan: StartRun
    ranks: list[Any]
    until: float  # discarded when still untaken then
    ready: set[int] = field(default_factory=set)  # ranks that joined the group

    @property
    def all_ready(self) -> bool:
        """Whether every rank of the generation said StandbyReady."""
        return len(self.ready) == len(self.ranks)


class Pool:
    """The launcher's standby ranks: at most one generation waiting, others being reaped.

    ``fork(plan, generation)`` is the launcher's: it forks the plan's ranks (registered on
    the selector as ``standby`` with the generation) and returns them.
    """

    def __init__(
        self,
        selector: selectors.BaseSelector,
        fork: Callable[[StartRun, Generation], list[Any]],
        tell: Callable[[StandbyChanged], None],
        show: Callable[[Generation | None], None],
        dismissed: Callable[[], bool] = lambda: False,
    ):
        self.selector = selector
        self.fork = fork
        self.tell = tell
        self.show = show
        self.dismissed = dismissed  # their registry record was removed: ended from the sidebar
        self.waiting: Generation | None = None
        self.dying: list[Any] = []  # discarded ranks not reaped yet

    def pids(self) -> set[int]:
        """Every standby rank not reaped yet: the launcher's children too."""
        ranks = [*self.dying, *(self.waiting.ranks if self.waiting else ())]
        return {rank.pid for rank in ranks if not rank.exited}

    def after_run(self, start: StartRun) -> None:
        """A run ended: have its plan's next ranks waiting (or keep those already waiting)."""
        key = plan_key(start)
        if key is None:
            return
        assert start.standby_seconds is not None
        until = time.monotonic() + start.standby_seconds
        if self.waiting is not None and self.waiting.key == key:
            self.waiting.until = until
            return
        self.discard()
        self._fork(Generation(key, plan_of(start), [], until))

    def tell_waiting(self, message: NotebookModules) -> None:
        """Modules a cell imported: the waiting ranks import them now, and so do their replacements."""
        waiting = self.waiting
        if waiting is None:
            return
        modules = (*waiting.plan.notebook_modules, *message.modules)
        waiting.plan = dataclasses.replace(waiting.plan, notebook_modules=modules)
        for rank in waiting.ranks:
            with contextlib.suppress(OSError):  # one gone: its pidfd says so
                wire.send(rank.channel, message)

    def take(self, start: StartRun) -> list[Any] | None:
        """The ranks waiting for this run's plan, now the run's; None (and any discarded) otherwise.

        The caller calls :meth:`changed` once it has handed them the run: the kernel and the
        registry hear of it after the ranks, off the run's critical path.
        """
        waiting = self.waiting
        if waiting is None:
            return None
        if waiting.key != plan_key(start) or not all(_alive(rank) for rank in waiting.ranks):
            # Another plan, or one died just now. Reaped before the run forks its own ranks: the
            # memory they held (a GPU's too) is free again by then.
            self.release(time.monotonic() + RELEASE_SECONDS)
            return None
        self.waiting = None
        for rank in waiting.ranks:
            self.selector.unregister(rank.pidfd)
            self._unregister(rank.channel)
        return waiting.ranks

    def on_message(self, generation: Generation, rank: Any) -> None:
        """A standby rank's record: StandbyReady, or EOF when it died waiting."""
        try:
            message, fds = wire.receive(rank.channel)
        except (wire.ChannelClosed, OSError):
            self._unregister(rank.channel)  # its pidfd tells the rest
            return
        for fd in fds:
            os.close(fd)
        if isinstance(message, StandbyReady) and generation is self.waiting:
            generation.ready.add(message.rank)
            if generation.all_ready:
                self.changed()

    def on_exit(self, generation: Generation | None, rank: Any) -> None:
        """A standby rank ended: reap it; a waiting generation that loses one is replaced if it was ready."""
        processes.signal_group(rank.pid, signal.SIGKILL)  # what it started goes with it (its leader a zombie still)
        status = processes.reap(rank.pid)
        if status is None:
            return
        self._forget(rank)
        if generation is not None and generation is self.waiting:
            dismissed = self.dismissed()
            self.discard()
            # It had worked: a death while waiting is not the plan's fault. Ended from the
            # sidebar (Dismiss removes the record, then kills them): the user wants them gone.
            if generation.all_ready and not dismissed:
                self._fork(Generation(generation.key, generation.plan, [], generation.until))

    def tick(self, now: float) -> None:
        """Discard the standby ranks once they waited their whole idle limit."""
        if self.waiting is not None and now > self.waiting.until:
            self.discard()

    def discard(self) -> None:
        """End the waiting ranks (SIGKILL to their groups); their pidfds reap them."""
        generation, self.waiting = self.waiting, None
        if generation is None:
            return
        for rank in generation.ranks:
            if rank.exited:
                continue  # reaped already (the one whose death discards its generation)
            processes.signal_group(rank.pid, signal.SIGKILL)
            self.selector.unregister(rank.pidfd)
            self.selector.register(rank.pidfd, selectors.EVENT_READ, ("standby-exit", None, rank))
            self._unregister(rank.channel)
            self.dying.append(rank)
        self.changed()

    def release(self, deadline: float) -> list[int]:
        """End them now and reap them (bounded), so that once the caller hears back they are gone
        and the launcher holds nothing of theirs; the pids ended."""
        self.discard()
        ended = []
        for rank in list(self.dying):
            while processes.reap(rank.pid) is None and time.monotonic() < deadline:
                time.sleep(0.005)  # SIGKILLed a moment ago: gone within milliseconds
            ended.append(rank.pid)
            self._forget(rank)
        return ended

    def _fork(self, generation: Generation) -> None:
        try:
            generation.ranks = self.fork(generation.plan, generation)
        except OSError:
            return  # no standby this time: the next run forks its own ranks, and reports why not
        self.waiting = generation
        self.changed()

    def _forget(self, rank: Any) -> None:
        """Close what the launcher holds of a reaped standby rank."""
        rank.exited = True
        self._unregister(rank.pidfd)
        _close(rank.pidfd)
        self._unregister(rank.channel)
        rank.channel.close()
        for fd in [*rank.pipes, *([rank.stack_fd] if rank.stack_fd is not None else [])]:
            _close(fd)
        rank.pipes.clear()
        rank.stack_fd = None
        processes.remove_torch_shared_memory({rank.pid})
        if rank in self.dying:
            self.dying.remove(rank)

    def changed(self) -> None:
        """Tell the kernel (StandbyChanged) and the registry which standby ranks wait now."""
        generation = self.waiting
        self.show(generation)  # first: once the kernel hears of them, the registry is written
        if generation is None:
            self.tell(StandbyChanged())
        else:
            ranks = tuple((rank.spec.rank, rank.pid) for rank in generation.ranks)
            devices = tuple(
                rank.spec.device_index for rank in generation.ranks if rank.spec.device_type == "cuda"
                and rank.spec.device_index is not None
            )
            self.tell(StandbyChanged(ranks, plan_summary(generation.plan), devices, generation.all_ready))

    def _unregister(self, fileobj: Any) -> None:
        """Take ``fileobj`` off the selector, if it is on it (one closed already is not)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fileobj)


def registered(selector: selectors.BaseSelector, fileobj: Any) -> bool:
    """Whether ``fileobj`` is on ``selector`` (one closed already is not: its handler unregistered it)."""
    try:
        selector.get_key(fileobj)
    except (KeyError, ValueError):  # ValueError: a socket closed already, and not registered
        return False
    return True


def _alive(rank: Any) -> bool:
    """Not exited, and its pidfd not readable (a death the loop has not seen yet)."""
    if rank.exited:
        return False
    readable, _, _ = select.select([rank.pidfd], [], [], 0)
    return not readable


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):  # closed already
        os.close(fd)
