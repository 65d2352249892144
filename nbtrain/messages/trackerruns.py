"""A tracker run opened in the kernel, used by a ``%%distributed`` cell: its calls reach the kernel's run.

A notebook often opens its run in an early cell (``writer = SummaryWriter(d)``,
``run = wandb.init()``) and logs to it from the training cell. The run's object holds
threads, files and a service connection of the kernel's process: it cannot be copied to
the ranks. When a cell uses it, :func:`stand_in` (called by :class:`nbtrain.messages.codepickle.Pickler`)
sends a :class:`KernelRunStandIn` instead, with the few plain attributes a cell reads (``log_dir``,
``id``, ``name``, ``dir``...). On rank 0 every call on the stand-in (``writer.add_scalar(...)``,
``run.log(...)``, ``run.summary["x"] = 1``, ``run.config.update(...)``) travels to the kernel
as a :class:`~nbtrain.messages.events.TrackerCalls` event and :func:`replay` makes it on the kernel's
own object, in order; the scalars also go to the live view. The other ranks' calls do
nothing. The run stays open after the cell, as in one process. A cell that uses the
notebook's ``wandb`` module while the kernel has an active ``wandb.run`` gets that run's
stand-in behind ``wandb.log`` (and ``wandb.run``) on rank 0.

Standard library only; nothing here imports a tracker.

Example (a stand-in outside a run: its attributes as the kernel's run had them, its calls
go nowhere)::

    >>> run = KernelRunStandIn(7, "wandb run", {"id": "abc", "name": "bright-sun-1"})
    >>> run.id, run.name
    ('abc', 'bright-sun-1')
    >>> run.log({"loss": 0.5})
    >>> run.summary["best"] = 0.1
    >>> scalars({"acc": 0.5, "name": "x", "nested": {"loss": 1}})  # what the live view is sent
    {'acc': 0.5, 'nested/loss': 1.0}
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

# The kernel's tracker objects a cell was sent stand-ins for, by token (the object's id).
_kernel_objects: dict[int, Any] = {}
_warned: set[tuple[int, tuple[str, ...]]] = set()  # the failed calls said once
# On a rank: the calls rank 0 made since the last send (token, path, args, kwargs).
_pending: list[tuple[int, tuple[str, ...], tuple[Any, ...], dict[str, Any]]] = []
_last_send = 0.0
SEND_SECONDS = 0.25  # calls travel in batches, at most this long after they were made
_CHARTED = {"add_scalar", "add_scalars", "log"}  # calls whose scalars also go to the live view
# The wandb run the kernel had active when it sent its wandb module (wandb.log reaches it).
kernel_wandb_run: KernelRunStandIn | None = None

_TENSORBOARD = ("torch.utils.tensorboard.writer", "SummaryWriter", "a SummaryWriter", ("log_dir",))
_TENSORBOARDX = ("tensorboardX.writer", "SummaryWriter", "a SummaryWriter", ("logdir",))
_WANDB = ("wandb.sdk.wandb_run", "Run", "a wandb run", ("id", "name", "project", "dir", "entity", "group"))


def _no_rank() -> Any:
    return None


# The running rank's context (nbtrain.rank.api.RankContext), or None in the kernel: the rank's
# API puts its current_context here as it is imported (the messages are a layer below the rank,
# so they are handed the way to it rather than import it). Before that no context is set anyway.
rank_context: Callable[[], Any] = _no_rank


def stand_in(obj: Any) -> tuple[Any, ...] | None:
    """The pickle reduction that sends ``obj`` as a :class:`KernelRunStandIn`, if it is a tracker's run; else None."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and obj is wandb and getattr(wandb, "run", None) is not None:
        return (with_kernel_wandb_run, (wandb.__name__, _reduction(wandb.run, _WANDB)[1]))
    for kind in (_TENSORBOARD, _TENSORBOARDX, _WANDB):
        module = sys.modules.get(kind[0])
        if module is not None and isinstance(obj, getattr(module, kind[1])):
            return _reduction(obj, kind)
    return None


def _reduction(obj: Any, kind: tuple[str, str, str, tuple[str, ...]]) -> tuple[Any, ...]:
    _kernel_objects[id(obj)] = obj
    values = {name: getattr(obj, name, None) for name in kind[3]}
    attributes = {name: v for name, v in values.items() if isinstance(v, (str, int, float, bool, type(None)))}
    return (KernelRunStandIn, (id(obj), kind[2], attributes))


def with_kernel_wandb_run(module_name: str, arguments: tuple[Any, ...]) -> Any:
    """On a rank: the wandb module, with the kernel's active run standing behind ``wandb.log``."""
    global kernel_wandb_run

    kernel_wandb_run = KernelRunStandIn(*arguments)
    return importlib.import_module(module_name)


