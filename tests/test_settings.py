"""The run's settings on a rank (nbtrain.rank.machinery.settings): the launch options reach the ranks in one record.

Outside a run the reader holds the built-in defaults; in a run (real CPU ranks through
``nbtrain.start``) every rank reads the run's --precision, --sync-batchnorm and --strategy
from it, what prepare does follows them, and none of them travels as an environment
variable. Standby ranks and the cluster engine are tested where they run (test_standby.py,
tests/cluster/test_cluster.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import nbtrain
from helpers.procs import finish
from nbtrain.messages.events import RankSettings
from nbtrain.options import LaunchOptions
from nbtrain.rank.machinery import settings

pytestmark = pytest.mark.timeout(240)


def test_outside_a_run_the_settings_are_the_options_built_in_defaults():
    built_in = LaunchOptions()
    assert settings.current().options == built_in.rank_options()
    assert (settings.current().precision, settings.current().sync_batchnorm) == ("32-true", False)
    assert settings.current().model_wrapper == ""  # no run planned it: prepare decides by the world size


def test_adopted_settings_keep_what_they_say_and_take_the_defaults_for_the_rest():
    try:
        settings.adopt(RankSettings("fsdp", (1, 0), {"precision": "bf16-true"}))
        told = settings.current()
        assert (told.model_wrapper, told.dp_devices, told.precision, told.sync_batchnorm) == (
            "fsdp", (1, 0), "bf16-true", False,
        )
        with pytest.raises(AttributeError, match=r"'detect_anomalies' is not a launch option the ranks are told"):
            _ = told.detect_anomalies
    finally:
        settings.adopt(RankSettings())
    assert settings.current().precision == "32-true"


def _what_the_rank_was_told(model: torch.nn.Module) -> dict:
    """On a rank: the settings it reads, what prepare made of ``model`` by them, and its nbtrain variables."""
    from torch.distributed.fsdp import FSDPModule

    from nbtrain.rank.machinery import settings as rank_settings

    told = rank_settings.current()
    prepared = nbtrain.prepare(model)
    with torch.no_grad():
        out = prepared(torch.randn(4, 3))
    return {
        "told": (told.model_wrapper, told.precision, told.sync_batchnorm),
        "sharded": isinstance(prepared, FSDPModule),
        "norm": type(prepared[1]).__name__,
        "output": str(out.dtype),
        "weights": str(prepared[0].weight.dtype),
        "variables": sorted(name for name in os.environ if name.startswith("NBTRAIN_")),
    }


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize(
    ("options", "told", "sharded", "norm", "dtypes"),
    [
        ({"precision": "bf16-mixed", "sync_batchnorm": True}, ("ddp", "bf16-mixed", True), False, "SyncBatchNorm",
         ("torch.bfloat16", "torch.float32")),  # autocast; the weights stay float32
        ({"strategy": "fsdp"}, ("fsdp", "32-true", False), True, "FSDPBatchNorm1d", ("torch.float32",) * 2),
        ({"strategy": "ddp_spawn", "precision": "bf16-true"}, ("ddp", "bf16-true", False), False, "BatchNorm1d",
         ("torch.float32", "torch.bfloat16")),  # a fresh interpreter's rank; -true casts the output back
    ],
    ids=["bf16-mixed, sync BN", "fsdp", "spawned, bf16-true"],
)
def test_the_runs_options_reach_every_rank_in_its_settings_not_its_environment(
    launcher, options, told, sharded, norm, dtypes
):
    run = nbtrain.start(_what_the_rank_was_told, (_model(),), devices=2, accelerator="cpu", **options)
    seen = finish(run)
    assert seen["told"] == told and seen["sharded"] is sharded
    assert (seen["norm"], (seen["output"], seen["weights"])) == (norm, dtypes)
    kernel = {name for name in os.environ if name.startswith("NBTRAIN_")}
    assert set(seen["variables"]) == (kernel - {"NBTRAIN_CONTROL_FD"}) | {"NBTRAIN_ROLE"}  # no option among them
