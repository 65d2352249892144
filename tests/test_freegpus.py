"""Free-GPU selection: ``nbtrain.find_usable_cuda_devices(k)`` and ``--devices free:k``.

There is no GPU here, so NVML is simulated: ``tests/helpers/fake_nvml/pynvml.py``, put
first on the PYTHONPATH of a real subprocess or a real kernel. The GPUs' holders are real
processes (a ``sleep`` this test starts), so the names in the messages are read from
/proc as on a GPU machine. Everything nbtrain does with NVML's answers is the real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import procs
from kernel_helpers import NotebookKernel
from nbtrain.errors import ConfigurationError
from nbtrain.planning import freegpus
from nbtrain.planning.deviceplan import GpuInfo

GIB = 2**30
FAKE_NVML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fake_nvml")
SUBPROCESS_SECONDS = 60


# -- the choice, pure --------------------------------------------------------------------


def _gpu(index, free_gib, *holders, known=True):
    processes = tuple(freegpus.GpuProcess(pid, name, used) for pid, name, used in holders)
    return freegpus.GpuOccupancy(GpuInfo(index, "NVIDIA A100", 80 * GIB, free_gib * GIB), processes, known)


def test_free_gpus_with_the_most_free_memory_are_chosen_and_returned_in_order():
    machine = [_gpu(0, 60), _gpu(1, 79, (7, "python", GIB)), _gpu(2, 75), _gpu(3, 70)]
    assert freegpus.choose_free_gpus(2, machine) == (2, 3)
    assert freegpus.choose_free_gpus(-1, machine) == (0, 2, 3)


def test_too_few_free_gpus_names_each_busy_one_and_what_holds_it():
    machine = [_gpu(0, 50, (4242, "python", 30 * GIB), (77, "trainer", None)), _gpu(1, 79), _gpu(2, 0, known=False)]
    with pytest.raises(ConfigurationError) as refused:
        freegpus.choose_free_gpus(2, machine, "devices='free:2'")
    message = str(refused.value)
    assert message.startswith(
        "devices='free:2' asks for 2 GPUs that no other process uses, but 1 of the 3 visible is free"
    )
    assert "GPU 0 (NVIDIA A100) held by pid 4242 python (30.0 GiB), pid 77 trainer (memory unknown)" in message
    assert "GPU 2 (NVIDIA A100): NVML cannot list its processes" in message
    assert "ask for fewer (free:1)" in message and "\n" not in message


@pytest.mark.parametrize("text", ["free:0", "free:two", "free:", "free:-2", "free:1.5"])
def test_a_bad_free_count_is_refused_with_the_forms(text):
    with pytest.raises(ConfigurationError, match=rf"devices='{text}' is not valid: free:k takes a number of GPUs"):
        freegpus.parse_free_devices(text)


# -- through real processes, NVML simulated -----------------------------------------------


@pytest.fixture
def holder():
    """A real process that 'holds' a GPU in the simulated NVML; ended by its pid."""
    process = subprocess.Popen(["sleep", "600"])
    yield process.pid
    procs.kill_pids([process.pid])
    process.wait(timeout=10)


def _machine(holder_pid, **extra):
    gpus = [
        {"uuid": "GPU-aa11", "name": "NVIDIA A100", "total": 80 * GIB, "free": 60 * GIB, "processes": []},
        {"uuid": "GPU-bb22", "name": "NVIDIA A100", "total": 80 * GIB, "free": 50 * GIB,
         "processes": [{"pid": holder_pid, "used": 30 * GIB}]},
        {"uuid": "GPU-cc33", "name": "NVIDIA A100", "total": 80 * GIB, "free": 79 * GIB, "processes": []},
    ]
    return json.dumps({"gpus": gpus, **extra})


def _environment(spec, **extra):
    path = os.pathsep.join(p for p in (FAKE_NVML, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NBTRAIN_FAKE_NVML": spec, "NBTRAIN_PREWARM": "0", **extra}


def _python(code, spec, **extra):
    done = subprocess.run(
        [sys.executable, "-c", code], env=_environment(spec, **extra), capture_output=True, text=True, check=False,
        timeout=SUBPROCESS_SECONDS,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


SELECT = """
import sys, nbtrain
from nbtrain.planning import probe
print(nbtrain.find_usable_cuda_devices(2))
print(probe.probe_plan("free:2"))
print(nbtrain.set_defaults(devices="free:2").magic_line())
try:
    nbtrain.find_usable_cuda_devices(3)
