"""The errors nbtrain raises: their classes, fields and messages (nbtrain.errors).

Every message names the value, says why it is a problem and says what to do; these tests
match on that text.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys

import pytest

from nbtrain import errors
from nbtrain.errors import (
    ClusterError,
    ConfigurationError,
    LauncherError,
    NbtrainError,
    NodeLostError,
    RankDiedError,
    RankError,
    RankStartError,
    RunFailedError,
    RunInterrupted,
    RunStoppedError,
    RunTimeoutError,
    SerializationError,
    UnusedParametersError,
)

TRACEBACK = 'Traceback (most recent call last):\n  File "<cell>", line 3, in <module>\nValueError: bad batch\n'


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (ConfigurationError, ValueError),
        (LauncherError, RuntimeError),
        (RunFailedError, RuntimeError),
        (RunTimeoutError, TimeoutError),
        (SerializationError, TypeError),
        (UnusedParametersError, RuntimeError),
        (ClusterError, RuntimeError),
    ],
)
def test_each_error_is_also_the_builtin_a_caller_would_catch(error, builtin):
    assert issubclass(error, NbtrainError) and issubclass(error, builtin)


@pytest.mark.parametrize(
    "error", [RankError, RankDiedError, RankStartError, RunTimeoutError, RunStoppedError, NodeLostError]
)
def test_every_way_a_run_fails_is_a_run_failed_error(error):
    assert issubclass(error, RunFailedError)


def test_an_interrupt_is_not_an_exception_that_except_exception_swallows():
    with pytest.raises(KeyboardInterrupt):
        try:
            raise RunInterrupted("the run was interrupted and every rank was stopped.")
        except Exception:  # noqa: BLE001 - the point: this must not catch it
            pytest.fail("RunInterrupted was caught by `except Exception`")
    assert RunInterrupted("x")._render_traceback_() == ["KeyboardInterrupt: x"]


def test_a_rank_error_names_the_rank_the_exception_and_carries_the_remote_traceback():
    err = RankError(1, "ValueError", "bad batch", TRACEBACK, note="the kernel's objects are unchanged")
    text = str(err)
    assert text.startswith(
        "rank 1 raised ValueError: bad batch\nThe other ranks were stopped. Traceback from rank 1:\n"
    )
    assert 'File "<cell>", line 3' in text and text.endswith(
        "ValueError: bad batch\nthe kernel's objects are unchanged"
    )
    assert (err.rank, err.exc_type, err.exc_message, err.node) == (1, "ValueError", "bad batch", "")


def test_a_rank_error_renders_in_ipython_as_the_remote_traceback_only():
    lines = RankError(2, "KeyError", "'x'", TRACEBACK, node="node 1 (10.0.0.7)")._render_traceback_()
    assert lines[:3] == [
        "RankError: rank 2 on node 1 (10.0.0.7) raised KeyError: 'x'",
        "(the other ranks were stopped)",
        "",
    ]
    assert lines[3:] == TRACEBACK.rstrip().splitlines()  # no note: nothing after it


@pytest.mark.parametrize(
    ("signal_number", "advice"),
    [
        (
            signal.SIGKILL,
            "ran out of memory (the kernel's OOM killer): use a smaller batch or model, or fewer devices.",
        ),
        (signal.SIGSEGV, "A segmentation fault is a crash in native code"),
        (signal.SIGTERM, "rank 0 was killed by signal 15 (SIGTERM). The other ranks were stopped."),
    ],
)
def test_a_rank_killed_by_a_signal_names_it_and_says_what_it_likely_means(signal_number, advice):
    err = RankDiedError(0, signal_number=signal_number)
    assert str(err).startswith(f"rank 0 was killed by signal {signal_number} ({signal.Signals(signal_number).name}).")
    assert advice in str(err) and str(err).endswith("The other ranks were stopped.")
    assert (err.rank, err.signal_number, err.exit_code) == (0, signal_number, None)


def test_an_unknown_signal_number_is_still_described():
    assert errors.describe_death(1, signal_number=200, exit_code=None).startswith(
        "rank 1 was killed by signal 200 (unknown signal)."
    )


def test_a_rank_that_exited_early_says_with_which_code_and_the_likely_causes():
    text = str(RankDiedError(3, exit_code=7, node="node 2 (10.0.0.8)"))
    assert text == (
        "rank 3 on node 2 (10.0.0.8) exited with code 7 before finishing its work"
        " (a call to sys.exit/os._exit, or a crash in native code). The other ranks were stopped."
    )


@pytest.mark.parametrize(
    ("error_name", "advice"),
    [
        ("EAGAIN", "A limit on processes is reached"),
        ("ENOMEM", "not enough memory to create another process"),
        ("EMFILE", "(ulimit -n)"),
        ("ENFILE", "The system has too many open files"),
        ("EPERM", "Use fewer devices, or check the limits of this machine."),  # no specific advice
    ],
)
def test_a_rank_that_could_not_start_names_the_error_and_what_to_do(error_name, advice):
    text = str(RankStartError(3, 8, error_name, "the reason"))
    assert text.startswith(f"could not start rank 3 of 8: creating its process failed with {error_name} (the reason). ")
    assert advice in text and text.endswith("The run ended; the 3 already started were stopped.")


def test_a_first_rank_that_could_not_start_says_none_had_started():
    assert str(RankStartError(0, 2, "EAGAIN", "x")).endswith("The run ended; none had started.")


def test_a_timeout_names_the_limit_and_how_to_raise_it_and_keeps_where_ranks_were_apart():
    err = RunTimeoutError(2.5, where="rank 0: in train (cell 3, line 4)")
    assert err.headline == (
        "the run exceeded timeout=2.5 s and every rank was stopped. "
        "Raise `timeout` (or pass timeout=None) if the run needs longer."
    )
    assert str(err) == err.headline + "\nrank 0: in train (cell 3, line 4)"
    assert isinstance(err, TimeoutError) and err.timeout == 2.5
    assert str(RunTimeoutError(600)) == RunTimeoutError(600).headline  # nothing known about where


def test_a_stopped_run_renders_as_its_message_in_ipython():
    err = RunStoppedError("the run was stopped with the Stop button.", where="rank 0: in step")
    assert err._render_traceback_() == ["RunStoppedError: the run was stopped with the Stop button.", "rank 0: in step"]


def test_a_lost_node_names_it_and_what_happens_next():
    text = str(NodeLostError("node 1 (10.0.0.7)", "its agent exited"))
    assert text.startswith("node 1 (10.0.0.7) was lost during the run: its agent exited. ")
    assert "the next run starts new nbtrain agents" in text


def test_unused_parameters_are_listed_up_to_a_limit_with_both_fixes():
    names = [f"layer{i}.weight" for i in range(11)]
    err = UnusedParametersError("Net", names, trainable=20, shown=8)
    text = str(err)
    assert text.startswith("Net has 11 of its 20 trainable parameters that got no gradient in the first step: ")
    assert "layer7.weight and 3 more." in text and "layer8.weight" not in text
    assert "--strategy ddp_find_unused_parameters_true" in text and ".requires_grad_(False)" in text
    assert err.names == names and err.model == "Net"


@pytest.mark.parametrize(
    "error",
    [
        RankError(1, "ValueError", "bad batch", TRACEBACK, note="n", node="node 1 (10.0.0.7)"),
        RankDiedError(1, signal_number=9),
        RankStartError(2, 4, "EAGAIN", "Resource temporarily unavailable"),
        RunTimeoutError(3.0, where="rank 0: in step"),
        RunStoppedError("stopped", where="rank 1: in step"),
        NodeLostError("node 1", "its agent exited"),
        UnusedParametersError("Net", ["head.weight"], 4),
        ConfigurationError("--devices 3: this machine has 2 GPUs. Pass --devices 2."),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_survive_pickling_with_their_message_and_fields(error):
    # Users keep failures (joblib, multiprocessing, a saved list of runs): the copy must read the same.
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)


def test_the_module_imports_only_the_standard_library():
    heavy = "('torch', 'IPython', 'numpy', 'cloudpickle')"
    code = f"import sys, nbtrain.errors; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
