"""The %%distributed magic (nbtrain.kernel.magic) in a real Jupyter kernel (ipykernel, driven by nbclient).

Its registration and its flags, and its second name ``%%nbtrain`` beside another package's
``%%distributed`` (nbdistributed, loaded before nbtrain and after it: a kernel each); running a
cell is tests/test_cellrun.py, its errors tests/test_tracebacks.py, what it writes
tests/test_display_owntext.py. One kernel serves the module's other tests (starting one costs seconds).
"""

from __future__ import annotations

import psutil
import pytest

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("--devices two", "devices='two' is not valid"),
        (
            "--strategy zero",
            (
                "unknown strategy 'zero'. Available strategies: ddp_notebook, ddp_spawn, "
                "ddp_find_unused_parameters_true, ddp_sharded, fsdp, fsdp_cpu_offload, dp, auto"
            ),
        ),
        ("--output loud", "argument --output: invalid choice: 'loud'"),
        ("--timeout soon", "argument --timeout: invalid float value: 'soon'"),
        ("--timeout -3", "timeout must be positive"),
        ("--accelerator tpu", "tpu"),
        ("--devices 2 --frobnicate", "unrecognized arguments: --frobnicate. The flags are --devices, --accelerator,"),
        ("--devicez 2", "unrecognized arguments: --devicez 2. Did you mean --devices?"),
        ("--timeout soon", "'soon'. --timeout: Stop every rank after this many seconds; none: no limit."),
        ("--num-nodes x", "argument --num-nodes: --num-nodes takes a whole number of nodes, not 'x'."),
        ("--devices '2", "cannot read the flags \"--devices '2\": No closing quotation. Close the quote,"),
    ],
)
def test_bad_flags_give_one_clear_line(kernel, flags, expected):
    out = kernel.run(f"%%distributed {flags}\nprint('ran')\n")
    # IPython shows a UsageError as one line on stderr, never with a traceback
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: %%distributed: "), out.text
    assert expected in lines[0] and out.error is None and "ran" not in out.stdout
    if "argument" in lines[0] or "cannot read the flags" in lines[0]:  # argparse's or shlex's: where to look
        assert lines[0].endswith("%%distributed --help (or %%distributed?) says what each flag takes."), lines[0]


def test_help_documents_every_flag(kernel):
    help_text = kernel.run_ok("%%distributed --help\nprint('ran')\n").stdout
    doc = kernel.value("get_ipython().find_cell_magic('distributed').__doc__")  # what %%distributed? shows
    for text in (help_text, doc):
        assert "%%distributed [-h]" in text
        for flag in ("--devices", "--accelerator", "--strategy", "--timeout", "--output", "--no-auto", "-h, --help"):
            assert flag in text, (flag, text)
    assert help_text.startswith("%%distributed [-h]") and "\nran\n" not in help_text and "ddp_spawn" in doc


def test_nbtrain_is_the_same_magic_and_its_help_names_it(kernel):
    owners = kernel.value(
        "[get_ipython().find_cell_magic(name).__self__.__class__.__name__ if name == 'distributed'"
        " else get_ipython().find_cell_magic(name).__module__ for name in ('distributed', 'nbtrain')]"
    )
    assert owners == ["DistributedMagics", "nbtrain.kernel.magic"]
    help_text = kernel.run_ok("%%nbtrain --help\nprint('ran')\n").stdout
    doc = kernel.value("get_ipython().find_cell_magic('nbtrain').__doc__")  # what %%nbtrain? shows
    for text in (help_text, doc):
        assert "%%nbtrain [-h]" in text and "%%distributed" not in text, text
        assert "%%nbtrain --devices 2 --strategy ddp_notebook" in text  # the example, under its name
        for flag in ("--devices", "--accelerator", "--strategy", "--timeout", "--output", "--no-auto", "-h, --help"):
            assert flag in text, (flag, text)
    assert help_text.startswith("%%nbtrain [-h]") and "\nran\n" not in help_text
    # %%distributed's own help is unchanged by its second name
    assert kernel.value("get_ipython().find_cell_magic('distributed').parser.prog") == "%distributed"


