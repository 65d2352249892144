"""The records between the kernel, the launcher and the ranks (nbtrain.messages.events)."""

from __future__ import annotations

import dataclasses
import inspect
import socket
import subprocess
import sys

import pytest

from nbtrain.messages import events, wire

SPEC = events.RankSpec(rank=1, local_rank=1, world_size=2, device_type="cpu", device_index=None)
START = events.StartRun(
    run_id=3,
    payload=b"\x80\x05cloudpickled",
    ranks=(events.RankSpec(0, 0, 2, "cpu", None), SPEC),
    start_method="fork",
    environ={"OMP_NUM_THREADS": "1"},
    cwd="/tmp",
    sys_path=("/tmp",),
    source_lines={"<cell 1>": ("x = 1\n",)},
    timeout=None,
    node=events.NodePlace(0, 2, 2, "10.0.0.7", label="node 0 (10.0.0.7)"),
    rank_settings=events.RankSettings("ddp", precision="bf16-mixed", sync_batchnorm=True),
)
FAILED = events.RankFailed(3, 1, "ValueError", "bad batch", "Traceback ...\nValueError: bad batch\n")

# One example of every record; a record added to events.py must be added here (checked below).
EXAMPLES: list[object] = [
    SPEC,
    START,
    START.node,
    START.rank_settings,
    events.StoreListening(3, 29500),
    events.RanksDone(3),
    events.ReleaseRanks(3),
    events.StopRun(3, "stopped with the Stop button"),
    events.StopRun(3, "interrupted", graceful=True),
    events.StopStep(3, 412, 2.0),
    events.StepsBegun(3, 412, 2.0, events.STOPPED),
    events.StepChosen(3, 412, 2.0),
    events.RankStarted(3, 0, 4242),
    events.Output(3, 1, "stdout", "epoch 1\n"),
    events.Display(3, 1, {"text/plain": "<Figure size 640x480 with 1 Axes>", "image/png": "iVBORw0K"}, {}, "auto-0",
                   label="Figure"),
    events.Displayed(3),
    events.OutputSkipped(3, 1, 5000, (("stdout", "line 5000"),)),
    events.Metrics(3, 0, ((1, 1700000000.0, {"loss": 0.5}),)),
    events.TrackerCalls(3, 0, ((140000, ("add_scalar",), ("accuracy", 0.5, 1), {}),)),
    events.MemorySample(3, 0, 200 << 20, cuda_allocated_bytes=1 << 20, time=1.5),
    FAILED,
    events.RankExited(3, 1, exit_code=None, signal_number=9, reported=False),
    events.RankExited(3, 0, None, 6, False, collectives=("rank 0: all_reduce of 4 float32 elements, its 8th",)),
    events.NodeLost(3, "node 1 (10.0.0.8)", "its agent exited"),
    events.RankNotStarted(3, 1, 2, "EAGAIN", "Resource temporarily unavailable"),
    events.RunEnded(3, events.FAILED, failure=FAILED, stacks=((0, "Thread 0x1 (most recent call first):"),)),
    events.RunEnded(3, events.STOPPED, result=b"r", stopped_at=412),
    events.RunEnded(3, events.STOPPED, stop_note="stopped hard (rank 1 did not reach step 412 within 2.0 s)"),
    events.RanksWaiting(3, (0,), 10.4, ((1, "Current thread 0x00007f (most recent call first):\n"),), ((0, 8), (1, 7))),
    events.RanksStalled(3, 31.0, ((0, "all_reduce of 4 float32 elements", 8, True),), ((1, "Thread 0x1:\n"),), "node"),
    events.RanksStalled(3, 0.0),
    events.RankDone(3, 0, result=b"42", regions=((0x7F00, 8, 0),), total_bytes=8),
    events.ResultOffer(3, 4242, b"r", ((0x7F00, 8, 0),), 8),
    events.ReleaseResult(3, send_file=True),
    events.SendResultFile(3),
    events.RankAssignment(START, SPEC, 29500, 4000),
    events.Release(3),
    events.LauncherReady(4000, ("torch",)),
    events.DebugOutput(3, 1, "> Cell In[5](3)<module>()\n"),
    events.DebugPrompt(3, 1, "(Pdb) ", post_mortem=True),
    events.DebugInput(3, 1, "p x.shape"),
    events.DebugEnded(3, 1),
    events.DebugQuit(3, 0),
    events.RankHeld(3, 1, 4242, 300 << 20, None, 600.0, "cpu"),
    events.AttachHeld(3, 1),
    events.ReleaseHeld(3, "the next launch needs its devices"),
    events.HeldReleased(3, 1, "its debugger ended"),
    events.StandbyReady(1),
    events.StandbyChanged(((0, 4001), (1, 4002)), "2 cuda ranks, nccl", (0, 1), ready=True),
    events.ReleaseStandby(),
    events.NotebookModules(("fastai", "fastai.callback.schedule")),
]


