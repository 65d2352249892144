"""The kernel's view of its standby ranks (nbtrain.kernel.standbyview), on real processes.

What the launcher keeps waiting, and when, is tests/test_standby.py; here the listing reads
real processes' memory and ``wait_gone`` waits for real processes to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kernel_helpers
from nbtrain.kernel import standbyview
from nbtrain.messages import events
from nbtrain.planning import probe

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_nothing_waits_when_the_launcher_reported_none():
    assert standbyview.listed(None) == []
    assert standbyview.listed(events.StandbyChanged(ranks=())) == []


def test_the_waiting_ranks_are_listed_with_the_memory_they_hold_now():
    changed = events.StandbyChanged(ranks=((0, os.getpid()),), plan="1 cpu rank, gloo", ready=True)
    (listed,) = standbyview.listed(changed)
    assert (listed.state, listed.plan, listed.ready) == ("standby", "1 cpu rank, gloo", True)
    (rank,) = listed.ranks
    assert (rank.rank, rank.pid, rank.gpu_bytes) == (0, os.getpid(), None)  # no GPU held: none asked
    assert rank.rss_bytes is not None and rank.rss_bytes > 10 << 20  # this interpreter, torch or not
    assert repr(listed).startswith(f"<standby ranks: 1 cpu rank, gloo; rank 0 pid {os.getpid()}: ")
    assert repr(listed).endswith("; nbtrain.release() ends them>")


def test_wait_gone_returns_once_the_processes_ended_and_gives_up_at_its_bound():
    child = subprocess.Popen(SLEEPER)
    try:
        assert standbyview.wait_gone([child.pid], timeout=0.2) is False  # still running
    finally:
        child.kill()
        child.wait(timeout=10)
    assert standbyview.wait_gone([child.pid], timeout=5.0) is True


# -- GPU memory: the policy, pure (NVML's answers as probe.GpuUsage records) ----------------

MIB = 1 << 20


def _gpu(index, total_gib, name="NVIDIA A100-SXM4-80GB", **held):
    return probe.GpuUsage(index, name, 0, total_gib << 30, None, {int(pid[1:]): used for pid, used in held.items()})


def test_what_the_standby_ranks_and_the_kernel_hold_is_summed_from_nvmls_per_process_figures():
    gpus = [_gpu(0, 80, p11=758 * MIB, p99=1474 * MIB, p5=9 * MIB), _gpu(1, 15, "Tesla T4", p12=300 * MIB)]
    held = standbyview.held_now([11, 12], 99, gpus)
    assert held == standbyview.GpuHeld(1058 * MIB, 1474 * MIB, ("GPU 1 (Tesla T4, 15 GiB)",), "GPUs 0, 1")
    assert standbyview.held_now([11], 99, [_gpu(0, 80, p99=MIB)]).standby_bytes == 0


def test_they_give_their_memory_up_when_the_kernels_own_grows_or_on_a_small_gpu_before_any_other_cell():
    big = standbyview.held_now([11], 99, [_gpu(0, 80, p11=758 * MIB, p99=1474 * MIB)])
    assert standbyview.release_reason(big, None, False) == ""  # the first look: nothing to compare with
    assert standbyview.release_reason(big, 1474 * MIB, False) == ""
    assert standbyview.release_reason(big, 1450 * MIB, False) == ""  # within the noise of a cell
    grew = standbyview.release_reason(big, 1000 * MIB, True)
    assert grew == "this kernel's own GPU memory grew from 1000 MiB to 1474 MiB since the last cell"
    small = standbyview.held_now([11], 99, [_gpu(0, 15, "Tesla T4", p11=758 * MIB, p99=1474 * MIB)])
    assert standbyview.release_reason(small, 1474 * MIB, True) == ""  # a %%distributed cell takes them
    said = standbyview.release_reason(small, 1474 * MIB, False)
    assert said == "GPU 0 (Tesla T4, 15 GiB) has 16 GiB or less, and the cell may need all of it"
    nothing = standbyview.held_now([11], 99, [_gpu(0, 15, "Tesla T4", p99=1474 * MIB)])
    assert standbyview.release_reason(nothing, 0, False) == ""  # they hold none of it (CPU ranks)


# -- the same through a real kernel, NVML simulated at its one boundary ------------------------

FAKE_NVML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fake_nvml")
RUN = "%%distributed --devices 1 --accelerator cpu\nimport os\nran_on = os.getpid()\n"
STANDBY_PIDS = "sorted(__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).standby_pids())"


def _machine(path, total_gib, name, held):
    gpu = {"uuid": "GPU-aa11", "name": name, "total": total_gib << 30, "free": 4 << 30}
    gpu["processes"] = [{"pid": pid, "used": used} for pid, used in held.items()]
    with open(path, "w") as spec:
        json.dump({"gpus": [gpu]}, spec)


def _standby_after_a_run(kernel):
    kernel.run_ok(RUN)
    waited, ready = kernel_helpers.wait_for_standby(kernel, 60.0)
    assert ready, f"no ready standby ranks within {waited:.0f} s"
    (pid,) = kernel.value(STANDBY_PIDS)
    return pid


@pytest.mark.slow
def test_a_kernel_gives_its_standby_ranks_gpu_memory_up_before_a_cell_that_may_need_it(tmp_path):
    machine = str(tmp_path / "nvml.json")
    _machine(machine, 80, "NVIDIA A100-SXM4-80GB", {})
    path = os.pathsep.join([FAKE_NVML, os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, "NBTRAIN_FAKE_NVML": "@" + machine}
    with kernel_helpers.NotebookKernel(env=env) as kernel:
        _machine(machine, 80, "NVIDIA A100-SXM4-80GB", {kernel.pid: 1474 * MIB})  # the kernel uses the GPU
        kernel.run_ok("%load_ext nbtrain")
        standby = _standby_after_a_run(kernel)
        _machine(machine, 80, "NVIDIA A100-SXM4-80GB", {standby: 758 * MIB, kernel.pid: 1474 * MIB})
        assert "nbtrain" not in kernel.run_ok("x = 1").stderr  # the kernel's memory as it was: they stay
        # A CUDA out-of-memory error in the kernel names them and what frees their memory.
        out = kernel.run("import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')")
        assert out.error is not None
        note = f"standby ranks (1 cpu rank, gloo, pids {standby}) hold 758 MiB on GPU 0: nbtrain.release() frees it"
        assert note in out.stderr, out.stderr
        assert kernel.value(STANDBY_PIDS) == [standby]
        # The kernel's own GPU memory grew: before the next cell they give theirs up, and say what it was.
        _machine(machine, 80, "NVIDIA A100-SXM4-80GB", {standby: 758 * MIB, kernel.pid: 2300 * MIB})
        said = kernel.run_ok("y = 2").stderr
        grew = "this kernel's own GPU memory grew from 1474 MiB to 2300 MiB"
        assert f"gave up the 758 MiB they held on GPU 0: {grew}" in said, said
        assert kernel.value(STANDBY_PIDS) == [] and kernel_helpers.wait_gone([standby], 10.0) == []
        # On a T4 (15 GiB): a %%distributed cell takes them; any other cell first ends them.
        standby = _standby_after_a_run(kernel)
        _machine(machine, 15, "Tesla T4", {standby: 300 * MIB, kernel.pid: 2300 * MIB})
        small = "GPU 0 (Tesla T4, 15 GiB) has 16 GiB or less"
        said = kernel.run_ok("z = 3").stderr
        assert f"gave up the 300 MiB they held on GPU 0: {small}" in said, said
        assert kernel_helpers.wait_gone([standby], 10.0) == []
        standby = _standby_after_a_run(kernel)
        _machine(machine, 15, "Tesla T4", {standby: 300 * MIB, kernel.pid: 2300 * MIB})
        out = kernel.run_ok(RUN)
        assert "gave up" not in out.stderr and kernel.value("ran_on") == standby  # taken by the re-run
        assert kernel_helpers.wait_for_standby(kernel, 60.0)[1]
        (standby,) = kernel.value(STANDBY_PIDS)
        _machine(machine, 15, "Tesla T4", {standby: 300 * MIB, kernel.pid: 2300 * MIB})
        said = kernel.run_ok("w = 4").stderr
        assert f"gave up the 300 MiB they held on GPU 0: {small}" in said, said
        assert kernel_helpers.wait_gone([standby], 10.0) == []


def test_a_cuda_out_of_memory_error_is_known_in_the_kernel_and_from_a_rank():
    import torch

    from nbtrain.errors import RankError

    assert standbyview._out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    rank = RankError(0, "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", "Traceback ...")
    assert standbyview._out_of_memory(rank)
    assert not standbyview._out_of_memory(RankError(0, "ValueError", "bad batch", "Traceback ..."))
    assert not standbyview._out_of_memory(MemoryError())
