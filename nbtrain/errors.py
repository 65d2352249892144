"""Every error and warning nbtrain raises on purpose.

Messages follow one rule: name the value, say why it is a problem, say what to do.
This module is pure: it imports nothing beyond the standard library, so the kernel
can render a failure without importing torch.
"""

from __future__ import annotations

import signal


class NbtrainError(Exception):
    """Base class of every error nbtrain raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled as their fields and message, not by calling __init__ with the message:
        # most constructors take fields (rank, signal, ...), so pickle's default rebuilds a
        # wrong message or fails. Users keep failures (joblib, multiprocessing, a saved run).
        return _restore_error, (type(self), self.args, self.__dict__)


def _restore_error(cls: type[NbtrainError], args: tuple[object, ...], state: dict[str, object]) -> NbtrainError:
    # OSError (TimeoutError's base) lays out its instances itself and only its __new__ may
    # make one; for RunTimeoutError, cls.__new__ would be RuntimeError's.
    new = OSError.__new__ if issubclass(cls, OSError) else cls.__new__
    error = new(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigurationError(NbtrainError, ValueError):
    """A launch setting (devices, accelerator, strategy, timeout) cannot be satisfied."""


class LauncherError(NbtrainError, RuntimeError):
    """The warm launcher process could not be started or stopped answering."""


class RunNotEndedError(NbtrainError, RuntimeError):
    """A run's result was asked for while the run was still going (``Run.result()``, a background handle's ``result``).

    Example:
        >>> error = RunNotEndedError("run 3 has not ended yet, so it has no result: call run.wait()")
        >>> isinstance(error, RuntimeError)
        True
    """


class RunFailedError(NbtrainError, RuntimeError):
    """A run ended without a result. ``rank`` names the rank that caused it (or None)."""

    rank: int | None = None
    headline: str = ""  # the message without ``where``
    where: str = ""  # a timed-out or stopped run: where each rank was (nbtrain.messages.stacktext.where_each_rank_was)

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our own (uninteresting) frames.
        return f"{type(self).__name__}: {self}".splitlines()

    def _set_message(self, headline: str, where: str) -> None:
        self.headline, self.where = headline, where
        self.args = (headline + (f"\n{where}" if where else ""),)


class RankError(RunFailedError):
    """A rank raised an exception; the message carries its remote traceback.

    Example:
        >>> err = RankError(1, "ValueError", "bad batch", "Traceback ...\\nValueError: bad batch\\n")
        >>> err.rank, err.exc_type
        (1, 'ValueError')
    """

    rank: int  # always known here

    def __init__(
        self, rank: int, exc_type: str, exc_message: str, remote_traceback: str, note: str = "", node: str = ""
    ):
        # node: on a cluster, the node's label (e.g. "node 1 (10.0.0.7)"); note: what it means for the caller
        # (e.g. which kernel objects are unchanged)
        self.rank, self.node, self.exc_type, self.exc_message = rank, node, exc_type, exc_message
        self.remote_traceback, self.note = remote_traceback, note
        super().__init__(
            f"{rank_name(rank, node)} raised {exc_type}: {exc_message}\n"
            f"The other ranks were stopped. Traceback from rank {rank}:\n{remote_traceback.rstrip()}"
            + (f"\n{note}" if note else "")
        )

    def _render_traceback_(self) -> list[str]:
        return [
            f"RankError: {rank_name(self.rank, self.node)} raised {self.exc_type}: {self.exc_message}",
            "(the other ranks were stopped)",
            "",
            *self.remote_traceback.rstrip().splitlines(),
            *(["", self.note] if self.note else []),
        ]


class RankDiedError(RunFailedError):
    """A rank ended without reporting (killed by a signal, crashed, or called ``os._exit``)."""

    def __init__(
        self, rank: int, *, signal_number: int | None = None, exit_code: int | None = None, node: str = "",
        collectives: tuple[str, ...] = (),
    ):
        self.rank, self.node, self.signal_number, self.exit_code = rank, node, signal_number, exit_code
        self.collectives = collectives  # each rank's last collective, from its ledger
        text = describe_death(rank, signal_number=signal_number, exit_code=exit_code, node=node)
        if collectives:
            text += (
                f" Each rank's last collective: {'; '.join(collectives)}. A collective library (gloo, NCCL) aborts a"
                " process when the ranks' calls differ in size or kind: see docs/failures.md."
            )
        super().__init__(text)


class RankStartError(RunFailedError):
    """The launcher could not create a rank's process; the ranks already started were stopped.

    Example:
        >>> str(RankStartError(3, 8, "EAGAIN", "Resource temporarily unavailable")).split(":")[0]
        'could not start rank 3 of 8'
    """

    def __init__(self, rank: int, world_size: int, error_name: str, reason: str):
        self.rank = rank
        self.error_name = error_name
        started = f"the {rank} already started were stopped" if rank else "none had started"
        super().__init__(
            f"could not start rank {rank} of {world_size}: creating its process failed with {error_name} ({reason}). "
            f"{_START_ADVICE.get(error_name, 'Use fewer devices, or check the limits of this machine.')} "
            f"The run ended; {started}."
        )


_START_ADVICE = {
    "EAGAIN": "A limit on processes is reached: the user's (ulimit -u, RLIMIT_NPROC), a container's "
    "(the cgroup's pids.max) or the system's (kernel.pid_max). Use fewer devices, end other processes, "
    "or raise the limit.",
    "ENOMEM": "There is not enough memory to create another process. Use fewer devices, or free memory.",
    "EMFILE": "The launcher has too many open files (ulimit -n). Use fewer devices, or raise the limit.",
    "ENFILE": "The system has too many open files. Use fewer devices, or end other processes.",
}


class RunTimeoutError(RunFailedError, TimeoutError):
    """The run took longer than its ``timeout``; every rank was stopped."""

    def __init__(self, timeout: float, where: str = ""):
        self.timeout = timeout
        super().__init__()
        self._set_message(
            f"the run exceeded timeout={timeout:g} s and every rank was stopped. "
            "Raise `timeout` (or pass timeout=None) if the run needs longer.",
            where,
        )


class RunStoppedError(RunFailedError):
    """The run was stopped on request (``stop()`` or the Stop button) before it finished.

    ``where`` says where each rank was when it was stopped.
    """

    def __init__(self, message: str, where: str = ""):
        super().__init__()
        self._set_message(message, where)


class RunInterrupted(KeyboardInterrupt):
    """The caller was interrupted (Jupyter's "interrupt kernel", Ctrl-C) and every rank stopped.

    A KeyboardInterrupt, not an Exception: ``except Exception`` around a run does not
    swallow the user's interrupt, and tools that execute notebooks see an interrupt. The
    message says what happened to the run and the kernel. A stop on request (``stop()``, a
    Stop button) is a :class:`RunStoppedError` instead.

    Example:
        >>> error = RunInterrupted("the run was interrupted and every rank was stopped.")
        >>> isinstance(error, KeyboardInterrupt), isinstance(error, Exception)
        (True, False)
    """

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing nbtrain's frames.
        return f"KeyboardInterrupt: {self}".splitlines()  # with where each rank was, if known


class NodeLostError(RunFailedError):
    """A node of a cluster run was lost (its agent or its whole node died) before the run ended."""

    def __init__(self, node: str, detail: str):
        self.node = node
        self.detail = detail
        super().__init__(
            f"{node} was lost during the run: {detail}. Its ranks are gone and the other nodes' ranks "
            "were stopped; the next run starts new nbtrain agents on the nodes the cluster has then."
        )


class ClusterError(NbtrainError, RuntimeError):
    """The cluster cannot be reached or cannot hold the run (the cluster engine)."""


def rank_name(rank: int, node: str = "") -> str:
    """How messages name a rank: ``rank 1``, or on a cluster ``rank 1 on node 1 (10.0.0.7)``.

    >>> rank_name(3, "node 1 (10.0.0.7)")
    'rank 3 on node 1 (10.0.0.7)'
    """
    return f"rank {rank} on {node}" if node else f"rank {rank}"


def describe_death(rank: int, *, signal_number: int | None, exit_code: int | None, node: str = "") -> str:
    """One sentence saying how a rank ended and what the user can do about it.

    >>> describe_death(1, signal_number=9, exit_code=None).split(".")[0]
    'rank 1 was killed by signal 9 (SIGKILL)'
    """
    who = rank_name(rank, node)
    if signal_number is not None:
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = "unknown signal"
        text = f"{who} was killed by signal {signal_number} ({name})."
        if signal_number == signal.SIGKILL:
            text += (
                " SIGKILL often means the machine ran out of memory (the kernel's OOM killer):"
                " use a smaller batch or model, or fewer devices."
            )
        elif signal_number == signal.SIGSEGV:
            text += " A segmentation fault is a crash in native code (a C/C++/CUDA extension)."
        return text + " The other ranks were stopped."
    return (
        f"{who} exited with code {exit_code} before finishing its work"
        " (a call to sys.exit/os._exit, or a crash in native code). The other ranks were stopped."
    )


class UnusedParametersError(NbtrainError, RuntimeError):
    """A DDP model's first backward left trainable parameters without a gradient.

    Example:
        >>> print(UnusedParametersError("Net", ["head.weight", "head.bias"], 6))  # doctest: +ELLIPSIS
        Net has 2 of its 6 trainable parameters that got no gradient in the first step: head.weight, head.bias. ...
    """

    def __init__(self, model: str, names: list[str], trainable: int, shown: int = 8):
        self.model = model
        self.names = list(names)
        listed = ", ".join(self.names[:shown])
        if len(self.names) > shown:
            listed += f" and {len(self.names) - shown} more"
        super().__init__(
            f"{model} has {len(self.names)} of its {trainable} trainable parameters that got no gradient in the"
            f" first step: {listed}. DistributedDataParallel averages gradients only once every parameter has one,"
            " so the ranks' copies of the model would drift apart. If the model skips them on purpose (a branch,"
            " a frozen head),"
            " run with --strategy ddp_find_unused_parameters_true (nbtrain.launch: strategy="
            "'ddp_find_unused_parameters_true'; nbtrain.prepare(model, find_unused_parameters=True)), which looks"
            " for unused parameters at every step; or freeze them with .requires_grad_(False)."
        )


class CollectiveMismatchError(NbtrainError, RuntimeError):
    """Ranks called different collectives (or sizes, or dtypes) as the same call of a group: raised
    on the rank that arrived last, before it joins (nbtrain.rank.machinery.collectives)."""


class SerializationError(NbtrainError, TypeError):
    """Something the ranks need cannot be pickled (an open file, a generator, a thread, a socket...).

    Locks and weak references do travel: a lock arrives in the other process as a new, unlocked lock."""
