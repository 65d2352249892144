"""The worker API: what code running on a rank calls (``nbtrain.rank()``, ``nbtrain.log()``).

Outside a run every function behaves as a single process (rank 0 of 1), so code written
for the ranks also runs unchanged in the kernel.

Example:
    >>> import nbtrain
    >>> nbtrain.rank(), nbtrain.world_size()
    (0, 1)
    >>> nbtrain.log(loss=0.5)  # outside a run: nothing to send, returns at once
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbtrain.messages import trackerruns

# Metrics are sent in batches at most this often (GPU scalars go to the host together then,
# in one copy that the loop never waits for: see _RowsOnTheWay)...
FLUSH_SECONDS = 0.25
# ...and after this many rows: thousands of pending GPU tensors make every garbage
# collection slower, which a fast loop would pay for on each step.
FLUSH_ROWS = 256


@dataclass
class RankContext:
    """Set once in each rank by the runtime; None in the kernel."""

    run_id: int
    rank: int
    local_rank: int
    world_size: int
    device_type: str
    device_index: int | None
    send: Callable[[Any], None]
    # Send, then wait until the launcher passed on what the rank printed before it (a display).
    send_in_order: Callable[[Any], None] | None = None
    pending: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)
    pending_on_device: bool = False  # some pending value is still a tensor on a device
    outbox: list[Any] = field(default_factory=list)  # flushed batches not sent yet, oldest first
    step: int = 0
    last_flush: float = 0.0
    logged: bool = False
    imported: tuple[str, ...] = ()  # rank 0: library modules its payload imported (nbtrain.rank.machinery.runtime)
    pid: int = field(default_factory=os.getpid)  # the rank's; a DataLoader worker forked from it inherits this
    # A cell that raised: this rank's CellResult at the raise (nbtrain.rank.cell), sent with its failure;
    # or why none could be made.
    state_at_failure: Any = None
    no_state_why: str = ""

    def add_row(self, step: int | None, values: dict[str, Any]) -> None:
        """Keep one logged row (``step`` None: the next step); send the batch when one is due."""
        self.step = self.step + 1 if step is None else int(step)
        self.keep_row(self.step, values)

    def keep_row(self, step: int, values: dict[str, Any]) -> None:
        """Keep one row at ``step``, the cell's own step count left as it is; send the batch when one is due."""
        self.pending.append((step, time.time(), values))
        if len(self.pending) >= FLUSH_ROWS or time.monotonic() - self.last_flush >= FLUSH_SECONDS:
            self.flush(wait=False)

    def log_value(self, name: str, value: Any, step: int) -> None:
        """``log(step, **{name: value})`` for a value the cell did not log itself (the loss hook's).

        It does only what one value needs, and does not count as the cell logging for
        itself (``logged``).
        """
        kept = _pending_value(value, self)
        self.add_row(step, {} if kept is None else {name: kept})

    def flush(self, wait: bool = True) -> None:
        """Send the logged rows as Metrics events, in order (and, on a GPU, a memory sample).

        Rows holding CUDA scalars start their copy to the host now and go once it is done: at a
        later flush that finds it done, or at this one where ``wait`` (the cell's end). So the
        loop never waits for the device to catch up with it.
        """
        if self.pending:
            # Without a value on a device, every value is a float already: the rows go as they are.
            self.outbox.append(_RowsOnTheWay(self.pending) if self.pending_on_device else tuple(self.pending))
            self.pending.clear()
            self.pending_on_device = False
            self.last_flush = time.monotonic()
        self._send_outbox(wait)

    def _send_outbox(self, wait: bool) -> None:
        # deferred: start-up time
        from nbtrain.messages.events import MemorySample, Metrics

        sent = False
        while self.outbox and (wait or not isinstance(self.outbox[0], _RowsOnTheWay) or self.outbox[0].done()):
            batch = self.outbox.pop(0)
            self.send(Metrics(self.run_id, self.rank, batch.rows() if isinstance(batch, _RowsOnTheWay) else batch))
            sent = True
        if sent and self.device_type == "cuda":
            # deferred: start-up time (torch)
            import torch

            allocated, peak, reserved = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                                         torch.cuda.memory_reserved())
            self.send(MemorySample(self.run_id, self.rank, rss_bytes=None, cuda_allocated_bytes=allocated,
                                   cuda_peak_bytes=peak, time=time.time(), cuda_reserved_bytes=reserved))


