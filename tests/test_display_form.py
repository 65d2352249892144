"""``nbtrain.launcher()`` and the session defaults of ``%%distributed``.

The form's rules are checked in this process (ipywidgets works without a frontend), on
this machine and on a pretend GPU machine; then in a real kernel, executed through
nbclient with the widget state stored in the notebook, as a frontend would receive it:
what the form shows, and that changing a control changes what the next cell runs on.
"""

from __future__ import annotations

import pytest

import nbtrain
from kernel_helpers import NotebookKernel
from nbtrain.errors import ConfigurationError
from nbtrain.kernel import defaults
from nbtrain.kernel.display import form as launcher_form
from nbtrain.options import LaunchOptions
from nbtrain.planning import probe
from nbtrain.planning.deviceplan import GpuInfo

GIB = 2**30
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(autouse=True)
def fresh_defaults():
    defaults.reset_defaults()
    yield
    defaults.reset_defaults()


@pytest.fixture
def two_gpus(monkeypatch):
    gpus = (GpuInfo(0, "NVIDIA A100", 80 * GIB, 70 * GIB), GpuInfo(1, "NVIDIA A100", 80 * GIB, 79 * GIB))
    monkeypatch.setattr(probe, "detect_gpus", lambda: list(gpus))
    return launcher_form.Machine(gpus, False, 8)


# -- the defaults, without widgets ---------------------------------------------------------


def test_set_defaults_keeps_what_is_not_given_and_writes_the_magic_line():
    assert nbtrain.get_defaults() == LaunchOptions("auto", "auto", "ddp_notebook", None)
    nbtrain.set_defaults(devices=2, accelerator="CPU")
    changed = nbtrain.set_defaults(strategy="ddp_spawn", timeout=90)
    assert changed == LaunchOptions("2", "cpu", "ddp_spawn", 90.0)
    assert changed.magic_line() == "%%distributed --devices 2 --accelerator cpu --strategy ddp_spawn --timeout 90"
    assert nbtrain.set_defaults(timeout=None).timeout is None
    assert nbtrain.reset_defaults() == LaunchOptions()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"devices": 0}, "devices=0 is not valid"),
        ({"devices": "two"}, "devices='two' is not valid"),
        ({"accelerator": "tpu"}, "accelerator='tpu' is not supported"),
        ({"accelerator": "cuda"}, "needs a GPU"),
        ({"strategy": "zero"}, "unknown strategy 'zero'"),
        ({"timeout": -1}, "timeout must be positive"),
    ],
)
def test_set_defaults_refuses_what_cannot_run_here_and_changes_nothing(settings, message, monkeypatch):
    monkeypatch.setattr(probe, "detect_gpus", list)
    nbtrain.set_defaults(devices=2, accelerator="cpu")
    with pytest.raises(ConfigurationError, match=message):
        nbtrain.set_defaults(**settings)
    assert nbtrain.get_defaults() == LaunchOptions("2", "cpu", "ddp_notebook", None)


# -- the form, in this process ---------------------------------------------------------------


def test_the_cpu_form_counts_processes_and_shows_the_line_live():
    machine = launcher_form.Machine((), False, 2)
    form = launcher_form.LauncherForm(machine)
    assert form.accelerator.options == (("cpu: 2 cores", "cpu"),) and form.accelerator.value == "cpu"
    assert (form.devices.value, form.devices.min, form.devices.max) == (2, 1, 4)
    assert list(form.devices_box.children) == [form.devices, form.devices_help]
    assert form.gpus == []
    assert "%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook" in form.magic_line.value
    assert nbtrain.get_defaults().devices == "2"  # showing the form sets what it shows

    form.devices.value = 3
    form.strategy.value = "fsdp"
    form.timeout.value = 120
    line = "%%distributed --devices 3 --accelerator cpu --strategy fsdp --timeout 120"
    assert line in form.magic_line.value and nbtrain.get_defaults().magic_line() == line
    assert "Fully sharded" in form.strategy_help.value
    form.timeout.value = 0
    assert nbtrain.get_defaults().timeout is None and "--timeout" not in form.magic_line.value


