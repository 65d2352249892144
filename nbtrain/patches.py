"""Every change nbtrain makes to code it does not own, declared in one table and undone.

Auto mode lets a notebook's single-device code run on several ranks unchanged, and a few
of the ways it does so replace an attribute of a library: ``torch.save`` writes a whole file
when ranks save one path at once, ``DataLoader.__iter__`` reads a rank's share, a rank's
``builtins.input`` asks the cell. Each such replacement is one :class:`Patch` in
:data:`TABLE`: what it replaces (target and attribute), with what (a factory that is given
the original and returns the replacement, named by its module path so that reading the
table imports nothing), why, and for how long (:class:`Lifetime`). Nothing else in nbtrain
assigns an attribute of a library (``tests/test_structure.py`` looks).

:func:`install` installs the patches of one group onto an :class:`contextlib.ExitStack`, in
the table's order; closing the stack undoes them in reverse. Undo puts the original back
unless something else (the user's own code) replaced the attribute meanwhile: theirs stays.
A patch with ``on_import`` waits for its module to be imported (its library's own code has
run, nothing has bound its names yet), so that a cell that never imports numpy pays
nothing; a module already imported is patched at once.

Standard library only; installing imports what the group's patches name.

Example (a patch of the standard library's ``colorsys``, installed and undone)::

    >>> import colorsys, contextlib
    >>> patch = Patch("example", "colorsys", "rgb_to_hsv", "builtins:repr", Lifetime.CELL, "an example")
    >>> with contextlib.ExitStack() as stack:
    ...     install("example", stack, table=(patch,))
    ...     colorsys.rgb_to_hsv is colorsys.rgb_to_yiq
    False
    >>> colorsys.rgb_to_hsv(0.0, 0.0, 0.0)
    (0.0, 0.0, 0.0)
"""

from __future__ import annotations

import enum
import importlib
import sys
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from nbtrain import frameworks  # standard library only at import, like this module
from nbtrain.system import stepboard  # standard library only, like this module


class Lifetime(enum.Enum):
    """How long a patch stays: who installs it, and when it is undone."""

    RANK = "a rank's process"  # installed as the rank starts; the process ends with it
    CELL = "one cell"  # installed as a cell starts on a rank, undone as it ends
    LAUNCHER = "the launcher"  # installed by the warm launcher; its forked ranks inherit it
    PROMPT = "one pdb prompt"  # installed as a rank's pdb prompts, undone as it returns
    PICKLING = "one pickling"  # installed while one of nbtrain's picklers runs (any process), undone after


@dataclass(frozen=True)
class Patch:
    """One replacement of an attribute nbtrain does not own.

    ``target`` is a module (``"torch.serialization"``), or a class or other object in one reached by
    attributes after the colon (``"torch.utils.data:DataLoader"``; fastai's ``"fastai.learner:defaults"``, a
    namespace, whose attribute is replaced and put back as a class's); ``replacement`` names a factory
    (``"nbtrain.rank.machinery.checkpoints:whole_torch_save"``) called with the original attribute
    (``None`` where the target had none of its own) that returns what replaces it, or that
    same object to leave the target as it is.
    """

    group: str  # the patches installed together, by the code that owns the group
    target: str
    attribute: str
    replacement: str
    lifetime: Lifetime
    why: str
    on_import: bool = False  # wait for the target's module to be imported rather than import it

    @property
    def module(self) -> str:
        """The module the target lives in."""
        return self.target.partition(":")[0]


_MISSING = object()  # the target had no attribute of its own (a class's was inherited)


def install(group: str, stack: ExitStack, table: Iterable[Patch] | None = None) -> None:
    """Install every patch of ``group`` in ``table`` (:data:`TABLE`) onto ``stack``, in order."""
    patches = [patch for patch in (TABLE if table is None else table) if patch.group == group]
    if not patches:
        raise ValueError(f"no patch belongs to group {group!r}; the groups are {sorted(groups())}")
    for patch in patches:
        if patch.on_import and patch.module not in sys.modules:
            stack.callback(_when_imported(patch, stack))
        else:
            _apply(patch, importlib.import_module(patch.module), stack)


