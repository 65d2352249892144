"""The training frameworks that distribute themselves, declared in one table: what auto mode leaves to each.

A notebook that calls ``trainer.train()``, ``trainer.fit(model)`` or ``accelerator.prepare(...)``
hands the model to a framework that wraps it in DDP and shards its loaders itself, once it
finds its world: torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``TORCHELASTIC_RUN_ID``), which a rank has, and the process group, which every one of these
frameworks reuses. Auto mode then steps aside: it wraps no model and shards no loader of that
cell, and the summary names the framework. A cell that only uses a framework's helpers on its
own loop (an ``Accelerator`` prepared in the kernel, ``accelerator.backward(loss)``) is a plain
loop: auto mode prepares it as any other.

Each :class:`Framework` row says which classes and functions mean "the framework distributes
this cell" (:attr:`Framework.distributes`, matched by :func:`names_of` against what the cell
refers to) and what nbtrain does for it beyond stepping aside (:attr:`Framework.adapted`),
with why. Every change to the framework's own code is a row of :mod:`nbtrain.patches`; what a
framework keeps per process (accelerate's state singletons) travels as the receiving process's
own (:mod:`nbtrain.messages.processlocal`). docs/frameworks.md is the user's page.

Standard library only; reading the table imports no framework.

Example:
    >>> class Trainer: ...
    >>> Trainer.__module__ = "transformers.trainer"
    >>> [f.name for f in distributing(names_of(Trainer))]
    ["transformers' Trainer"]
    >>> distributing(names_of(len))
    []
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Singleton:
    """A per-process singleton of a framework whose world each process builds for itself
    (:mod:`nbtrain.messages.processlocal`). A singleton of the Borg kind not listed holds no
    world (accelerate's ``GradientState``): it travels as the sender's."""

    cls: str  # "module:Class"
    # "" where it is a process's world itself (rank, size, device); else the world singleton whose
    # fields it holds beside its own (those are the receiver's, its own the sender's)
    world: str = ""
    rebuilt_with: tuple[tuple[str, str], ...] = ()  # a world's (keyword, sender's field): the sender's choices


@dataclass(frozen=True)
class Adapter:
    """One change to a framework's own code that a rank needs, beyond stepping aside: the patch table
    (:mod:`nbtrain.patches`, group "framework world") installs each for a cell of several ranks."""

    target: str  # "module:Class" or "module"
    attribute: str
    replacement: str  # "module:factory", given the original, as a patch's
    why: str


@dataclass(frozen=True)
class Framework:
    """One framework that distributes a cell's training itself."""

    name: str  # as the summary says it
    tested: str  # the package and the versions tested
    # "module:Class" (an instance of it or of a subclass, or the class itself, in the cell),
    # "module:Class()" (the class itself: the cell builds one), "module:function" (the cell calls it).
    distributes: tuple[str, ...]
    adapted: str  # what nbtrain does for it besides stepping aside, and why
    singletons: tuple[Singleton, ...] = ()  # what it keeps per process
    adapters: tuple[Adapter, ...] = ()  # changes to its code a rank needs (rows of nbtrain.patches)
    # "module:Class" of loaders that keep the framework's books on each pass (begin(), end(), end_of_dataloader):
    # a rank's share of one, read by auto mode, keeps them too (in_pass_books)
    pass_books: tuple[str, ...] = ()

    def matches(self, names: Iterable[str]) -> bool:
        """Whether one of ``names`` (see :func:`names_of`) is one of this framework's."""
        return not set(self.distributes).isdisjoint(names)


TABLE: tuple[Framework, ...] = (
    Framework(
        "transformers' Trainer",
        "transformers 5.23",
        ("transformers.trainer:Trainer",),
        "its TrainingArguments and Accelerator keep accelerate's per-process state: each process reads its own",
    ),
    Framework(
        "accelerate",
        "accelerate 1.16",
        (
            "accelerate.accelerator:Accelerator()",
            *(f"accelerate.accelerator:Accelerator.{m}" for m in ("prepare", "prepare_model", "prepare_data_loader")),
        ),
        "PartialState, AcceleratorState and GradientState are per process: each process reads its own "
        "(an Accelerator built in the kernel has the rank's world on a rank, and one process back in the kernel)",
        (
            Singleton("accelerate.state:PartialState", rebuilt_with=(("cpu", "_cpu"),)),
            Singleton("accelerate.state:AcceleratorState", world="accelerate.state:PartialState"),
        ),
        (
            Adapter(
                "accelerate.accelerator:Accelerator",
                "prepare_model",
                "nbtrain.frameworks:untrainable_left_unwrapped",
                "on CPU ranks accelerate wraps a module with no trainable parameter (skorch's criterion) in DDP, "
                "which refuses it; on GPU ranks accelerate leaves such a module unwrapped, and so it is here",
            ),
        ),
        # Its accumulate() syncs at a pass's last batch, which its loaders mark in GradientState.
        ("accelerate.data_loader:DataLoaderStateMixin",),
    ),
    Framework(
        "Lightning",
        "lightning 2.6.6",
        # lightning, and the older pytorch_lightning package that holds the same Trainer
        (
            "lightning.pytorch.trainer.trainer:Trainer",
            "lightning.fabric.fabric:Fabric",
            "pytorch_lightning.trainer.trainer:Trainer",
        ),
        "under auto mode a Trainer or Fabric built for one device (devices=1 or 'auto') gets the cell's world "
        "(the run's devices and nodes, strategy 'ddp'; a Fabric is launched), as does a Trainer the kernel built: "
        "Lightning checks torchrun's world against devices x nodes. Back in the kernel each is one device's again "
        "(with_world): its strategy was chosen for the process that built it",
    ),
    Framework(
        "ignite's idist",
        "pytorch-ignite 0.5.5",
        tuple(f"ignite.distributed.auto:{f}" for f in ("auto_model", "auto_optim", "auto_dataloader")),
        "nothing: idist finds the process group and torchrun's variables",
    ),
    Framework(
        "fastai's distributed callback",
        "fastai 2.8",
        # fastcore's @patch names the methods it adds to Learner by the class; a Learner (in the
        # kernel or built in the cell) is fastai's to distribute, with auto mode's adapter (fastai_world)
        (
            "fastai.learner:Learner",
            *(
                f"fastai.distributed:{f}"
                for f in ("Learner.distrib_ctx", "Learner.to_distributed", "DistributedTrainer")
            ),
        ),
        "under auto mode each Learner of the cell, the kernel's (add_cb) and those the cell builds (fastai's "
        "defaults.callbacks), fits with a DistributedTrainer of auto mode's (fastai_world): DDP, and each rank its "
        "share of every DataLoader, as distrib_ctx gives; its shuffled order is broadcast on the group's device "
        "(fastai's own sends a CUDA tensor), on CPU ranks with Accelerator(cpu=True), and no BatchNorm is converted "
        "(the kernel's model keeps its layers). Undone as the cell ends: the callback leaves each Learner (a fit that "
        "raised gets its model and loaders back), and defaults.callbacks is fastai's own list again. A fit inside "
        "distrib_ctx is fastai's own",
        adapters=(
            Adapter(
                "fastai.distributed:DistributedDL",
                "_broadcast",
                "nbtrain.frameworks:group_broadcast",
                "fastai broadcasts a loader's shuffled order as a CUDA tensor, which CPU ranks (gloo) cannot send: "
                "it is sent on the process group's device, so distrib_ctx and auto mode's callback shard on CPU too",
            ),
            Adapter(
                "fastai.learner:defaults",  # fastcore's namespace of fastai's defaults, as fastai.learner has it
                "callbacks",
                "nbtrain.frameworks:with_auto_trainer",
                "a Learner the cell builds adds fastai's defaults.callbacks: a new list with auto mode's "
                "DistributedTrainer (fastai_world's) fits it over the ranks; fastai's own list is put back unchanged",
            ),
        ),
    ),
    Framework(
        "skorch with accelerate",
        "skorch 1.4",
        ("skorch.hf:AccelerateMixin",),
        "the Accelerator it is given finds the rank's world; its criterion, a module with no parameter, "
        "is left unwrapped (accelerate's adapter)",
    ),
)
"""Every framework auto mode steps aside for. docs/frameworks.md says, per framework, the
pattern that works and what comes back."""


def names_of(obj: Any) -> set[str]:
    """The table's names ``obj`` answers to: its class's and bases' (and "()" ones for a class), or its function's."""
    if isinstance(obj, type):
        mro = _mro(obj)
        return {*mro, *(f"{name}()" for name in mro)}
    if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        function = getattr(obj, "__func__", obj)
        return {f"{getattr(function, '__module__', '')}:{getattr(function, '__qualname__', '')}"}
    if isinstance(obj, types.ModuleType):
        return set()
    return set(_mro(type(obj)))


def _mro(cls: type) -> list[str]:
    return [f"{base.__module__}:{base.__qualname__}" for base in getattr(cls, "__mro__", (cls,))]


def by_name(imported: Iterable[str]) -> set[str]:
    """The table's names that a cell's imports of a package not imported yet name ("package:Name" each):
    a class or function of the table whose package and own name are those.

    >>> sorted(by_name({"accelerate:Accelerator", "torch:nn"}))
    ['accelerate.accelerator:Accelerator()']
    """
    wanted = set(imported)
    return {
        entry
        for framework in TABLE
        for entry in framework.distributes
        if f"{entry.partition('.')[0].partition(':')[0]}:{entry.partition(':')[2].removesuffix('()')}" in wanted
    }


def distributing(names: Iterable[str]) -> list[Framework]:
    """The frameworks of :data:`TABLE` that one of ``names`` belongs to, in the table's order."""
    names = set(names)
    return [framework for framework in TABLE if framework.matches(names)]


_LIGHTNING_TRAINERS = ("lightning.pytorch.trainer.trainer:Trainer", "pytorch_lightning.trainer.trainer:Trainer")
_FABRIC = "lightning.fabric.fabric:Fabric"


def with_world(objects: Iterable[Any], devices: int, num_nodes: int) -> list[str]:
    """Give each Lightning ``Trainer`` and ``Fabric`` among ``objects`` a world of ``devices`` x ``num_nodes``;
    the class names of those changed.

    A Trainer's or Fabric's strategy and cluster environment are chosen once, when it is built,
    for the process that built it: one built in the kernel for one device reaches a rank saying
    one device, and one built on a rank comes back to the kernel with a DDP strategy that reads
    the rank's environment. Its connector is built again for this process, with its own
    accelerator and precision (what Lightning's own constructor would choose here); a
    Trainer's LightningModule is connected to the new strategy.
    """
    changed = []
    for obj in objects:
        try:
            names = names_of(obj)
        except Exception:  # noqa: BLE001, S112 - an object whose class lies about itself is none of these
            continue
        if not names.isdisjoint(_LIGHTNING_TRAINERS):
            connector = obj._accelerator_connector
        elif _FABRIC in names:
            connector = obj._connector
        else:
            continue
        if _devices_of(connector.strategy) == devices * num_nodes:
            continue
        rebuilt = type(connector)(
            devices=devices, num_nodes=num_nodes,
            accelerator=connector._accelerator_flag if isinstance(connector._accelerator_flag, str) else "auto",
            strategy="auto" if devices * num_nodes == 1 else "ddp",
            precision=getattr(obj, "precision", None) or getattr(connector, "_precision_input", None),
        )
        _connect(obj, rebuilt)
        changed.append(type(obj).__name__)
    return changed


def _connect(obj: Any, connector: Any) -> None:
    """Put ``connector`` in a Trainer or a Fabric, as its own constructor does."""
    if hasattr(obj, "_accelerator_connector"):  # a Trainer: its strategy is its connector's
        module = obj._accelerator_connector.strategy.lightning_module
        obj._accelerator_connector = connector
        if module is not None:
            obj.strategy.connect(module)
        # Logged results keep the old strategy's reduction: a next fit would find each self.log "changed".
        for loop in (obj.fit_loop.epoch_loop, obj.validate_loop, obj.test_loop):
            loop._results.clear()
        return
    obj._connector = connector
    obj._strategy = connector.strategy
    obj._accelerator = connector.accelerator
    obj._precision = connector.strategy.precision


def _devices_of(strategy: Any) -> int:
    """How many processes a Lightning strategy trains on (1 for a single-device one)."""
    devices = getattr(strategy, "parallel_devices", None)
    return len(devices or [None]) * int(getattr(strategy, "num_nodes", 1) or 1)


def untrainable_left_unwrapped(original: Any) -> Any:
    """accelerate's ``Accelerator.prepare_model`` (an adapter of the table, installed by the patch table):
    a module with no parameter that trains is prepared as for evaluation, left out of DDP.

    On CPU ranks (``MULTI_CPU``) accelerate wraps every module it prepares in DDP, and DDP refuses
    one with nothing to average ("DistributedDataParallel is not needed when a module doesn't have
    any parameter that requires a gradient"): skorch's ``AccelerateMixin`` prepares its criterion,
    a loss with no parameters, so its ``fit`` failed on CPU ranks, under torchrun too. accelerate
    itself leaves such a module unwrapped on GPUs; the same here keeps its device placement and
    mixed precision (what ``evaluation_mode`` still applies).
    """
    if original is None:
        return original

    @functools.wraps(original)
    def prepare_model(self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        trains = any(parameter.requires_grad for parameter in model.parameters())
        return original(self, model, device_placement, evaluation_mode or not trains)

    return prepare_model


def fastai_world(objects: Iterable[Any], undo: Any) -> list[str]:
    """Make every fastai ``Learner`` of this cell fit over the ranks with auto mode's DistributedTrainer
    (the fastai row of :data:`TABLE`); ``undo`` (an ``ExitStack`` closed as the cell ends) takes it away.
    The class names of the Learners among ``objects`` (the kernel's, which get it now).

    fastai's ``Optimizer`` and ``DataLoader`` are not torch's, so auto mode's own preparation never sees
    them: a plain ``learn.fit`` would train alone on each rank, on all the data. fastai's own answer is
    its callback; a Learner the cell builds gets it from ``defaults.callbacks``, fastai's list of the
    callbacks every new Learner adds, which the fastai adapter (:func:`with_auto_trainer`, installed after
    this with the patch table's "framework world") replaces for this cell.
    """
    learner = sys.modules["fastai.learner"]
    trainer = _fastai_trainer()
    _TRAINER_OF_THE_CELL[:] = [trainer]  # for the defaults adapter, installed after this (nbtrain.rank.cell)
    undo.callback(_fastai_undo, trainer)
    found = []
    for obj in objects:
        if isinstance(obj, learner.Learner) and not any(isinstance(cb, trainer) for cb in obj.cbs):
            obj.add_cb(trainer())
            found.append(type(obj).__name__)
    return found


# Auto mode's trainer class while a cell that fastai_world prepared runs: only then does the defaults
# adapter add it, since only then is it taken out of the Learners again (_fastai_undo) as the cell ends.
_TRAINER_OF_THE_CELL: list[Any] = []


def with_auto_trainer(original: Any) -> Any:
    """fastai's ``defaults.callbacks`` (a patch factory's form: given the original) with auto mode's
    DistributedTrainer last, in a cell that :func:`fastai_world` prepared (else the original, kept): a new
    list, so that undoing the patch puts fastai's own list back as it was.

    >>> class Trainer: ...
    >>> own = ["TrainEvalCallback"]
    >>> with_auto_trainer(own) is own  # no cell of fastai_world's
    True
    >>> _TRAINER_OF_THE_CELL[:] = [Trainer]
    >>> with_auto_trainer(own) == ["TrainEvalCallback", Trainer], own
    (True, ['TrainEvalCallback'])
    >>> _TRAINER_OF_THE_CELL.clear()
    """
    if original is None or not _TRAINER_OF_THE_CELL or _TRAINER_OF_THE_CELL[0] in original:
        return original
    return [*original, *_TRAINER_OF_THE_CELL]


def _fastai_undo(trainer: Any) -> None:
    """Take auto mode's callback out of every Learner that got it (fastai's defaults are the patch table's)."""
    _TRAINER_OF_THE_CELL.clear()
    for callback in list(trainer.made):
        learn = callback.learn
        if learn is None:
            continue
        if callback.active:  # a fit that raised: its after_fit never ran
            callback.after_fit()
        learn.remove_cb(callback)
    trainer.made.clear()


@functools.cache
def _fastai_trainer() -> Any:
    """fastai's DistributedTrainer for auto mode: made by each Learner (no Accelerator until it fits),
    stepping aside for one of fastai's own, sharding through fastai's DistributedDL (its broadcast adapted, the
    patch table's "framework world")."""
    distributed = importlib.import_module("fastai.distributed")
    accelerate = importlib.import_module("accelerate")
    dist = importlib.import_module("torch.distributed")
    loader = distributed.DistributedDL

    def __init__(self: Any) -> None:
        self.sync_bn, self.kwargs, self.accelerator, self.active = False, {}, None, False
        type(self).made.append(self)

    def before_fit(self: Any) -> None:
        if any(isinstance(cb, distributed.DistributedTrainer) and cb is not self for cb in self.learn.cbs):
            return  # inside distrib_ctx: fastai's own callback distributes this fit
        if self.accelerator is None:
            self.accelerator = accelerate.Accelerator(cpu=dist.get_backend() != "nccl")
        distributed.DistributedTrainer.before_fit(self)
        self.active = True

    def after_fit(self: Any) -> None:
        if self.active:
            distributed.DistributedTrainer.after_fit(self)
            self.active = False

    def only_fitting(name: str) -> Any:
        def event(self: Any) -> None:
            if self.active:  # a validate() outside fit stays one rank's, on the whole set
                getattr(distributed.DistributedTrainer, name)(self)

        return event

    def _wrap_dl(self: Any, dl: Any) -> Any:
        return dl if isinstance(dl, distributed.DistributedDL) else loader(dl, device=self.learn.model.device)

    members = {"__init__": __init__, "before_fit": before_fit, "after_fit": after_fit, "_wrap_dl": _wrap_dl}
    members |= {name: only_fitting(name) for name in ("before_train", "before_validate")}
    return type("AutoDistributedTrainer", (distributed.DistributedTrainer,), {**members, "made": []})


def group_broadcast(original: Any) -> Any:
    """fastai's ``DistributedDL._broadcast`` (a patch factory's form: given the original), on the process
    group's device: fastai's own sends a CUDA tensor ("nccl only works with cuda tensors"), which CPU
    ranks (gloo) do not have, so ``distrib_ctx`` fails there."""
    if original is None:
        return original
    torch = importlib.import_module("torch")

    @functools.wraps(original)
    def _broadcast(self: Any, t: Any, rank: int) -> Any:
        nccl = torch.distributed.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        t = torch.tensor(t, dtype=torch.long, device=device)
        torch.distributed.broadcast(t, rank)
        return t.cpu().tolist()

    return _broadcast


def keeps_pass_books(loader: Any) -> bool:
    """Whether ``loader`` is one whose passes a framework keeps books of (:attr:`Framework.pass_books`)."""
    names = set(_mro(type(loader)))
    return any(not names.isdisjoint(framework.pass_books) for framework in TABLE)


def in_pass_books(loader: Any, batches: Iterable[Any]) -> Iterator[Any]:
    """``batches`` (a rank's share of ``loader``'s pass) read as ``loader``'s own pass would be: in its books.

    accelerate's ``DataLoaderShard`` registers each pass in ``GradientState`` (``begin()``), marks the
    last batch (``end_of_dataloader``, looking one batch ahead) and leaves at the end (``end()``);
    ``accelerator.accumulate()`` syncs and steps at that last batch and restarts its count. Auto mode
    reads a rank's share through a loader of its own: without these books no pass ever ends for
    accelerate. As accelerate's own, a pass left part-way (a ``break``, a raise) stays registered.

    >>> class Shard:
    ...     end_of_dataloader = False
    ...     def begin(self): print("begin")
    ...     def end(self): print("end")
    >>> shard = Shard()
    >>> [(b, shard.end_of_dataloader) for b in in_pass_books(shard, [1, 2])]
    begin
    end
    [(1, False), (2, True)]
    """
    loader.begin()
    batches = iter(batches)
    current = next(batches, _END)
    while current is not _END:
        following = next(batches, _END)
        loader.end_of_dataloader = following is _END
        yield current
        current = following
    loader.end()


_END = object()  # no batch: a pass's end