def test_every_strategy_has_its_explanation_under_the_dropdown():
    form = launcher_form.LauncherForm(launcher_form.Machine((), False, 2))
    assert list(form.strategy.options) == list(nbtrain.planning.config.STRATEGIES)
    for name, strategy in nbtrain.planning.config.STRATEGIES.items():
        form.strategy.value = name
        assert strategy.when_to_use.split(";")[0] in form.strategy_help.value


def test_precision_backend_batchnorm_sync_and_cluster_are_fields_of_the_form():
    form = launcher_form.LauncherForm(launcher_form.Machine((), False, 2))
    assert (
        list(form.precision.options) == list(nbtrain.planning.config.PRECISIONS) and form.precision.value == "32-true"
    )
    assert [value for _, value in form.backend.options] == ["", *nbtrain.planning.config.BACKENDS]
    assert form.num_nodes.disabled and form.cluster.value == "local"
    form.precision.value = "bf16-mixed"
    form.backend.value = "gloo"
    form.sync_batchnorm.value = True
    line = "%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook --precision bf16-mixed"
    assert nbtrain.get_defaults().magic_line() == line + " --sync-batchnorm --backend gloo"
    form.precision.value = "16-mixed"  # the CPU cannot: said so, the last good defaults stay
    assert "precision &#x27;16-mixed&#x27; cannot run on the cpu accelerator" in form.status.value
    assert nbtrain.get_defaults().precision == "bf16-mixed"
    form.precision.value = "32-true"
    form.cluster.value = "ray"
    assert not form.num_nodes.disabled
    form.num_nodes.value = 3
    assert nbtrain.get_defaults().magic_line().endswith("--cluster ray --num-nodes 3 --sync-batchnorm --backend gloo")
    form.cluster.value = "10.0.0.1:6379"  # an address, typed in
    assert (nbtrain.get_defaults().cluster, nbtrain.get_defaults().num_nodes) == ("10.0.0.1:6379", 3)
    form.cluster.value = ""
    assert nbtrain.get_defaults().cluster == "local" and form.num_nodes.disabled


def test_every_option_with_a_control_is_in_the_form_under_its_name_and_sets_the_option():
    from nbtrain import options

    form = launcher_form.LauncherForm(launcher_form.Machine((), False, 2))
    assert list(form.controls) == [name for name, info in options.described() if info.control is not None]
    assert form.controls["precision"] is form.precision and form.strategy_help is form.helps["strategy_help"]
    form.timeout.value = 45
    assert nbtrain.get_defaults().timeout == 45.0 and form.option_value("timeout") == 45.0
    form.backend.value = ""  # an empty control: the option's own empty value
    assert nbtrain.get_defaults().backend is None and form.option_value("backend") is None


def test_the_new_strategies_are_in_the_form_with_their_help():
    form = launcher_form.LauncherForm(launcher_form.Machine((), False, 2))
    for name in ("ddp_sharded", "fsdp_cpu_offload", "dp"):
        assert name in form.strategy.options
    form.strategy.value = "dp"  # CUDA only: refused on this CPU form, pointing to ddp_notebook
    assert "use strategy &#x27;ddp_notebook&#x27;" in form.status.value
    form.strategy.value = "fsdp_cpu_offload"
    assert form.status.value == "" and "CPUOffloadPolicy" in form.strategy_help.value


def test_the_magic_page_flag_table_lists_every_flag_and_strategy():
    import pathlib
    import re

    from nbtrain.kernel import magic

    page = (pathlib.Path(__file__).parent.parent / "docs" / "magic.md").read_text(encoding="utf-8")
    row = re.compile(r"^\| `(--[a-z-]+)`[^|]*\| (.*)$", re.MULTILINE)
    rows = {match.group(1): match.group(2) for match in row.finditer(page)}
    flags = {a.option_strings[-1] for a in magic.DistributedMagics.distributed.parser._actions}
    assert flags - {"--help"} <= set(rows), flags - set(rows)
    strategies = set(re.findall(r"`([a-z_]+)`:", rows["--strategy"]))
    assert strategies == set(nbtrain.planning.config.STRATEGIES)
    assert set(re.findall(r"`([a-z0-9-]+)`", rows["--precision"])) >= set(nbtrain.planning.config.PRECISIONS)


