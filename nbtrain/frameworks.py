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

import types
from collections.abc import Iterable
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
class Framework:
    """One framework that distributes a cell's training itself."""

    name: str  # as the summary says it
    tested: str  # the package and the versions tested
    # "module:Class" (an instance of it or of a subclass, or the class itself, in the cell),
    # "module:Class()" (the class itself: the cell builds one), "module:function" (the cell calls it).
    distributes: tuple[str, ...]
    adapted: str  # what nbtrain does for it besides stepping aside, and why
    singletons: tuple[Singleton, ...] = ()  # what it keeps per process

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
        # fastcore's @patch names the methods it adds to Learner by the class
        tuple(
            f"fastai.distributed:{f}" for f in ("Learner.distrib_ctx", "Learner.to_distributed", "DistributedTrainer")
        ),
        "nothing: its Accelerator finds the rank's world (on CPU ranks, given cpu=True)",
    ),
    Framework(
        "skorch with accelerate",
        "skorch 1.4",
        ("skorch.hf:AccelerateMixin",),
        "nothing: the Accelerator it is given finds the rank's world",
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