_context: RankContext | None = None


def _set_context(context: RankContext | None) -> None:
    global _context
    _context = context


def current_context() -> RankContext | None:
    """The running rank's context, or None in the kernel."""
    return _context


trackerruns.rank_context = current_context  # the kernel's tracker runs' stand-ins send through it


def rank() -> int:
    """This process's global rank (0 outside a run)."""
    return 0 if _context is None else _context.rank


def local_rank() -> int:
    """This process's rank on its machine (0 outside a run)."""
    return 0 if _context is None else _context.local_rank


def world_size() -> int:
    """How many ranks the run has (1 outside a run)."""
    return 1 if _context is None else _context.world_size


def device() -> Any:
    """The ``torch.device`` this rank trains on (outside a run: cuda:0 if present, else cpu)."""
    # deferred: start-up time (torch)
    import torch

    if _context is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if _context.device_index is None:
        return torch.device(_context.device_type)
    return torch.device(_context.device_type, _context.device_index)


def is_rank_zero() -> bool:
    """True on rank 0 (and in the kernel): the rank whose results come back."""
    return rank() == 0


def log(step: int | None = None, **scalars: Any) -> None:
    """Record scalars for the live view, e.g. ``nbtrain.log(loss=loss)``.

    Tensors are accepted: a GPU tensor is kept as it is and converted (one device sync)
    only when a batch is sent, about four times a second. ``step`` defaults to a counter that
    increases by one per call.
    """
    context = _context
    if context is None or not scalars:
        return
    context.logged = True
    values: dict[str, Any] = {}
    for name, value in scalars.items():
        if type(value) is not float:
            value = _pending_value(value, context)
            if value is None:
                continue  # not a scalar: the live view has nothing to draw for it
        values[name] = value
    context.add_row(step, values)


REDUCE_OPS = ("sum", "mean", "max", "min")


