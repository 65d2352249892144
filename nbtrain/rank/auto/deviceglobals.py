"""The kernel's device globals, read on a rank as the rank's own device.

Single-device code names its device once, in an early cell, as PyTorch's tutorials do:
``device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")``, then moves
every batch with ``x.to(device)``. On a rank whose device is another GPU (rank 1 on
``cuda:1``) those batches went to GPU 0 while the model trained on GPU 1, and the cell
failed with "Expected all tensors to be on the same device"; on the CPU ranks of a kernel
with a GPU they went to a GPU the run did not ask for. So for the cell, a shipped global
naming an accelerator device other than the rank's (a ``torch.device``, or a string with an
index such as ``"cuda:0"``) reads as the rank's device; the kernel's keeps its value. So does
such a device one step inside a shipped global, where notebooks keep their settings: a
class used as a namespace (``class CFG: device = "cuda:0"``), an instance of a notebook class
(a trainer's or a model's ``self.device``), a dataclass, a ``SimpleNamespace`` or argparse
``Namespace``, a dict (``config["device"]``). A ``"cpu"`` device stays the CPU (code moves
results back to it), and ``torch.device("cuda")`` on a CUDA rank already means the rank's
GPU. A string without an index (``"cuda"``, often an autocast ``device_type``) is left as it is.

Example (outside a run the device is cuda:0 if present, else the CPU):
    >>> import torch
    >>> cell_globals = {"device": torch.device("cuda:0"), "cfg": {"device": "cuda:0"}, "home": torch.device("cpu")}
    >>> swapped = as_rank_devices(cell_globals, ["device", "cfg", "home"])
    >>> sorted(swap.key for swap in swapped) == ([] if torch.cuda.is_available() else ["device", "device"])
    True
    >>> restore(swapped); cell_globals["device"], cell_globals["cfg"]
    (device(type='cuda', index=0), {'device': 'cuda:0'})
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nbtrain.messages import reach
from nbtrain.rank import api

_INDEXED = re.compile(r"(cuda|xpu|mps):\d+")


@dataclass(frozen=True, eq=False)
class Swap:
    """A device put in for the cell: where (a mapping's key, or an attribute), the kernel's value, the rank's."""

    holder: Any
    key: Any
    attribute: bool
    kernels: Any
    ranks: Any

    def current(self) -> Any:
        """What the place holds now."""
        return getattr(self.holder, self.key, None) if self.attribute else self.holder.get(self.key)

    def put(self, value: Any) -> None:
        """Put ``value`` in the place."""
        if not self.attribute:
            self.holder[self.key] = value
        elif isinstance(self.holder, type):
            setattr(self.holder, self.key, value)
        else:  # a frozen dataclass too: this is the rank's copy, and the kernel's value goes back
            object.__setattr__(self.holder, self.key, value)


def as_rank_devices(cell_globals: dict[str, Any], names: Iterable[str]) -> list[Swap]:
    """Put this rank's device wherever ``names`` (or what they hold, one step in) name another accelerator device."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    mine = api.device()
    swapped = []
    for name in names:
        value = cell_globals.get(name)
        places = [(cell_globals, name, False, value), *_settings(value)]
        for holder, key, attribute, held in places:
            replacement = _as_rank_device(held, mine, torch)
            if replacement is not None:
                swap = Swap(holder, key, attribute, held, replacement)
                try:
                    swap.put(replacement)
                except (AttributeError, TypeError):
                    continue  # a holder that refuses it keeps the kernel's device
                swapped.append(swap)
    return swapped


def _settings(value: Any) -> list[tuple[Any, Any, bool, Any]]:
    """(holder, key, is an attribute, value) one step inside ``value``, where notebooks keep settings."""
    if isinstance(value, dict):
        return [(value, k, False, v) for k, v in itertools.islice(value.items(), reach.ITEMS) if isinstance(k, str)]
    if isinstance(value, type):
        if value.__module__ != "__main__":
            return []
        items = [(k, v) for k, v in vars(value).items() if not k.startswith("__")]
    elif reach.is_users_object(value) or reach.torch_kind(value) == "module":  # a model's self.device too
        items = list(reach.attributes(value).items())
    else:
        return []
    return [(value, k, True, v) for k, v in itertools.islice(items, reach.ITEMS)]


def _as_rank_device(value: Any, mine: Any, torch: Any) -> Any:
    """The rank's device in ``value``'s form, or None where ``value`` is no other accelerator device."""
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str) and _INDEXED.fullmatch(value):
        device = torch.device(value)
    else:
        return None
    other_type = device.type != mine.type
    other_index = device.index is not None and device.index != mine.index
    if device.type == "cpu" or not (other_type or other_index):
        return None
    return mine if isinstance(value, torch.device) else str(mine)


def restore(swapped: Iterable[Swap]) -> None:
    """The kernel's values back where the cell left the rank's (so the kernel's ``device`` comes back unchanged)."""
    for swap in swapped:
        if swap.current() is swap.ranks:
            swap.put(swap.kernels)
