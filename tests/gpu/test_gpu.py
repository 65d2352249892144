"""The CUDA paths on a real GPU: skipped where no CUDA device exists (CI has none).

Run on a GPU machine with ``.venv/bin/python -m pytest tests/gpu -m gpu``, or ``bash .ci/gpu``
(with the machine's own CUDA torch; it also runs benchmarks/gpu.py). What they show:
the kernel may initialise CUDA and still launch CUDA ranks (they fork from the launcher,
never from the kernel), nccl groups, mixed precision with the loss scaler, FSDP on one GPU,
CUDA memory in the live view's samples, CUDA tensors coming back, an out-of-memory
error named as such, free-GPU selection through the real NVML, DataParallel (``dp``) and
FSDP with the shards offloaded to host memory (``fsdp_cpu_offload``). The cluster engine
with CUDA ranks is in ``test_gpu_cluster.py``.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys

import pytest
import torch

import nbtrain
from helpers.procs import RUN_TIMEOUT, finish
from kernel_helpers import NotebookKernel
from nbtrain.errors import RankError
from nbtrain.messages import events

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def _start(fn, *args, **settings):
    return nbtrain.start(fn, args, devices=1, accelerator="cuda", timeout=RUN_TIMEOUT, **settings)


def test_a_kernel_that_touched_cuda_trains_a_cuda_cell_and_gets_its_weights_back():
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch\ntorch.cuda.init()\ntorch.manual_seed(0)\n"
            "model = torch.nn.Linear(8, 1).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "x, y = torch.randn(64, 8, device='cuda'), torch.randn(64, 1, device='cuda')\n"
            "before = model.weight.detach().clone()\n"
        )
        kernel.run_ok(
            "%%distributed --accelerator cuda --devices 1\n"
            "for _ in range(5):\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
        )
        moved, device = kernel.value("[(model.weight - before).abs().sum().item(), str(model.weight.device)]")
        assert moved > 0 and device.startswith("cuda")


def test_the_kernels_torch_settings_reach_a_cuda_rank():
    """TF32, cuDNN's autotuner and a default CUDA device set in the kernel (nbtrain.messages.torchsettings)."""
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport torch\nmodel = torch.nn.Linear(8, 1).cuda()\n"
            "torch.set_float32_matmul_precision('high')\ntorch.backends.cudnn.benchmark = True\n"
            "torch.set_default_device('cuda')\n"
        )
        kernel.run_ok(
            "%%distributed --accelerator cuda --devices 1\n"
            "import nbtrain\n"
            "loss = model(torch.randn(4, 8)).pow(2).mean()\n"  # torch.randn on the default device: the GPU
            "loss.backward()\n"
            "nbtrain.log(loss=loss)  # a CUDA scalar, copied to pinned host memory whatever the default device\n"
            "settings = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark,\n"
            "            torch.empty(1).device.type]\n"
        )
        assert kernel.value("settings") == [True, True, "cuda"]


def test_kernel_tensors_on_the_cpu_in_a_cuda_cell_get_a_hint_to_move_them():
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport torch\nmodel = torch.nn.Linear(8, 1)\n")
        kernel.run_ok("x, y = torch.randn(4, 8), torch.randn(4, 1)")
        # the prepared model moves its inputs to the rank's device; the target stays on the CPU
        out = kernel.run("%%distributed --accelerator cuda --devices 1\ntorch.nn.functional.mse_loss(model(x), y)\n")
        assert out.error is not None and "`.to(nbtrain.device())`" in out.text, out.text


