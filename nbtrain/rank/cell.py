"""What a rank does with a ``%%distributed`` cell: run it, then send back what it changed.

:func:`run_cell` is the function the magic launches on every rank. In order:

1. Build the cell's namespace: the kernel globals the cell uses, in the very dict the
   notebook's functions see as their globals (see ``namespace.anchor_function``).
2. Start from the kernel's RNG state; give the cell a ``get_ipython()`` when its
   transformed code calls one (``%time``, ``!ls``).
3. Auto mode: prepare the Modules, Optimizers and DataLoaders the cell uses, and log the
   loss passed to ``.backward()`` unless the cell logs itself.
4. Execute the cell, compiled under a filename the kernel registered in linecache, so a
   traceback shows the cell's own lines at the cell's own line numbers.
5. Namespace out: gather full weights and optimizer state (a collective under FSDP, so
   every rank takes part), then rank 0 pickles what changed into a
   :class:`~nbtrain.messages.records.CellResult`. References to the kernel's objects go
   back as references, wrappers as the objects they wrap, and functions defined in the
   cell as functions of the kernel's globals.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copyreg
import functools
import hashlib
import io
import pickle
import sys
import types
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbtrain import patches
from nbtrain.messages import processlocal, reach, records
from nbtrain.rank import api
from nbtrain.rank.auto import (
    averaging,
    boundoptimizers,
    cellloaders,
    celloptimizers,
    deviceglobals,
    inherent,
    keptmodels,
    ledger,
    losslogging,
    prepare,
    preparedloaders,
    samedata,
    stepaside,
    stephooks,
    wrapping,
)
from nbtrain.rank.auto.preparedloaders import batches_per_rank, loader_lengths, samples_per_rank
from nbtrain.rank.machinery import rankdisplay, settings, stepcheck, trackers, trainedalone
from nbtrain.rank.machinery.trainedalone import steps_alone

# The cell's entry points: with nbtrain.rank.api, all the kernel side may import from the ranks'
# (tests/test_structure.py). The kernel sizes a cell's loaders by the rule the ranks shard them with.
__all__ = ["CellSpec", "batches_per_rank", "loader_lengths", "run_cell", "samples_per_rank"]

if TYPE_CHECKING:
    from cloudpickle import Pickler as _PicklerBase
else:
    _PicklerBase = object  # cloudpickle's, put under it when the pickler is first built


@dataclass(frozen=True)
class CellSpec:
    """Everything a rank needs to run one cell, besides the namespace itself."""

    code: str  # transformed source, padded with blank lines so line numbers match the notebook cell
    filename: str  # registered in the kernel's linecache; shipped to ranks by the engine
    names: tuple[str, ...]  # the kernel globals shipped with the cell
    auto: bool = True  # prepare the kernel's modules, optimizers and loaders
    log_loss: bool = True  # log the scalar passed to .backward() as "loss"
    needs_shell: bool = False
    display_last: bool = False
    rng: Mapping[str, Any] | None = None
    held: tuple[Any, ...] = ()  # nbtrain.messages.reach.Held: the objects inside the shipped globals, by where they are


def run_cell(spec: CellSpec, namespace: dict[str, Any], anchor: Any = None) -> records.CellResult | None:
    """Run the cell on this rank; rank 0 returns the :class:`CellResult`, the others None.

    Example (what the magic ships, here run in one process)::

        spec = CellSpec(code="y = x + 1\\n", filename="<cell>", names=("x",), auto=False)
        run_cell(spec, {"x": 1})   # -> CellResult whose "bound" holds y = 2
    """
    __tracebackhide__ = True  # the rank runtime drops frames that say so
    cell_globals: dict[str, Any] = anchor.__globals__ if anchor is not None else {"__name__": "__main__"}
    cell_globals.update(namespace)
    cell_globals.setdefault("__builtins__", builtins)
    cell_globals.setdefault("__name__", "__main__")
    records.set_rng_states(spec.rng)
    # The objects inside globals (trainer.model, trainer.config) are tracked like globals, by label.
    tracked = {**namespace, **{h.label: obj for h, obj in prepare.resolved(namespace, spec.held)}}
    _rewrap_scheduled_optimizers(tracked.values())
    rank0 = api.rank() == 0
    parts = _submodules(tracked)  # before the cell: a layer it replaces was the model's
    # Every rank records it: a rank whose cell raises sends its own state at the raise (state_at_failure).
    before = _Before(cell_globals, tracked, parts)
    devices = deviceglobals.as_rank_devices(cell_globals, namespace)  # `device = torch.device("cuda:0")` in the kernel
    hidden = _install_shell(cell_globals) if spec.needs_shell else set()
    ledger.configure()
    with ledger.cell_registry().patches as cell_patches:  # undone in reverse as the cell ends
        display, prepared, placed, failure = _run_patched(spec, cell_globals, namespace, tracked, cell_patches)
        ours = patches.replacements(patches.Lifetime.CELL)
    _originals_back(cell_globals, ours)
    rankdisplay.show_open_figures()  # what the kernel's inline backend shows at a cell's end
    prepare.put_back(namespace, placed)  # so trainer.model is the kernel's model again on the way back
    deviceglobals.restore(devices)
    context = api.current_context()
    if context is not None:
        context.flush()  # the cell's last metrics go out before the (slower) namespace-out
    if failure is not None:
        _keep_state_at_failure(context, spec, cell_globals, tracked, before, prepared, hidden, parts)
        raise failure  # as the cell raised it: its traceback starts at the cell's own line
    return _collect(spec, cell_globals, tracked, before if rank0 else None, display, prepared, hidden, parts)


def _keep_state_at_failure(
    context: api.RankContext | None,
    spec: CellSpec,
    cell_globals: dict[str, Any],
    tracked: dict[str, Any],
    before: _Before,
    prepared: list[tuple[str, str]],
    hidden: set[str],
    parts: set[int],
) -> None:
    """The cell raised on this rank: what it holds at the raise, for the runtime to send with the failure.

    One process running the cell would keep what it had done up to the raise (the names bound
    before it, a model trained up to that step), so the kernel gets this rank's state as after a
    finished cell. Built from this rank's own objects, with no collective: the other ranks may be
    waiting in one, or gone. Where that cannot be whole (weights sharded over the ranks), nothing
    is kept and ``no_state_why`` says why.
    """
    if context is None:
        return
    try:
        why = _why_no_state_alone(tracked)
        if why:
            context.no_state_why = why
            return
        context.state_at_failure = _collect(
            spec, cell_globals, tracked, before, None, prepared, hidden, parts, alone=True
        )
    except Exception as error:  # noqa: BLE001 - the cell's own error is what the user must see
        context.no_state_why = f"its state could not be gathered ({_short(error)})"


def _why_no_state_alone(tracked: Mapping[str, Any]) -> str:
    """Why this rank alone cannot send a whole state (weights or optimizer state sharded over the ranks), or ""."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    modules = [m for _, m in _unique(tracked, torch.nn.Module)]
    if any(_is_sharded(m) for m in modules):
        return "its weights are sharded over the ranks (fsdp), and one rank alone cannot gather them"
    for _, optimizer in _unique(tracked, torch.optim.Optimizer):
        if _zero_of(optimizer) is not None or _sharded_owner(optimizer, modules) is not None:
            return "its optimizer's state is sharded over the ranks, and one rank alone cannot gather it"
    return ""