def test_load_ext_registers_the_magics_once_and_wraps_debug_once(kernel):
    kernel.run_ok("%load_ext nbtrain")  # a second time: nothing registered twice
    magics = kernel.value(
        "[sorted(m for m in get_ipython().magics_manager.magics[kind]"
        " if m in ('distributed', 'nbtrain', 'nbtrain_debug', 'debug')) for kind in ('cell', 'line')]"
    )
    assert magics == [["debug", "distributed", "nbtrain"], ["debug", "nbtrain_debug"]]  # IPython's %%debug: its own
    debug = "get_ipython().magics_manager.magics['line']['debug']"
    assert kernel.value(f"getattr({debug}, 'nbtrain_wrapped', False)") is True


def test_unload_ext_gives_ipythons_debug_back_and_load_ext_wraps_it_again(kernel):
    debug = "get_ipython().magics_manager.magics['line']['debug']"
    kernel.run_ok("%unload_ext nbtrain")
    assert kernel.value(f"getattr({debug}, 'nbtrain_wrapped', False)") is False
    assert kernel.value(f"{debug}.__self__.__class__.__name__") == "ExecutionMagics"  # IPython's own
    kernel.run_ok("%load_ext nbtrain")
    assert kernel.value(f"getattr({debug}, 'nbtrain_wrapped', False)") is True


def test_load_ext_watches_the_standby_ranks_gpu_memory_around_each_cell_once_and_unload_ext_stops(kernel):
    hooks = (
        "[[c.__qualname__ for c in get_ipython().events.callbacks[e] if c.__module__.startswith('nbtrain')]"
        " for e in ('pre_run_cell', 'post_run_cell')]"
    )
    # standbyview's, and importedmodules' (what each cell imports, for the ranks)
    watched = [["before_cell", "CellImports.before_cell"], ["after_cell", "CellImports.after_cell"]]
    assert kernel.value(hooks) == watched
    kernel.run_ok("%load_ext nbtrain")  # loaded again: still once
    assert kernel.value(hooks) == watched
    kernel.run_ok("%unload_ext nbtrain")
    assert kernel.value(hooks) == [[], []]
    kernel.run_ok("%load_ext nbtrain")
    assert kernel.value(hooks) == watched


def test_nbtrain_debug_without_a_held_rank_says_how_to_get_one(kernel):
    out = kernel.run("%nbtrain_debug")
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("UsageError: %nbtrain_debug: no rank is held for a post-mortem"), out.text
    assert "nbtrain.set_defaults(debug_hold=600)" in lines[0]


# --- another package's %%distributed (nbdistributed, which also registers %%rank) -----------------

THEIRS = "nbdistributed.magic"
TWO_RANKS = (
    "%%nbtrain --devices 2 --accelerator cpu\n"
    "import nbtrain, torch, torch.distributed as dist\n"
    "total = torch.tensor([nbtrain.rank() + 1.0])\n"
    "dist.all_reduce(total)\n"
    "print('rank', nbtrain.rank(), 'of', nbtrain.world_size())\n"
    "ranks, total = nbtrain.world_size(), float(total)\n"
)
LEFT_NOTE = (
    "nbtrain: %%distributed belongs to nbdistributed here (loaded before nbtrain), so nbtrain left it; "
    "use %%nbtrain for nbtrain's cells, with the same flags (%%nbtrain --devices 2; %%nbtrain --help lists them)."
)
OWNER = "get_ipython().find_cell_magic({name!r}).__self__.__class__.__module__"