def install_for_process(*groups: str) -> None:
    """Install each of ``groups`` for the rest of this process and the processes it forks (a rank's,
    the launcher's): once, as the first caller asks; a forked rank's own call finds it installed."""
    for group in groups:
        if group not in _for_the_process:
            _for_the_process[group] = stack = ExitStack()
            install(group, stack)


def factory_modules(table: Iterable[Patch] | None = None) -> tuple[str, ...]:
    """The modules of ``table``'s (:data:`TABLE`'s) factories, nbtrain's own, each once.

    A launcher imports them before it forks: a rank's first patch of a group then finds its
    factory imported, rather than importing it on the run's way (about 1 ms a module).

    >>> "nbtrain.rank.machinery.checkpoints" in factory_modules()
    True
    """
    return tuple(dict.fromkeys(patch.replacement.partition(":")[0] for patch in (TABLE if table is None else table)))


def replacements(lifetime: Lifetime) -> list[tuple[Any, Any, str]]:
    """(what replaces it now, owner, attribute) for each patch of ``lifetime`` whose module is
    imported: so that, once they are undone, a name bound to a replacement can name the original."""
    imported = [(patch, sys.modules.get(patch.module)) for patch in TABLE if patch.lifetime is lifetime]
    owners = [(patch, _owner(patch, module)) for patch, module in imported if module is not None]
    return [(getattr(owner, patch.attribute, None), owner, patch.attribute) for patch, owner in owners]


_for_the_process: dict[str, ExitStack] = {}  # group -> its undo, for the groups a process keeps


def groups(table: Iterable[Patch] | None = None) -> set[str]:
    """The groups of ``table`` (:data:`TABLE`)."""
    return {patch.group for patch in (TABLE if table is None else table)}


def _apply(patch: Patch, module: ModuleType, stack: ExitStack) -> None:
    owner = _owner(patch, module)
    original = vars(owner).get(patch.attribute, _MISSING)
    current = getattr(owner, patch.attribute, None)
    replacement = _factory(patch.replacement)(current)
    if replacement is current:  # the factory keeps what is there (the target lacks it, or has ours)
        return
    setattr(owner, patch.attribute, replacement)
    stack.callback(_undo, owner, patch.attribute, original, replacement)


def _owner(patch: Patch, module: ModuleType) -> Any:
    _, _, path = patch.target.partition(":")
    owner: Any = module
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name)
    return owner


def _undo(owner: Any, attribute: str, original: Any, replacement: Any) -> None:
    """Put the original back, unless the attribute is no longer ours (the user's code replaced it)."""
    if vars(owner).get(attribute, _MISSING) is not replacement:
        return
    if original is _MISSING:
        delattr(owner, attribute)
    else:
        setattr(owner, attribute, original)


def _factory(reference: str) -> Callable[[Any], Any]:
    module, _, name = reference.partition(":")
    factory: Callable[[Any], Any] = getattr(importlib.import_module(module), name)
    return factory


def _when_imported(patch: Patch, stack: ExitStack) -> Callable[[], None]:
    """Apply ``patch`` once its module is imported; returns what stops waiting for it."""
    from nbtrain.rank.machinery import afterimport  # an import hook, needed only by a patch that waits

    return afterimport.when_imported(patch.module, lambda module: _apply(patch, module, stack))


