"""Gradients averaged as each backward ends, as DDP averages them, for the models nbtrain averages itself.

DDP averages a model's gradients in the backward of its own forward: between a backward and
the optimizer's step every rank holds the whole batch's. A model nbtrain averages itself (one
the cell made and keeps one over the ranks, :mod:`~nbtrain.rank.auto.keptmodels`; a DDP model
whose forward the loop bypassed, or one auto mode left unwrapped frozen that the cell unfroze,
:mod:`~nbtrain.rank.auto.bypass`) is averaged here, at the end of each backward that wrote into
its gradients: under gradient accumulation each micro-batch's backward too, so a cell that
raises between a backward and its step leaves the union batch's gradients, as one process
holds them. Averaging is linear (each backward's average summed is the sum's average), and
the step then finds nothing left to average: one all-reduce per step without accumulation,
as before, one per backward with it, as DDP without ``no_sync``.

Each watched parameter has a post-accumulate-grad hook: it fires where autograd writes a
``.grad`` (``loss.backward()``, ``scaler.scale(loss).backward()``, ``torch.autograd.backward``,
twice with ``retain_graph``), not for ``torch.autograd.grad`` nor a forward under ``no_grad``.
The first in a backward queues one callback at the backward's end (autograd's final callback,
as DDP's reducer queues its own); it calls each averager that backward touched, once, in the
order they were made: the same order on every rank, each average being a collective. (On CUDA
autograd may run that callback on its device thread, as it runs DDP's: the gradients are ready
on the current streams there.) An averager averages its whole model: a backward that wrote
into part of it averages the rest again, values already the same on every rank (the same
result over 2 ranks; over more, maybe not to the last bit).

Importing this module does not import torch.

Example (a backward writing into a watched parameter's gradient calls its averager once, at its end):
    >>> import torch
    >>> from contextlib import ExitStack
    >>> w, seen = torch.nn.Parameter(torch.ones(2)), []
    >>> with ExitStack() as cell:
    ...     watch_backwards([w], averager(lambda: seen.append(w.grad.tolist()), cell))
    ...     (w * 3).sum().backward()
    ...     grads = torch.autograd.grad((w * 2).sum(), [w])  # no .grad written: nothing
    >>> seen
    [[3.0, 3.0]]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from nbtrain.rank.auto import ledger


@dataclass(frozen=True, eq=False)
class Averager:
    """What averages some watched parameters' gradients (``average``), and when it was made (``order``:
    those touched by one backward average in it); ``hooks`` removes its hooks."""

    order: int
    average: Callable[[], None]
    hooks: ExitStack = field(default_factory=ExitStack)
    watched: set[int] = field(default_factory=set)  # ids of the parameters hooked


_orders = itertools.count()
_touched: dict[int, Averager] = {}  # order -> averager: touched by the running backward
_queued: dict[str, int | None] = {"task": None}  # the backward whose end is queued


def averager(average: Callable[[], None], stack: ExitStack) -> Averager:
    """An averager calling ``average()`` at the end of each backward writing into a gradient it watches,
    until ``stack`` (the cell's) closes."""
    by = Averager(next(_orders), average)
    stack.callback(unwatch_backwards, by)
    return by


def watch_backwards(params: Iterable[Any], by: Averager) -> None:
    """Have ``by`` average at the end of each backward writing into a gradient of ``params`` (those that
    require grad now; calling again adds those that came to, a backbone unfrozen)."""
    for param in params:
        if param.requires_grad and id(param) not in by.watched:
            by.watched.add(id(param))
            by.hooks.callback(param.register_post_accumulate_grad_hook(functools.partial(_touch, by)).remove)


def unwatch_backwards(by: Averager) -> None:
    """Stop ``by``'s watching (until :func:`watch_backwards` is called again)."""
    by.hooks.close()
    by.watched.clear()


def _touch(by: Averager, _param: Any) -> None:
    """A watched parameter's gradient was written: its averager averages as this backward ends."""
    _touched[by.order] = by
    torch = ledger.torch_module()
    task = torch._C._current_graph_task_id()
    if _queued["task"] != task:
        _queued["task"] = task
        torch.autograd.Variable._execution_engine.queue_callback(_at_end)


def _at_end() -> None:
    """The backward ended: each averager it touched averages, in the order they were made."""
    _queued["task"] = None
    owners = [_touched[order] for order in sorted(_touched)]
    _touched.clear()
    with ledger.torch_module().no_grad():
        for by in owners:
            by.average()
