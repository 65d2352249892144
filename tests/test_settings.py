"""The run's settings on a rank (nbtrain.rank.machinery.settings): every setting reaches the ranks in one record.

Every option marked ``Option(rank=True)`` is a typed field of RankSettings. Outside a run the
reader holds the built-in defaults; in a run (real CPU ranks through ``nbtrain.start``) every
rank reads the run's --precision, --sync-batchnorm, --strategy, backend and threads from it,
what prepare does follows them, and none of them travels as an environment variable. Standby
ranks and the cluster engine are tested where they run (test_standby.py, tests/cluster/test_cluster.py).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import pytest
import torch

import nbtrain
from helpers.procs import finish
from nbtrain import options
from nbtrain.messages.events import RankSettings
from nbtrain.options import LaunchOptions
from nbtrain.rank.machinery import settings

pytestmark = pytest.mark.timeout(240)


def test_outside_a_run_the_settings_are_the_records_defaults():
    assert settings.current() == RankSettings()
    assert (settings.current().precision, settings.current().sync_batchnorm) == ("32-true", False)
    assert settings.current().model_wrapper == ""  # no run planned it: prepare decides by the world size


def test_every_option_the_ranks_are_told_is_a_typed_field_of_their_settings_with_its_default():
    # Adding an option the ranks read is its Option(rank=True), this field and the code that reads it:
    # the plan fills the field by name (nbtrain.planning.config.make_config), nothing lists it again.
    fields = {each.name: each for each in dataclasses.fields(RankSettings)}
    launch = {each.name: each for each in dataclasses.fields(LaunchOptions)}
    told = [name for name, info in options.described() if info.rank]
    assert told == ["precision", "sync_batchnorm"]
    for name in told:
        assert name in fields, f"Option(rank=True) {name!r} has no field in RankSettings: add it there"
        assert (fields[name].type, fields[name].default) == (launch[name].type, launch[name].default), name
    assert RankSettings(**LaunchOptions(precision="bf16").rank_options()).precision == "bf16-mixed"
    assert "__getattr__" not in vars(RankSettings) and dataclasses.is_dataclass(RankSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.current().precision = "64-true"  # type: ignore[misc]


def test_no_rank_module_reads_a_setting_from_the_start_message():
    # backend and debug_hold are on StartRun too, for the launcher (standby plans, holding a
    # failed rank); a rank reads them, as every setting, from nbtrain.rank.machinery.settings.
    rank_code = pathlib.Path(nbtrain.__file__).parent / "rank"
    for path in rank_code.rglob("*.py"):
        found = re.findall(r"start\.(backend|threads_per_rank|debug_hold)\b", path.read_text(encoding="utf-8"))
        assert not found, f"{path} reads start.{found[0]}: read settings.current().{found[0]} instead"


def test_adopted_settings_are_the_runs_whole():
    try:
        settings.adopt(RankSettings("fsdp", (1, 0), precision="bf16-true", threads_per_rank=3, debug_hold=60.0))
        told = settings.current()
        assert (told.model_wrapper, told.dp_devices, told.precision, told.sync_batchnorm) == (
            "fsdp", (1, 0), "bf16-true", False,
        )
        assert (told.backend, told.threads_per_rank, told.debug_hold) == ("gloo", 3, 60.0)
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
        "plan": (told.backend, told.debug_hold, told.threads_per_rank, torch.get_num_threads()),
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
    # The plan's part: gloo on CPU, no hold without a notebook's %nbtrain_debug, the threads the rank runs.
    backend, held, threads, running = seen["plan"]
    assert (backend, held) == ("gloo", None) and (threads is None or running == threads)
    assert (seen["norm"], (seen["output"], seen["weights"])) == (norm, dtypes)
    kernel = {name for name in os.environ if name.startswith("NBTRAIN_")}
    assert set(seen["variables"]) == (kernel - {"NBTRAIN_CONTROL_FD"}) | {"NBTRAIN_ROLE"}  # no option among them
