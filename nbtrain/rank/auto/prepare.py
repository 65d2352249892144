"""``nbtrain.prepare``: make a model, optimizer and data loader ready for the run's strategy.

On a rank, ``prepare`` does what a torchrun script does by hand:

- a ``Module`` moves to the rank's device and is wrapped for the strategy: a
  :class:`~torch.nn.parallel.DistributedDataParallel` (``ddp_*``) that still reads through
  to the model's own attributes and methods, or sharded in place with FSDP2's
  ``fully_shard`` (``fsdp``). A module with no trainable parameters is moved, not wrapped,
  and so is every module of a run with one rank (nothing to average): the model trains as
  it is, its loader keeps its own order, and on a GPU its inputs and batches move there.
- an ``Optimizer`` is bound to the prepared parameters (with FSDP2 the parameters become
  DTensors, so its param_groups are rebuilt in the same order, state included).
- a ``DataLoader`` is rebuilt on a ``DistributedSampler`` that keeps its batch size,
  shuffle, drop_last, collate_fn and workers. Each pass decides, when iteration starts,
  what it is: with gradients enabled it is a training pass (this rank's share, with
  ``set_epoch`` on every training pass); with gradients disabled (``torch.no_grad()``,
  ``torch.inference_mode()``) it is an evaluation pass, and every rank reads the whole
  dataset in the loader's own order, so a metric computed the single-device way is the
  true one on every rank. ``evaluation="shard"`` shards evaluation passes too (faster;
  reduce the metric with :func:`nbtrain.all_reduce`).

Outside a run (in the kernel) every rank-specific step is skipped: a module only moves to
:func:`nbtrain.device`, the rest comes back unchanged, so the same code runs anywhere.

Importing this module does not import torch: ``import nbtrain`` must stay light.

Example:
    >>> import torch, nbtrain
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model, opt = nbtrain.prepare(model, opt)   # outside a run: moved to nbtrain.device()
    >>> nbtrain.prepare(model) is model             # preparing twice changes nothing
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nbtrain.messages import reach
from nbtrain.rank import api
from nbtrain.rank.auto import boundoptimizers, ledger, preparedloaders, wrapping

_lock = threading.Lock()


def prepare(*objs: Any, evaluation: str | None = None, **wrapper_options: Any) -> Any:
    """Prepare models, optimizers and data loaders for this rank; return them in order.

    Pass everything at once: modules are prepared first, then the optimizers are bound to
    their (possibly new) parameters, then loaders are sharded. One object in, one object
    out; several in, a tuple out. Anything else passes through unchanged, and an object
    already prepared comes back as it is, so calling ``prepare`` twice is harmless.

    A loader's training passes (iterated with gradients enabled) read this rank's share.
    ``evaluation`` says what its passes without gradients read: ``"whole"`` (the default:
    every rank reads the whole dataset, so metrics come out right unchanged) or
    ``"shard"`` (each rank reads its share, as in training: faster, and the metric must be
    reduced across ranks with :func:`nbtrain.all_reduce`). Outside a run (in the kernel)
    the loader comes back unchanged but remembers the choice, so a later
    ``%%distributed`` cell's auto mode honours it.

    ``wrapper_options`` go to the model wrapper: DistributedDataParallel's keyword
    arguments with ``ddp_*``, ``fully_shard``'s with ``fsdp``. DDP gets
    ``find_unused_parameters=False`` (no extra search of the autograd graph every step)
    unless the strategy is ``ddp_find_unused_parameters_true`` or the caller passes
    ``find_unused_parameters=True``; a model whose first backward leaves a trainable
    parameter without a gradient then fails at once with
    :class:`~nbtrain.errors.UnusedParametersError`, naming the parameters and the fix.

    Example, in a ``%%distributed`` cell or a function run by ``nbtrain.launch``::

        model, opt, loader = nbtrain.prepare(model, opt, loader)
        for x, y in loader:                       # this rank's share of the data
            loss = loss_fn(model(x), y)           # model is DDP-wrapped; model.fc still works
            opt.zero_grad(); loss.backward(); opt.step()
    """
    if not objs:
        raise TypeError("prepare() needs something to prepare, e.g. nbtrain.prepare(model, optimizer, loader).")
    _check_evaluation(evaluation)
    torch = ledger.torch_module()
    # deferred: start-up time (torch)
    from torch.utils.data import DataLoader

    out = list(objs)
    with _lock:
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.nn.Module):
                out[i] = wrapping.prepare_module(obj, **wrapper_options)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = boundoptimizers.prepare_optimizer(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, DataLoader):
                out[i] = preparedloaders.prepare_loader(obj, evaluation)
    return out[0] if len(objs) == 1 else tuple(out)


def _check_evaluation(evaluation: str | None) -> None:
    if evaluation is not None and evaluation not in preparedloaders.EVALUATION_CHOICES:
        raise ValueError(
            f"prepare(evaluation={evaluation!r}): a loader's passes without gradients read either "
            "'whole' (every rank reads the whole dataset: metrics come out right unchanged; the default) "
            "or 'shard' (each rank reads its share: faster; reduce metrics with nbtrain.all_reduce)."
        )


# -- auto mode -----------------------------------------------------------------------------


def auto_prepare(namespace: dict[str, Any], names: Iterable[str]) -> list[tuple[str, str]]:
    """Prepare the Modules, Optimizers and DataLoaders among ``namespace[names]`` in place.

    Each name is rebound to its prepared object (so the cell, and every notebook function
    it calls, uses the wrapped model and the sharded loader). Only root modules are
    wrapped: a module inside another one the cell uses is moved with it. Returns
    (name, what was done) for the run's summary.
    """
    torch = ledger.torch_module()
    # deferred: start-up time (torch)
    from torch.utils.data import DataLoader

    names = sorted(n for n in names if n in namespace)
    modules = {id(namespace[n]): namespace[n] for n in names if isinstance(namespace[n], torch.nn.Module)}
    inside = {id(sub) for module in modules.values() for sub in module.modules() if sub is not module}
    done: list[tuple[str, str]] = []
    boundoptimizers.know_optimizers(namespace[n] for n in names)
    for kind in (torch.nn.Module, torch.optim.Optimizer, DataLoader):
        for name in names:
            obj = namespace[name]
            if not isinstance(obj, kind) or (kind is torch.nn.Module and id(obj) in inside):
                continue
            said = len(ledger.cell_registry().notes)
            prepared = prepare(obj)
            _name_in_notes(said, name)
            namespace[name] = prepared
            done.append((name, _describe(obj, prepared)))
            if kind is DataLoader and prepared is not obj:
                ledger.cell_registry().loader_names[name] = prepared
    return done


def auto_prepare_held(
    namespace: Mapping[str, Any], held: Iterable[Any]
) -> tuple[list[tuple[str, str]], list[tuple[Any, Any, Any]]]:
    """Prepare the torch objects held inside the cell's globals (``trainer.model``), in their places.

    ``held`` is :func:`nbtrain.messages.reach.find_reached`'s list, made in the kernel: its torch
    objects are prepared. Each prepared object replaces the original where it is held, so
    the cell's ``trainer.run()`` trains the wrapped model. Returns (label, what was done)
    for the summary, a place that could not take the prepared object saying ``not prepared
    (why)``, and (held, original, prepared) for each place changed: the cell puts the
    originals back after it ran. Every place of an object holds the same prepared one
    (``model`` and ``trainer.model``), which the summary names once.
    """

    torch = ledger.torch_module()
    found = [(h, obj) for h, obj in resolved(namespace, held) if h.preparable]
    roots = [v for v in namespace.values() if isinstance(v, torch.nn.Module)]
    roots += [obj for h, obj in found if h.kind == "module"]
    inside = {id(sub) for root in roots for sub in root.modules() if sub is not root}
    done: list[tuple[str, str]] = []
    placed: list[tuple[Any, Any, Any]] = []
    for kind in ("module", "optimizer", "loader"):
        for h, obj in found:
            if h.kind != kind or (kind == "module" and id(obj) in inside):
                continue
            if h.fixed and kind == "module":
                done.append((h.label, _not_prepared(h.fixed, kind)))
                continue
            said = len(ledger.cell_registry().notes)
            again = ledger.cell_registry().prepared_for(obj) is not None  # at another place, said there
            prepared = prepare(obj)
            _name_in_notes(said, h.label)
            if prepared is not obj:
                try:
                    reach.put(namespace, h, prepared)
                except Exception as error:  # noqa: BLE001 - whatever the holder raises, the summary says it
                    done.append((h.label, _not_prepared(h.fixed or f"its holder refused it: {error}", kind)))
                    continue
                placed.append((h, obj, prepared))
            if not again:
                done.append((h.label, _describe(obj, prepared)))
            if kind == "loader" and prepared is not obj:
                ledger.cell_registry().loader_names[h.label] = prepared
    return done, placed


def _name_in_notes(said: int, name: str) -> None:
    """Name the object in the notes its preparation added (past the first ``said``): the user's
    name says which loader "a DataLoader over TensorDataset" is."""
    notes = ledger.cell_registry().notes
    for i in range(said, len(notes)):
        if notes[i].startswith("a DataLoader over "):
            notes[i] = f"`{name}`, {notes[i]}"


def resolved(namespace: Mapping[str, Any], held: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """(held, this rank's object) for each place that still holds an object of its kind (its class)."""

    for h in held:
        try:
            obj = reach.resolve(namespace, h)
        except (LookupError, AttributeError, TypeError):
            continue
        if reach.kind_of(obj) == h.kind:
            yield h, obj


def _not_prepared(why: str, kind: str) -> str:
    consequence = {
        "module": "each rank trains its own copy, gradients not averaged",
        "loader": "each rank reads all of it",
    }.get(kind, "it stays as it was")
    fix = "hold it in a list or attribute, or call nbtrain.prepare on it in the cell"
    return f"not prepared ({why}; {consequence}): {fix}"


def put_back(namespace: Mapping[str, Any], placed: Iterable[tuple[Any, Any, Any]]) -> None:
    """Put the originals back where :func:`auto_prepare_held` put prepared objects (unless the cell replaced them)."""

    for h, original, prepared in placed:
        with contextlib.suppress(Exception):
            if reach.resolve(namespace, h) is prepared:
                reach.put(namespace, h, original)


def _describe(original: Any, prepared: Any) -> str:
    # deferred: start-up time (torch)
    from torch.nn.parallel import DataParallel
    from torch.utils.data import DataLoader

    inner = ledger.cell_registry().prepared_for(getattr(original, "module", None))
    if isinstance(original, DataParallel) and inner is not None:  # set aside (wrapping.prepare_module)
        kept = "on the rank's one device" if inner is original.module else "set aside: one process per device"
        return f"{_describe(original.module, inner)}, its DataParallel {kept}"
    if prepared is original:
        if type(original).__name__.startswith("FSDP"):
            return "sharded with fully_shard"
        torch = ledger.torch_module()
        trains = isinstance(original, torch.nn.Module) and wrapping.trains(original)
        if trains and ledger.one_rank():
            return f"on {api.device()}, not wrapped (one rank)"
        return "moved" if not _is_optimizer(original) else "bound"
    if isinstance(prepared, DataLoader):
        return "DistributedSampler"
    return type(prepared).__name__


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, ledger.torch_module().optim.Optimizer)
