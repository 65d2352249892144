"""What the kernel and the ranks share about a cell (nbtrain.messages.records)."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from nbtrain.messages import records


@pytest.mark.parametrize(
    "name", ["In", "Out", "_", "__", "___", "_3", "_i", "_ii", "_i7", "_oh", "_dh", "__name__", "get_ipython", "exit"]
)
def test_names_ipython_and_python_manage_are_internal(name):
    assert records.is_internal(name)


@pytest.mark.parametrize("name", ["model", "_private", "x_1", "In2", "i7", "_x3", "output"])
def test_the_users_names_are_not_internal(name):
    assert not records.is_internal(name)


def test_type_names_are_qualified_except_for_builtins_and_the_notebook():
    class Local:
        pass

    Local.__module__ = "__main__"
    assert records.type_name([]) == "list" and records.type_name(Local()) == Local.__qualname__
    assert records.type_name(torch.nn.Linear(1, 1)) == "torch.nn.modules.linear.Linear"


def test_rng_states_carry_torch_random_and_numpy_to_another_process_state():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    states = records.rng_states()
    assert states is not None and set(states) == {"torch", "random", "numpy"}
    # As bytes: cheap to pickle, and no tensor (a cell that ships none needs no shared-memory file).
    assert isinstance(states["torch"], bytes) and isinstance(states["random"][1], bytes)
    expected = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    records.set_rng_states(states)
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expected


def test_without_torch_there_is_no_state_to_carry_and_none_changes_nothing():
    code = "import random, sys, nbtrain.messages.records as r; s = random.getstate(); r.set_rng_states(None); "
    code += "print(r.rng_states(), random.getstate() == s, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == "None True False\n"


def test_a_cell_result_is_a_frozen_record_with_empty_reports_by_default():
    result = records.CellResult(b"payload", [])
    assert (result.deleted, result.skipped, result.prepared, result.notes, result.loaders) == ([], [], [], [], [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.payload = b""  # type: ignore[misc]  # the assignment a frozen record refuses


def test_the_self_distributing_names_are_those_of_ddp_fsdp_and_their_sampler():
    assert {"DistributedDataParallel", "DDP", "fully_shard", "DistributedSampler"} <= records.SELF_DISTRIBUTING
    assert "DataLoader" not in records.SELF_DISTRIBUTING
    assert records.same(records) is records
