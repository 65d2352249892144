"""Launch settings: strategies, backends, threads per rank, and the plan of one launch.

Pure: it imports no torch and starts nothing, so every rule here is unit-tested directly.

Example:
    >>> from nbtrain.planning.deviceplan import DevicePlan
    >>> cfg = make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None)
    >>> cfg.strategy.start_method, cfg.backend, cfg.world_size
    ('fork', 'gloo', 2)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.errors import ConfigurationError
from nbtrain.messages.events import RankSettings, RankSpec
from nbtrain.planning.deviceplan import DevicePlan


@dataclass(frozen=True)
class Strategy:
    """How ranks start and how ``prepare`` wraps a model."""

    name: str
    start_method: str  # "fork": from the warm launcher; "spawn": a fresh interpreter per rank
    model_wrapper: str  # "ddp" | "ddp_find_unused" | "ddp_sharded" | "fsdp" | "fsdp_offload" | "dp" | "none"
    when_to_use: str


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp_notebook", "fork", "ddp",
            "Data parallel; ranks fork from a warm, clean launcher. Fast start. The default."
        ),
        Strategy(
            "ddp_spawn", "spawn", "ddp",
            "Data parallel; each rank is a fresh interpreter. Slower start; for libraries that break after fork."
        ),
        Strategy(
            "ddp_find_unused_parameters_true", "fork", "ddp_find_unused",
            "ddp_notebook for a model that leaves some parameters unused in a step (a branch, a frozen head): "
            "DDP then searches the autograd graph for them at every step, which costs time."
        ),
        Strategy(
            "ddp_sharded", "fork", "ddp_sharded",
            "Data parallel with the optimizer state partitioned across ranks (ZeroRedundancyOptimizer): each "
            "rank keeps 1/N of it. The optimizer in the kernel gets the full state back."
        ),
        Strategy(
            "fsdp", "fork", "fsdp",
            "Fully sharded (FSDP2): each rank holds a slice of every weight. For models too big for one device."
        ),
        Strategy(
            "fsdp_cpu_offload", "fork", "fsdp_offload",
            "fsdp with the sharded parameters, gradients and optimizer state kept in host memory (the "
            "CPUOffloadPolicy of FSDP2): the GPU holds the gathered weights of one block at a time; the "
            "optimizer steps on the CPU. For models whose shards do not fit in GPU memory."
        ),
        Strategy(
            "dp", "fork", "dp",
            "DataParallel: one process drives every chosen GPU, splitting each batch across them. CUDA only; "
            "slower than ddp_notebook (one Python process, weights copied every step)."
        ),
        Strategy("auto", "fork", "ddp", "ddp_notebook for more than one device, a single worker for one."),
    )
}

BACKENDS = ("gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl")

# Lightning's precision names; the short forms it accepts map to them.
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
# What each accelerator can run. fp16 on CPU is left out as Lightning does: CPU autocast
# and kernels in float16 are slow or missing, and bf16 is the CPU's reduced precision.
_PRECISION_SUPPORT = {
    "cpu": ("32-true", "64-true", "bf16-mixed", "bf16-true"),
    "cuda": PRECISIONS,
    "mps": ("32-true", "16-mixed", "16-true"),  # MPS has no float64
}


@dataclass(frozen=True)
class LaunchConfig:
    """Everything decided before a launch; nothing here touches a process."""

    plan: DevicePlan
    strategy: Strategy
    backend: str
    timeout: float | None
    on_stop: str = "keep"  # a stop or timeout: "keep" the state at one optimizer step, or "discard" it
    stop_grace: float = 2.0  # the least time ranks get to reach that step (3 x the median step if longer)
    stall_seconds: float | None = 30.0  # no rank moved this long, some waiting on the others: a stall is named
    # What the ranks are told (the model wrapper, precision, sync BN...): StartRun carries it whole.
    rank: RankSettings = field(default_factory=RankSettings)

    @property
    def world_size(self) -> int:
        """Processes (ranks): one under ``dp``, which drives every chosen GPU from one process."""
        return 1 if self.strategy.model_wrapper == "dp" else self.plan.world_size

    def rank_specs(self) -> tuple[RankSpec, ...]:
        """Each rank's number, local rank, world size and device, in rank order (``dp``: one rank on the first GPU)."""
        device_type = self.plan.accelerator
        if self.strategy.model_wrapper == "dp":  # one rank, on the first chosen GPU (DataParallel's output device)
            return (RankSpec(0, 0, 1, device_type, self.plan.device_ids[0]),)
        return tuple(
            RankSpec(rank, rank, self.world_size, device_type, None if device_type == "cpu" else device_id)
            for rank, device_id in enumerate(self.plan.device_ids)
        )


