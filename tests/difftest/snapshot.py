"""The kernel's state after a cell as a canonical, comparable description (imported inside the kernel).

Every object reachable from the user's globals gets a number in the order a deterministic walk
first meets it (names sorted; a module's parameters, buffers and sub-modules in their order; a
dict's items in order; an object's attributes sorted). A reference to an object already met is
written ``{"ref": n}``: two descriptions are equal in identity exactly when the same names and
paths lead to the same objects (``trainer.model is model``, tied weights, an optimizer's state
keyed by the live parameters). Tensors are described by dtype, shape, values (as floats) and
their gradient; an optimizer by its groups (parameters as references) and its state keyed by
parameter reference; RNG states by a digest.

>>> import torch
>>> net = torch.nn.Linear(1, 1, bias=False)
>>> shot = describe({"a": net, "b": net.weight})
>>> shot["names"]["b"]  # the same object as a's weight, met first under a
{'ref': 4}
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import types
from typing import Any

import torch

# Names the harness itself sets in the kernel (the batch size differs between a 2-rank run and its reference).
HARNESS = {"BS", "In", "Out", "exit", "quit", "get_ipython"}
# Attributes that hold sizes the reference changes (the 2-rank reference reads a 2x batch).
SIZED = {"batch_size"}
MODULE_SKIP = {
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_non_persistent_buffers_set",
    "_is_full_backward_hook",
    "_compiled_call_impl",
}


class _Walk:
    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # alive while walking, so id() stays unique

    def node(self, obj: Any, depth: int = 0) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, complex)):
            return {"value": repr(obj)} if isinstance(obj, float) and math.isnan(obj) else obj
        if id(obj) in self.seen:
            return {"ref": self.seen[id(obj)]}
        if depth > 12:
            return {"type": type(obj).__qualname__, "deep": True}
        number = len(self.seen)
        self.seen[id(obj)] = number
        self.keep.append(obj)
        out = {"id": number, "type": _type_name(obj)}
        out.update(self.body(obj, depth + 1))
        return out

    def body(self, obj: Any, depth: int) -> dict[str, Any]:
        if isinstance(obj, torch.Tensor):
            return _tensor(obj, self, depth)
        if isinstance(obj, torch.nn.Module):
            return {"modules": {key: self.node(value, depth) for key, value in _module_items(obj)}}
        if isinstance(obj, torch.optim.Optimizer):
            return _optimizer(obj, self, depth)
        if isinstance(obj, torch.utils.data.DataLoader):
            return {"dataset": self.node(obj.dataset, depth)}
        if isinstance(obj, torch.utils.data.Dataset) and hasattr(obj, "tensors"):
            return {"tensors": [self.node(t, depth) for t in obj.tensors]}
        if isinstance(obj, (list, tuple)):
            return {"items": [self.node(item, depth) for item in obj]}
        if isinstance(obj, dict):
            return {"items": [[_key(key), self.node(value, depth)] for key, value in obj.items()]}
        if isinstance(obj, (set, frozenset)):
            return {"items": sorted(repr(item) for item in obj)}
        if isinstance(obj, (types.FunctionType, type, types.ModuleType, types.BuiltinFunctionType, types.MethodType)):
            return {"name": getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))}
        if hasattr(obj, "state_dict") and not hasattr(obj, "__dict__"):
            return {"state": self.node(obj.state_dict(), depth)}
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            return {"attrs": {key: self.node(value, depth) for key, value in sorted(attrs.items()) if key not in SIZED}}
        return {"repr": repr(obj)[:80]}


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return (
        kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
    )


def _key(key: Any) -> Any:
    return key if isinstance(key, (str, int, float, bool)) or key is None else repr(key)


def _module_items(module: torch.nn.Module) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in sorted(vars(module).items()):
        if key in MODULE_SKIP or key.startswith("__"):
            continue
        items.append((key, value))
    return items


def _tensor(tensor: torch.Tensor, walk: _Walk, depth: int) -> dict[str, Any]:
    data = tensor.detach()
    out: dict[str, Any] = {
        "dtype": str(data.dtype),
        "shape": list(data.shape),
        "requires_grad": tensor.requires_grad,
        "values": data.double().flatten().tolist() if data.is_floating_point() else data.flatten().tolist(),
    }
    if tensor.grad is not None:
        out["grad"] = walk.node(tensor.grad, depth)
    return out


def _optimizer(optimizer: torch.optim.Optimizer, walk: _Walk, depth: int) -> dict[str, Any]:
    groups = []
    for group in optimizer.param_groups:
        groups.append({key: walk.node(value, depth) for key, value in sorted(group.items())})
    state = []
    for param, values in optimizer.state.items():
        state.append([walk.node(param, depth), {key: walk.node(value, depth) for key, value in sorted(values.items())}])
    return {"groups": groups, "state": state}


def _digest(data: Any) -> str:
    return hashlib.sha256(repr(data).encode() if not isinstance(data, bytes) else data).hexdigest()[:16]


def rng_states() -> dict[str, str]:
    """Digests of the torch, Python and numpy generators' states."""
    states = {"torch": _digest(torch.get_rng_state().numpy().tobytes()), "random": _digest(random.getstate())}
    try:
        import numpy

        states["numpy"] = _digest(repr(numpy.random.get_state()))
    except ImportError:
        pass
    return states


def saved_files(folder: str) -> dict[str, Any]:
    """The ``.pt`` files in ``folder``, each loaded and described."""
    files: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".pt"):
            files[name] = _Walk().node(torch.load(os.path.join(folder, name), weights_only=False))
    return files


def describe(namespace: dict[str, Any], folder: str | None = None) -> dict[str, Any]:
    """The canonical description of what ``namespace``'s user names reach (and of ``folder``'s saved files)."""
    walk = _Walk()
    names = {}
    for name in sorted(namespace):
        value = namespace[name]
        if name.startswith("_") or name in HARNESS or isinstance(value, types.ModuleType):
            continue
        names[name] = walk.node(value)
    return {"names": names, "rng": rng_states(), "files": saved_files(folder) if folder else {}}
