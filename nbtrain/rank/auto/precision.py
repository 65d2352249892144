"""Precision on a rank: Lightning's names applied to what ``prepare`` hands back.

- ``*-mixed``: the prepared model's forward runs under ``torch.autocast`` for the rank's
  device (weights stay in full precision: the optimizer updates float32 master weights).
  ``16-mixed`` on CUDA also scales the loss and unscales before each optimizer step
  (``torch.amp.GradScaler``: a step whose gradients overflowed is skipped, as torch does).
- ``*-true``: the model is cast to that dtype on the rank; floating-point inputs are cast
  to it and half-precision outputs back to the default dtype, so a float32 target still
  meets a float32 prediction in the loss.

The kernel's objects never change dtype: the state that comes back is loaded into them in
their own dtype (``namespace.apply_result`` copies with ``load_state_dict``).

Example (on a rank, or anywhere outside a run):
    >>> import torch
    >>> model = apply(torch.nn.Linear(2, 1), "bf16-true", torch.device("cpu"))
    >>> model.weight.dtype, model(torch.ones(1, 2)).dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from typing import Any

from nbtrain import patches
from nbtrain.rank.auto import ledger, stephooks

_DTYPES = {"16": "float16", "bf16": "bfloat16", "64": "float64", "32": "float32"}


def casts_model(precision: str) -> bool:
    """Whether ``precision`` casts the model's weights on the rank (the ``-true`` ones but 32)."""
    return precision.endswith("-true") and precision != "32-true"


def dtype_of(precision: str) -> Any:
    """The torch dtype a precision name computes in: ``bf16-mixed`` -> torch.bfloat16."""
    # deferred: start-up time (torch)
    import torch

    return getattr(torch, _DTYPES[precision.split("-")[0]])


def apply(module: Any, precision: str, device: Any) -> Any:
    """Make ``module`` compute in ``precision`` on ``device``; returns the same module."""
    if precision == "32-true":
        return module
    dtype = dtype_of(precision)
    if precision.endswith("-true"):
        module.to(dtype)
        module.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
        if precision != "64-true":
            module.register_forward_hook(_cast_outputs(), always_call=True)
        return module
    _autocast_forward(module, device.type, dtype)
    return module


def _autocast_forward(module: Any, device_type: str, dtype: Any) -> None:
    """Run every forward of ``module`` under autocast, entered and left by two hooks."""
    # deferred: start-up time (torch)
    import torch

    entered: list[Any] = []

    def enter(_module: Any, _args: Any) -> None:
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        entered.append(context)

    def leave(_module: Any, _args: Any, output: Any) -> Any:
        # always_call: the context is left even when the forward raised.
        if entered:
            entered.pop().__exit__(None, None, None)
        return output

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _cast_inputs(dtype: Any) -> Any:
    def hook(_module: Any, args: Any, kwargs: Any) -> Any:
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    return hook


def _cast_outputs() -> Any:
    def hook(_module: Any, _args: Any, output: Any) -> Any:
        # deferred: start-up time (torch)
        import torch

        return _cast_floating(output, torch.get_default_dtype())

    return hook


def _cast_floating(data: Any, dtype: Any) -> Any:
    # deferred: start-up time (torch)
    import torch

    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, (list, tuple)):
        cast = [_cast_floating(item, dtype) for item in data]
        return type(data)(*cast) if hasattr(data, "_fields") else type(data)(cast)
    if isinstance(data, dict):
        return {key: _cast_floating(value, dtype) for key, value in data.items()}
    return data