def resolve_strategy(name: str, world_size: int) -> Strategy:
    """The strategy called ``name``; ``auto`` becomes ``ddp_notebook`` (or one plain worker).

    >>> resolve_strategy("auto", 1).model_wrapper
    'none'
    """
    key = str(name).strip().lower()
    if key not in STRATEGIES:
        raise ConfigurationError(
            f"unknown strategy {name!r}. Available strategies: {', '.join(STRATEGIES)}."
        )
    if key == "auto":
        if world_size > 1:
            return STRATEGIES["ddp_notebook"]
        return Strategy("auto", "fork", "none", STRATEGIES["auto"].when_to_use)
    return STRATEGIES[key]


def backend_for(accelerator: str, requested: str | None = None) -> str:
    """gloo on CPU, nccl on CUDA, unless the caller asked for one of ``BACKENDS``.

    >>> backend_for("cuda"), backend_for("cpu")
    ('nccl', 'gloo')
    """
    if requested is not None:
        if requested not in BACKENDS:
            raise ConfigurationError(
                f"unknown process-group backend {requested!r}. Available backends: {', '.join(BACKENDS)}."
            )
        if requested == "nccl" and accelerator != "cuda":
            raise ConfigurationError(
                f"backend 'nccl' needs CUDA devices, but the accelerator is {accelerator!r}; use backend='gloo'."
            )
        return requested
    return "nccl" if accelerator == "cuda" else "gloo"


def resolve_precision(precision: object, accelerator: str) -> str:
    """Lightning's precision name for ``precision``, if ``accelerator`` can run it.

    >>> resolve_precision("bf16", "cpu"), resolve_precision(32, "cuda")
    ('bf16-mixed', '32-true')
    """
    key = str(precision).strip().lower()
    key = PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ConfigurationError(
            f"unknown precision {precision!r}. Available precisions: {', '.join(PRECISIONS)} "
            f"(or {', '.join(PRECISION_ALIASES)})."
        )
    supported = _PRECISION_SUPPORT.get(accelerator, PRECISIONS)
    if key not in supported:
        raise ConfigurationError(
            f"precision {key!r} cannot run on the {accelerator} accelerator. "
            f"Available there: {', '.join(supported)}"
            + (" (bf16-mixed is the CPU's mixed precision)." if accelerator == "cpu" else ".")
        )
    return key


