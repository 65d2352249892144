"""nbtrain.planning.config: strategies, backends, timeouts, threads per rank, rank specs (pure, no processes)."""

from __future__ import annotations

import math

import pytest

from nbtrain.errors import ConfigurationError
from nbtrain.messages.events import RankSpec
from nbtrain.planning import config
from nbtrain.planning.config import (
    backend_for,
    intra_op_threads,
    make_config,
    resolve_strategy,
    user_thread_count,
    validate_timeout,
)
from nbtrain.planning.deviceplan import DevicePlan


@pytest.mark.parametrize(
    "name, start_method, wrapper",
    [("ddp_notebook", "fork", "ddp"), ("ddp_spawn", "spawn", "ddp"), ("fsdp", "fork", "fsdp")],
)
def test_strategies(name, start_method, wrapper):
    strategy = resolve_strategy(name, 2)
    assert (strategy.name, strategy.start_method, strategy.model_wrapper) == (name, start_method, wrapper)
    assert strategy.when_to_use


def test_strategy_names_ignore_case_and_spaces():
    assert resolve_strategy("  DDP_Spawn ", 2) is config.STRATEGIES["ddp_spawn"]


def test_auto_is_ddp_notebook_for_many_ranks_and_a_plain_worker_for_one():
    assert resolve_strategy("auto", 2) is config.STRATEGIES["ddp_notebook"]
    single = resolve_strategy("auto", 1)
    assert (single.start_method, single.model_wrapper) == ("fork", "none")


@pytest.mark.parametrize("name", ["ddp_fork", "", "deepspeed", None])
def test_unknown_strategy_lists_the_valid_ones(name):
    with pytest.raises(ConfigurationError) as caught:
        resolve_strategy(name, 2)
    message = str(caught.value)
    assert repr(name) in message
    for valid in ("ddp_notebook", "ddp_spawn", "fsdp", "auto"):
        assert valid in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("accelerator, backend", [("cpu", "gloo"), ("mps", "gloo"), ("cuda", "nccl")])
def test_default_backend_per_accelerator(accelerator, backend):
    assert backend_for(accelerator) == backend


@pytest.mark.parametrize("requested", ["gloo", "mpi", "cpu:gloo,cuda:nccl"])
def test_requested_backend_is_kept(requested):
    assert backend_for("cpu", requested) == requested


def test_nccl_can_be_requested_on_cuda_only():
    assert backend_for("cuda", "nccl") == "nccl"
    with pytest.raises(ConfigurationError, match="needs CUDA"):
        backend_for("cpu", "nccl")


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ConfigurationError) as caught:
        backend_for("cpu", "ucc")
    assert "'ucc'" in str(caught.value)
    for valid in config.BACKENDS:
        assert valid in str(caught.value)


@pytest.mark.parametrize("timeout, expected", [(None, None), (5, 5.0), (0.25, 0.25), (math.inf, math.inf)])
def test_valid_timeouts(timeout, expected):
    result = validate_timeout(timeout)
    assert result == expected
    assert result is None or isinstance(result, float)


@pytest.mark.parametrize("timeout", [0, -1, -0.5, math.nan, True, "10", [1]])
def test_invalid_timeouts(timeout):
    with pytest.raises(ConfigurationError) as caught:
        validate_timeout(timeout)
    assert repr(timeout) in str(caught.value)


@pytest.mark.parametrize(
    "cores, ranks, environ, expected",
    [
        (8, 2, {}, 4),
        (2, 2, {}, 1),
        (2, 1, {}, 2),
        (2, 4, {}, 1),
        (7, 2, {}, 3),
        (1, 1, {}, 1),
        (4, 0, {}, 4),
        (8, 2, {"OMP_NUM_THREADS": "3"}, None),
        (8, 2, {"OMP_NUM_THREADS": ""}, 4),  # set but empty: as if unset
    ],
)
def test_threads_per_rank(cores, ranks, environ, expected):
    assert intra_op_threads(cores, ranks, environ) == expected


def test_rank_specs_on_cpu():
    cfg = make_config(DevicePlan("cpu", (0, 1, 2)), strategy="ddp_notebook", timeout=None)
    assert cfg.world_size == 3 and cfg.backend == "gloo" and cfg.timeout is None
    assert cfg.rank_specs() == tuple(RankSpec(r, r, 3, "cpu", None) for r in range(3))


def test_rank_specs_on_chosen_gpus():
    cfg = make_config(DevicePlan("cuda", (1, 3)), strategy="fsdp", timeout=30)
    assert (cfg.backend, cfg.timeout, cfg.strategy.model_wrapper) == ("nccl", 30.0, "fsdp")
    assert cfg.rank_specs() == (RankSpec(0, 0, 2, "cuda", 1), RankSpec(1, 1, 2, "cuda", 3))


def test_make_config_checks_every_setting():
    plan = DevicePlan("cpu", (0, 1))
    with pytest.raises(ConfigurationError):
        make_config(plan, strategy="nope", timeout=None)
    with pytest.raises(ConfigurationError):
        make_config(plan, strategy="ddp_notebook", timeout=-1)
    with pytest.raises(ConfigurationError):
        make_config(plan, strategy="ddp_notebook", timeout=None, backend="nccl")
    assert make_config(plan, strategy="auto", timeout=None, backend="gloo").strategy.name == "ddp_notebook"


@pytest.mark.parametrize(("value", "threads"), [("4", 4), ("0", 1), ("", None), ("many", None)])
def test_the_users_omp_num_threads_is_read_leniently(value, threads):
    assert user_thread_count({"OMP_NUM_THREADS": value}) == threads


def test_ranks_sharing_a_gpu_get_gloo_and_nccl_is_refused_with_what_to_do():
    from nbtrain.errors import ConfigurationError
    from nbtrain.planning.config import make_config
    from nbtrain.planning.deviceplan import DevicePlan

    shared = DevicePlan("cuda", (0, 0))
    assert make_config(shared, strategy="ddp_notebook", timeout=None).backend == "gloo"
    assert make_config(DevicePlan("cuda", (0, 1)), strategy="ddp_notebook", timeout=None).backend == "nccl"
    with pytest.raises(ConfigurationError) as refused:
        make_config(shared, strategy="ddp_notebook", timeout=None, backend="nccl")
    assert str(refused.value) == (
        "devices '0,0' puts more than one rank on GPU 0, and backend 'nccl' cannot run that: nccl refuses a GPU "
        "that two ranks of its group share. Use backend='gloo' (--backend gloo), which can (slower; meant for "
        "testing multi-rank code on one GPU), or give each rank its own GPU."
    )


def test_the_ranks_are_told_the_wrapper_and_the_options_they_read_in_one_record():
    from nbtrain.messages.events import RankSettings

    given = {"precision": "bf16", "sync_batchnorm": True}
    cfg = make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None, rank_options=given)
    assert cfg.rank == RankSettings("ddp", (), "gloo", precision="bf16-mixed", sync_batchnorm=True)
    assert given["precision"] == "bf16"  # the caller's mapping is left as it was
    single = make_config(DevicePlan("cpu", (0,)), strategy="auto", timeout=None)
    assert single.rank == RankSettings("none")  # auto over one rank: no wrapper, the rest at the built-in defaults
    with pytest.raises(TypeError, match="example"):  # an option the ranks are told is a field of their settings
        make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None, rank_options={"example": 7})
    with pytest.raises(ConfigurationError, match="precision '16-mixed' cannot run on the cpu accelerator"):
        make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None, rank_options={"precision": "16"})
