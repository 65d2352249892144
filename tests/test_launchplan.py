"""One plan for a run (nbtrain.kernel.launchplan): where it goes and with what, for cells and the API alike."""

from __future__ import annotations

import dataclasses

import pytest

from nbtrain.errors import ConfigurationError
from nbtrain.kernel import launchplan
from nbtrain.options import LaunchOptions
from nbtrain.planning import probe

NO_GPU = not probe.detect_gpus()


def test_a_run_on_this_machine_gets_its_launcher_and_the_options_config():
    options = LaunchOptions(devices=2, accelerator="cpu", precision="bf16", on_stop="discard", stop_grace=5)
    engine, cfg = launchplan.plan_run(options)
    assert engine is None  # this machine's launcher
    assert (cfg.world_size, cfg.backend, cfg.rank.precision) == (2, "gloo", "bf16-mixed")
    assert (cfg.on_stop, cfg.stop_grace, cfg.strategy.name) == ("discard", 5.0, "ddp_notebook")


@pytest.mark.skipif(not NO_GPU, reason="checks what a machine without GPU refuses")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"strategy": "dp"}, "strategy 'dp' (DataParallel) splits each batch over CUDA GPUs"),
        ({"precision": "16-mixed"}, "precision '16-mixed' cannot run on the cpu accelerator"),
        ({"backend": "nccl"}, "backend 'nccl' needs CUDA devices"),
        ({"devices": 100_000}, "devices=100000 is not valid: it asks for 100000 CPU processes"),
    ],
)
def test_what_this_machine_cannot_run_is_refused_by_the_plan_and_the_sessions_check_alike(changes, message):
    options = dataclasses.replace(LaunchOptions(devices=2, accelerator="cpu"), **changes)
    for check in (launchplan.plan_run, launchplan.check_options):
        with pytest.raises(ConfigurationError) as refused:
            check(options)
        assert message in str(refused.value), (check, str(refused.value))


def test_oversubscribing_is_an_option_of_the_plan():
    many = 4 * probe.cpu_count() + 1
    with pytest.raises(ConfigurationError, match="oversubscribe=True"):
        launchplan.plan_run(LaunchOptions(devices=many, accelerator="cpu"))
    _, cfg = launchplan.plan_run(LaunchOptions(devices=many, accelerator="cpu", oversubscribe=True))
    assert cfg.world_size == many


def test_a_cluster_run_is_checked_without_connecting_and_dp_is_refused_there():
    launchplan.check_options(LaunchOptions(cluster="ray://nowhere.invalid:10001", num_nodes=3))  # connects to nothing
    with pytest.raises(ConfigurationError, match="cannot span a cluster's nodes"):
        launchplan.check_options(LaunchOptions(cluster="ray", strategy="dp"))
    with pytest.raises(ConfigurationError, match="cannot span a cluster's nodes"):
        launchplan.plan_run(LaunchOptions(cluster="ray", strategy="dp"))
