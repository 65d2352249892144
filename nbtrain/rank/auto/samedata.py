"""Ranks that trained on the same batches: the one-device result, at the work of several.

Auto mode shards the DataLoaders a cell reads. A loop that makes its batches itself (it
slices tensors, ``x[i:i + 64]``, as introductory tutorials do, or draws ``torch.randn``
data, a GAN's noise among them, the same on every rank since each starts from the
kernel's random state) gives every rank the same batches: DDP averages identical
gradients, and the run computes the one-device result on every rank, with no error and
no gain. So at a DDP model's first training forward (:func:`note_first_inputs`) each rank
adds up its inputs into one number, and one all-reduce (the maximum of that number and of
its negation, left on the device: no sync in the loop) tells at the cell's end
(:func:`same_data_notes`) whether every rank's was the same. The summary then says so and
what to change.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbtrain.rank import api
from nbtrain.rank.auto import ledger
from nbtrain.rank.machinery import trainedalone


def note_first_inputs(ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Start the comparison of ``ddp``'s first training inputs over the ranks (one all-reduce, every rank)."""
    torch = ledger.torch_module()
    tensors = [t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor) and t.numel()]
    extremes = _compared(tensors, ddp.process_group)
    fallback = f"the {type(ddp.module).__name__} model"
    ledger.cell_registry().first_inputs.append(((ddp, ddp.module), fallback, extremes, bool(tensors)))


def compare_first_gradients(gradients: list[Any]) -> Any:
    """Start the comparison of a model's first gradients over the ranks (one all-reduce, every rank):
    for a model no DDP wraps, the same gradients on every rank mean the same batch. What it returns
    goes to :func:`note_first_gradients` (it may be started before the model is known)."""
    return _compared([g for g in gradients if g is not None and g.numel()], None)


def note_first_gradients(models: tuple[Any, ...], fallback: str, compared: Any) -> None:
    """Note the comparison :func:`compare_first_gradients` started for the model: ``models`` are looked
    for among the cell's globals to name it, else ``fallback`` names it."""
    ledger.cell_registry().first_inputs.append((models, fallback, compared, True))


def _compared(tensors: list[Any], group: Any) -> Any:
    """[max over ranks of s, max of -s], s the tensors' sum weighted by place, left on the device."""
    torch = ledger.torch_module()
    device = api.device()
    exact = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    summed = torch.zeros((), dtype=exact, device=device)
    for place, tensor in enumerate(tensors, 1):  # weighted by place: tensors that differ anywhere differ in the sum
        within = exact if tensor.device.type != "mps" else torch.float32
        summed += place * tensor.detach().sum(dtype=within).to(device=device, dtype=exact)  # no copy
    extremes = torch.stack([summed, -summed])
    with trainedalone.not_gradients():  # a comparison of batches, not an average of gradients
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    return extremes


def same_data_notes(cell_globals: Mapping[str, Any]) -> list[str]:
    """One note per model every rank fed the same first training batch (read at the cell's end).

    A model is named as the cell's globals name it (``G``), else by its class. Nothing is
    said where a loader could not be sharded: its own note says every rank reads all of it.
    """
    registry = ledger.cell_registry()
    if registry.unsharded:  # a loader read whole by every rank: its own note says why and what to do
        return []
    notes = []
    for models, fallback, extremes, any_tensor in registry.first_inputs:
        largest, negated_smallest = extremes.tolist()
        if any_tensor and largest == -negated_smallest:
            ranks = api.world_size()
            name = next((f"`{n}`" for n, v in cell_globals.items() if any(v is m for m in models)), None)
            model = name or fallback
            notes.append(
                f"every rank fed {model} the same first training batch, so the {ranks} "
                f"ranks trained it on the same data: the one-device result at {ranks} times the work. A loop that "
                "makes its batches itself (slicing tensors, or drawing them with torch.randn: each rank starts from "
                "the kernel's random state) gets no share of them: put the data in a DataLoader, which auto mode "
                "shards (made before the cell or in it), or make each rank's differ by nbtrain.rank() "
                "(torch.manual_seed(seed + nbtrain.rank()) for random batches)."
            )
    return notes