def records() -> list[type]:
    return [
        c
        for _, c in inspect.getmembers(events, inspect.isclass)
        if dataclasses.is_dataclass(c) and c.__module__ == events.__name__
    ]


def test_every_record_has_an_example_here():
    assert {type(e) for e in EXAMPLES} == set(records())


@pytest.mark.parametrize("record", records(), ids=lambda c: c.__name__)
def test_every_record_is_frozen(record):
    assert record.__dataclass_params__.frozen
    example = next(e for e in EXAMPLES if type(e) is record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        example.run_id = 99  # type: ignore[attr-defined]  # every record refuses a new value, named or not


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_record_crosses_a_channel_unchanged(example):
    a, b = socket.socketpair()
    try:
        wire.send(a, example)
        assert wire.receive(b) == (example, [])
    finally:
        a.close()
        b.close()


def test_records_compare_and_hash_by_value():
    assert events.StopRun(3) == events.StopRun(3, "stopped") and events.StopRun(3) != events.StopRun(4)
    assert len({events.RanksDone(1), events.RanksDone(1), events.RanksDone(2)}) == 2


def test_an_output_tag_names_the_rank_and_on_a_cluster_its_node():
    assert events.Output(1, 2, "stderr", "x\n").tag == "[rank 2]"
    assert events.Output(1, 2, "stdout", "x\n", node="node 0 (10.0.0.7)").tag == "[rank 2, node 0 (10.0.0.7)]"


def test_the_run_states_are_the_words_the_live_view_shows():
    assert (events.FINISHED, events.FAILED, events.STOPPED, events.TIMED_OUT) == (
        "finished",
        "failed",
        "stopped",
        "timed out",
    )


def test_defaults_describe_a_run_on_one_machine_that_has_not_failed():
    start = dataclasses.replace(START, node=None)
    assert (start.rank_settings.threads_per_rank, start.has_tensor_file, start.log_path, start.node) == (
        None, False, None, None,
    )
    ended = events.RunEnded(1, events.FINISHED, result=b"r")
    assert (ended.failure, ended.detail, ended.stacks, ended.has_tensor_file) == (None, "", (), False)
    assert events.LauncherReady(1).preloaded == ()


def test_the_module_imports_only_the_standard_library():
    # The launcher relays these records without importing torch or the user's code.
    heavy = "('torch', 'IPython', 'numpy', 'cloudpickle')"
    code = f"import sys, nbtrain.messages.events; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_rank_settings_are_typed_fields_and_nothing_else():
    told = START.rank_settings
    assert (told.model_wrapper, told.precision, told.sync_batchnorm, told.dp_devices) == ("ddp", "bf16-mixed", True, ())
    with pytest.raises(AttributeError):
        _ = told.nope  # no mapping behind it: a setting a rank reads is a field
    with pytest.raises(TypeError, match="nope"):
        events.RankSettings(nope=1)