def _run_patched(
    spec: CellSpec, cell_globals: dict[str, Any], namespace: dict[str, Any], tracked: dict[str, Any], stack: Any
) -> tuple[tuple[Any] | None, list[Any], list[tuple[Any, Any, Any]], Exception | None]:
    """Prepare and run the cell with the patches (nbtrain.patches) and step hooks it needs on ``stack``:
    (what it displays last, what auto mode prepared, what it placed inside held objects, what the cell
    raised: None when it ran to its end)."""
    __tracebackhide__ = True  # the rank runtime drops frames that say so
    several = api.world_size() > 1
    ledger.cell_registry().ship(tracked.values())
    boundoptimizers.know_optimizers(tracked.values())
    if "torch" in sys.modules or stepcheck.counting():  # a cell without torch has no optimizer to hook
        stephooks.for_the_cell()  # one step pre-hook and post-hook, in nbtrain.rank.auto.stephooks' order
    # A framework's per-process state that arrived with the cell's objects (accelerate's), built for this rank's world.
    ledger.cell_registry().notes.extend(processlocal.initialize())
    auto = spec.auto and not _left_to_a_framework(spec, cell_globals, tracked, several)
    if auto and several:  # what the cell makes and trains itself, to name it if unprepared
        patches.install("made in the cell", stack)  # optimizers, DDP, clipping, loaders, plateau schedulers
        averaging.watch_steps(celloptimizers.first_step, celloptimizers.unstepped_optimizers, cell_globals)  # kept one
    if spec.auto and several:  # a framework's trainer built for one device gets the cell's world
        patches.install("framework world", stack)
    prepared = prepare.auto_prepare(cell_globals, spec.names) if auto else []
    placed: list[tuple[Any, Any, Any]] = []
    if auto:
        more, placed = prepare.auto_prepare_held(namespace, spec.held)
        prepared += more
    if several:  # every rank saving one checkpoint path: a reader never sees a torn file
        patches.install("whole files", stack)
    logging = losslogging.loss_logging(stack) if spec.log_loss else contextlib.nullcontext()
    try:
        # Trackers: one run per tracker, rank 0's; charted live. trainedalone: whether the cell's own code
        # stepped an optimizer without joining any collective (each rank trained alone).
        with logging, trackers.tracked_cell(), trainedalone.watched(api.world_size()):
            try:
                display = _execute(spec, cell_globals)
            except stepcheck.StopAtStep:
                display = None  # stopped at the step every rank reached: what it holds goes back as at the end
    except Exception as error:  # noqa: BLE001 - raised again once the state at the raise is kept (run_cell)
        return None, prepared, placed, error
    return display, prepared, placed, None


