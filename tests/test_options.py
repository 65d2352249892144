"""The one record of a run's options (nbtrain.options): defaults, checks, merging, and the docs made from it.

Every option is a field of LaunchOptions with one default, one check and one help text;
constructing or replacing the record checks it, a cell's flags and a call's keywords are
merged over the session's with it, and docs/magic.md's tables and ``%%distributed --help`` are
generated from it, so a field missing from either fails here.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import pytest

from nbtrain import options
from nbtrain.errors import ConfigurationError
from nbtrain.kernel import flags
from nbtrain.kernel.magic import DistributedMagics
from nbtrain.livestate import STALL_SECONDS
from nbtrain.options import LaunchOptions

MAGIC_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "magic.md"


def test_every_option_has_one_default_a_check_and_help():
    built_in = LaunchOptions()
    assert built_in == LaunchOptions("auto", "auto", "ddp_notebook", None, STALL_SECONDS, "local", 1)
    for name, info in options.described():
        assert info.help and info.shown_default is not None, name
        assert info.check(getattr(built_in, name)) == getattr(built_in, name), name  # the default passes its check
    with pytest.raises(dataclasses.FrozenInstanceError):
        built_in.devices = 4  # type: ignore[misc]  # frozen: what the test checks


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"strategy": "fsdp9"}, "unknown strategy 'fsdp9'. Available strategies: ddp_notebook, ddp_spawn,"),
        ({"accelerator": "tpu"}, "accelerator='tpu' is not supported; choose one of 'auto', 'cpu', 'cuda', 'gpu'"),
        ({"timeout": -1}, "timeout must be positive (seconds), not -1; pass None for no limit."),
        ({"timeout": "90"}, "timeout must be a number of seconds or None, not '90'."),
        ({"stall_warning": 0}, "stall_warning=0 is not valid: give a positive number of seconds, or None for no "),
        ({"cluster": "a b"}, "cluster='a b' is not valid: pass 'local', 'ray', or a Ray address such as"),
        ({"num_nodes": 2}, "num_nodes=2 needs a cluster: on this machine every rank runs on one node. Pass"),
        ({"cluster": "ray", "num_nodes": 0}, "num_nodes must be a positive whole number of nodes, not 0."),
        ({"precision": "half"}, "unknown precision 'half'. Available precisions: 32-true, 64-true,"),
        ({"sync_batchnorm": "yes"}, "sync_batchnorm='yes' is not valid: pass True or False."),
        ({"oversubscribe": 1}, "oversubscribe=1 is not valid: pass True or False."),
        ({"backend": "tcp"}, "unknown process-group backend 'tcp'. Available backends: gloo, nccl,"),
        ({"debug_hold": -5}, "debug_hold=-5 is not valid: give a positive number of seconds a failed rank"),
        ({"standby_idle": "soon"}, "standby_idle='soon' is not valid: give the seconds standby ranks may wait"),
        ({"on_stop": "later"}, "on_stop='later' is not valid: pass 'keep' (a stop brings back the state"),
        ({"stop_grace": 0}, "stop_grace=0 is not valid: give a positive number of seconds (2 built in)."),
    ],
)
def test_a_bad_value_is_refused_with_one_message_naming_it(changes, message):
    with pytest.raises(ConfigurationError) as refused:
        dataclasses.replace(LaunchOptions(), **changes)
    assert str(refused.value).startswith(message), str(refused.value)


def test_values_are_kept_in_one_form():
    given = dataclasses.replace(
        LaunchOptions(), accelerator=" GPU ", strategy=" DDP_SPAWN ", precision="bf16", backend="GLOO",
        cluster=" LOCAL ", num_nodes=None, standby_idle=0, debug_hold="none", on_stop=" Discard ", timeout=5,
    )
    kept = (given.accelerator, given.strategy, given.precision, given.backend)
    assert kept == ("cuda", "ddp_spawn", "bf16-mixed", "gloo")
    assert (given.cluster, given.num_nodes, given.standby_idle, given.debug_hold) == ("local", 1, None, None)
    assert (given.on_stop, given.timeout) == ("discard", 5.0)


def test_what_is_given_wins_over_the_options_it_is_merged_into():
    session = LaunchOptions(devices="2", accelerator="cpu", timeout=60, precision="bf16")
    merged = session.merged({"timeout": None, "strategy": "ddp_spawn"})
    assert (merged.devices, merged.accelerator, merged.precision) == ("2", "cpu", "bf16-mixed")  # the session's
    assert (merged.timeout, merged.strategy) == (None, "ddp_spawn")  # what was given
    on_ray = LaunchOptions(cluster="ray", num_nodes=2)
    assert on_ray.merged({"cluster": "local"}).num_nodes == 1  # another cluster does not take the nodes
    assert on_ray.merged({"devices": 4}).num_nodes == 2
    assert on_ray.merged({"cluster": "ray", "num_nodes": 3}).num_nodes == 3


def test_the_magic_line_gives_each_option_that_differs_from_the_built_in_one():
    line = LaunchOptions(devices=[0, 2], timeout=90, sync_batchnorm=True, oversubscribe=True).magic_line()
    assert line == (
        "%%distributed --devices 0,2 --accelerator auto --strategy ddp_notebook --timeout 90 --sync-batchnorm"
        " --allow-oversubscribe"
    )


def test_the_keywords_of_launch_are_the_options_that_are_not_only_the_sessions():
    assert options.keywords() == {name for name, _ in options.described()} - {
        "stall_warning", "debug_hold", "standby_idle"
    }


def test_what_takes_options_lists_them_from_the_record():
    # Adding an option is its field: set_defaults, launch/start, the flags and the form read the record,
    # and no public docstring keeps a list of them by hand (one that names most of them is such a list).
    import nbtrain
    from nbtrain.kernel import client

    names = [name for name, _ in options.described()]
    with pytest.raises(TypeError, match=re.escape(f"it takes {', '.join(names)}.")):
        nbtrain.set_defaults(nope=1)
    with pytest.raises(TypeError, match=re.escape(f"its launch options are {', '.join(sorted(options.keywords()))}.")):
        nbtrain.start(print, nope=1)
    parser_flags = {flag for action in DistributedMagics.distributed.parser._actions for flag in action.option_strings}
    assert {flag for _, info in options.flagged() for flag in (info.flag, info.no_flag) if flag} <= parser_flags
    for public in (nbtrain.launch, nbtrain.start, client.start, nbtrain.set_defaults, nbtrain.launcher,
                   DistributedMagics.distributed):
        named = {name for name in names if f"``{name}" in (public.__doc__ or "")}
        assert len(named) <= len(names) // 2, f"{public.__qualname__}'s docstring lists options by hand: {named}"


def _page_table(header: str) -> str:
    text = MAGIC_PAGE.read_text(encoding="utf-8")
    start = text.index(header)
    end = text.find("\n\n", start)  # a table ends at a blank line, or where the page ends
    return text[start:end if end >= 0 else len(text.rstrip())]


def _update_page(old: str, new: str) -> str:
    """The table docs/magic.md has; NBTRAIN_UPDATE_DOCS=1 first writes the generated one there (after a new option)."""
    if os.environ.get("NBTRAIN_UPDATE_DOCS") == "1" and old != new:
        MAGIC_PAGE.write_text(MAGIC_PAGE.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
        return new
    return old


def test_the_magic_page_flag_table_is_the_one_generated_from_the_record():
    generated = flags.flag_table()
    table = _update_page(_page_table("| flag | values | default |"), generated)
    assert table == generated, "docs/magic.md's flag table is stale: run this test with NBTRAIN_UPDATE_DOCS=1"
    listed = set(re.findall(r"^\| `(--[a-z-]+)`", table, re.MULTILINE))
    assert {info.flag for _, info in options.flagged()} <= listed


def test_the_magic_page_session_table_is_the_one_generated_from_the_record():
    generated = options.markdown_table(("keyword", "sets", "built-in default"), options.session_rows())
    table = _update_page(_page_table("| keyword | sets | built-in default |"), generated)
    assert table == generated, "docs/magic.md's table of session defaults is stale: run with NBTRAIN_UPDATE_DOCS=1"
    assert set(re.findall(r"^\| `([a-z_]+)`", table, re.MULTILINE)) == {name for name, _ in options.described()}


def test_the_magics_help_lists_every_flag_with_the_records_help():
    help_text = " ".join(flags.help_text(DistributedMagics.distributed).split())
    for _, info in options.flagged():
        assert info.flag in help_text, info.flag
        assert " ".join(info.help.replace("`", "").rstrip(".").split()) in help_text, info.flag
    for flag in flags.CELL_FLAGS:
        assert all(name in help_text for name in flag.flags)


# -- num_nodes (checked with the cluster) -------------------------------------------------
@pytest.mark.parametrize("num_nodes", [None, 1])
def test_one_node_or_none_is_one_node_with_or_without_a_cluster(num_nodes: int | None) -> None:
    assert options.validate_num_nodes(num_nodes, None) == 1
    assert options.validate_num_nodes(num_nodes, "ray") == 1


@pytest.mark.parametrize("cluster", [None, "local", " Local "])
def test_several_nodes_without_a_cluster_are_refused_saying_what_to_pass(cluster: str | None) -> None:
    with pytest.raises(ConfigurationError) as caught:
        options.validate_num_nodes(2, cluster)
    text = str(caught.value)
    assert text.startswith("num_nodes=2 needs a cluster: on this machine every rank runs on one node.")
    assert "Pass cluster='ray' (or %%distributed --cluster ray)" in text


@pytest.mark.parametrize("num_nodes", [0, -1, 2.5, "2", True])
def test_a_number_of_nodes_that_is_not_a_positive_whole_number_is_refused_naming_it(num_nodes: object) -> None:
    refusal = f"num_nodes must be a positive whole number of nodes, not {num_nodes!r}."
    with pytest.raises(ConfigurationError, match=re.escape(refusal)):
        options.validate_num_nodes(num_nodes, "ray")