def test_cuda_ranks_join_an_nccl_group(launcher):
    assert finish(_start(lambda: torch.distributed.get_backend())) == "nccl"


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_precision_on_cuda_trains(launcher, precision, dtype):
    def fn():
        torch.manual_seed(0)
        net = nbtrain.prepare(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x, y = torch.randn(128, 32, device="cuda"), torch.randn(128, 1, device="cuda")
        losses, out_dtype = [], None
        for _ in range(30):
            out = net(x)
            out_dtype = out.dtype
            loss = torch.nn.functional.mse_loss(out.float(), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        return losses, str(out_dtype), str(next(net.parameters()).dtype)

    losses, out_dtype, weight_dtype = finish(_start(fn, precision=precision))
    assert out_dtype == str(dtype) and weight_dtype == "torch.float32"
    assert losses[-1] < 0.9 * losses[0]


def test_16_mixed_skips_an_overflowed_step_and_lowers_the_scale(launcher):
    """The optimizer is built after prepare and never handed to it; the scaling still holds."""

    def fn():
        from nbtrain.rank.auto import ledger

        torch.manual_seed(0)
        net = nbtrain.prepare(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        # small inputs, small gradients: only the step made infinite overflows at the first scale
        x = torch.randn(16, 8, device="cuda") * 0.01
        opt.zero_grad(); net(x).float().pow(2).mean().backward(); opt.step()
        before = next(net.parameters()).detach().clone()
        scaling = ledger.cell_registry().loss_scaling
        scale, skipped = scaling.scaler.get_scale(), scaling.skipped_steps
        opt.zero_grad(); (net(x).float().pow(2).mean() * float("inf")).backward(); opt.step()
        unchanged = torch.equal(before, next(net.parameters()))
        after_overflow = (unchanged, scaling.skipped_steps - skipped, scaling.scaler.get_scale() / scale)
        opt.zero_grad(); net(x).float().pow(2).mean().backward(); opt.step()
        return after_overflow, torch.equal(before, next(net.parameters())), scaling.skipped_steps - skipped

    (unchanged, skipped, ratio), later_unchanged, skipped_in_all = finish(_start(fn, precision="16-mixed"))
    assert unchanged and skipped == 1 and ratio == 0.5
    assert not later_unchanged and skipped_in_all == 1  # the next good step steps


def test_bf16_true_casts_the_model_on_the_rank_and_the_kernels_copy_stays_float32(launcher):
    model = torch.nn.Linear(8, 1)

    def fn(model):
        net = nbtrain.prepare(model)
        out = net(torch.randn(4, 8, device="cuda"))
        return str(next(net.parameters()).dtype), str(out.dtype), net.state_dict()

    weight_dtype, out_dtype, state = finish(_start(fn, model, precision="bf16-true"))
    assert weight_dtype == "torch.bfloat16" and out_dtype == "torch.float32"
    model.load_state_dict(state)
    assert model.weight.dtype == torch.float32


def test_sync_batchnorm_on_cuda_is_torchs_own(launcher):
    def fn():
        net = nbtrain.prepare(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)))
        net(torch.randn(4, 1, 8, 8, device="cuda")).sum().backward()
        kinds = {f"{type(m).__module__}.{type(m).__name__}" for m in net.modules()}
        return sorted(kind for kind in kinds if "BatchNorm" in kind)

    assert finish(_start(fn, sync_batchnorm=True)) == ["torch.nn.modules.batchnorm.SyncBatchNorm"]


def test_fsdp_on_one_gpu_brings_full_weights_back(launcher):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    def fn(model):
        net = nbtrain.prepare(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(4, 8, device="cuda")).sum().backward()
        opt.step()
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()}

    state = finish(_start(fn, model, strategy="fsdp"))
    assert set(state) == set(model.state_dict())


def test_cuda_memory_reaches_the_live_view(launcher):
    def fn():
        keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        import time

        for step in range(20):
            nbtrain.log(step=step, seconds=time.time())  # memory samples travel with the logged values
            torch.cuda.synchronize()
            time.sleep(0.05)  # the rank's own pace: the samples are taken while it runs
        return keep.numel()

    samples = []
    finish(_start(fn), on_event=lambda e: samples.append(e) if isinstance(e, events.MemorySample) else None)
    assert any((s.cuda_allocated_bytes or 0) >= 64 << 20 for s in samples)


def test_logged_cuda_scalars_reach_the_kernel_in_order_without_a_device_sync(launcher):
    def fn():
        import time

        x = torch.randn(256, 256, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # whatever waits for the GPU raises
        began, step = time.monotonic(), 0
        while time.monotonic() - began < 0.8:  # several batches sent (every 0.25 s or 256 rows)
            step += 1
            nbtrain.log(step=step, loss=(x @ x).mean())
        torch.cuda.set_sync_debug_mode(0)
        return step

    rows = []
    steps = finish(_start(fn), on_event=lambda e: rows.extend(e.rows) if isinstance(e, events.Metrics) else None)
    assert steps > 256
    assert [step for step, _, _ in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(values["loss"]) for _, _, values in rows)


def test_an_auto_mode_loop_on_one_gpu_never_waits_for_it():
    """The loss hook, the step hooks and the metrics' sends: no device sync anywhere in the loop."""
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport time, torch\ntorch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
            "x, y = torch.randn(32, 64, device='cuda'), torch.randn(32, 1, device='cuda')\n"
        )
        kernel.run_ok(
            "%%distributed --accelerator cuda --devices 1\n"
            "torch.cuda.set_sync_debug_mode('error')\n"
            "began, steps = time.monotonic(), 0\n"
            "while time.monotonic() - began < 0.8:\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
            "    steps += 1\n"
            "torch.cuda.set_sync_debug_mode(0)\n"
        )
        assert kernel.value("steps") > 100


def test_a_cuda_result_tensor_comes_back(launcher):
    value = finish(_start(lambda: torch.arange(4.0, device="cuda") * 2))
    assert torch.equal(value.cpu(), torch.arange(4.0) * 2)