def _left_to_a_framework(spec: CellSpec, cell_globals: dict[str, Any], tracked: dict[str, Any], several: bool) -> bool:
    """Whether a framework distributes this auto-mode cell itself (nbtrain.frameworks): then auto mode
    prepares nothing, and the summary says which framework did."""
    if not (spec.auto and several):
        return False
    found = stepaside.frameworks_in(spec.code, cell_globals, spec.names, tracked.values())
    if found:
        ledger.cell_registry().notes.append(stepaside.note(found))
        # A Lightning Trainer the kernel built for its one process gets the cell's world, as one built here would.
        stepaside.given_the_world(tracked.values())
    return bool(found)


def _originals_back(cell_globals: dict[str, Any], ours: list[tuple[Any, Any, str]]) -> None:
    """A global the cell bound to a cell patch's replacement (``from torch import save``, a clip
    function pointed at the averaging one) names the library's own again, now that the patch is
    undone: it goes back to the kernel as torch's. ``ours``: (replacement, owner, attribute)."""
    by_id = {id(replacement): (replacement, owner, attribute) for replacement, owner, attribute in ours}
    for name, value in list(cell_globals.items()):
        replacement, owner, attribute = by_id.get(id(value), (None, None, ""))
        if replacement is value:
            cell_globals[name] = getattr(owner, attribute, value)


def _rewrap_scheduled_optimizers(values: Iterable[Any]) -> None:
    """Give back each LR scheduler's wrapper around its optimizer's ``step``.

    An optimizer pickles without the instance attributes a scheduler added (its ``step``
    wrapper), so on the rank the first ``scheduler.step()`` would warn that
    ``optimizer.step()`` was overridden. This is the wrapper torch's LRScheduler installs.
    """
    if "torch" not in sys.modules:
        return

    for scheduler in values:
        optimizer = getattr(scheduler, "optimizer", None)
        if not _is_scheduler(scheduler) or optimizer is None:
            continue
        step = optimizer.step
        if hasattr(step, "_wrapped_by_lr_sched") or not hasattr(step, "__func__"):
            continue
        func, opt_ref = step.__func__, weakref.ref(optimizer)

        def wrapper(*args: Any, _func: Any = func, _ref: Any = opt_ref, **kwargs: Any) -> Any:
            opt = _ref()
            opt._opt_called = True
            return _func.__get__(opt, opt.__class__)(*args, **kwargs)

        functools.update_wrapper(wrapper, func)
        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # the mark torch's LRScheduler sets
        optimizer.step = wrapper


def _execute(spec: CellSpec, cell_globals: dict[str, Any]) -> tuple[Any] | None:
    __tracebackhide__ = True  # the rank runtime drops frames that say so
    tree = ast.parse(spec.code, spec.filename)
    last = None
    if spec.display_last and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    exec(compile(tree, spec.filename, "exec"), cell_globals)  # noqa: S102 - running the user's cell is the point
    if last is not None:
        return (eval(compile(last, spec.filename, "eval"), cell_globals),)
    return None


def _install_shell(cell_globals: dict[str, Any]) -> set[str]:
    """An IPython shell on this rank whose namespace is the cell's, for get_ipython() calls."""
    # deferred: start-up time (traitlets)
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # ranks must not write the kernel's history file
    shell = rankdisplay.shell_class().instance(config=config, user_ns=cell_globals)
    return set(shell.user_ns_hidden)


# -- what the cell changed ---------------------------------------------------------------

_STATIC_TYPES = (
    types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
    int, float, complex, str, bytes, bool, range, type(None),
)


def _kind(obj: Any) -> str:
    if isinstance(obj, _STATIC_TYPES) or processlocal.is_shared_state(obj):  # a process's own: not the cell's
        return "static"
    kind = reach.kind_of(obj)
    return kind if kind in (*reach.TORCH_KINDS, "tensor") else "plain"


def _is_scheduler(obj: Any) -> bool:
    return reach.torch_kind(obj) == "scheduler"