class KernelRunStandIn:
    """A kernel tracker object on a rank: plain attributes, and calls that rank 0 sends to the kernel."""

    _token: int
    _what: str
    _attributes: dict[str, Any]

    def __init__(self, token: int, what: str, attributes: dict[str, Any]) -> None:
        object.__setattr__(self, "_token", token)
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_attributes", dict(attributes))

    def __reduce__(self) -> tuple[Any, ...]:
        return (KernelRunStandIn, (self._token, self._what, self._attributes))

    def __repr__(self) -> str:
        return f"<{self._what} of the kernel, standing in on this rank>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attributes = object.__getattribute__(self, "_attributes")
        if name in attributes:
            return attributes[name]
        if name == "get_logdir" and ("log_dir" in attributes or "logdir" in attributes):
            return lambda: attributes.get("log_dir", attributes.get("logdir"))
        return _Path(self._token, (name,))

    def __setattr__(self, name: str, value: Any) -> None:
        _call(self._token, ("__setattr__",), (name, value), {})


class _Path:
    """An attribute of a stand-in (``run.summary``, ``writer.add_scalar``): called, set or indexed, it is sent."""

    _token: int
    _path: tuple[str, ...]

    def __init__(self, token: int, path: tuple[str, ...]) -> None:
        object.__setattr__(self, "_token", token)
        object.__setattr__(self, "_path", path)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        _call(self._token, self._path, args, kwargs)

    def __getattr__(self, name: str) -> _Path:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Path(self._token, (*self._path, name))

    def __setattr__(self, name: str, value: Any) -> None:
        _call(self._token, (*self._path, "__setattr__"), (name, value), {})

    def __setitem__(self, key: Any, value: Any) -> None:
        _call(self._token, (*self._path, "__setitem__"), (key, value), {})


def _call(token: int, path: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Keep rank 0's call for the kernel (and chart its scalars); other ranks' calls do nothing."""
    context = rank_context()
    if context is None or context.rank != 0:
        return
    args, kwargs = tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}
    if path[-1] in _CHARTED:
        _chart(path[-1], args, kwargs)
    _pending.append((token, path, args, kwargs))
    if time.monotonic() - _last_send >= SEND_SECONDS:
        send_calls()


def _chart(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if method == "add_scalar" and len(args) >= 2:
        chart({args[0]: args[1]}, args[2] if len(args) > 2 else kwargs.get("global_step"))
    elif method == "add_scalars" and len(args) >= 2:
        values = {f"{args[0]}/{tag}": value for tag, value in dict(args[1]).items()}
        chart(values, args[2] if len(args) > 2 else kwargs.get("global_step"))
    elif method == "log" and args and isinstance(args[0], dict):
        chart(args[0], args[1] if len(args) > 1 else kwargs.get("step"))


def send_calls() -> None:
    """Send rank 0's kept calls to the kernel now (the cell's end calls it too)."""
    global _last_send
    # deferred: start-up time
    from nbtrain.messages.events import TrackerCalls

    _last_send = time.monotonic()
    context = rank_context()
    if not _pending or context is None:
        return
    calls = tuple(_pending)
    _pending.clear()
    context.send(TrackerCalls(context.run_id, context.rank, calls))


def scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers in ``values`` (one level of nesting named ``outer/inner``), as floats."""
    out: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, Mapping) and not prefix:
            out.update(scalars(value, f"{name}/"))
            continue
        number = _number(value)
        if number is not None:
            out[f"{prefix}{name}"] = number
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, (str, bytes, bool)) or value is None:
        return None
    if hasattr(value, "numel"):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def chart(values: Mapping[str, Any], step: Any = None) -> None:
    """Send rank 0's logged scalars to the live view (the step: the tracker's, else the cell's)."""
    context = rank_context()
    if context is None or context.rank != 0:
        return
    row = scalars(values)
    if not row:
        return
    context.keep_row(context.step if step is None else int(step), dict(row))


def _plain(value: Any) -> Any:
    """``value`` as it can travel: a one-element tensor as a float, a tensor as a CPU array."""
    if hasattr(value, "detach") and hasattr(value, "numel"):
        tensor = value.detach()
        return float(tensor.float().item()) if tensor.numel() == 1 else tensor.cpu().numpy()
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def replay(calls: Any, warn: Callable[[str], None]) -> None:
    """In the kernel: make rank 0's calls on the kernel's own objects, in order; ``warn`` says what failed
    (once per kind of call)."""
    for token, path, args, kwargs in calls.calls:
        target = _kernel_objects.get(token)
        if target is None:
            continue
        try:
            for name in path[:-1]:
                target = getattr(target, name)
            if path[-1] == "__setattr__":
                setattr(target, *args)
            elif path[-1] == "__setitem__":
                target[args[0]] = args[1]
            else:
                getattr(target, path[-1])(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - one failed call is said, the others still made
            if (token, path) not in _warned:
                _warned.add((token, path))
                warn(
                    f"nbtrain: {'.'.join(path)}(...) from rank 0 could not be made on the kernel's run: {error}. "
                    "Its later failures are not repeated; call it in a cell of the kernel to see why."
                )