except nbtrain.ConfigurationError as error:
    print(error)
print("torch" in sys.modules)
"""


def test_a_process_picks_the_free_gpus_without_touching_cuda(holder):
    chosen, plan, line, refused, torch_imported = _python(SELECT, _machine(holder))
    assert chosen == "[0, 2]"
    assert plan == "DevicePlan(accelerator='cuda', device_ids=(0, 2))"
    assert line.startswith("%%distributed --devices free:2 --accelerator auto")
    assert f"GPU 1 (NVIDIA A100) held by pid {holder} sleep (30.0 GiB)" in refused
    assert torch_imported == "False"  # chosen through NVML: no torch, so no CUDA context


def test_cuda_visible_devices_renumbers_the_choice(holder):
    (refused,) = _python(
        "import nbtrain\ntry:\n    nbtrain.find_usable_cuda_devices(2)\n"
        "except nbtrain.ConfigurationError as e:\n    print(e)",
        _machine(holder),
        CUDA_VISIBLE_DEVICES="2,1",
    )
    assert "but 1 of the 2 visible is free (free: 0 (NVIDIA A100, 79.0 GiB free))" in refused
    assert f"GPU 1 (NVIDIA A100) held by pid {holder} sleep" in refused


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("absent", "needs NVML to see which GPUs other processes use, but the nvidia-ml-py package is not installed"),
        (
            json.dumps({"gpus": [], "init_error": "Driver Not Loaded"}),
            "NVML, which could not start (Driver Not Loaded)",
        ),
    ],
)
def test_without_nvml_free_selection_says_what_is_missing(spec, needle):
    code = (
        "import nbtrain\ntry:\n    nbtrain.find_usable_cuda_devices(1)\n"
        "except nbtrain.ConfigurationError as e:\n    print(e)"
    )
    (message,) = _python(code, spec)
    assert message.startswith("find_usable_cuda_devices(1) ") and needle in message


@pytest.fixture
def gpu_kernel(holder):
    with NotebookKernel(env=_environment(_machine(holder))) as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport nbtrain")
        yield kernel, holder


def test_the_magic_refuses_too_few_free_gpus_in_one_line(gpu_kernel):
    kernel, pid = gpu_kernel
    out = kernel.run("%%distributed --devices free:3\nprint(1)\n")
    line = "UsageError: %%distributed: devices='free:3' asks for 3 GPUs that no other process uses, but 2 of the 3"
    assert line in out.text, out.text
    assert f"held by pid {pid} sleep (30.0 GiB)" in out.text
    out = kernel.run("%%distributed --devices free:2 --accelerator cpu\nprint(1)\n")
    assert "devices='free:2' picks GPUs that no other process uses, but the accelerator is 'cpu'" in out.text


def test_the_magic_plans_its_ranks_on_the_free_gpus(gpu_kernel):
    kernel, _ = gpu_kernel
    assert kernel.value("nbtrain.find_usable_cuda_devices(2)") == [0, 2]
    # No GPU exists behind the simulated NVML, so the CUDA ranks fail at once; the run's
    # record shows what the magic planned from --devices free:2.
    kernel.run("%%distributed --devices free:2\nprint(1)\n")
    assert kernel.value("[nbtrain.last_run().accelerator, nbtrain.last_run().world_size]") == ["cuda", 2]