_TRACKERS = "nbtrain.rank.machinery.trackers:"
_ONE_RUN = "a cell of several ranks writes one run, rank 0's; "
# Experiment trackers (nbtrain.rank.machinery.trackers): installed for a cell on every rank; each factory
# leaves rank 0's tracker writing (and charting its scalars) and quiets the other ranks'.
_CHARTED = "rank 0's scalars are charted in the live view"
_SUMMARY_WRITER = (  # (owner in the writer's module, attribute, factory, why) of a SummaryWriter's patches
    ("", "FileWriter", "tensorboard_file_writer", _ONE_RUN + "the other ranks' SummaryWriters write no event file"),
    (":SummaryWriter", "__init__", "tensorboard_init", "a writer the cell leaves open is closed (flushed) at its end"),
    (":SummaryWriter", "add_scalar", "tensorboard_add_scalar", _CHARTED),
    (":SummaryWriter", "add_scalars", "tensorboard_add_scalars", _CHARTED),
)
TRACKER_PATCHES: tuple[Patch, ...] = (
    *(
        Patch("trackers", module + owner, attribute, _TRACKERS + factory, Lifetime.CELL, why, on_import=True)
        for module in ("torch.utils.tensorboard.writer", "tensorboardX.writer")  # tensorboardX's: the same
        for owner, attribute, factory, why in _SUMMARY_WRITER
    ),
    Patch(
        "trackers", "wandb", "init", _TRACKERS + "wandb_init", Lifetime.CELL,
        _ONE_RUN + "the other ranks get a disabled run (and no wandb service process)", on_import=True,
    ),
    Patch(
        "trackers", "wandb", "log", _TRACKERS + "wandb_module_log", Lifetime.CELL,
        "wandb.log reaches the run the kernel opened (rank 0's calls, sent to the kernel)", on_import=True,
    ),
    Patch(
        "trackers", "wandb.sdk.wandb_run:Run", "log", _TRACKERS + "wandb_log", Lifetime.CELL,
        _CHARTED, on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking._tracking_service.utils", "_get_store", _TRACKERS + "mlflow_store",
        Lifetime.CELL, _ONE_RUN + "the other ranks track into a throwaway store", on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking.client:MlflowClient", "log_metric", _TRACKERS + "mlflow_log_metric",
        Lifetime.CELL, "rank 0's metrics are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "mlflow.tracking.client:MlflowClient", "log_batch", _TRACKERS + "mlflow_log_batch",
        Lifetime.CELL, "rank 0's metrics are charted in the live view", on_import=True,
    ),
    Patch(
        "trackers", "trackio", "init", _TRACKERS + "trackio_init", Lifetime.CELL,
        _ONE_RUN + "the other ranks get a run that writes nothing", on_import=True,
    ),
    Patch(
        "trackers", "trackio.run:Run", "log", _TRACKERS + "trackio_log", Lifetime.CELL,
        _CHARTED, on_import=True,
    ),
)

_RANK, _CELL, _LAUNCHER = Lifetime.RANK, Lifetime.CELL, Lifetime.LAUNCHER
_RUNTIME, _DEBUGGER = "nbtrain.rank.machinery.runtime:", "nbtrain.rank.machinery.debugger:"
_CHECKPOINTS = "nbtrain.rank.machinery.checkpoints:"
_MADE_LOADERS, _SCHEDULERS = "nbtrain.rank.auto.cellloaders:", "nbtrain.rank.auto.schedulers:"
_DISPLAYS, _TEXT_BARS = "nbtrain.rank.machinery.rankdisplay:in_the_cell", "nbtrain.rank.machinery.progressbars:text_bar"
_C10D = "torch.distributed.distributed_c10d"  # where torch defines init_process_group; torch.distributed re-exports it
_TORCHRUN = "code written for torchrun runs unchanged: its own init_process_group joins nothing new"
_TORCHRUN_END = "its destroy_process_group leaves the group (a gloo group destroyed under DDP can hang)"
_LEDGER = "each collective is written on the run's board: a stall is named, a mismatch ends the run before gloo aborts"
_AVERAGED_CLIP = "clipping reads averaged gradients (a cell-made model's, a model called past its DDP), as under DDP"
_WHOLE = "ranks saving one path at once: a reader never sees a torn file"
_SHOWN = "IPython's {} on a rank goes to the cell (the kernel's own outside a run)"
_TEXT_BAR = "tqdm.notebook's widget bar on a rank (no frontend there) prints as text"
_SHARE = "a DataLoader made in the cell reads this rank's share, as the kernel's do"

