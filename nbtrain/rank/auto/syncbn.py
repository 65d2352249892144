"""``--sync-batchnorm`` on a rank: BatchNorm statistics computed over every rank's batch.

torch's ``SyncBatchNorm`` refuses CPU tensors (and DDP refuses to wrap it on CPU), so on
CPU (gloo) a BatchNorm of our own all-reduces the statistics, through the differentiable
``torch.distributed.nn`` all_reduce: per channel the sum, the sum of squares and the count
travel in one message, and the gradient flows back through the same reduction. On other
devices torch's own ``SyncBatchNorm`` runs.

The layers are replaced on the rank's copy of the model only, keeping the same Parameter
and buffer objects (so optimizers stay bound) and the same state-dict keys: the kernel's
model keeps its plain BatchNorm layers and receives the synchronised running statistics.

Example (outside a run it changes the layer types and nothing else):
    >>> import torch
    >>> model = convert(torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4)), "cpu")
    >>> type(model[1]).__name__
    'SyncBatchNorm'
"""

from __future__ import annotations

import functools
from typing import Any


def convert(module: Any, device_type: str) -> Any:
    """Replace every BatchNorm layer under ``module`` (in place) with a synchronised one."""
    # deferred: start-up time (torch)
    import torch

    cls = sync_class() if device_type == "cpu" else torch.nn.SyncBatchNorm
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(child, cls):
            setattr(module, name, _synced(child, cls))
        else:
            convert(child, device_type)
    return module


def _synced(layer: Any, cls: type) -> Any:
    synced = cls(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    # The same objects, not copies: optimizers and the kernel's state keys stay valid.
    for name in ("weight", "bias"):
        setattr(synced, name, getattr(layer, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        synced._buffers[name] = layer._buffers.get(name)
    synced.train(layer.training)
    return synced


@functools.cache
def sync_class() -> type:
    """A BatchNorm for CPU ranks that all-reduces its batch statistics (any input rank)."""
    # deferred: start-up time (torch)
    import torch

    class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
        def _check_input_dim(self, input: Any) -> None:
            if input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

        def forward(self, input: Any) -> Any:
            if not (self.training and _distributed()):
                return super().forward(input)
            self._check_input_dim(input)
            return _cpu_sync_forward(self, input)

    return SyncBatchNorm


def _distributed() -> bool:
    # deferred: start-up time (torch)
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _cpu_sync_forward(layer: Any, x: Any) -> Any:
    """Batch norm over the union of every rank's batch, differentiable (CPU, gloo)."""
    # deferred: start-up time (torch)
    import torch
    from torch.distributed.nn.functional import all_reduce

    dims = [d for d in range(x.dim()) if d != 1]
    channels = x.shape[1]
    count = torch.tensor([x.numel() / channels], dtype=x.dtype)
    totals = all_reduce(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
    n = totals[-1]
    mean = totals[:channels] / n
    var = totals[channels : 2 * channels] / n - mean * mean
    if layer.track_running_stats and layer.running_mean is not None:
        _update_running(layer, mean.detach(), var.detach(), float(n.detach()))  # no autograd warning
    shape = [1, channels] + [1] * (x.dim() - 2)
    out = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + layer.eps)
    if layer.affine:
        out = out * layer.weight.view(shape) + layer.bias.view(shape)
    return out


def _update_running(layer: Any, mean: Any, var: Any, n: float) -> None:
    # deferred: start-up time (torch)
    import torch

    with torch.no_grad():
        layer.num_batches_tracked.add_(1)
        momentum = layer.momentum if layer.momentum is not None else 1.0 / float(layer.num_batches_tracked)
        unbiased = var * n / max(n - 1.0, 1.0)
        layer.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        layer.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