class _Before:
    """Rank 0's record of the shipped objects before the cell ran, to tell what changed."""

    def __init__(self, cell_globals: dict[str, Any], namespace: Mapping[str, Any], parts: set[int]):
        self.objects = dict(namespace)
        self.bindings = dict(cell_globals)  # holds the objects, so identity checks stay valid
        self.kinds = {name: "part" if id(v) in parts else _kind(v) for name, v in self.objects.items()}
        # Every object the kernel has is by reference in the others' fingerprints: its changes are its own.
        special = {id(v) for n, v in self.objects.items() if self.kinds[n] != "static"}
        self.special = special
        self.parts: list[Any] = []  # what self.refs names by id, kept alive
        self.refs = _kernel_refs(self.objects, self.parts)
        self.keep: list[Any] = []  # tensors the fingerprints name by id (see _fingerprint)
        self.fingerprints = {
            name: _fingerprint(value, special, self.keep, root=value)
            for name, value in self.objects.items()
            if self.kinds[name] == "plain"
        }
        self.versions = {name: v._version for name, v in self.objects.items() if self.kinds[name] == "tensor"}
        self.signatures = {
            name: _signature(v) for name, v in self.objects.items() if self.kinds[name] == "module"
        }
        # Cheap "did it change" marks: tensors by identity and in-place version counter.
        self.states = {
            name: _fingerprint(_state_marks(v), special, self.keep)
            for name, v in self.objects.items()
            if self.kinds[name] in ("module", "optimizer")
        }
        # A model's own attributes (model.epoch): a model is an object too.
        self.attributes = {
            name: _fingerprint(reach.contents(v), special, self.keep)
            for name, v in self.objects.items()
            if self.kinds[name] in ("module", "part")
        }


def _submodules(objects: Mapping[str, Any]) -> set[int]:
    """The ids of the modules inside another of ``objects``: their weights are the outer one's state."""
    torch = sys.modules.get("torch")
    if torch is None:
        return set()
    modules = [v for v in objects.values() if isinstance(v, torch.nn.Module)]
    return {id(sub) for module in modules for sub in module.modules() if sub is not module}


def _kernel_refs(objects: Mapping[str, Any], keep: list[Any]) -> dict[int, tuple[Any, ...]]:
    """id -> persistent id, for every shipped object and the parts of shipped modules, each kept in ``keep``."""
    refs: dict[int, tuple[Any, ...]] = {}
    for name in sorted(objects):
        refs.setdefault(id(objects[name]), (records.KERNEL_TAG, name))
    for name in sorted(objects):
        _add_module_parts(refs, name, objects[name], keep)
    return refs


def _add_module_parts(refs: dict[int, tuple[Any, ...]], name: str, module: Any, keep: list[Any]) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(module, torch.nn.Module):
        return
    parts = {"module": module.named_modules(), "param": module.named_parameters(), "buffer": module.named_buffers()}
    for kind, named in parts.items():
        for path, part in named:
            if path:  # the module itself is named "" among its modules
                refs.setdefault(id(part), (records.PART_TAG, name, kind, path))
                # Alive until the result is pickled: a part the cell replaced (a parameter swapped) must not
                # free its id for a tensor made since (a state dict's), which would pickle as a reference to it.
                keep.append(part)


def _state_marks(obj: Any) -> Any:
    """What identifies a module's or optimizer's state without reading its data."""
    if hasattr(obj, "named_modules"):  # a backward or a freeze alone changes its parameters' own state
        own = [(p.requires_grad, p.grad) for p in obj.parameters()]
        return (obj.state_dict(keep_vars=True), [m.training for _, m in obj.named_modules()], own)
    return obj.state_dict()


def _signature(module: Any) -> tuple[Any, ...]:
    # Under a -true precision the rank cast the model itself: its dtype changing is ours,
    # not the cell's, and the kernel's model keeps its own dtype (loaded by state).
    from nbtrain.rank.auto import precision

    ours = precision.casts_model(settings.current().precision)
    return tuple(
        (key, tuple(t.shape), "" if ours else str(t.dtype)) for key, t in module.state_dict().items()
    )