def test_the_form_starts_from_the_session_defaults():
    nbtrain.set_defaults(devices=3, accelerator="cpu", strategy="ddp_spawn", timeout=30)
    form = launcher_form.LauncherForm(launcher_form.Machine((), False, 2))
    assert (form.devices.value, form.strategy.value, form.timeout.value) == (3, "ddp_spawn", 30.0)


def test_the_gpu_form_has_a_checkbox_per_gpu_with_its_free_memory(two_gpus):
    form = launcher_form.LauncherForm(two_gpus)
    assert form.accelerator.value == "cuda"
    assert [label for label, _ in form.accelerator.options] == ["cuda: 2 GPUs (NVIDIA A100)", "cpu: 8 cores"]
    assert [box.description for box in form.gpus] == [
        "GPU 0 (NVIDIA A100, 70.0 GiB free)",
        "GPU 1 (NVIDIA A100, 79.0 GiB free)",
    ]
    assert form.devices not in form.devices_box.children and form.gpus[0] in form.devices_box.children
    assert nbtrain.get_defaults().magic_line() == "%%distributed --devices 2 --accelerator cuda --strategy ddp_notebook"

    form.gpus[0].value = False
    assert nbtrain.get_defaults().devices == "1,"  # GPU 1 alone (a count of 1 would be GPU 0)
    form.gpus[1].value = False  # nothing checked: said so, the last good defaults stay
    assert "no GPU is checked" in form.status.value and nbtrain.get_defaults().devices == "1,"
    form.accelerator.value = "cpu"
    assert form.status.value == "" and form.devices in form.devices_box.children
    assert nbtrain.get_defaults().magic_line() == "%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook"


def test_the_widget_module_never_imports_torch_or_initialises_cuda():
    import os
    import subprocess
    import sys

    code = "import sys\nfrom nbtrain.kernel.display import form\nform.LauncherForm()\nprint('torch' in sys.modules)\n"
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- in a real kernel ------------------------------------------------------------------------


def _state_of(notebook, model_id: str) -> dict:
    return notebook.metadata["widgets"][WIDGET_STATE]["state"][model_id]["state"]


def _child_ids(state: dict) -> list[str]:
    return [child.removeprefix("IPY_MODEL_") for child in state["children"]]