class LossScaling:
    """``16-mixed`` on CUDA: scale each scalar loss's backward, unscale before every optimizer step.

    Made by ``prepare``, which installs the patch table's ``loss scaling`` for the rest of the
    cell; the cell's step hooks (:mod:`~nbtrain.rank.auto.stephooks`) call it for every optimizer,
    also one the cell builds after ``prepare`` and never hands it:
    ``optimizer.step()`` and ``loss.backward()`` in the user's code are unchanged. Before a
    step the gradients are unscaled; a step whose gradients overflowed changes nothing
    (every torch optimizer skips a parameter without a gradient) and lowers the scale, as
    ``GradScaler.step`` does.
    """

    def __init__(self, device_type: str) -> None:
        # deferred: start-up time (torch)
        import torch

        self.scaler = torch.amp.GradScaler(device_type)
        self.skipped_steps = 0
        self._depth = 0  # an optimizer's step inside another's (ZeroRedundancyOptimizer's) is left alone
        self._unscaled = False  # GradScaler.update() refuses to run when nothing was unscaled

    def scale(self, loss: Any) -> Any:
        """The loss to call backward on: scaled when it is a scalar that needs gradients.

        The scaled tensor remembers the loss it came from, so the loss the live view logs
        is the true one, not the scaled one.
        """
        if loss.requires_grad and loss.numel() == 1:
            scaled = self.scaler.scale(loss)
            scaled._nbtrain_unscaled = loss
            return scaled
        return loss

    def backward(self, plain_backward: Any, tensor: Any, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``plain_backward`` of the scaled loss (:func:`scaled_backward`'s)."""
        self._depth = 0  # no step is under way at a backward; a step that raised left it counted
        if gradient is None and not hasattr(tensor, "_nbtrain_unscaled"):
            tensor = self.scale(tensor)
        return plain_backward(tensor, gradient, *args, **kwargs)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Unscale the gradients; drop them all when one overflowed (the step then skips)."""
        self._depth += 1
        if self._depth > 1:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._unscaled = bool(grads)
        if not grads:
            return
        self.scaler.unscale_(optimizer)
        if self._overflowed(optimizer, grads):
            self.skipped_steps += 1
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    def _overflowed(self, optimizer: Any, grads: list[Any]) -> bool:
        """Whether the unscaled gradients hold an infinity or a NaN.

        ``unscale_`` already found out, per device, in the same pass that unscaled them;
        reading its verdict (as ``GradScaler.step`` does) spares a second pass over every
        gradient. A torch that keeps it elsewhere gets the second pass.
        """
        # deferred: start-up time (torch)
        import torch

        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
        found = state.get("found_inf_per_device")
        if found:
            return bool(sum(float(v.item()) for v in found.values()))
        return not bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Update the scale once per outermost step (lower after an overflow, grow when stable)."""
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._unscaled:
            self.scaler.update()


def scale_losses(device_type: str) -> LossScaling:
    """From now on in this cell (this run, outside one), scale each scalar loss's backward and
    unscale before each optimizer step: the cell registry's :class:`LossScaling`."""
    scaling = ledger.cell_registry().loss_scaling = LossScaling(device_type)
    patches.install("loss scaling", ledger.cell_registry().patches)  # a scalar's backward is scaled
    stephooks.for_prepared_models()  # unscale_before_step and update_scale around each step
    return scaling


def scaled_backward(plain_backward: Any) -> Any:
    """``Tensor.backward`` in a cell that prepared a model for 16-mixed on CUDA (the patch table's):
    a scalar loss's backward is scaled by the cell's :class:`LossScaling`."""
    def backward(tensor: Any, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
        scaling = ledger.cell_registry().loss_scaling
        if scaling is None:
            return plain_backward(tensor, gradient, *args, **kwargs)
        return scaling.backward(plain_backward, tensor, gradient, *args, **kwargs)

    backward.__doc__ = plain_backward.__doc__
    return backward


def unscale_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step hook's (:mod:`~nbtrain.rank.auto.stephooks`): the cell's loss scaling unscales, if any."""
    scaling = ledger.cell_registry().loss_scaling
    if scaling is not None:
        scaling.before_step(optimizer, args, kwargs)


def update_scale(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step hook's: the cell's loss scaling updates its scale, if any."""
    scaling = ledger.cell_registry().loss_scaling
    if scaling is not None:
        scaling.after_step(optimizer, args, kwargs)