def _collect(
    spec: CellSpec,
    cell_globals: dict[str, Any],
    namespace: Mapping[str, Any],
    before: _Before | None,
    display: tuple[Any] | None,
    prepared: list[tuple[str, str]],
    hidden: set[str],
    parts: set[int],
    alone: bool = False,
) -> records.CellResult | None:
    """Gather full states (every rank: FSDP needs collectives); rank 0 builds the result.

    ``alone``: a rank whose cell raised builds it from its own objects, with no collective
    (:func:`_why_no_state_alone` said none is needed); ``before`` is then its own record.
    """
    # deferred: start-up time (torch)
    import torch

    modules = [(name, m) for name, m in _unique(namespace, torch.nn.Module) if id(m) not in parts]
    for _, module in modules:
        if not alone:
            _reshard(module)
    module_states, changed_modules = _module_states(modules, before)
    optimizer_states = _optimizer_states(namespace, modules, before)
    if before is None:  # not rank 0: it took part in the collectives, and sends nothing
        return None
    refs = dict(before.refs)
    for name, module in modules:  # FSDP swapped the parameters: map the new ones too
        if name not in changed_modules:
            _add_module_parts(refs, name, module, before.parts)
    outcome: dict[str, Any] = {
        "modules": module_states,
        "optimizers": optimizer_states,
        "optimizer_attributes": _optimizer_attributes(optimizer_states, namespace),
        "inner_optimizers": _inner_optimizer_states(optimizer_states, namespace, [m for _, m in modules]),
        "schedulers": {n: s.state_dict() for n, s in _unique(namespace, _is_scheduler)},
        **_changed_objects(before, changed_modules),  # tensors, contents, changed
        "bound": _bound(cell_globals, before, hidden),
        "display": display,
        "rng": records.rng_states(),
    }
    for name in outcome["bound"]:  # bound anew: it travels as a binding, not as a change
        outcome["changed"].pop(name, None)
        outcome["contents"].pop(name, None)
    whole = {*outcome["changed"], *outcome["tensors"]}  # where such a label's object is, should it be replaced
    outcome["places"] = {h.label: h for h in spec.held if h.label in whole}
    # Held objects' labels (trainer.model) are no names: never deleted.
    deleted = sorted(n for n in before.objects if n.isidentifier() and n not in cell_globals)
    skipped: list[tuple[str, str, str]] = []
    payload, storages = _dump_outcome(outcome, refs, cell_globals, skipped)
    kept = keptmodels.kept_summary(cell_globals)  # a name the cell bound anew is its own model's
    prepared = [entry for entry in prepared if entry[0] not in dict(kept)] + kept
    # Alone, no note on the ranks' first batches: it reads a collective's result the others may never join.
    notes = ledger.notes() + ([] if alone else samedata.same_data_notes(cell_globals))
    notes += _inherent_notes(outcome, modules)
    made = cellloaders.made_loader_report(cell_globals)  # a name the cell bound anew is its loader's
    loader_report = [entry for entry in preparedloaders.loader_report() if entry[0] not in dict(made)] + made
    return records.CellResult(payload, storages, deleted, skipped, prepared, notes, loader_report, steps_alone())


def _inherent_notes(outcome: Mapping[str, Any], modules: list[tuple[str, Any]]) -> list[str]:
    """What data parallelism left different from one process in the models the cell trained
    (nbtrain.rank.auto.inherent)."""
    # deferred: start-up time (torch)
    import torch

    trained = [(name, module) for name, module in modules if name in outcome["modules"]]
    trained += [(name, value) for name, value in outcome["bound"].items() if isinstance(value, torch.nn.Module)]
    return inherent.model_notes(trained, api.world_size())


def _module_states(modules: list[tuple[str, Any]], before: _Before | None) -> tuple[dict[str, Any], set[str]]:
    """Rank 0's (state, training flags) of each module the cell changed, and the modules whose architecture changed.

    ``before`` is None on the other ranks: they only take part in the collectives.
    """
    rank0 = before is not None
    changed_modules: set[str] = set()
    module_states: dict[str, Any] = {}
    for name, module in modules:
        if _is_sharded(module):
            state = _full_model_state(module)  # every rank, always: it is a collective
        elif before is None or _fingerprint(_state_marks(module), before.special) == before.states[name]:
            continue  # untouched (an evaluation cell, say): no need to copy its weights back
        elif _signature(module) == before.signatures.get(name):
            state = module.state_dict()
        else:
            changed_modules.add(name)  # its architecture changed: it travels as an object
            continue
        if rank0:
            modes = [(path, sub.training) for path, sub in module.named_modules()]
            module_states[name] = (state, modes, None if _is_sharded(module) else _parameter_states(module))
    return module_states, changed_modules


def _parameter_states(module: Any) -> list[tuple[str, bool, Any]]:
    """Each parameter's own state beyond its values: its ``requires_grad`` and its ``.grad`` (None
    where it has none, so only gradients that exist travel; under DDP the averaged ones)."""
    return [
        (path, p.requires_grad, None if p.grad is None else _own_grad(p.grad))
        for path, p in module.named_parameters()
    ]


def _own_grad(grad: Any) -> Any:
    # A DDP bucket view would carry the whole bucket's storage with it.
    return grad.detach().clone() if grad._is_view() else grad.detach()


def _optimizer_states(
    namespace: Mapping[str, Any], modules: list[tuple[str, Any]], before: _Before | None
) -> dict[str, Any]:
    """Rank 0's full state of each optimizer the cell changed (every rank takes part in the collectives)."""
    # deferred: start-up time (torch)
    import torch

    states: dict[str, Any] = {}
    for name, optimizer in _unique(namespace, torch.optim.Optimizer):
        owner = _sharded_owner(optimizer, [m for _, m in modules])
        zero = _zero_of(optimizer)
        if zero is not None:  # ddp_sharded: each rank holds a part
            zero.consolidate_state_dict(to=0)  # every rank, always: it is a collective
            if before is not None:
                states[name] = zero.state_dict()
        elif owner is not None:
            state = _full_optimizer_state(owner, optimizer)
            if before is not None:
                states[name] = state
        elif before is not None and _fingerprint(_state_marks(optimizer), before.special) != before.states[name]:
            states[name] = optimizer.state_dict()
    return states


