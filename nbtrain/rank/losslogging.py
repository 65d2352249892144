"""The loss logged with no code change: ``scalar.backward()`` logs the scalar as ``loss``.

While :func:`loss_logging` is active (the cell runs it unless told not to), the live view
gets a loss curve from a plain training loop; the first ``nbtrain.log`` of the cell's own
turns it off, and outside a run it does nothing.

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
from collections.abc import Iterator
from typing import Any

from nbtrain.rank import api, preparations


@contextlib.contextmanager
def loss_logging() -> Iterator[None]:
    """While active, ``scalar.backward()`` logs the scalar as ``loss`` unless the user logs.

    The live view then has a loss curve with no code change. It stops as soon as the cell
    calls ``nbtrain.log`` itself, and does nothing outside a run.
    """
    context = api.current_context()
    if context is None:
        yield
        return
    torch = preparations.torch_module()
    original = torch.Tensor.backward
    busy = threading.local()

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A tensor subclass re-enters through __torch_function__: log once per call.
        gradient = args[0] if args else kwargs.get("gradient")
        if not getattr(busy, "on", False) and not context.logged and gradient is None and self.numel() == 1:
            was = context.logged
            api.log(loss=getattr(self, "_nbtrain_unscaled", self))  # the true loss under 16-mixed
            context.logged = was  # our own entry does not count as the user's log()
        busy.on = True
        try:
            return original(self, *args, **kwargs)
        finally:
            busy.on = False

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps would set it
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original
