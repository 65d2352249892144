"""Standby ranks on a real GPU: skipped where no CUDA device exists (CI has none).

A CUDA run's standby ranks hold a CUDA context (cuDNN and cuBLAS loaded; NCCL's
communicator built where there are several ranks) and nothing of any cell; GPUs only they
hold count as free for ``--devices free:k``, and a run taking that GPU takes or ends them;
before a cell that may need their memory (the kernel's own grew, or a small GPU) they give it up.
"""

from __future__ import annotations

import time

import pytest
import torch

import kernel_helpers
import nbtrain
from helpers.procs import RUN_TIMEOUT, finish
from kernel_helpers import NotebookKernel
from nbtrain.kernel import launcher_connection
from nbtrain.planning import probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

CONTEXT_AT_MOST = 2 << 30  # a context with cuDNN/cuBLAS loaded is several hundred MB, not GBs


def _waiting(timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        standby = launcher_connection.get_client().standby
        if standby is not None and standby.ready:
            return [pid for _, pid in standby.ranks]
        time.sleep(0.02)
    raise AssertionError(f"no standby ranks within {timeout} s")


def _gpu_bytes(pid: int) -> int:
    return sum(gpu.process_bytes.get(pid, 0) for gpu in probe.gpu_usage())


def test_standby_ranks_hold_a_cuda_context_and_nothing_else(launcher):
    finish(nbtrain.start(lambda: None, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT))
    (pid,) = _waiting()
    held = _gpu_bytes(pid)
    assert 0 < held < CONTEXT_AT_MOST, held
    listed = nbtrain.runs()[0]
    assert listed.state == "standby" and (listed.ranks[0].gpu_bytes or 0) > 0

    def first_line():
        import os

        return os.getpid(), torch.cuda.is_initialized(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    ran_on, initialised, allocated, reserved = finish(
        nbtrain.start(first_line, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT)
    )
    assert ran_on == pid and initialised and allocated == 0 and reserved == 0
    assert nbtrain.release() == 1
    assert _gpu_bytes(pid) == 0


def test_a_gpu_held_only_by_standby_ranks_counts_as_free(launcher):
    finish(nbtrain.start(lambda: None, devices=[0], accelerator="cuda", timeout=RUN_TIMEOUT))
    (pid,) = _waiting()
    assert _gpu_bytes(pid) > 0
    occupancy = {o.gpu.index: o for o in probe.gpu_occupancy()}
    assert occupancy[0].free, occupancy[0].describe_busy()
    assert 0 in nbtrain.find_usable_cuda_devices(-1)

    def where():
        import os

        return os.getpid(), torch.cuda.current_device()

    count = torch.cuda.device_count()
    ran_on, device = finish(nbtrain.start(where, devices=f"free:{count}", accelerator="cuda", timeout=RUN_TIMEOUT))
    assert device == 0
    if count == 1:  # the same plan as the standby ranks': they ran it
        assert ran_on == pid
    nbtrain.release()


def test_a_cells_own_collective_runs_on_a_lone_standby_rank_that_built_no_communicator_ahead(launcher):
    finish(nbtrain.start(lambda: None, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT))
    (pid,) = _waiting()

    def collective():
        import os

        import torch.distributed as dist

        total = torch.full((1,), 3.0, device="cuda")
        dist.all_reduce(total)  # the communicator is built here, at the cell's first collective
        return os.getpid(), dist.get_backend(), total.item()

    ran_on, backend, total = finish(nbtrain.start(collective, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT))
    assert ran_on == pid and "nccl" in backend and total == 3.0
    nbtrain.release()


STANDBY_PIDS = "sorted(__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).standby_pids())"
GPU_BYTES = (
    "sum(g.process_bytes.get({pid}, 0) for g in __import__('nbtrain.planning.probe', fromlist=['x']).gpu_usage())"
)


def _kernel_standby(kernel: NotebookKernel) -> int:
    kernel.run_ok("%%distributed --devices 1 --accelerator gpu\nimport torch\nx = torch.ones(1, device='cuda').sum()\n")
    waited, ready = kernel_helpers.wait_for_standby(kernel, 60.0)
    assert ready, f"no ready standby ranks within {waited:.0f} s"
    (pid,) = kernel.value(STANDBY_PIDS)
    assert kernel.value(GPU_BYTES.format(pid=pid)) > 0
    return pid


def test_standby_ranks_give_their_gpu_memory_up_when_the_kernel_uses_the_gpu_and_an_oom_names_them():
    """Unrun so far (no GPU where it was written): the policy's CPU test is tests/test_standbyview.py."""
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain")
        standby = _kernel_standby(kernel)
        # A CUDA out-of-memory error in the kernel names them and nbtrain.release().
        too_much = "2 * torch.cuda.mem_get_info()[1]"
        out = kernel.run(f"import torch\nhuge = torch.empty({too_much}, dtype=torch.uint8, device='cuda')")
        assert out.error is not None and "OutOfMemoryError" in out.error["ename"]
        assert f"pids {standby}) hold" in out.stderr and "nbtrain.release() frees it" in out.stderr, out.stderr
        # The kernel takes 1 GiB of the GPU for itself: before the next cell they give theirs up.
        said = kernel.run_ok("big = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')").stderr
        said += kernel.run_ok("y = 2").stderr
        assert "gave up the" in said and ("this kernel's own GPU memory grew" in said or "16 GiB or less" in said), said
        assert kernel_helpers.wait_gone([standby], 30.0) == []
        assert kernel.value(STANDBY_PIDS) == []
