"""torch's process-wide settings, as the kernel has them, set the same on each run's ranks.

A notebook sets torch's switches in an early cell (``torch.set_default_dtype(torch.float64)``,
``torch.backends.cudnn.benchmark = True``, ``torch.use_deterministic_algorithms(True)``,
``torch.set_float32_matmul_precision("high")``) and expects every later cell to run with
them, as its RNG state does. A rank is a fresh process at torch's defaults: a float64
notebook's cell failed there on ``mat1 and mat2 must have the same dtype``, and TF32 or
cuDNN's autotuner were off. So the kernel sends the settings it changed from torch's
defaults with each run (:func:`changed_from_defaults`, a few microseconds, nothing when torch was never
imported), and each rank sets them before the run's code (:func:`take_on`).

Carried: the default dtype, the default device (where the rank's device is of its type),
deterministic algorithms (and warn-only), anomaly detection, cuDNN's ``benchmark``,
``deterministic`` and ``enabled``, and TF32 for float32 matmuls. Not carried: the thread
count (each rank's is set from its share of the cores), grad mode (per thread), cuDNN's TF32
(on by default; torch reads a change of it back inconsistently across its two APIs).

TF32 is read through ``torch.backends.cuda.matmul.fp32_precision``, which reads either way
of setting it without complaint (reading ``allow_tf32`` after a setting made the newer way
raises), and set on the rank with ``torch.set_float32_matmul_precision``, which both read back.

Example (torch at its defaults: nothing to carry):
    >>> changed_from_defaults()
    {}
    >>> take_on({})  # nothing to set
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

# name -> torch's default, for the settings read and set as plain flags.
_CUDNN_FLAGS = {"benchmark": False, "deterministic": False, "enabled": True}


def changed_from_defaults() -> dict[str, Any]:
    """The settings this process (the kernel) changed from torch's defaults, as plain values."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    changed: dict[str, Any] = {}
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    if dtype != "float32":
        changed["default_dtype"] = dtype
    device = torch.get_default_device().type
    if device != "cpu":
        changed["default_device"] = device
    if torch.are_deterministic_algorithms_enabled():
        changed["deterministic_algorithms"] = (True, torch.is_deterministic_algorithms_warn_only_enabled())
    if torch.is_anomaly_enabled():
        changed["detect_anomaly"] = True
    for name, default in _CUDNN_FLAGS.items():
        value = getattr(torch.backends.cudnn, name)
        if value != default:
            changed[f"cudnn.{name}"] = value
    matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")  # "ieee", or "tf32": TF32 allowed
    if matmul == "tf32":
        changed["tf32_matmul"] = True
    return changed


def take_on(settings: Mapping[str, Any], device_type: str = "cpu") -> None:
    """Set ``settings`` (the kernel's :func:`changed_from_defaults`) here, a rank on ``device_type``."""
    if not settings:
        return
    # deferred: start-up time (torch)
    import torch

    for name, value in settings.items():
        if name == "default_dtype":
            torch.set_default_dtype(getattr(torch, value))
        elif name == "default_device":
            if value == device_type:  # "cuda" on a CUDA rank: its own device, set already
                torch.set_default_device(value)
        elif name == "deterministic_algorithms":
            torch.use_deterministic_algorithms(value[0], warn_only=value[1])
        elif name == "detect_anomaly":
            torch.autograd.set_detect_anomaly(value)
        elif name.startswith("cudnn."):
            setattr(torch.backends.cudnn, name.removeprefix("cudnn."), value)
        elif name == "tf32_matmul":
            torch.set_float32_matmul_precision("high" if value else "highest")

