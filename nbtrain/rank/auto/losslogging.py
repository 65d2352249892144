"""The loss logged with no code change: ``scalar.backward()`` logs the scalar as ``loss``.

While :func:`loss_logging` is active (the cell runs it unless told not to), the live view
gets a loss curve from a plain training loop; the first ``nbtrain.log`` of the cell's own
turns it off, and outside a run it does nothing.

Every such backward is a step. A loop of up to ``MAX_ROWS_PER_SECOND`` steps a second has
each step's loss logged; a faster one every 2nd, 4th, 8th... step (the stride, a power of
two set from the first steps' pace, so every rank of a run logs the same steps, or every
second one of them, and the live view's mean over ranks has them all), and the cell's last
loss always. Reading a loss and keeping its row every step took 1-4% of a 1 ms step.

Example (outside a run nothing is patched):
    >>> import torch
    >>> plain = torch.Tensor.backward
    >>> with loss_logging():
    ...     torch.Tensor.backward is plain
    True
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from nbtrain import patches
from nbtrain.rank import api

MAX_ROWS_PER_SECOND = 100  # the live view draws about 4 times a second
FIRST_STEPS = 32  # each one logged; their pace sets the stride (and again at 64, 128, ... steps)


class _Sampler:
    """Counts the cell's steps and decides which of their losses are logged."""

    def __init__(self, context: api.RankContext):
        self.context = context
        self.stride = 1  # a step is logged when its number is a multiple of this (a power of two)
        self.first_at: float | None = None  # time.monotonic() of the first step
        self.next_pace = FIRST_STEPS  # the step at which the stride is looked at again
        self.unlogged: Any = None  # the newest loss not logged, or None

    def backward(self, loss: Any) -> None:
        """A loss's backward is about to run: count its step; log the loss when the stride says."""
        context = self.context
        step = context.step + 1
        if step % self.stride:
            context.step = step
            self.unlogged = loss  # the loop's own `loss` holds it until the next step anyway
            return
        self.unlogged = None
        context.log_value("loss", _true_loss(loss), step)
        if step >= self.next_pace:
            self._pace(step)
        elif self.first_at is None:
            self.first_at = time.monotonic()

    def finish(self) -> None:
        """The cell ends: its last loss is logged (unless the cell logs for itself by now)."""
        loss, self.unlogged = self.unlogged, None
        if loss is not None and not self.context.logged:
            self.context.log_value("loss", _true_loss(loss), self.context.step)

    def _pace(self, step: int) -> None:
        elapsed = time.monotonic() - (self.first_at or 0.0)
        while (step - 1) / self.stride > MAX_ROWS_PER_SECOND * elapsed:
            self.stride *= 2
        self.next_pace = 2 * step


def _true_loss(loss: Any) -> Any:
    return getattr(loss, "_nbtrain_unscaled", loss)  # under 16-mixed the tensor backward sees is scaled


@contextlib.contextmanager
def loss_logging(stack: contextlib.ExitStack | None = None) -> Iterator[None]:
    """While active, ``scalar.backward()`` logs the scalar as ``loss`` unless the user logs.

    The live view then has a loss curve with no code change. It stops as soon as the cell
    calls ``nbtrain.log`` itself, and does nothing outside a run. The patch goes on ``stack``
    (the cell's, which 16-mixed's loss scaling may join during the cell: undone in reverse as
    the cell ends), else on one of its own, undone as this ends.
    """
    context = api.current_context()
    if context is None:
        yield
        return
    _samplers.append(_Sampler(context))
    try:
        with contextlib.ExitStack() as own:
            patches.install("loss logging", own if stack is None else stack)  # Tensor.backward: logged_backward
            yield
    finally:
        sampler = _samplers.pop()
    sampler.finish()  # not after a failure: the cell's error is what it shows then


_samplers: list[_Sampler] = []  # the sampler of the cell logging its loss now


def logged_backward(original: Any) -> Any:
    """``Tensor.backward`` while a cell logs its loss (the patch table's): a scalar's backward is a step."""
    busy = threading.local()
    sampler = _samplers[-1]
    context = sampler.context

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # an error in the backward reads as in the kernel (rank.machinery.runtime)
        # A tensor subclass re-enters through __torch_function__: count once per call.
        gradient = args[0] if args else kwargs.get("gradient")
        if not getattr(busy, "on", False) and not context.logged and gradient is None and self.numel() == 1:
            sampler.backward(self)
        busy.on = True
        try:
            return original(self, *args, **kwargs)
        finally:
            busy.on = False

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps would set it
    return backward