def all_reduce(value: Any, op: str = "sum") -> Any:
    """``value`` combined over every rank (``op``: sum, mean, max or min); every rank gets the result.

    Takes a Python number (an int stays an int, except with ``mean``) or a tensor (a new
    tensor comes back; the one passed in is not changed). Every rank must call it, the
    same number of times: it is a collective. Outside a run, or on a single rank, there is
    nothing to combine and ``value`` comes back as it is, so the same code runs anywhere.
    Use it for the metrics of sharded evaluation (``nbtrain.prepare(loader,
    evaluation="shard")``). The test function of the PyTorch MNIST example, rewritten
    so: on the ranks each one scores its share and every rank prints the figures of the
    whole test set; outside a run (as here) it scores everything itself and prints the same.

    Example:
        >>> import torch, torch.nn.functional as F, nbtrain
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> def test(model, test_loader):
        ...     model.eval()
        ...     test_loss, correct, seen = 0.0, 0, 0
        ...     with torch.no_grad():
        ...         for data, target in test_loader:  # on a rank: its share
        ...             output = model(data)
        ...             test_loss += F.nll_loss(output, target, reduction="sum").item()
        ...             correct += output.argmax(dim=1).eq(target).sum().item()
        ...             seen += len(target)
        ...     test_loss, correct, seen = (nbtrain.all_reduce(v) for v in (test_loss, correct, seen))
        ...     print(f"Test set: Average loss: {test_loss / seen:.4f}, Accuracy: {correct}/{seen}")
        >>> model = torch.nn.LogSoftmax(dim=1)  # a "model" whose scores are its inputs
        >>> data = TensorDataset(torch.eye(4).repeat(2, 1), torch.tensor([0, 1, 2, 3, 0, 0, 0, 0]))
        >>> test(model, nbtrain.prepare(DataLoader(data, batch_size=4), evaluation="shard"))
        Test set: Average loss: 1.1187, Accuracy: 5/8
        >>> nbtrain.all_reduce(3), nbtrain.all_reduce(0.25, op="max")  # outside a run: as they are
        (3, 0.25)
        >>> nbtrain.all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce(op={op!r}) is not a reduction nbtrain knows; use one of {', '.join(REDUCE_OPS)}.")
    tensor_in = _is_tensor(value)
    if not tensor_in and not isinstance(value, numbers.Real):
        raise TypeError(
            f"all_reduce() takes a number or a tensor, not {type(value).__name__}: "
            "reduce each number on its own, or pass torch.tensor(values)."
        )
    return _reduce_across_ranks(value, op, tensor_in) if _collective_ready() else value


def _reduce_across_ranks(value: Any, op: str, tensor_in: bool) -> Any:
    # deferred: start-up time (torch)
    import torch
    import torch.distributed as dist

    if tensor_in:
        tensor = value.detach().clone()
    else:
        tensor = torch.tensor(value, dtype=torch.int64 if isinstance(value, numbers.Integral) else torch.float64)
    if op == "mean" and not tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    # nccl reduces only device tensors; gloo reduces either.
    home = tensor.device
    if dist.get_backend() == "nccl" and home.type != "cuda":
        tensor = tensor.to(device())
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    # deferred: start-up time
    from nbtrain.rank.machinery import trainedalone

    # A number is a metric, never a gradient: its all-reduce does not make the ranks train together.
    with trainedalone.not_gradients() if not tensor_in else contextlib.nullcontext():
        dist.all_reduce(tensor, op=ops[op])
    if op == "mean":
        tensor /= world_size()
    tensor = tensor.to(home)
    if tensor_in:
        return tensor
    return tensor.item() if op == "mean" or not isinstance(value, numbers.Integral) else int(tensor.item())


def _collective_ready() -> bool:
    if _context is None or _context.world_size < 2:
        return False
    # deferred: start-up time (torch)
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _pending_value(value: Any, context: RankContext) -> Any:
    """What ``log`` keeps until the next send: a float, a tensor on a device, or None.

    A one-element CPU tensor becomes a float at once, which costs less than keeping it
    and needs no device sync. A GPU tensor is kept (detached) and converted when the
    batch is sent: one sync per batch instead of one per call.
    """
    if hasattr(value, "detach"):
        if not value.is_cpu:
            context.pending_on_device = True
            return value.detach()
        return float(value.item()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class _RowsOnTheWay:
    """Logged rows whose device scalars are stacked and on their way to the host in one copy.

    On CUDA the copy goes to pinned memory behind the step's own work, with an event after
    it: ``done()`` asks the event, and only ``rows()`` before that waits. A device sync
    drains the queue the loop keeps ahead of the GPU, and the GPU then idles while the loop
    loads its next batch: about a batch's loading time every flush. Elsewhere (scalars on
    several devices, scalars on the CPU) the floats are read at once: one copy for them all,
    where a copy per value would be a device sync per logged step.
    """

    def __init__(self, pending: list[tuple[int, float, dict[str, Any]]]) -> None:
        # deferred: start-up time (torch)
        import torch

        self.pending = tuple(pending)
        self.event: Any = None
        self.floats: tuple[tuple[int, float, dict[str, Any]], ...] | None = None
        scalars = [
            value.reshape(())
            for _, _, values in self.pending
            for value in values.values()
            if type(value) is not float and value.numel() == 1
        ]
        try:  # stack promotes mixed dtypes (a bf16 loss beside a float32 accuracy)
            stacked = torch.stack(scalars) if scalars else torch.zeros(0)
            if stacked.is_cuda:
                # On the host whatever the default device (a notebook's set_default_device("cuda")).
                self.host = torch.empty(stacked.shape, dtype=stacked.dtype, device="cpu", pin_memory=True)
                self.host.copy_(stacked, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
            else:
                self.host = stacked.cpu()
        except (RuntimeError, NotImplementedError):  # scalars on different devices, or without values: each alone
            self.floats = tuple((step, t, _as_floats(values)) for step, t, values in self.pending)

    def done(self) -> bool:
        """Whether the copy is over (``rows()`` would not wait)."""
        return self.event is None or bool(self.event.query())

    def rows(self) -> tuple[tuple[int, float, dict[str, Any]], ...]:
        """The rows with floats for the scalars (waiting for the copy if it is still under way)."""
        if self.floats is None:
            if self.event is not None:
                self.event.synchronize()
            host = iter([float(v) for v in self.host.tolist()])
            self.floats = tuple(
                (step, t, {name: v if type(v) is float else next(host) for name, v in values.items() if _is_scalar(v)})
                for step, t, values in self.pending
            )
        return self.floats


def _is_scalar(value: Any) -> bool:
    return type(value) is float or value.numel() == 1


def _as_floats(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, value in values.items():
        try:
            out[name] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue  # not a scalar: the live view has nothing to draw for it
    return out
