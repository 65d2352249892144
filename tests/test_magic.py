"""The %%distributed magic (nbtrain.kernel.magic) in a real Jupyter kernel (ipykernel, driven by nbclient).

Its registration and its flags; running a cell is tests/test_cellrun.py, its errors
tests/test_tracebacks.py, what it writes tests/test_display_cellout.py. One kernel serves
the module (starting one costs seconds).
"""

from __future__ import annotations

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
        assert lines[0].endswith("%%distributed --help (or %distributed?) says what each flag takes."), lines[0]


def test_help_documents_every_flag(kernel):
    help_text = kernel.run_ok("%%distributed --help\nprint('ran')\n").stdout
    doc = kernel.value("get_ipython().find_cell_magic('distributed').__doc__")  # what %%distributed? shows
    for text in (help_text, doc):
        assert "%%distributed [-h]" in text
        for flag in ("--devices", "--accelerator", "--strategy", "--timeout", "--output", "--no-auto", "-h, --help"):
            assert flag in text, (flag, text)
    assert help_text.startswith("%%distributed [-h]") and "\nran\n" not in help_text and "ddp_spawn" in doc


def test_load_ext_registers_the_magics_once_and_wraps_debug_once(kernel):
    kernel.run_ok("%load_ext nbtrain")  # a second time: nothing registered twice
    magics = kernel.value(
        "[sorted(m for m in get_ipython().magics_manager.magics[kind]"
        " if m in ('distributed', 'nbtrain_debug', 'debug')) for kind in ('cell', 'line')]"
    )
    assert magics == [["debug", "distributed"], ["debug", "nbtrain_debug"]]  # IPython's %%debug: its own
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
    assert kernel.value(hooks) == [["before_cell"], ["after_cell"]]
    kernel.run_ok("%load_ext nbtrain")  # loaded again: still once
    assert kernel.value(hooks) == [["before_cell"], ["after_cell"]]
    kernel.run_ok("%unload_ext nbtrain")
    assert kernel.value(hooks) == [[], []]
    kernel.run_ok("%load_ext nbtrain")
    assert kernel.value(hooks) == [["before_cell"], ["after_cell"]]


def test_nbtrain_debug_without_a_held_rank_says_how_to_get_one(kernel):
    out = kernel.run("%nbtrain_debug")
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("UsageError: %nbtrain_debug: no rank is held for a post-mortem"), out.text
    assert "nbtrain.set_defaults(debug_hold=600)" in lines[0]
