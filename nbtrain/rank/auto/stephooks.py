"""What a rank does around each optimizer step, in one documented order: the cell's one pair of step hooks.

Several parts of a rank act at an optimizer's step: a model the cell made is kept one over
the ranks, a DDP model whose forward the step bypassed gets its gradients averaged, 16-mixed
unscales, a graceful stop ends the cell. Each is a named step in :data:`BEFORE` (before
``optimizer.step()`` runs) or :data:`AFTER` (after it), called in that order by the one
global pre-hook and the one post-hook :func:`for_the_cell` registers for a cell; the hooks are
removed as the cell ends. A step that has nothing to do for the cell returns at once. A
function run (``nbtrain.start``) has them from the first model ``prepare`` wraps
(:func:`for_prepared_models`), without the stop check, for the rest of the run.

The order, and why:

1. ``first step`` (:func:`nbtrain.rank.auto.celloptimizers.at_first_step`): at an optimizer's first step,
   one the cell made whose model nothing averages is kept one over the ranks (rank 0's
   weights broadcast). The next step averages what this one decides to keep.
2. ``averaged gradients`` (:func:`nbtrain.rank.auto.averaging.at_step`): the one gradient
   averager's step, where what no backward's end (or clipping, or unscaling) averaged is
   averaged (a closure's as it returns, so it may hand the step a changed closure). Every
   average comes before unscaling.
3. ``loss scaling`` (:func:`nbtrain.rank.auto.precision.unscale_before_step`): 16-mixed unscales the
   averaged gradients, so every rank finds the same overflow and skips the same step.
4. ``stop check`` (:func:`nbtrain.rank.machinery.stepcheck.check_stop`): last, so that when it ends
   the cell every rank has gone through this step's collectives (the averages above): none
   is left waiting in one.

After the step: ``loss scaling`` updates its scale, then ``averaged gradients`` and ``stop check``
leave the step (each counts nested steps, ZeroRedundancyOptimizer's, to act on the outermost).

Example (the order, by name):
    >>> [name for name, _ in BEFORE]
    ['first step', 'averaged gradients', 'loss scaling', 'stop check']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

from nbtrain.rank.auto import ledger

Step = Callable[[Any, Any, Any], Any]

BEFORE: tuple[tuple[str, str], ...] = (
    ("first step", "nbtrain.rank.auto.celloptimizers:at_first_step"),
    ("averaged gradients", "nbtrain.rank.auto.averaging:at_step"),
    ("loss scaling", "nbtrain.rank.auto.precision:unscale_before_step"),
    ("stop check", "nbtrain.rank.machinery.stepcheck:check_stop"),
)
"""The steps before ``optimizer.step()``, in order: (name, module:function)."""

AFTER: tuple[tuple[str, str], ...] = (
    ("loss scaling", "nbtrain.rank.auto.precision:update_scale"),
    ("averaged gradients", "nbtrain.rank.auto.averaging:leave_step"),
    ("stop check", "nbtrain.rank.machinery.stepcheck:leave_counted_step"),
)
"""The steps after ``optimizer.step()``, in order."""


def for_the_cell() -> None:
    """Hook the steps for the cell now running (:func:`nbtrain.rank.cell.run_cell`), until it ends."""
    registry = ledger.cell_registry()
    if not registry.steps_hooked:
        registry.steps_hooked = True
        hook_steps(registry.patches)


def for_prepared_models() -> None:
    """Hook the steps for a model ``prepare`` wrapped (a bypassed DDP's averaging, 16-mixed's
    unscaling): in a cell they are hooked already; in a function run (``nbtrain.start``) from now
    on, without the stop check (a graceful stop ends cells)."""
    registry = ledger.cell_registry()
    if not registry.steps_hooked:
        registry.steps_hooked = True
        hook_steps(registry.patches, [step for step in BEFORE if step[0] != "stop check"])


def hook_steps(stack: ExitStack, steps: Iterable[tuple[str, str]] = BEFORE) -> None:
    """Register the one step pre-hook (calling ``steps``) and post-hook for every optimizer; closing
    ``stack`` removes them."""
    # deferred: start-up time (torch)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    before, after = _resolved(tuple(steps)), _resolved(AFTER)

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
        changed = None
        for step in before:
            result = step(optimizer, args, kwargs)
            if result is not None:  # a closure averaged as it returns: the later steps see it too
                args, kwargs = changed = result
        return changed

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for step in after:
            step(optimizer, args, kwargs)

    stack.callback(register_optimizer_step_pre_hook(before_step).remove)
    stack.callback(register_optimizer_step_post_hook(after_step).remove)


def _resolved(steps: tuple[tuple[str, str], ...]) -> tuple[Step, ...]:
    found = []
    for _, reference in steps:
        module, _, name = reference.partition(":")
        found.append(getattr(importlib.import_module(module), name))
    return tuple(found)
