"""Which framework distributes a cell, read from what the cell refers to (real framework packages)."""

from __future__ import annotations

import pytest

from nbtrain import frameworks
from nbtrain.rank.auto import stepaside

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
L = pytest.importorskip("lightning")


def _names(code: str, cell_globals: dict[str, object] | None = None, held: tuple[object, ...] = ()) -> list[str]:
    cell_globals = cell_globals or {}
    return [f.name for f in stepaside.frameworks_in(code, cell_globals, list(cell_globals), held)]


def test_a_framework_class_imported_in_the_cell_or_reached_through_a_module_is_found() -> None:
    assert _names("from transformers import Trainer\ntrainer = Trainer(model=m)\n") == ["transformers' Trainer"]
    assert _names("trainer = L.Trainer(devices=1)\n", {"L": L}) == ["Lightning"]
    assert _names("import lightning as pl\nfabric = pl.Fabric()\n") == ["Lightning"]


def test_an_accelerator_distributes_when_built_or_preparing_not_when_its_helpers_run() -> None:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    assert _names("a = Accelerator()\n", {"Accelerator": accelerate.Accelerator}) == ["accelerate"]
    assert _names("m, o = accelerator.prepare(m, o)\n", {"accelerator": accelerator}) == ["accelerate"]
    # A plain loop on objects prepared in the kernel: auto mode prepares it.
    assert _names("accelerator.backward(loss)\n", {"accelerator": accelerator}) == []


def test_an_object_held_in_a_global_counts_and_plain_code_finds_nothing() -> None:
    trainer = L.Trainer(devices=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    assert _names("run()\n", {}, held=(trainer,)) == ["Lightning"]
    assert _names("for x in loader:\n    loss = model(x).sum()\n", {"loader": [], "model": len}) == []
    assert _names("def broken(:\n", {"L": L}) == []  # a syntax error is the cell's to raise


def test_the_summary_sentence_names_each_framework() -> None:
    assert stepaside.note(frameworks.TABLE[1:3]) == (
        "accelerate and Lightning distributed the training over the ranks: "
        "auto mode wrapped no model and sharded no loader"
    )


@pytest.mark.parametrize(
    ("asked", "given"),
    [
        ({"devices": 1}, {"devices": 2, "num_nodes": 1, "strategy": "ddp"}),
        ({}, {"devices": 2, "num_nodes": 1, "strategy": "ddp"}),
        ({"devices": 2}, {}),
        ({"devices": 1, "strategy": "fsdp"}, {}),
        ({"devices": 1, "num_nodes": 2}, {}),
    ],
)
def test_only_a_trainer_asked_for_one_device_gets_the_world(
    asked: dict[str, object], given: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(stepaside.api, "world_size", lambda: 2)
    assert stepaside._world_for_one_device(asked) == given


def test_a_framework_the_rank_has_not_imported_yet_is_found_by_its_names_without_importing_it() -> None:
    """The cell imports it itself: importing it earlier would let its modules bind names before the patches
    that wait for its import (a tracker's) replace them."""
    import sys

    code = "from fastai.distributed import DistributedTrainer\nlearn.fit(1, cbs=DistributedTrainer())\n"
    assert "fastai" not in sys.modules
    assert _names(code) == ["fastai's distributed callback"]
    assert "fastai.distributed" not in sys.modules