def test_cuda_out_of_memory_is_reported_as_such(launcher):
    def fn():
        free, _ = torch.cuda.mem_get_info()
        return torch.empty(free * 4, dtype=torch.uint8, device="cuda")

    with pytest.raises(RankError, match="(?i)out of memory"):
        finish(_start(fn))


def test_free_gpu_selection_reads_the_real_nvml_without_a_cuda_context():
    """find_usable_cuda_devices in a fresh process: real NVML, and no torch imported for it."""
    code = "import sys, nbtrain\nprint(nbtrain.find_usable_cuda_devices(-1))\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    chosen, torch_imported = done.stdout.strip().splitlines()
    assert torch_imported == "False"
    assert all(0 <= index < torch.cuda.device_count() for index in ast.literal_eval(chosen))


def test_a_gpu_another_process_holds_is_busy_and_one_this_kernel_holds_is_free():
    from nbtrain.planning import probe

    torch.cuda.init()
    held = torch.empty(16 << 20, dtype=torch.uint8, device="cuda:0")  # this process (the kernel) holds GPU 0
    mine = {o.gpu.index: o for o in probe.gpu_occupancy()}
    if not mine[0].known:
        pytest.skip("NVML cannot list the processes of this GPU")
    code = "import sys, torch\nx = torch.empty(1 << 24, device='cuda')\nprint('holding', flush=True)\nsys.stdin.read()"
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "holding"
        theirs = {o.gpu.index: o for o in probe.gpu_occupancy()}
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert mine[0].free, mine[0]
    assert not theirs[0].free and f"pid {other.pid}" in theirs[0].describe_busy(), theirs[0]
    del held


def test_free_devices_run_a_cuda_rank(launcher):
    assert finish(nbtrain.start(lambda: torch.cuda.current_device(), devices="free:1", timeout=RUN_TIMEOUT)) >= 0


def test_dp_splits_a_batch_over_the_gpus_in_one_process(launcher):
    count = torch.cuda.device_count()

    def fn():
        torch.manual_seed(0)
        net = nbtrain.prepare(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = torch.randn(64, 8), torch.randn(64, 1, device="cuda")
        losses = []
        for _ in range(10):
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        return type(net).__name__, list(net.device_ids), nbtrain.world_size(), losses

    name, device_ids, world_size, losses = finish(
        nbtrain.start(fn, devices=count, accelerator="cuda", strategy="dp", timeout=RUN_TIMEOUT)
    )
    assert name == "DataParallel" and device_ids == list(range(count)) and world_size == 1
    assert losses[-1] < losses[0]


def test_a_dp_cell_brings_the_weights_back():
    with NotebookKernel() as kernel:
        kernel.run_ok(
            "%load_ext nbtrain\nimport nbtrain, torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nx, y = torch.randn(64, 8), torch.randn(64, 1)\n"
            "before = model.weight.detach().clone()\n"
        )
        out = kernel.run_ok(
            "%%distributed --accelerator cuda --devices -1 --strategy dp\n"
            "for _ in range(5):\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y.to(nbtrain.device()))\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\n"
        )
        assert "model (DataParallel)" in out.text, out.text
        assert kernel.value("(model.weight - before).abs().sum().item()") > 0


def test_fsdp_cpu_offload_keeps_the_shards_in_host_memory(launcher):
    def fn():
        net = nbtrain.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)))
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        x = torch.randn(32, 64, device="cuda")
        for _ in range(3):
            loss = net(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        return [p.to_local().device.type for p in net.parameters()], loss.item()

    devices, loss = finish(_start(fn, strategy="fsdp_cpu_offload"))
    assert set(devices) == {"cpu"} and math.isfinite(loss)  # the shards stayed on the host


def test_no_process_that_forks_has_loaded_the_cuda_driver_after_cuda_cells():
    """The kernel may use CUDA; the processes that fork (the launcher, which forks the ranks) must never
    have: a process that initialised CUDA forks unusable children. Checked by the driver library in
    its memory map (cuInit loads libcuda), after a CUDA cell, a device query and a re-run."""
    with NotebookKernel(env={"NBTRAIN_TEMPLATE": "0"}) as kernel:
        kernel.run_ok("%load_ext nbtrain\nimport torch, nbtrain\nx = torch.ones(2, device='cuda')")
        for _ in range(2):  # the second run takes the standby ranks the launcher forked after the first
            kernel.run_ok("%%distributed --accelerator cuda --devices 1\ny = (x * 2).sum().item()\n")
        kernel.run_ok("devices = nbtrain.runs()")  # the kernel's view of the devices (NVML's counts)
        launcher = kernel.value(
            "__import__('nbtrain.kernel.launcher_connection', fromlist=['x']).get_client().process.pid"
        )
        with open(f"/proc/{launcher}/maps") as maps:
            assert "libcuda.so" not in maps.read(), "the launcher loaded the CUDA driver: its ranks fork unusable"