def _zero_of(optimizer: Any) -> Any | None:
    """The ZeroRedundancyOptimizer ``ddp_sharded`` made of ``optimizer``, or None."""
    zero = ledger.prepared_for(optimizer)
    return zero if zero is not None and type(zero).__name__ == "ZeroRedundancyOptimizer" else None


def _optimizer_attributes(optimizers: Mapping[str, Any], namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The plain attributes (a counter, slow weights) of each optimizer whose state goes back."""
    # deferred: start-up time (cloudpickle)
    from nbtrain.messages import codepickle

    attributes = {name: codepickle.own_attributes(namespace[name], optimizers=False) for name in optimizers}
    return {name: own for name, own in attributes.items() if own}


def _inner_optimizer_states(
    optimizers: Mapping[str, Any], namespace: Mapping[str, Any], modules: list[Any]
) -> dict[str, dict[str, Any]]:
    """The state of each optimizer another one whose state goes back holds in an attribute.

    SAM's ``base_optimizer`` and a Lookahead's inner optimizer take the steps, so their
    momentum is the training's own. (Not under ``fsdp`` or ``ddp_sharded``, whose optimizers
    are rebuilt around the parameters: there the wrapper's full state is what there is.)
    """
    # deferred: start-up time (torch)
    import torch

    inner = {
        name: {
            key: value.state_dict()
            for key, value in vars(optimizer).items()
            if isinstance(value, torch.optim.Optimizer) and value is not optimizer
        }
        for name, optimizer in namespace.items()
        if name in optimizers and _sharded_owner(optimizer, modules) is None and _zero_of(optimizer) is None
    }
    return {name: held for name, held in inner.items() if held}


def _bound(cell_globals: dict[str, Any], before: _Before, hidden: set[str]) -> dict[str, Any]:
    """The names the cell bound to another object (a prepared wrapper counts as what it wraps)."""
    names = [name for name in cell_globals if not (records.is_internal(name) or name in hidden)]
    originals = {name: wrapping.original_of(cell_globals[name]) for name in names}
    return {name: o for name, o in originals.items() if name not in before.bindings or before.bindings[name] is not o}


def _changed_objects(before: _Before, changed_modules: set[str]) -> dict[str, dict[str, Any]]:
    """The kernel's objects the cell changed: ``contents``, what each holds now, one step deep,
    where that says it all (reach.contents); ``tensors`` and ``changed``, those that travel
    whole (modules whose architecture changed among them).

    What an object holds travels with the kernel's objects in it as references: the
    kernel refills its own object, and what it shared stays shared.
    """
    contents: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    for name, value in before.objects.items():
        if before.kinds[name] in ("module", "part") and name not in changed_modules:
            if _fingerprint(reach.contents(value), before.special) != before.attributes[name]:
                contents[name] = reach.contents(value)
            continue
        if before.kinds[name] != "plain":
            continue
        if _fingerprint(value, before.special, root=value) == before.fingerprints[name]:
            continue
        held = reach.contents(value)
        if held is None:
            whole[name] = value
        else:
            contents[name] = held
    for name in sorted(changed_modules):
        whole[name] = before.objects[name]
    tensors = {
        n: _Whole(v)
        for n, v in before.objects.items()
        if before.kinds[n] == "tensor" and v._version != before.versions[n]
    }
    return {"tensors": tensors, "contents": contents, "changed": {n: _Whole(v) for n, v in whole.items()}}


def _reduction(value: Any) -> Any:
    """``value``'s reduction, made without ``copyreg.__newobj__``: pickle checks that one's class against the
    object it pickles, which here is the :class:`_Whole` standing for ``value``."""

    reduced = value.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__:  # type: ignore[attr-defined]
        cls, *args = reduced[1]
        return (records.made, (cls, tuple(args), {}), *reduced[2:])
    if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj_ex__:  # type: ignore[attr-defined]
        return (records.made, reduced[1], *reduced[2:])
    return reduced


class _Whole:
    """A kernel object that travels by value here (its new state), and as a reference everywhere else."""

    def __init__(self, value: Any):
        self.value = value


def _unique(namespace: Mapping[str, Any], kind: Any) -> list[tuple[str, Any]]:
    """(first name, object) for each distinct shipped object of a class (or passing a test), by name."""
    found: dict[int, tuple[str, Any]] = {}
    for name in sorted(namespace):
        value = namespace[name]
        if isinstance(value, kind) if isinstance(kind, type) else kind(value):
            found.setdefault(id(value), (name, value))
    return list(found.values())


def _reshard(module: Any) -> None:
    """Register the shards of every FSDP2 unit of ``module`` again (local: no collective).

    FSDP2 keeps the root's gathered weights after a forward, for the backward that
    usually follows. After a forward without gradients (an evaluation loop at the end of
    the cell) none follows, and the module would hold plain, gathered tensors: it would
    look unsharded to the gathering below, on some ranks and not others.
    """
    # deferred: start-up time (torch)
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _is_sharded(module: Any) -> bool:
    # deferred: start-up time (torch)
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _full_options() -> Any:
    # deferred: start-up time (torch)
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _full_model_state(module: Any) -> dict[str, Any]:
    """The unsharded state on rank 0 (a collective: every rank calls it; others get {})."""
    # deferred: start-up time (torch)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_full_options())


def _sharded_owner(optimizer: Any, modules: list[Any]) -> Any | None:
    # deferred: start-up time (torch)
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return None
    ids = {id(p) for p in params}
    for module in modules:
        if ids <= {id(p) for p in module.parameters()}:
            return module
    return None


def _full_optimizer_state(module: Any, optimizer: Any) -> dict[str, Any]:
    """The unsharded optimizer state, keyed by parameter index as ``Optimizer.state_dict`` keys it."""
    # deferred: start-up time (torch)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # Any: torch's type is a union over every key, and "state" / "param_groups" hold known shapes.
    by_name: Any = get_optimizer_state_dict(module, optimizer, options=_full_options())
    if not by_name:
        return {}
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return boundoptimizers.rekeyed(by_name, {name: i for i, name in enumerate(order)}.__getitem__)


# -- pickling the way back -----------------------------------------------------------------


def _dump_outcome(
    outcome: dict[str, Any],
    refs: dict[int, tuple[Any, ...]],
    cell_globals: dict[str, Any],
    skipped: list[tuple[str, str, str]],
) -> tuple[bytes, list[Any]]:
    """Pickle the outcome; a value that cannot travel is left out and named in ``skipped``."""
    with contextlib.suppress(Exception):  # find the culprits below
        return _dump(outcome, refs, cell_globals)
    for section in ("bound", "contents", "changed", "tensors"):
        for name in sorted(outcome[section]):
            value = outcome[section][name]
            try:
                _dump(value, refs, cell_globals)
            except Exception as error:  # noqa: BLE001 - whatever stops it, it is named in skipped
                del outcome[section][name]
                value = value.value if isinstance(value, _Whole) else value
                skipped.append((name, records.type_name(value), _why_not_sent(name, value, error)))
    if outcome["display"] is not None:
        try:
            _dump(outcome["display"], refs, cell_globals)
        except Exception as error:  # noqa: BLE001 - whatever stops it, it is named in skipped
            value = outcome["display"][0]
            skipped.append(("the cell's value", records.type_name(value), _why_not_sent("", value, error)))
            outcome["display"] = None
    return _dump(outcome, refs, cell_globals)


def _why_not_sent(name: str, value: Any, error: BaseException) -> str:
    """Why ``name`` (empty: the cell's value) could not go back to the kernel, and what to do."""
    if not isinstance(error, ShardedTensorError):
        return _short(error)
    if not name:
        return "a sharded DTensor, of which rank 0 has only its shard; end the cell with `<expression>.full_tensor()`"
    if isinstance(value, _result_pickler_class().dtensor_type):
        return (
            f"a sharded DTensor, of which rank 0 has only its shard; end the cell with "
            f"`{name} = {name}.full_tensor()` to bring the whole tensor back, or `del {name}`"
        )
    return (
        f"{error}; keep `.full_tensor()` of each sharded tensor in `{name}` instead, "
        f"or `del {name}` at the end of the cell"
    )


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _dump(obj: Any, refs: dict[int, tuple[Any, ...]], cell_globals: dict[str, Any]) -> tuple[bytes, list[Any]]:

    buffer = io.BytesIO()
    pickler = _result_pickler_class()(buffer, refs, cell_globals)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages


_ATOMIC = (int, float, str, bytes, bool, type(None))


class ShardedTensorError(pickle.PicklingError):
    """A value holds a sharded DTensor: only its shard is on this rank, so it cannot go to the kernel whole."""


class _ResultReferences(_PicklerBase):
    """cloudpickle that sends references to the kernel's own objects instead of copies.

    A mixin: :func:`_result_pickler_class` puts it in front of ``cloudpickle.Pickler``
    once torch and cloudpickle are imported, and names the torch classes it looks for.
    """

    # The torch classes, set by _result_pickler_class (Any: torch is not imported here).
    typed_storage_type: Any = type(None)
    storage_types: Any = ()
    dtensor_type: Any = type(None)
    parameter_type: Any = type(None)

    def __init__(self, file: Any, refs: dict[int, tuple[Any, ...]], cell_globals: dict[str, Any]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs = refs
        self.cell_globals = cell_globals
        self.storages: list[Any] = []
        self._storage_index: dict[tuple[str, int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        """A reference to what the kernel already has (its objects, the cell's globals, tensor storages).

        None: ``obj`` is pickled by value.
        """
        if type(obj) in _ATOMIC:
            return None
        if obj is self.cell_globals:
            return (records.GLOBALS_TAG,)
        if isinstance(obj, self.storage_types):
            return self._storage_id(obj)
        ref = self.refs.get(id(obj))
        if ref is None:
            original = wrapping.original_of(obj)
            if original is not obj:
                ref = self.refs.get(id(original))
        return ref

    def _storage_id(self, obj: Any) -> tuple[Any, ...]:
        if isinstance(obj, self.typed_storage_type):
            untyped, dtype = obj._untyped_storage, obj.dtype
        else:
            untyped, dtype = obj, None
        key = (str(untyped.device), untyped.data_ptr(), untyped.nbytes())
        if key not in self._storage_index or untyped.nbytes() == 0:
            self._storage_index[key] = len(self.storages)
            self.storages.append(untyped)
        return (records.STORAGE_TAG, self._storage_index[key], dtype)

    def reducer_override(self, obj: Any) -> Any:
        """DDP wrappers and prepared objects pickle as their originals; a sharded DTensor is refused."""
        if type(obj) is _Whole:  # the object's own reduction, not a reference to it
            return _reduction(obj.value)
        if isinstance(obj, self.dtensor_type):
            raise ShardedTensorError("it holds a sharded DTensor, of which rank 0 has only its shard")
        if isinstance(obj, self.parameter_type) and obj.grad is not None:  # the cell's own: its grad too
            return (records.with_grad, (_Whole(obj), _own_grad(obj.grad)))
        refused = trackers.stays_on_rank(obj)  # a tracker's run: its files and threads are rank 0's
        if refused:
            raise pickle.PicklingError(refused)
        original = wrapping.original_of(obj)  # a DDP wrapper: its model, or the DataParallel it stands for
        if original is not obj:
            return (records.same, (original,))
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func: Any) -> Any:
        # A function defined in the cell gets the kernel's globals (not a copy of
        # them), as if the cell had run in the kernel.
        reduced = super()._dynamic_function_reduce(func)
        if func.__globals__ is not self.cell_globals:
            return reduced
        try:
            make, newargs, (state, slotstate), items, dict_items, setter = reduced
        except (TypeError, ValueError):  # another cloudpickle layout: keep its copy of the globals
            return reduced
        slotstate = dict(slotstate, __globals__={})
        return (make, (newargs[0], self.cell_globals, *newargs[2:]), (state, slotstate), items, dict_items, setter)


@functools.cache
def _result_pickler_class() -> type[_ResultReferences]:
    """:class:`_ResultReferences` on cloudpickle's Pickler (built once: it imports torch and cloudpickle)."""
    # deferred: start-up time (torch)
    import torch
    from torch.distributed.tensor import DTensor

    from nbtrain.messages import codepickle

    class ResultPickler(_ResultReferences, codepickle.Pickler):
        typed_storage_type = torch.storage.TypedStorage
        storage_types = (torch.storage.TypedStorage, torch.UntypedStorage)
        dtensor_type = DTensor
        parameter_type = torch.nn.Parameter

    return ResultPickler


# -- change detection ----------------------------------------------------------------------

@functools.cache
def _fingerprint_pickler() -> type:
    """Our Pickler naming tensors by identity and version, and the objects in ``special``
    (but ``root``) by identity (built once: it imports codepickle, and so cloudpickle)."""
    # codepickle's, as the result's: an object that keeps weak references or locks (an ignite Engine), or
    # pickles notebook code with the standard pickler (skorch's NeuralNet), has a fingerprint, and so its
    # change is seen, rather than None before the cell and after it, which compare equal.
    from nbtrain.messages import codepickle

    class FingerprintPickler(codepickle.Pickler):
        def __init__(self, file: Any, special: set[int], keep: list[Any] | None, root: Any):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.special = special
            self.keep = keep
            self.root = root
            self.torch = sys.modules.get("torch")

        def persistent_id(self, obj: Any) -> Any:
            if type(obj) in _ATOMIC:
                return None
            if id(obj) in self.special and obj is not self.root:
                return ("k", id(obj))
            torch = self.torch
            if torch is not None and isinstance(obj, torch.Tensor):
                if self.keep is not None:
                    self.keep.append(obj)
                return ("t", id(obj), obj._version, tuple(obj.shape), str(obj.dtype))
            return None

    return FingerprintPickler


def _fingerprint(value: Any, special: set[int], keep: list[Any] | None = None, root: Any = None) -> bytes | None:
    """A digest of ``value``'s pickle; tensors count by identity and version, not by data, and the
    objects in ``special`` (but ``root``, whose own state this is) by identity alone.

    ``keep`` collects the tensors seen: holding them keeps their ids from being reused by
    a new tensor while the cell runs (a replaced layer's weights freed, a new one's
    allocated at the same address, both at version 0, would look unchanged).
    """
    digest = hashlib.blake2b(digest_size=16)

    class Sink:
        def write(self, data: bytes) -> int:
            digest.update(data)
            return len(data)

    try:
        _fingerprint_pickler()(Sink(), special, keep, root).dump(value)
    except Exception:  # noqa: BLE001 - cannot tell: treat as changed
        return None
    return digest.digest()
