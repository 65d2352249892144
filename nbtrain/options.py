"""Every launch option once: its default, its check and its help, in one frozen record.

:class:`LaunchOptions` is what a run is asked to be: the session defaults
(``nbtrain.set_defaults``) are one, a ``%%distributed`` cell's flags are merged over them,
``nbtrain.launch`` / ``nbtrain.start`` build one from their keywords, the launcher form
writes one, and the cluster engine plans from one. Each field carries an :class:`Option`
in its metadata: the check that turns a value as the user gave it into the value kept
(raising a ConfigurationError that names it), the flag that sets it in a cell, and its
help, from which ``%%distributed --help`` and docs/magic.md's flag table are generated; whether
the ranks are told it (``rank``: it then travels in the run's
:class:`~nbtrain.messages.events.RankSettings`) and how the launcher form shows it (``control``).
Constructing the record (or ``dataclasses.replace`` on it) checks every field, so a record
that exists is a valid one. Pure: it imports no torch and starts nothing.

Example:
    >>> import dataclasses
    >>> options = dataclasses.replace(LaunchOptions(), devices=2, accelerator=" CPU ", precision="bf16")
    >>> options.accelerator, options.precision, options.on_this_machine
    ('cpu', 'bf16-mixed', True)
    >>> dataclasses.replace(options, stop_grace=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbtrain.errors.ConfigurationError: stop_grace=0 is not valid: give a positive number of seconds (2 built in).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbtrain.errors import ConfigurationError
from nbtrain.livestate import STALL_SECONDS
from nbtrain.planning import config
from nbtrain.planning import deviceplan as devices_module
from nbtrain.planning.deviceplan import DevicePlan

DEBUG_HOLD_SECONDS = 600.0  # how long a failed run's root-cause rank waits, idle, for %nbtrain_debug
STANDBY_IDLE_SECONDS = 600.0
ON_STOP = ("keep", "discard")
_DEVICE_FORMS = "pass a number of devices, -1, 'auto' or GPU indices"


@dataclass(frozen=True)
class Control:
    """How the launcher form (:mod:`nbtrain.kernel.display.form`) shows an option: read from here.

    ``kind``: ``dropdown`` (of ``choices``: values, or (label, value) pairs), ``combobox``
    (``choices`` offered, anything typed in; ``placeholder`` when empty), ``checkbox``,
    ``seconds`` (a number of seconds), ``count`` (a whole number from 1); "" picks a checkbox
    for a boolean option, a dropdown for one with ``Option.choices``. ``label`` names it (the
    option's name when empty), ``width`` in pixels (0: the control's own). Controls with the
    same ``row`` sit side by side, rows in their numbers' order after the device controls;
    an option that names no row comes last. ``note``: grey text beside it; ``explain``: what
    the chosen value means, shown under it. ``empty``: the option's value for an empty
    control ("", or 0 seconds): None unless said.

    >>> Control(label="sync BatchNorm").row
    100
    """

    kind: str = ""
    label: str = ""
    choices: tuple[Any, ...] = ()
    width: int = 0
    row: int = 100
    note: str = ""
    explain: Mapping[str, str] | None = None
    empty: Any = None
    placeholder: str = ""


@dataclass(frozen=True)
class Option:
    """What the record knows of one option besides its default.

    ``check`` turns a value as the user gave it into the value kept, or raises a
    ConfigurationError naming it. ``flag`` is the ``%%distributed`` flag ("": a session
    default only), ``parse`` what turns the flag's text into a value, ``no_flag`` the flag
    that turns a boolean off. ``help`` is markdown: docs/magic.md's table shows it (with
    ``more``, whose links are relative to docs/, after it), ``--help`` shows it without the
    backticks. ``shown_default`` is how the
    built-in default reads. ``keyword``: ``nbtrain.launch`` and ``nbtrain.start`` take it.
    ``rank``: the ranks are told it as given: it is a field of the same name and default of the run's
    :class:`~nbtrain.messages.events.RankSettings` (tests/test_settings.py checks it has one), and rank
    code reads it from :func:`nbtrain.rank.machinery.settings.current` (``current().precision``), with
    no other plumbing. (An option the ranks are told through the plan, as ``backend`` resolved or
    ``debug_hold`` where a failure can be held, is set on that record where it is built.)
    ``control``: how the launcher form shows it (:mod:`nbtrain.kernel.display.form`; None: not there).

    >>> Option("Seconds.", check=float, flag="--wait").keyword
    True
    """

    help: str
    check: Callable[[Any], Any]
    flag: str = ""
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    no_flag: str = ""
    no_help: str = ""
    shown_default: str = ""
    more: str = ""
    keyword: bool = True
    rank: bool = False
    control: Control | None = None


# -- checks: each takes the value as given and returns the value kept ------------------------


def _devices(devices: Any) -> Any:
    # Kept as given (2, "0,2", [0, 2]): the device planner checks it against the machine
    # and its messages name it as the user wrote it. The session keeps it as flag text.
    return "auto" if devices is None else devices


def devices_text(devices: Any) -> str:
    """``devices`` as ``--devices`` writes it: 2 -> "2", [1] -> "1,", [0, 2] -> "0,2".

    >>> devices_text(2), devices_text([1]), devices_text((0, 2)), devices_text(" auto ")
    ('2', '1,', '0,2', 'auto')
    """
    if devices is None:
        return "auto"
    if isinstance(devices, (bool, float)):
        raise ConfigurationError(f"devices={devices!r} is not valid: {_DEVICE_FORMS}.")
    if isinstance(devices, (list, tuple, range)):
        items = [str(int(item)) for item in devices]
        # As for --devices, a trailing comma makes a one-element list (GPU 1, not one GPU).
        return ",".join(items) + ("," if len(items) == 1 else "")
    text = str(devices).strip()
    if not text or any(ch.isspace() for ch in text):
        raise ConfigurationError(f"devices={devices!r} is not valid: {_DEVICE_FORMS}.")
    return text


def _strategy(strategy: Any) -> str:
    name = str(strategy).strip().lower()
    config.resolve_strategy(name, 2)  # raises, listing the strategies
    return name


def _stall_seconds(seconds: Any) -> float | None:
    if seconds is None:
        return None
    return _positive_seconds("stall_warning", seconds, "a positive number of seconds, or None for no warning")


def _cluster(cluster: Any) -> str:
    text = "local" if cluster is None else str(cluster).strip()
    if not text or any(ch.isspace() for ch in text):
        raise ConfigurationError(
            f"cluster={cluster!r} is not valid: pass 'local', 'ray', or a Ray address such as 'ray://host:10001'."
        )
    return "local" if text.lower() == "local" else text


def _num_nodes(num_nodes: Any) -> Any:
    return 1 if num_nodes is None else num_nodes  # checked with the cluster, in LaunchOptions.__post_init__


def validate_num_nodes(num_nodes: Any, cluster: str | None) -> int:
    """``num_nodes`` as a positive int; refused without a cluster.

    >>> validate_num_nodes(2, "ray")
    2
    """
    if num_nodes is None or (num_nodes == 1 and not isinstance(num_nodes, bool)):
        return 1
    if cluster is None or str(cluster).strip().lower() == "local":
        raise ConfigurationError(
            f"num_nodes={num_nodes!r} needs a cluster: on this machine every rank runs on one node. "
            "Pass cluster='ray' (or %%distributed --cluster ray) to run across the nodes of a Ray cluster."
        )
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigurationError(f"num_nodes must be a positive whole number of nodes, not {num_nodes!r}.")
    return num_nodes


def _precision(precision: Any) -> str:
    return config.resolve_precision(precision, "cuda")  # every name; the machine is checked with the rest


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        """``value`` if it is a bool; anything else is refused, naming the option."""
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name}={value!r} is not valid: pass True or False.")
        return value

    return check


def _backend(backend: Any) -> str | None:
    if backend is None or str(backend).strip().lower() in ("", "default", "none"):
        return None
    name = str(backend).strip().lower()
    config.backend_for("cuda", name)  # raises, listing the backends
    return name


def _positive_seconds(name: str, seconds: Any, wanted: str) -> float:
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(seconds, bool) or not value > 0 or value == float("inf"):
        raise ConfigurationError(f"{name}={seconds!r} is not valid: give {wanted}.")
    return value


def _optional_seconds(name: str, seconds: Any, wanted: str) -> float | None:
    """A positive number of seconds, or None for none (also written ``"none"``)."""
    if seconds is None or (isinstance(seconds, str) and seconds.strip().lower() == "none"):
        return None
    return _positive_seconds(name, seconds, wanted)


def _debug_hold(seconds: Any) -> float | None:
    wanted = "a positive number of seconds a failed rank is kept for %nbtrain_debug, or None (or 'none') to keep none"
    return _optional_seconds("debug_hold", seconds, wanted)


def _standby_idle(seconds: Any) -> float | None:
    if seconds == 0 and not isinstance(seconds, bool):
        return None
    wanted = "the seconds standby ranks may wait (600 built in), or None for no standby ranks"
    return _optional_seconds("standby_idle", seconds, wanted)


def on_stop_text(value: Any) -> str:
    """``on_stop`` checked: "keep" or "discard".

    >>> on_stop_text(" Discard ")
    'discard'
    """
    text = str(value).strip().lower()
    if text not in ON_STOP:
        raise ConfigurationError(
            f"on_stop={value!r} is not valid: pass 'keep' (a stop brings back the state at the last optimizer "
            "step every rank reached) or 'discard' (a stop changes nothing in the kernel)."
        )
    return text


def _stop_grace(seconds: Any) -> float:
    return _positive_seconds("stop_grace", seconds, "a positive number of seconds (2 built in)")


# -- flag texts: what a cell's flag turns into a value -------------------------------------


def num_nodes_flag(text: str) -> int:
    """``--num-nodes``: a whole, positive number of nodes.

    >>> num_nodes_flag("2")
    2
    """
    # ArgumentTypeError: argparse shows its text (a ValueError's would become "invalid value").
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-nodes takes a whole number of nodes, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--num-nodes takes a positive number of nodes, not {text!r}")
    return value


def seconds_flag(text: str) -> float | None:
    """``--timeout``, ``--stall-warning``: seconds, or ``none`` (over a session default that has some).

    >>> seconds_flag("90"), seconds_flag("none")
    (90.0, None)
    """
    if text.strip().lower() in ("none", "off"):
        return None
    return float(text)


seconds_flag.__name__ = "float"  # argparse names the type in its message: "invalid float value: 'soon'"


# -- the record ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOptions:
    """What a run is asked to be: every launch option, with its built-in default.

    ``nbtrain.get_defaults()`` returns the session's; a cell's flags and ``nbtrain.launch``'s
    keywords are merged over one with ``dataclasses.replace``, which checks every value
    (a ConfigurationError names a bad one and what to pass). :func:`described` lists them.

    >>> LaunchOptions("2", "cpu").magic_line()
    '%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook'
    """

    devices: Any = field(default="auto", metadata={"option": Option(
        "how many ranks, or which GPUs: `2`, `-1` (every GPU, or one process per CPU core), `auto` (every GPU, "
        "else 1 process), `0,2` (GPUs 0 and 2), `free:2` (2 GPUs no other process uses, most free memory first; "
        "NVML)",
        _devices, "--devices", shown_default="`auto`",
        more="; `0,0` puts two ranks on GPU 0, for testing multi-rank CUDA code on a one-GPU machine (they use "
        "gloo, as nccl refuses a GPU that two ranks share); too few free GPUs for `free:k` is an error naming each "
        "busy GPU's processes, pid, name and memory, and `nbtrain.find_usable_cuda_devices(2)` returns the same "
        "choice as a list",
    )})
    accelerator: str = field(default="auto", metadata={"option": Option(
        "`auto` (CUDA, then MPS, then CPU), `cpu`, `cuda` (or `gpu`), `mps`",
        devices_module.normalize_accelerator, "--accelerator", shown_default="`auto`",
    )})
    strategy: str = field(default="ddp_notebook", metadata={"option": Option(
        "`ddp_notebook`: data parallel, ranks fork from the warm launcher (fast start) · `ddp_spawn`: data "
        "parallel, each rank a fresh interpreter (for libraries that break after fork) · "
        "`ddp_find_unused_parameters_true`: `ddp_notebook` for a model that leaves some parameters out of a step "
        "(DDP then searches for them every step) · `ddp_sharded`: `ddp_notebook` with the optimizer state "
        "partitioned across ranks (ZeroRedundancyOptimizer) · `fsdp`: fully sharded with FSDP2, each rank holds a "
        "slice of every weight · `fsdp_cpu_offload`: `fsdp` with the shards and the optimizer step in host memory "
        "· `dp`: DataParallel, one process splitting each batch over the chosen GPUs (CUDA only) · `auto`: "
        "`ddp_notebook` for more than one device, a single worker for one",
        _strategy, "--strategy", shown_default="`ddp_notebook`",
        control=Control("dropdown", "strategy", tuple(config.STRATEGIES), width=420, row=2,
                        explain={name: each.when_to_use for name, each in config.STRATEGIES.items()}),
        more=". Without `ddp_find_unused_parameters_true` a model that skips parameters stops at its first step "
        "with an error naming them; `ddp_sharded`'s optimizer in the kernel gets the full state back; "
        "`fsdp_cpu_offload` is FSDP2's `CPUOffloadPolicy` (the GPU holds one block's gathered weights at a time; "
        "on CPU ranks it trains as `fsdp`); `dp` is the notebook fallback, refused on CPU in favour of "
        "`ddp_notebook`, and takes no `--sync-batchnorm`",
    )})
    timeout: float | None = field(default=None, metadata={"option": Option(
        "Stop every rank after this many seconds; `none`: no limit.",
        config.validate_timeout, "--timeout", parse=seconds_flag, shown_default="no limit",
        control=Control("seconds", "timeout (s)", width=220, row=3, note="0: no limit"),
        more=" The stop ends at a step: see `--on-stop`.",
    )})
    stall_warning: float | None = field(default=STALL_SECONDS, metadata={"option": Option(
        "seconds without progress after which the cell names the stall: the live view a rank that logged steps "
        "and then none, and the cell which ranks wait in which collective and where the others are "
        "(see [Failures](failures.md)); `none`: never",
        _stall_seconds, "--stall-warning", parse=seconds_flag, shown_default="30", keyword=False,
    )})
    cluster: str = field(default="local", metadata={"option": Option(
        "where the ranks run: `local` (this machine), `ray` (the Ray cluster in `RAY_ADDRESS`, or the one this "
        "machine belongs to) or a Ray address (`host:6379`, `ray://host:10001`)",
        _cluster, "--cluster", shown_default="`local`", more="; see [On a cluster](cluster.md)",
        control=Control("combobox", "cluster", ("local", "ray"), width=260, row=6, empty="local",
                        placeholder="local, ray, or host:6379"),
    )})
    num_nodes: int = field(default=1, metadata={"option": Option(
        "with `--cluster`: how many nodes the run spans, `--devices` ranks on each",
        _num_nodes, "--num-nodes", parse=num_nodes_flag, shown_default="1",
        control=Control("count", "nodes", width=160, row=6),
    )})
    precision: str = field(default="32-true", metadata={"option": Option(
        "Lightning's names: `32-true` (`32`), `64-true`, `16-mixed` (`16`), `bf16-mixed` (`bf16`), `16-true`, "
        "`bf16-true`. `-mixed` runs the prepared model's forward under autocast (`16-mixed` on CUDA also scales "
        "the loss); `-true` casts the model on the ranks. The kernel's objects keep their dtype",
        _precision, "--precision", shown_default="`32-true`", rank=True,
        control=Control("dropdown", "precision", config.PRECISIONS, width=260, row=4),
        more=". `16-mixed` unscales before each optimizer step, skipping a step whose gradients overflowed; "
        "gradients are still scaled before that step, so clip them with `torch.nn.utils.clip_grad_norm_` only "
        "without `16-mixed`, or use `bf16-mixed`. Under `-true` float inputs are cast to the model's dtype and "
        "half-precision outputs back to float32. `16-*` is refused on CPU (use `bf16-mixed`)",
    )})
    sync_batchnorm: bool = field(default=False, metadata={"option": Option(
        "BatchNorm statistics over every rank's batch (SyncBatchNorm on the ranks); the kernel's model keeps its "
        "plain BatchNorm and gets the synced running statistics",
        _flag("sync_batchnorm"), "--sync-batchnorm", shown_default="off", rank=True,
        control=Control("checkbox", "sync BatchNorm statistics across ranks", row=5),
        no_flag="--no-sync-batchnorm", no_help="plain BatchNorm on each rank, over a session default of "
        "`--sync-batchnorm`",
        more=". On CPU an all-reduce of the batch statistics (torch's SyncBatchNorm is CUDA-only). Refused with "
        "`dp` (one process in all)",
    )})
    backend: str | None = field(default=None, metadata={"option": Option(
        "process-group backend: `gloo`, `nccl`, `mpi`, `cpu:gloo,cuda:nccl`",
        _backend, "--backend", shown_default="gloo on CPU, nccl on CUDA",
        control=Control("dropdown", "backend", (("default (gloo on CPU, nccl on CUDA)", ""), *config.BACKENDS),
                        width=260, row=4),
    )})
    debug_hold: float | None = field(default=DEBUG_HOLD_SECONDS, metadata={"option": Option(
        "seconds a failed run's root-cause rank is kept, idle, for `%nbtrain_debug`; `None`: not kept",
        _debug_hold, shown_default="600", keyword=False,
    )})
    standby_idle: float | None = field(default=STANDBY_IDLE_SECONDS, metadata={"option": Option(
        "seconds standby ranks (the next run's, forked after a run) wait before they end; `None` or 0: none kept",
        _standby_idle, shown_default="600", keyword=False,
    )})
    on_stop: str = field(default="keep", metadata={"option": Option(
        "what an interrupt, a Stop or `--timeout` does: `keep` (every rank ends at the last optimizer step they "
        "all reach; the kernel's objects hold it) or `discard` (every rank stops at once; the kernel keeps what "
        "it had)",
        on_stop_text, "--on-stop", choices=ON_STOP, shown_default="`keep`",
    )})
    stop_grace: float = field(default=2.0, metadata={"option": Option(
        "the least seconds every rank gets to reach the stop step (3 x the median step when longer)",
        _stop_grace, shown_default="2",
    )})
    oversubscribe: bool = field(default=False, metadata={"option": Option(
        "allow more CPU processes than 4 per core (refused otherwise, as a likely typo for a smaller number)",
        _flag("oversubscribe"), "--allow-oversubscribe", shown_default="off",
    )})

    def __post_init__(self) -> None:
        # Each value as given becomes the value kept, or a ConfigurationError naming it.
        for each in dataclasses.fields(LaunchOptions):  # a subclass's own fields have no Option
            object.__setattr__(self, each.name, each.metadata["option"].check(getattr(self, each.name)))
        object.__setattr__(self, "num_nodes", validate_num_nodes(self.num_nodes, self.cluster))

    @property
    def on_this_machine(self) -> bool:
        """True when the ranks run on this machine's launcher, False on a cluster's nodes."""
        return self.cluster == "local"

    def config_for(self, plan: DevicePlan) -> config.LaunchConfig:
        """The launch configuration of these options on ``plan``'s devices (refusing what they cannot run).

        >>> LaunchOptions(strategy="dp").config_for(DevicePlan("cpu", (0, 1)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nbtrain.errors.ConfigurationError: strategy 'dp' (DataParallel) splits each batch over CUDA GPUs ...
        """
        cfg = config.make_config(
            plan, strategy=self.strategy, timeout=self.timeout, backend=self.backend, rank_options=self.rank_options()
        )
        return dataclasses.replace(
            cfg, on_stop=self.on_stop, stop_grace=self.stop_grace, stall_seconds=self.stall_warning
        )

    def rank_options(self) -> dict[str, Any]:
        """The options the ranks are told (``Option(rank=True)``), by name: the run's RankSettings carry them.

        >>> told = LaunchOptions(precision="bf16").rank_options()
        >>> told["precision"], told["sync_batchnorm"]
        ('bf16-mixed', False)
        """
        return {name: getattr(self, name) for name, info in described() if info.rank}

    def magic_line(self, magic: str | None = None) -> str:
        """The ``%%distributed`` line that asks for exactly these settings, to copy into a cell.

        ``magic``: the cell magic it starts with; by default the one that is nbtrain's in this
        kernel (``%%nbtrain`` where another package holds ``%%distributed``).

        >>> LaunchOptions(timeout=90, on_stop="discard").magic_line()
        '%%distributed --devices auto --accelerator auto --strategy ddp_notebook --timeout 90 --on-stop discard'
        >>> LaunchOptions("2", "cpu").magic_line("%%nbtrain")
        '%%nbtrain --devices 2 --accelerator cpu --strategy ddp_notebook'
        """
        if magic is None:
            from nbtrain.kernel import shell  # the one place that decides; it asks IPython only if imported

            magic = shell.magic_name()
        parts = [magic, "--devices", devices_text(self.devices), "--accelerator", self.accelerator]
        parts += ["--strategy", self.strategy]
        built_in = LaunchOptions()
        for name, info in flagged():
            value = getattr(self, name)
            if name in ("devices", "accelerator", "strategy", "num_nodes") or value == getattr(built_in, name):
                continue
            if isinstance(value, bool):
                parts.append(info.flag if value else info.no_flag)
            else:
                parts += [info.flag, _flag_text(value)]
            if name == "cluster":  # the nodes go with the cluster, whatever their number
                parts += ["--num-nodes", str(self.num_nodes)]
        return " ".join(parts)

    def merged(self, given: Mapping[str, Any]) -> LaunchOptions:
        """These options with those ``given`` (a cell's flags, a call's keywords) over them, checked.

        A cluster other than this one does not take its number of nodes: ``--cluster local``
        over a session on two Ray nodes runs here.

        >>> LaunchOptions(cluster="ray", num_nodes=2).merged({"cluster": "local"}).num_nodes
        1
        """
        changes = dict(given)
        if "cluster" in changes and "num_nodes" not in changes and _cluster(changes["cluster"]) != self.cluster:
            changes["num_nodes"] = 1
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The options by name, as ``set_defaults(**options.as_dict())`` takes them back."""
        return dataclasses.asdict(self)


def _flag_text(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def described() -> Iterator[tuple[str, Option]]:
    """Each field of :class:`LaunchOptions` with its :class:`Option`, in the record's order.

    >>> [name for name, _ in described()][:3]
    ['devices', 'accelerator', 'strategy']
    """
    for each in dataclasses.fields(LaunchOptions):
        yield each.name, each.metadata["option"]


def flagged() -> Iterator[tuple[str, Option]]:
    """The options a ``%%distributed`` flag sets."""
    return ((name, info) for name, info in described() if info.flag)


def keywords() -> frozenset[str]:
    """The options ``nbtrain.launch`` and ``nbtrain.start`` take as keywords.

    >>> "devices" in keywords(), "debug_hold" in keywords()
    (True, False)
    """
    return frozenset(name for name, info in described() if info.keyword)


def flag_rows() -> list[tuple[str, str, str]]:
    """(flags, values, default) of each launch option a flag sets: docs/magic.md's rows, in markdown.

    >>> flag_rows()[0][0], flag_rows()[0][2]
    ('`--devices`', 'the session default (`auto`)')
    """
    rows = []
    for _, info in flagged():
        rows.append((f"`{info.flag}`", info.help + info.more, f"the session default ({info.shown_default})"))
        if info.no_flag:
            rows.append((f"`{info.no_flag}`", info.no_help, ""))
    return rows


def session_rows() -> list[tuple[str, str, str]]:
    """(keyword, what it sets, built-in default) of every option: docs/magic.md's table of ``nbtrain.set_defaults``.

    >>> session_rows()[0]
    ('`devices`', 'as `--devices`', '`auto`')
    """
    return [
        (f"`{name}`", f"as `{info.flag}`" if info.flag else info.help + info.more, info.shown_default)
        for name, info in described()
    ]


def markdown_table(header: tuple[str, str, str], rows: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``rows`` under ``header``.

    >>> print(markdown_table(("a", "b", "c"), [("1", "2", "")]))
    | a | b | c |
    |---|---|---|
    | 1 | 2 | |
    """
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|"]
    lines += [("| " + " | ".join(row) + " |").replace("|  |", "| |") for row in rows]
    return "\n".join(lines)
