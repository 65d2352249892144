"""Per-rank memory of Adam's optimizer state under ddp_notebook, ddp_sharded, fsdp and fsdp_cpu_offload.

Each rank counts the bytes of the optimizer-state tensors it holds after one step (for
FSDP the local shards of its DTensors); the baseline is ddp_notebook in the same run.
On CPU ranks fsdp_cpu_offload holds what fsdp holds (host memory is all there is); on
GPUs it moves those bytes from the GPU to the host.

    .venv/bin/python benchmarks/sharded_memory.py [--devices 2] [--width 1024]
"""

from __future__ import annotations

import argparse

import torch

import nbtrain


def state_bytes_per_rank(strategy: str, devices: int, width: int) -> list[int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))

    def fn(model: torch.nn.Module) -> list[int]:
        import torch.distributed as dist

        net = nbtrain.prepare(model)
        opt = nbtrain.prepare(torch.optim.Adam(net.parameters(), lr=1e-3))
        net(torch.randn(8, width)).sum().backward()
        opt.step()
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's part in .optim
        total = 0
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
        gathered: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(gathered, total)
        return gathered

    return nbtrain.launch(fn, model, devices=devices, accelerator="cpu", strategy=strategy, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    params = 4 * (args.width * args.width + args.width)
    print(f"model: 4 x Linear({args.width}, {args.width}), {params:,} parameters; Adam; {args.devices} CPU ranks")
    baseline = None
    for strategy in ("ddp_notebook", "ddp_sharded", "fsdp", "fsdp_cpu_offload"):
        per_rank = state_bytes_per_rank(strategy, args.devices, args.width)
        baseline = baseline or max(per_rank)
        shown = ", ".join(f"{b / 2**20:.1f} MiB" for b in per_rank)
        ratio = max(per_rank) / baseline
        print(f"{strategy:>16}: optimizer state per rank [{shown}]  max / ddp_notebook = {ratio:.3f}x")


if __name__ == "__main__":
    main()
