"""The session's defaults for ``%%distributed`` cells without flags (nbtrain.kernel.defaults).

Setting them merges with what was set before, checks the result against this machine and
changes nothing when it is refused; the messages name the value and what to pass instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nbtrain import options
from nbtrain.errors import ConfigurationError
from nbtrain.kernel.defaults import get_defaults, reset_defaults, set_defaults
from nbtrain.livestate import STALL_SECONDS
from nbtrain.options import LaunchOptions
from nbtrain.planning import probe

NO_GPU = not probe.detect_gpus()


@pytest.fixture(autouse=True)
def built_in_defaults() -> Iterator[None]:
    reset_defaults()
    yield
    reset_defaults()


def test_the_built_in_defaults_use_every_device_of_the_best_accelerator():
    assert get_defaults() == LaunchOptions("auto", "auto", "ddp_notebook", None, STALL_SECONDS, "local", 1)
    assert get_defaults().magic_line() == "%%distributed --devices auto --accelerator auto --strategy ddp_notebook"


def test_settings_not_passed_keep_their_value():
    set_defaults(devices=2, accelerator="cpu")
    merged = set_defaults(timeout=600)
    assert merged == get_defaults()
    assert (merged.devices, merged.accelerator, merged.timeout, merged.strategy) == ("2", "cpu", 600.0, "ddp_notebook")


def test_a_refused_setting_changes_nothing():
    before = set_defaults(devices=2, accelerator="cpu")
    with pytest.raises(ConfigurationError):
        set_defaults(devices=1, strategy="no-such-strategy")
    assert get_defaults() is before


def test_reset_goes_back_to_the_built_in_defaults():
    set_defaults(devices=1, accelerator="cpu", timeout=5, stall_warning=None)
    assert reset_defaults() == LaunchOptions() == get_defaults()


def test_defaults_are_a_frozen_record():
    with pytest.raises(AttributeError):
        get_defaults().devices = "4"  # type: ignore[misc]  # frozen: what the test checks
    assert set(get_defaults().as_dict()) >= {  # these stay; an option added later joins them
        "devices",
        "accelerator",
        "strategy",
        "timeout",
        "stall_warning",
        "cluster",
        "num_nodes",
        "precision",
        "sync_batchnorm",
        "standby_idle",
        "backend",
        "debug_hold",
        "on_stop",
        "stop_grace",
        "oversubscribe",
    }


def test_debug_hold_takes_seconds_or_none():
    previous = get_defaults()
    try:
        assert set_defaults(debug_hold=120).debug_hold == 120.0
        assert set_defaults(debug_hold="none").debug_hold is None
        assert set_defaults(debug_hold=None).debug_hold is None
        with pytest.raises(ConfigurationError, match=r"debug_hold=-5 is not valid: give a positive number of seconds"):
            set_defaults(debug_hold=-5)
    finally:
        set_defaults(**previous.as_dict())


def test_on_stop_and_its_grace_are_session_defaults_checked_when_set():
    assert set_defaults(on_stop="Discard", stop_grace=5).on_stop == "discard"
    assert get_defaults().magic_line().endswith("--on-stop discard") and get_defaults().stop_grace == 5.0
    with pytest.raises(ConfigurationError, match="on_stop='later' is not valid: pass 'keep'"):
        set_defaults(on_stop="later")
    with pytest.raises(ConfigurationError, match="stop_grace=0 is not valid"):
        set_defaults(stop_grace=0)
    reset_defaults()


@pytest.mark.parametrize(
    ("devices", "text"),
    [
        (2, "2"),
        (-1, "-1"),
        ("auto", "auto"),
        (" 3 ", "3"),
        ([1], "1,"),
        ((0, 2), "0,2"),
        (range(2), "0,1"),
        (None, "auto"),
    ],
)
def test_devices_are_kept_as_the_flag_would_write_them(devices, text):
    assert options.devices_text(devices) == text


@pytest.mark.parametrize("devices", [True, 2.0, "", " ", "0, 2"])
def test_devices_of_no_valid_form_are_refused_with_the_forms_that_are(devices):
    with pytest.raises(ConfigurationError) as caught:
        set_defaults(devices=devices)
    assert (
        str(caught.value) == f"devices={devices!r} is not valid: pass a number of devices, -1, 'auto' or GPU indices."
    )


def test_too_many_cpu_processes_are_refused_with_how_many_fit():
    limit = 4 * probe.cpu_count()
    with pytest.raises(
        ConfigurationError, match=rf"devices={limit + 1} is not valid: .* use at most {limit} .* oversubscribe=True"
    ):
        set_defaults(devices=limit + 1, accelerator="cpu")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_gpu_indices_on_a_machine_without_gpu_explain_that_devices_is_a_count():
    with pytest.raises(
        ConfigurationError, match=r"devices='0,2' is not valid: it lists device indices, which select GPUs"
    ):
        set_defaults(devices="0,2", accelerator="cpu")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_what_to_check_or_use_instead():
    with pytest.raises(ConfigurationError, match=r"accelerator='cuda' needs a GPU, .* or use accelerator='cpu'"):
        set_defaults(accelerator="cuda")


def test_the_accelerator_is_normalised_and_an_unknown_one_lists_the_choices():
    assert set_defaults(accelerator=" CPU ").accelerator == "cpu"
    with pytest.raises(
        ConfigurationError,
        match=r"accelerator='tpu' is not supported; choose one of 'auto', 'cpu', 'cuda', 'gpu', 'mps'",
    ):
        set_defaults(accelerator="tpu")


def test_a_strategy_is_normalised_and_an_unknown_one_lists_the_available_ones():
    assert set_defaults(strategy=" DDP_SPAWN ").strategy == "ddp_spawn"
    with pytest.raises(
        ConfigurationError, match=r"unknown strategy 'fsdp9'\. Available strategies: ddp_notebook, ddp_spawn, "
    ):
        set_defaults(strategy="fsdp9")


@pytest.mark.parametrize(("timeout", "seconds"), [(600, 600.0), (90.5, 90.5), (None, None)])
def test_a_timeout_is_seconds_or_none(timeout, seconds):
    assert set_defaults(timeout=timeout).timeout == seconds


@pytest.mark.parametrize(
    ("timeout", "why"),
    [(-1, "must be positive"), (0, "must be positive"), ("90", "must be a number of seconds or None")],
)
def test_a_bad_timeout_is_refused(timeout, why):
    with pytest.raises(ConfigurationError, match=f"timeout {why}"):
        set_defaults(timeout=timeout)


@pytest.mark.parametrize(("seconds", "kept"), [(5, 5.0), ("2.5", 2.5), (None, None)])
def test_the_stall_warning_is_seconds_or_none(seconds, kept):
    assert set_defaults(stall_warning=seconds).stall_warning == kept


@pytest.mark.parametrize("seconds", [0, -3, float("inf"), "soon", True])
def test_a_bad_stall_warning_is_refused_with_what_to_give(seconds):
    with pytest.raises(ConfigurationError) as caught:
        set_defaults(stall_warning=seconds)
    assert (
        str(caught.value)
        == f"stall_warning={seconds!r} is not valid: give a positive number of seconds, or None for no warning."
    )


@pytest.mark.parametrize(
    ("cluster", "kept"),
    [(None, "local"), (" LOCAL ", "local"), ("ray", "ray"), ("ray://10.0.0.1:10001", "ray://10.0.0.1:10001")],
)
def test_a_cluster_is_local_ray_or_an_address(cluster, kept):
    assert set_defaults(cluster=cluster).cluster == kept  # setting it connects to nothing


@pytest.mark.parametrize("cluster", ["", "ray ://x", "a\tb"])
def test_a_cluster_that_is_no_name_or_address_is_refused(cluster):
    with pytest.raises(
        ConfigurationError, match=r"is not valid: pass 'local', 'ray', or a Ray address such as 'ray://host:10001'"
    ):
        set_defaults(cluster=cluster)


def test_several_nodes_need_a_cluster():
    with pytest.raises(ConfigurationError, match=r"num_nodes=2 needs a cluster: .* Pass cluster='ray'"):
        set_defaults(num_nodes=2)
    assert set_defaults(cluster="ray", num_nodes=2).num_nodes == 2
    with pytest.raises(ConfigurationError, match="num_nodes must be a positive whole number of nodes, not 0"):
        set_defaults(num_nodes=0)


def test_the_magic_line_asks_for_exactly_the_defaults():
    assert set_defaults(devices=-1, accelerator="cpu", timeout=90.5).magic_line() == (
        "%%distributed --devices -1 --accelerator cpu --strategy ddp_notebook --timeout 90.5"
    )
    reset_defaults()
    line = set_defaults(stall_warning=None, cluster="ray://h:10001", num_nodes=3).magic_line()
    assert line.endswith("--stall-warning none --cluster ray://h:10001 --num-nodes 3")
    assert (
        set_defaults(stall_warning=12).magic_line().endswith("--stall-warning 12 --cluster ray://h:10001 --num-nodes 3")
    )


def test_precision_backend_and_batchnorm_sync_are_session_defaults_too():
    settings = set_defaults(devices=2, accelerator="cpu", precision="bf16", backend="GLOO", sync_batchnorm=True)
    assert (settings.precision, settings.backend, settings.sync_batchnorm) == ("bf16-mixed", "gloo", True)
    assert settings.magic_line() == (
        "%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook"
        " --precision bf16-mixed --sync-batchnorm --backend gloo"
    )
    assert set_defaults(backend=None, precision="32").magic_line().endswith("--strategy ddp_notebook --sync-batchnorm")


@pytest.mark.skipif(not NO_GPU, reason="checks what a machine without GPU refuses")
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"precision": "16-mixed"}, "precision '16-mixed' cannot run on the cpu accelerator"),
        ({"precision": "half"}, "unknown precision 'half'. Available precisions:"),
        ({"backend": "nccl"}, "backend 'nccl' needs CUDA devices"),
        ({"backend": "tcp"}, "unknown process-group backend 'tcp'. Available backends:"),
        ({"strategy": "dp"}, "strategy 'dp' (DataParallel) splits each batch over CUDA GPUs"),
        ({"sync_batchnorm": "yes"}, "sync_batchnorm='yes' is not valid: pass True or False."),
    ],
)
def test_training_defaults_the_cpu_cannot_run_are_refused(settings, message):
    before = set_defaults(devices=2, accelerator="cpu")
    with pytest.raises(ConfigurationError) as refused:
        set_defaults(**settings)
    assert message in str(refused.value)
    assert get_defaults() == before


def test_dp_is_refused_as_a_cluster_default():
    with pytest.raises(ConfigurationError, match="cannot span a cluster's nodes"):
        set_defaults(cluster="ray", num_nodes=2, strategy="dp")