def _their_workers(kernel) -> list[str]:
    """Processes of nbdistributed's under the kernel: its %dist_init starts them, loading it must not."""
    found = []
    for process in kernel.descendants():
        try:
            command = " ".join(process.cmdline())
        except psutil.NoSuchProcess:  # gone meanwhile: not running, then
            continue
        if "nbdistributed" in command:
            found.append(f"{process.pid}: {command}")
    return found


def _kernel_loading(*extensions: str):
    """A kernel that loads ``extensions`` in order; yields it and what each %load_ext showed; shut down after."""
    from kernel_helpers import NotebookKernel

    kernel = NotebookKernel()
    try:
        shown = [kernel.run_ok(f"%load_ext {name}") for name in extensions]
        yield kernel, shown
    finally:
        kernel.shutdown()  # every process it started, by PID


@pytest.fixture(scope="module")
def theirs_first():
    yield from _kernel_loading("nbdistributed", "nbtrain")


@pytest.fixture(scope="module")
def theirs_after():
    yield from _kernel_loading("nbtrain", "nbdistributed")


def test_nbtrain_leaves_a_distributed_magic_it_finds_and_says_what_to_type(theirs_first):
    kernel, (_, loaded) = theirs_first
    assert loaded.stdout.strip().splitlines() == [LEFT_NOTE], loaded.text
    assert kernel.value(OWNER.format(name="distributed")) == THEIRS
    assert kernel.value(OWNER.format(name="rank")) == THEIRS
    assert kernel.value("get_ipython().find_cell_magic('nbtrain').__module__") == "nbtrain.kernel.magic"
    assert _their_workers(kernel) == []  # only their %dist_init starts workers


def test_a_nbtrain_cell_runs_on_two_ranks_where_another_package_holds_distributed(theirs_first):
    kernel, _ = theirs_first
    out = kernel.run_ok(TWO_RANKS)
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout, out.text
    assert kernel.value("[ranks, total]") == [2, 3.0]  # the ranks' results, back in the kernel
    assert kernel.value(OWNER.format(name="distributed")) == THEIRS  # running ours changed nothing of theirs
    assert _their_workers(kernel) == []


def test_what_nbtrain_says_and_writes_names_nbtrain_where_another_holds_distributed(theirs_first):
    kernel, _ = theirs_first
    out = kernel.run("%%nbtrain --devicez 2\nprint('ran')\n")
    assert out.stderr.strip().splitlines() == [(
        "UsageError: %%nbtrain: unrecognized arguments: --devicez 2. Did you mean --devices? "
        "%%nbtrain --help (or %%nbtrain?) says what each flag takes."
    )], out.text
    out = kernel.run("%%nbtrain --devices 2 --accelerator cpu\n\n")
    empty = "UsageError: %%nbtrain: the cell is empty; put the code to run on every rank below the %%nbtrain line."
    assert out.stderr.strip().splitlines() == [empty], out.text
    assert kernel.value("__import__('nbtrain').get_defaults().magic_line()").startswith("%%nbtrain --devices ")
    form = kernel.value("repr(__import__('nbtrain').launcher())")  # the launcher form's line to copy
    assert form.startswith("<nbtrain launcher: %%nbtrain --devices "), form
    assert kernel.value("__import__('nbtrain.kernel.shell', fromlist=['x']).magic_name()") == "%%nbtrain"


def test_a_nbtrain_cell_still_runs_after_another_package_took_distributed(theirs_after):
    kernel, (ours, theirs) = theirs_after
    assert LEFT_NOTE not in ours.text and LEFT_NOTE not in theirs.text  # nbtrain loaded first: it had the name
    assert kernel.value(OWNER.format(name="distributed")) == THEIRS  # the last to load takes %%distributed
    out = kernel.run_ok(TWO_RANKS)
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout, out.text
    assert kernel.value("[ranks, total]") == [2, 3.0]
    # from then on nbtrain names the magic that is still its own
    assert kernel.value("__import__('nbtrain').get_defaults().magic_line()").startswith("%%nbtrain --devices ")
    assert _their_workers(kernel) == []