def test_the_form_renders_in_a_kernel_and_its_values_become_the_cells_defaults():
    """One kernel for all of it: starting one and warming its launcher is most of the cost."""
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport nbtrain")
        kernel.run_ok("w = nbtrain.launcher()")
        outputs = kernel.notebook.cells[-1].outputs
        assert [o["output_type"] for o in outputs] == ["display_data"] and WIDGET_VIEW in outputs[0]["data"]
        form_id = outputs[0]["data"][WIDGET_VIEW]["model_id"]
        kernel.run_ok("nbtrain.launcher()")  # as a cell's last line: shown once, not again as its value
        assert [o["output_type"] for o in kernel.notebook.cells[-1].outputs] == ["display_data"]
        kernel.run_ok("w")  # shown again on request, in a later cell
        assert kernel.notebook.cells[-1].outputs[0]["data"][WIDGET_VIEW]["model_id"] == form_id

        kernel.run_ok("w.devices.value = 3")  # what dragging the slider does
        out = kernel.run_ok("%%distributed\nprint('world', nbtrain.world_size())\n")
        assert "[rank 2] world 3" in out.stdout and "3 ranks (cpu, ddp_notebook)" in out.stdout
        flagged = kernel.run_ok("%%distributed --devices 2\nprint('world', nbtrain.world_size())\n")
        assert "[rank 1] world 2" in flagged.stdout and "rank 2" not in flagged.stdout  # a flag wins

        kernel.run_ok("nbtrain.set_defaults(devices=1)")  # without widgets
        single = kernel.run_ok("%%distributed\nprint('world', nbtrain.world_size())\n")
        assert "world 1" in single.stdout and "1 rank (cpu, ddp_notebook)" in single.stdout

        assert kernel.client.store_widget_state  # nbclient keeps each widget's state, as a frontend does
        kernel.client.set_widgets_metadata()
        notebook = kernel.notebook
        form = _state_of(notebook, form_id)
        assert form["_model_name"] == "VBoxModel"
        children = {cid: _state_of(notebook, cid) for cid in _child_ids(form)}
        kinds = [state["_model_name"] for state in children.values()]
        # An option given a control later adds its row before the last two (the line and the status).
        assert kinds[:9] == [
            "HTMLModel",
            "DropdownModel",
            "VBoxModel",
            "DropdownModel",
            "HTMLModel",
            "HBoxModel",
            "HBoxModel",
            "CheckboxModel",
            "HBoxModel",
        ]
        assert kinds[-2:] == ["HTMLModel", "HTMLModel"]
        _, accelerator, devices_box, strategy, strategy_help, timeout_row, *_, line, status = children.values()
        cores = probe.cpu_count()
        assert accelerator["_options_labels"] == [f"cpu: {cores} core" + ("s" if cores != 1 else "")]
        assert accelerator["description"] == "accelerator" and strategy["_options_labels"][0] == "ddp_notebook"
        assert "Data parallel; ranks fork from a warm, clean launcher" in strategy_help["value"]
        slider = _state_of(notebook, _child_ids(devices_box)[0])
        assert slider["_model_name"] == "IntSliderModel" and slider["value"] == 3
        assert slider["max"] == max(2, 2 * probe.cpu_count())
        # The line the form shows changed with the slider; set_defaults (no widget) does not move the form.
        assert "%%distributed --devices 3 --accelerator cpu --strategy ddp_notebook" in line["value"]
        assert status["value"] == ""
        timeout_box = _state_of(notebook, _child_ids(timeout_row)[0])
        assert timeout_box["_model_name"] == "BoundedFloatTextModel" and timeout_box["value"] == 0

        # The training fields become the cells' defaults as well: the ranks are told them.
        kernel.run_ok("w.precision.value = 'bf16-mixed'\nw.sync_batchnorm.value = True\nw.devices.value = 2")
        told = kernel.run_ok(
            "%%distributed\nfrom nbtrain.rank.machinery import settings\n"
            "print(settings.current().precision, settings.current().sync_batchnorm)\n"
        )
        assert "[rank 1] bf16-mixed True" in told.stdout, told.text
        plain = kernel.run_ok(
            "%%distributed --precision 32-true\nfrom nbtrain.rank.machinery import settings\n"
            "print(settings.current().precision)\n"
        )
        assert "[rank 0] 32-true" in plain.stdout  # a flag wins
        unsynced = kernel.run_ok(
            "%%distributed --no-sync-batchnorm\nfrom nbtrain.rank.machinery import settings\n"
            "print('sync', settings.current().sync_batchnorm)\n"
        )
        assert "[rank 0] sync False" in unsynced.stdout
        kernel.run_ok("w.precision.value = '32-true'\nw.sync_batchnorm.value = False")

        # The flags' help says where defaults come from; --timeout none beats a session timeout.
        help_text = " ".join(kernel.run_ok("%%distributed --help\npass\n").stdout.split())
        for text in ("--background", "session default", "none: no limit"):
            assert text in help_text, text
        kernel.run_ok("nbtrain.set_defaults(devices=2, accelerator='cpu', timeout=0.5)")
        slow = kernel.run("%%distributed\nimport time\ntime.sleep(30)\n")
        assert slow.error is not None and "timeout=0.5" in slow.error["evalue"]
        free = kernel.run_ok("%%distributed --timeout none\nprint('no limit', nbtrain.world_size())\n")
        assert "[rank 1] no limit 2" in free.stdout