TABLE: tuple[Patch, ...] = (
    # A rank's process, installed as it starts (nbtrain.rank.machinery.runtime).
    Patch("rank", "sys", "stdout", _RUNTIME + "line_buffered_stdout", _RANK, "each print reaches the cell live"),
    Patch("rank", "sys", "stderr", _RUNTIME + "line_buffered_stderr", _RANK, "each warning reaches the cell live"),
    Patch("rank", "builtins", "input", _RUNTIME + "no_input", _RANK, "input() says why a rank can't answer"),
    *(
        Patch("torchrun", module, f"{verb}_process_group", _RUNTIME + f"harmless_{verb}", _RANK, why)
        for verb, why in (("init", _TORCHRUN), ("destroy", _TORCHRUN_END))
        for module in ("torch.distributed", _C10D)
    ),
    *(
        Patch("collectives", module, name, "nbtrain.rank.machinery.collectives:ledgered", _RANK, _LEDGER)
        for module in ("torch.distributed", _C10D)  # the user's calls, and torch's own calls of its functions
        for name in stepboard.COLLECTIVES  # the board names each by its index
    ),
    Patch(
        "collectives", "torch.nn.parallel:DistributedDataParallel", "forward",
        "nbtrain.rank.machinery.collectives:noting_ddp_steps", _RANK,
        "a syncing forward counts its backward's gradient all-reduce (C++'s) on the board: a skipped step is named",
    ),
    # A rank's, once its run's environment is in place (nbtrain.rank.machinery.compiling).
    Patch(
        "compiling", "torch._inductor.config", "compile_threads",
        "nbtrain.rank.machinery.compiling:threads_from_environment", _RANK,
        "a cell's ranks share the host's cores for torch.compile's workers: inductor decided at the launcher's "
        "import, before the run's TORCHINDUCTOR_COMPILE_THREADS existed", on_import=True,
    ),
    Patch("debugger", "sys", "breakpointhook", _DEBUGGER + "relayed_hook", _RANK, "breakpoint() opens pdb in the cell"),
    Patch(
        "debugger", "pdb", "set_trace", _DEBUGGER + "relayed_set_trace", _RANK, "pdb.set_trace() opens pdb in the cell"
    ),
    # A rank's, and the processes it starts, from their first notebook object (nbtrain.rank.machinery.childpickling).
    Patch(
        "child processes", "multiprocessing.reduction:ForkingPickler", "reducer_override",
        "nbtrain.rank.machinery.childpickling:by_value_reducer", _RANK,
        "a process the rank starts by spawn or forkserver (3.14's default: DataLoader workers, process pools) "
        "gets notebook classes and functions by value, as the rank did: its __main__ has none",
    ),
    Patch(
        "child processes", "multiprocessing.forkserver:_forkserver", "_preload_modules",
        "nbtrain.rank.machinery.childpickling:forkserver_preload", _RANK,
        "a rank's forkserver imports torch once: each worker it forks starts without importing it", on_import=True,
    ),
    # The launcher, before it forks ranks (a spawned rank installs them itself): as each module is imported.
    *(
        Patch("notebook only", module, name, _DISPLAYS, _LAUNCHER, _SHOWN.format(name), True)
        for module in ("IPython.core.display_functions", "IPython.core.display")  # IPython 8 and later, then 7.x
        for name in ("display", "clear_output")
    ),
    *(
        Patch("notebook only", "tqdm.notebook", name, _TEXT_BARS, _LAUNCHER, _TEXT_BAR, True)
        for name in ("tqdm_notebook", "tqdm")
    ),
    # One pdb prompt on a rank (nbtrain.rank.machinery.debugger): interact's input() and print() use the relay.
    Patch("pdb prompt", "sys", "stdin", _DEBUGGER + "the_relay", Lifetime.PROMPT, "interact reads the relay"),
    Patch("pdb prompt", "sys", "stdout", _DEBUGGER + "the_relay", Lifetime.PROMPT, "interact writes the relay"),
    # One auto-mode cell of several ranks (nbtrain.rank.cell): what the cell makes and trains itself.
    Patch(
        "made in the cell",
        "torch.optim:Optimizer",
        "__init__",
        "nbtrain.rank.auto.celloptimizers:recording_optimizers",
        _CELL,
        "an optimizer made in the cell records where, so its model can be kept averaged",
    ),
    Patch(
        "made in the cell",
        "torch.nn.parallel:DistributedDataParallel",
        "__init__",
        "nbtrain.rank.auto.celloptimizers:recording_averaged",
        _CELL,
        "a DDP made in the cell marks its parameters averaged",
    ),
    Patch(
        "made in the cell",
        "torch.amp:GradScaler",
        "unscale_",
        "nbtrain.rank.auto.averaging:averaging_unscale",
        _CELL,
        "a scaler looks for infinities in averaged gradients (a cell-made model's, a model called past its DDP): "
        "every rank skips alike",
    ),
    *(
        Patch("made in the cell", module, name, "nbtrain.rank.auto.averaging:averaging_clip", _CELL, _AVERAGED_CLIP)
        for module in ("torch.nn.utils.clip_grad", "torch.nn.utils")
        for name in ("clip_grad_norm_", "clip_grad_value_")
    ),
    *(
        Patch("made in the cell", "torch.utils.data:DataLoader", f"__{name}__", _MADE_LOADERS + factory, _CELL, _SHARE)
        for name, factory in (("init", "recording_loaders"), ("iter", "sharded_iter"), ("len", "sharded_len"))
    ),
    Patch(
        "made in the cell", "torch.optim.lr_scheduler:ReduceLROnPlateau", "step", _SCHEDULERS + "agreed_step", _CELL,
        "every rank steps on the ranks' agreed metric, so all keep the same learning rate",
    ),
    # One auto-mode cell of several ranks (nbtrain.rank.cell): a framework's trainer built for one device.
    *(
        Patch(
            "framework world", target, "__init__", "nbtrain.rank.auto.stepaside:one_device_gets_the_world", _CELL,
            "a Lightning Trainer or Fabric built for one device trains on the cell's ranks, as the cell asked",
            on_import=True,
        )
        for target in (
            "lightning.pytorch.trainer.trainer:Trainer", "lightning.fabric.fabric:Fabric",
            "pytorch_lightning.trainer.trainer:Trainer",
        )
    ),
    # ... and a framework's own code a rank needs changed (nbtrain.frameworks' adapters).
    *(
        Patch("framework world", a.target, a.attribute, a.replacement, _CELL, a.why, on_import=True)
        for framework in frameworks.TABLE
        for a in framework.adapters
    ),
    # One cell of several ranks: a file saved to one path by every rank is written whole.
    Patch("whole files", "torch", "save", _CHECKPOINTS + "whole_torch_save", _CELL, _WHOLE),
    Patch("whole files", "torch.serialization", "save", _CHECKPOINTS + "whole_torch_save", _CELL, _WHOLE),
    Patch("whole files", "numpy", "save", _CHECKPOINTS + "whole_numpy_save", _CELL, _WHOLE, True),
    Patch("whole files", "matplotlib.figure:Figure", "savefig", _CHECKPOINTS + "whole_savefig", _CELL, _WHOLE, True),
    # One cell that prepared a model for 16-mixed on CUDA (nbtrain.rank.auto.wrapping).
    Patch(
        "loss scaling",
        "torch:Tensor",
        "backward",
        "nbtrain.rank.auto.precision:scaled_backward",
        _CELL,
        "16-mixed scales a scalar loss's backward with no code change",
    ),
    # One cell that logs its loss (nbtrain.rank.cell): installed after loss scaling, so it sees the true loss.
    Patch(
        "loss logging",
        "torch:Tensor",
        "backward",
        "nbtrain.rank.auto.losslogging:logged_backward",
        _CELL,
        "scalar.backward() logs the loss for the live view with no code change",
    ),
    # One cell that imports an experiment tracker (nbtrain.rank.machinery.trackers).
    *TRACKER_PATCHES,
    # While one of nbtrain's picklers runs (nbtrain.messages.nestedpickling): a standard pickle made inside it.
    *(
        Patch(
            "nested pickles", "pickle", name, f"nbtrain.messages.nestedpickling:by_value_{factory}",
            Lifetime.PICKLING, f"a standard pickle inside ours ({user}) sends notebook code by value",
        )
        for name, factory, user in (
            ("Pickler", "pickler", "torch.save"),
            ("dump", "dump", "skorch's NeuralNet"),
            ("dumps", "dumps", "pickle.dumps"),
        )
    ),
)
"""Every patch nbtrain installs, in the order each group installs them. docs/architecture.md
shows this table; ``tests/test_structure.py`` checks that nothing else replaces a library's
attribute."""