def validate_timeout(timeout: float | None) -> float | None:
    """``None`` (no limit) or a positive number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise ConfigurationError(f"timeout must be a number of seconds or None, not {timeout!r}.")
    if timeout <= 0:
        raise ConfigurationError(f"timeout must be positive (seconds), not {timeout!r}; pass None for no limit.")
    return float(timeout)


def user_thread_count(environ: Mapping[str, str]) -> int | None:
    """The intra-op threads the user asked for with OMP_NUM_THREADS, if they did.

    >>> user_thread_count({"OMP_NUM_THREADS": "3"}), user_thread_count({"OMP_NUM_THREADS": "x"}), user_thread_count({})
    (3, None, None)
    """
    try:
        return max(1, int(environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return None


def intra_op_threads(cpu_count: int, world_size: int, environ: Mapping[str, str]) -> int | None:
    """Intra-op threads for each rank: physical cores / ranks (at least 1).

    ``cpu_count`` is the physical cores (:func:`nbtrain.planning.probe.physical_core_count`): one
    rank then runs the threads torch itself would in the kernel. None when the user set
    OMP_NUM_THREADS: their choice wins. Why it matters: N ranks each running a full-width
    OpenMP pool oversubscribe the cores (2 ranks x 2 threads on 2 cores doubled the step
    time here).

    >>> intra_op_threads(8, 2, {}), intra_op_threads(2, 4, {}), intra_op_threads(8, 2, {"OMP_NUM_THREADS": "3"})
    (4, 1, None)
    """
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cpu_count // max(1, world_size))


def make_config(
    plan: DevicePlan,
    *,
    strategy: str,
    timeout: float | None,
    backend: str | None = None,
    rank_options: Mapping[str, Any] | None = None,
) -> LaunchConfig:
    """Check and combine the settings of one launch.

    ``rank_options``: the launch options the ranks are told (``LaunchOptions.rank_options()``),
    checked here against the devices (a precision they can run; no BatchNorm sync under ``dp``)
    and carried, with the strategy's model wrapper and the backend, in the config's :class:`RankSettings`.

    >>> cfg = make_config(DevicePlan("cuda", (0, 2)), strategy="dp", timeout=None, rank_options={"precision": "bf16"})
    >>> cfg.rank.model_wrapper, cfg.rank.dp_devices, cfg.rank.precision
    ('dp', (0, 2), 'bf16-mixed')
    """
    chosen = resolve_strategy(strategy, plan.world_size)
    told = dict(rank_options or {})
    check_strategy_fits(chosen, plan, bool(told.get("sync_batchnorm")))
    if "precision" in told:
        told["precision"] = resolve_precision(told["precision"], plan.accelerator)
    dp_devices = tuple(plan.device_ids) if chosen.model_wrapper == "dp" else ()  # the rank's own GPU first
    resolved = _backend_for_plan(plan, backend)
    return LaunchConfig(
        plan=plan,
        strategy=chosen,
        backend=resolved,
        timeout=validate_timeout(timeout),
        rank=RankSettings(chosen.model_wrapper, dp_devices, resolved, **told),  # each told option is its field
    )


def _backend_for_plan(plan: DevicePlan, requested: str | None) -> str:
    """:func:`backend_for`, except that ranks sharing a GPU get gloo, and nccl is refused for them."""
    shared = plan.shared_gpus
    if not shared:
        return backend_for(plan.accelerator, requested)
    if requested is not None and "nccl" in requested:
        listed = ",".join(str(index) for index in plan.device_ids)
        raise ConfigurationError(
            f"devices '{listed}' puts more than one rank on GPU {shared[0]}, and backend {requested!r} cannot run "
            "that: nccl refuses a GPU that two ranks of its group share. Use backend='gloo' (--backend gloo), "
            "which can (slower; meant for testing multi-rank code on one GPU), or give each rank its own GPU."
        )
    return backend_for(plan.accelerator, requested or "gloo")


def check_strategy_fits(strategy: Strategy, plan: DevicePlan, sync_batchnorm: bool = False) -> None:
    """Refuse, before any process starts, a strategy the devices cannot run.

    ``dp`` is DataParallel, which scatters each batch over CUDA devices from one process:
    on CPU it would run every replica on the same cores, so the data-parallel way there is
    one process per share, ``ddp_notebook``. SyncBatchNorm needs one process per device,
    and DataParallel has one process in all.

    >>> check_strategy_fits(STRATEGIES["dp"], DevicePlan("cpu", (0, 1)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ConfigurationError: strategy 'dp' (DataParallel) splits each batch over CUDA GPUs from one ...
    """
    if strategy.model_wrapper != "dp":
        return
    if plan.accelerator != "cuda":
        raise ConfigurationError(
            f"strategy 'dp' (DataParallel) splits each batch over CUDA GPUs from one process, and the accelerator "
            f"here is {plan.accelerator!r}; use strategy 'ddp_notebook' for data parallel "
            f"{plan.accelerator.upper() if plan.accelerator == 'mps' else 'CPU'} processes."
        )
    if sync_batchnorm:
        raise ConfigurationError(
            "sync_batchnorm cannot go with strategy 'dp': SyncBatchNorm needs one process per GPU and DataParallel "
            "has one in all; use strategy 'ddp_notebook' (one process per GPU) to sync BatchNorm."
        )


def check_cluster_strategy(strategy: str) -> None:
    """Refuse ``dp`` on a cluster: DataParallel is one process, on one machine's GPUs."""
    if str(strategy).strip().lower() == "dp":
        raise ConfigurationError(
            "strategy 'dp' (DataParallel) is one process on one machine's GPUs and cannot span a cluster's "
            "nodes; use strategy 'ddp_notebook' (one rank per GPU on every node)."
        )
