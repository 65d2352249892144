"""The kernel's device globals, read on a rank as the rank's own device.

Single-device code names its device once, in an early cell, as PyTorch's tutorials do:
``device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")``, then moves
every batch with ``x.to(device)``. On a rank whose device is another GPU (rank 1 on
``cuda:1``) those batches went to GPU 0 while the model trained on GPU 1, and the cell
failed with "Expected all tensors to be on the same device"; on the CPU ranks of a kernel
with a GPU they went to a GPU the run did not ask for. So for the cell, a shipped global
naming an accelerator device other than the rank's (a ``torch.device``, or a string with an
index such as ``"cuda:0"``) reads as the rank's device; the kernel's keeps its value. A
``"cpu"`` device stays the CPU (code moves results back to it), and ``torch.device("cuda")``
on a CUDA rank already means the rank's GPU. A string without an index (``"cuda"``, often
an autocast ``device_type``) is left as it is.

Example (outside a run the device is cuda:0 if present, else the CPU):
    >>> import torch
    >>> cell_globals = {"device": torch.device("cuda:0"), "name": "cuda:0", "home": torch.device("cpu")}
    >>> swapped = as_rank_devices(cell_globals, ["device", "name", "home"])
    >>> sorted(name for name, _, _ in swapped) == ([] if torch.cuda.is_available() else ["device", "name"])
    True
    >>> restore(cell_globals, swapped); cell_globals["device"], cell_globals["name"]
    (device(type='cuda', index=0), 'cuda:0')
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any

from nbtrain.rank import api

_INDEXED = re.compile(r"(cuda|xpu|mps):\d+")


def as_rank_devices(cell_globals: dict[str, Any], names: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """Rebind each of ``names`` that names another accelerator device to this rank's; (name, kernel's, rank's)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    mine = api.device()
    swapped = []
    for name in names:
        value = cell_globals.get(name)
        replacement = _as_rank_device(value, mine, torch)
        if replacement is not None:
            cell_globals[name] = replacement
            swapped.append((name, value, replacement))
    return swapped


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


def restore(cell_globals: dict[str, Any], swapped: Iterable[tuple[str, Any, Any]]) -> None:
    """The kernel's values back where the cell left the rank's (so the kernel's ``device`` comes back unchanged)."""
    for name, kernels, ranks in swapped:
        if cell_globals.get(name) is ranks:
            cell_globals[name] = kernels
