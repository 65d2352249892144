"""Records and names both sides of a ``%%distributed`` cell share: the kernel and the ranks.

The kernel side (:mod:`nbtrain.kernel.namespace`) and the rank side (:mod:`nbtrain.rank.cell`)
agree here on what a rank sends back (:class:`CellResult`), on the persistent ids inside its
pickle, and on which names mean a cell distributes itself. Neither side imports the other:
both import this module, which imports only the standard library (torch is touched only
through ``sys.modules``, or when RNG states that came from torch are set).

>>> is_internal("_3"), is_internal("In"), is_internal("model"), is_internal("__compiled_fn_1_0f47")
(True, True, False, True)
>>> type_name(1.5), type_name(CellResult(b"", []))
('float', 'nbtrain.messages.records.CellResult')
"""

from __future__ import annotations

import array
import ctypes
import importlib
import random
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_INTERNAL = re.compile(
    r"^(__\w*__|_+|_i+|_i?\d+|_oh|_ih|_dh|In|Out|get_ipython|exit|quit|_exit_code"
    # torch.compile's own globals, put in the globals of the code it compiled: the
    # compiled code and the modules it reads, which belong to the process that compiled it.
    r"|__(compiled_fn|resume_at|import|builtins_dict|comprehension|gen_rand_values|warnings_warn_wrapper)_\w*)$"
)

# Persistent ids of a rank's result pickle (made by nbtrain.rank.cell, read by nbtrain.kernel.namespace).
STORAGE_TAG = "s"  # ("s", index into CellResult.storages, dtype or None)
KERNEL_TAG = "k"  # ("k", name): the kernel's own object shipped under that name
PART_TAG = "p"  # ("p", name, "param"|"buffer"|"module", dotted path) inside a shipped module
GLOBALS_TAG = "g"  # ("g",): the kernel's globals (a function defined in the cell)

# Names whose presence in a cell (or a function it calls) means it distributes itself by hand,
# as a torchrun script does: auto mode then steps aside. Frameworks that distribute themselves
# (accelerate, Lightning, transformers' Trainer) are known by their objects instead, on the ranks
# (nbtrain.frameworks), where auto mode still gives a one-device trainer the cell's world.
SELF_DISTRIBUTING = frozenset(
    {"DistributedDataParallel", "DDP", "fully_shard", "FullyShardedDataParallel", "FSDP", "DistributedSampler"}
)


def is_internal(name: str) -> bool:
    """True for names IPython or Python manage (``In``, ``_3``, ``__name__``...)."""
    return bool(_INTERNAL.match(name))


def type_name(value: Any) -> str:
    """The qualified name of ``value``'s type, as messages show it (builtins unqualified)."""
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"


def same(value: Any) -> Any:
    """Identity: a DDP wrapper that travels back is rebuilt as ``same(wrapper.module)``."""
    return value


def with_grad(param: Any, grad: Any) -> Any:
    """``param`` holding ``grad``: a parameter made in the cell comes back with the gradient the cell left
    on it (pickling a tensor keeps ``requires_grad`` but drops ``.grad``)."""
    param.grad = grad
    return param


def made(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A new ``cls`` object, as ``copyreg.__newobj__`` makes one: a value sent whole is rebuilt with it.

    >>> type(made(CopiedResult, (), {})).__name__
    'CopiedResult'
    """
    return cls.__new__(cls, *args, **kwargs)


@dataclass(frozen=True)
class CellResult:
    """What rank 0 sends back after the cell ran (tensors travel in ``storages``, zero-copy).

    ``payload`` unpickles (see :func:`nbtrain.kernel.namespace.decode_result`) to a dict with
    the keys ``modules`` {name: (state_dict, [(submodule path, training)], [(parameter path,
    requires_grad, grad or None)] or None where sharded)}, ``optimizers``
    and ``schedulers`` {name: state_dict}, ``contents`` {name: what the object holds, one
    step deep}, ``tensors`` / ``changed`` / ``bound`` {name: value}, ``places`` {label:
    nbtrain.messages.reach.Held}, ``display`` (a 1-tuple or None) and ``rng`` (RNG states or None).
    A name is a global's, or the label of an object inside one (``trainer.model``); the
    kernel's objects inside any value are references to them (``KERNEL_TAG``, ``PART_TAG``).
    """

    payload: bytes
    storages: list[Any]
    deleted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, why)
    prepared: list[tuple[str, str]] = field(default_factory=list)  # (name, what auto mode did)
    notes: list[str] = field(default_factory=list)
    loaders: list[tuple[str, str]] = field(default_factory=list)  # (name, what its passes read)
    # Rank 0's optimizer steps in a cell where it joined no collective: each rank trained alone
    # (nbtrain.rank.machinery.trainedalone); 0: it averaged, took no step, or could not tell.
    steps_alone: int = 0


class CopiedResult:
    """Rank 0's result once it is in the kernel's memory (filed under its run by either engine)."""

    def __init__(self, data: bytes, mapping: Any):
        self.data = data
        self.mapping = mapping


def rng_states() -> dict[str, Any] | None:
    """This process's RNG states (torch CPU, random, numpy), so ranks start where the kernel is.

    None when torch was never imported here (no torch state to carry).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    torch_state = torch.get_rng_state()  # a uint8 tensor, sent as bytes: no tensor, no shared-memory file
    torch_bytes = ctypes.string_at(torch_state.data_ptr(), torch_state.numel())
    states: dict[str, Any] = {"torch": torch_bytes, "random": _packed(random.getstate())}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def _packed(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """random's state with its 625 words as one bytes: a cell's payload pickles (and its ranks
    unpickle) one object instead of 625, about a millisecond on each side of every launch."""
    version, words, gauss_next = state
    return version, array.array("I", words).tobytes(), gauss_next


def _unpacked(state: tuple[Any, ...]) -> tuple[Any, ...]:
    version, words, gauss_next = state
    return version, tuple(array.array("I", words)), gauss_next


def set_rng_states(states: Mapping[str, Any] | None) -> None:
    """Start this process's RNGs where :func:`rng_states` left another's."""
    if not states:
        return

    # States that hold a torch state came from a process with torch: it is installed here too.
    torch = importlib.import_module("torch")
    torch.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
    random.setstate(_unpacked(states["random"]))
    if "numpy" in states and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(states["numpy"])
