"""What prepare prepared on this rank (nbtrain.rank.auto.ledger): the registry and the strategy's wrapper.

Pure: one process, no process group; what needs ranks is tested with the preparers
(test_wrapping.py, test_boundoptimizers.py, test_preparedloaders.py) and test_prepare.py.
"""

from __future__ import annotations

import collections

import torch

from nbtrain.messages.events import RankSettings
from nbtrain.rank.auto import ledger
from nbtrain.rank.machinery import settings


def test_configure_starts_a_fresh_registry():
    ledger.configure()
    first = ledger.cell_registry()
    first.notes.append("a note of the last cell")
    ledger.configure()
    assert ledger.cell_registry() is not first and ledger.notes() == []


def test_the_registry_maps_originals_to_prepared_objects_both_ways():
    ledger.configure()
    original, prepared, stranger = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    ledger.cell_registry().remember(original, prepared)
    assert ledger.prepared_for(original) is prepared
    assert ledger.prepared_for(prepared) is prepared  # preparing the prepared one changes nothing
    assert ledger.prepared_for(stranger) is None


def test_the_wrapper_comes_from_the_runs_settings_else_the_world_size():
    try:
        settings.adopt(RankSettings("ddp_sharded"))
        assert ledger.model_wrapper() == "ddp_sharded"
    finally:
        settings.adopt(RankSettings())
    assert ledger.model_wrapper() == "none"  # a run nbtrain did not plan, of one process
    assert not ledger.in_process_group() and not ledger.one_rank()


def test_to_device_moves_tensors_inside_lists_tuples_named_tuples_and_dicts():
    Pair = collections.namedtuple("Pair", "x y")
    batch = [torch.zeros(1), (torch.ones(1), "label"), Pair(torch.ones(2), 3), {"mask": torch.zeros(2)}]
    moved = ledger.to_device(batch, torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1][0].device.type == "meta" and moved[1][1] == "label"
    assert type(moved[2]) is Pair and moved[2].x.device.type == "meta" and moved[2].y == 3
    assert moved[3]["mask"].device.type == "meta"
