"""``%%distributed``'s flags (nbtrain.kernel.flags): generated from the record, merged over the session's defaults.

The parser is the magic's own; no kernel is needed to read a line of flags.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from IPython.core.error import UsageError

from nbtrain.kernel import defaults, flags
from nbtrain.kernel.magic import DistributedMagics

MAGIC = DistributedMagics.distributed


@pytest.fixture(autouse=True)
def built_in_defaults() -> Iterator[None]:
    defaults.reset_defaults()
    yield
    defaults.reset_defaults()


def test_a_flag_on_the_cell_wins_and_the_session_fills_in_the_rest():
    defaults.set_defaults(devices=2, accelerator="cpu", timeout=60, precision="bf16", sync_batchnorm=True)
    options = flags.parse_flags(MAGIC, "--timeout none --no-sync-batchnorm --strategy ddp_spawn --output rank0")
    assert (options.devices, options.accelerator, options.precision) == ("2", "cpu", "bf16-mixed")
    assert (options.timeout, options.sync_batchnorm, options.strategy) == (None, False, "ddp_spawn")
    assert (options.output, options.auto, options.background, options.help) == ("rank0", True, False, False)


def test_a_cell_on_another_cluster_does_not_take_the_sessions_nodes():
    defaults.set_defaults(cluster="ray", num_nodes=2)
    assert flags.parse_flags(MAGIC, "--cluster local").num_nodes == 1
    assert flags.parse_flags(MAGIC, "--devices 2").num_nodes == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # one message for num_nodes without a cluster, from the flag as from set_defaults
        ("--num-nodes 2", "%%distributed: num_nodes=2 needs a cluster: on this machine every rank runs on one node."),
        ("--strategy fsdp9", "%%distributed: unknown strategy 'fsdp9'. Available strategies:"),
        ("--stall-warning 0", "%%distributed: --stall-warning 0 is not a positive number of seconds; give one,"),
        ("--on-stop later", "%%distributed: argument --on-stop: invalid choice: 'later'"),
        ("--timeout soon", "'soon'. --timeout: Stop every rank after this many seconds; none: no limit."),
    ],
)
def test_a_bad_flag_is_one_usage_error_naming_it(line, message):
    with pytest.raises(UsageError) as refused:
        flags.parse_flags(MAGIC, line)
    assert message in str(refused.value), str(refused.value)


def test_the_plan_of_a_cell_is_refused_as_a_usage_error():
    options = flags.parse_flags(MAGIC, "--devices 2 --accelerator cpu --precision 16-mixed")
    with pytest.raises(UsageError, match="%%distributed: precision '16-mixed' cannot run on the cpu accelerator"):
        flags.check_flags(options)
    engine, cfg = flags.check_flags(flags.parse_flags(MAGIC, "--devices 2 --accelerator cpu --on-stop discard"))
    assert engine is None and cfg.world_size == 2 and cfg.on_stop == "discard"


def test_the_flag_table_has_a_row_for_every_flag_of_the_parser():
    table = flags.flag_table()
    for action in MAGIC.parser._actions:
        assert all(f"`{name}`" in table for name in action.option_strings), action.option_strings
