"""The collector's hold around a launch: nesting, the caller's own choice, the timer, a real run."""

from __future__ import annotations

import gc
import os
import threading

import pytest

import nbtrain
from helpers.procs import finish
from nbtrain.kernel import gcpause


@pytest.fixture(autouse=True)
def collector_on():
    """Each test starts with the collector on and leaves it on."""
    assert gc.isenabled()
    yield
    gc.enable()


def test_holds_nest_and_the_last_release_turns_the_collector_back_on():
    first, second = gcpause.hold_collections(), gcpause.hold_collections()
    first.release()
    assert not gc.isenabled()
    second.release()
    assert gc.isenabled()


def test_a_caller_that_turned_the_collector_off_keeps_it_off():
    gc.disable()
    hold = gcpause.hold_collections()
    hold.release_later(0.0)
    hold.release()
    assert not gc.isenabled()


def test_the_timer_releases_a_hold_nobody_released():
    hold = gcpause.hold_collections()
    hold.release_later(0.01)
    assert hold.released.wait(timeout=5.0)
    assert gc.isenabled()


def test_releasing_first_cancels_the_timer():
    hold = gcpause.hold_collections()
    hold.release_later(60.0)
    hold.release()
    assert gc.isenabled()
    assert hold not in gcpause._deadlines  # nothing left for the timer to do in 60 s


def test_one_thread_times_every_hold_of_the_process():
    """Starting a thread per launch cost the kernel a millisecond just as its ranks start."""
    holds = [gcpause.hold_collections() for _ in range(3)]
    holds[0].release_later(0.01)
    releaser = gcpause._releaser
    assert releaser is not None and releaser.is_alive()
    holds[1].release_later(0.02)
    holds[2].release_later(60.0)
    assert gcpause._releaser is releaser
    assert holds[0].released.wait(timeout=5.0) and holds[1].released.wait(timeout=5.0)
    assert not gc.isenabled()  # the third still holds it
    holds[2].release()
    assert gc.isenabled()
    assert [t.name for t in threading.enumerate()].count("nbtrain-gc-hold") == 1


def test_a_process_forked_during_a_hold_collects_again():
    hold = gcpause.hold_collections()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether its collector is on, and leave at once
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(write)
        try:
            assert os.read(read, 1) == b"1"
        finally:
            os.close(read)
            os.waitpid(pid, 0)
        assert not gc.isenabled()  # the parent still holds it
    finally:
        hold.release()
    assert gc.isenabled()


def test_a_run_holds_the_collector_while_its_ranks_start_and_its_end_gives_it_back(launcher):
    run = nbtrain.start(lambda: 7, devices=2, accelerator="cpu")
    held_while_starting = not gc.isenabled()
    assert finish(run) == 7
    assert held_while_starting
    assert gc.isenabled()  # the run ended before the hold's timer: its end released it


def test_a_launch_that_fails_to_serialise_gives_the_collector_back(launcher):
    stream = (i for i in range(3))
    with pytest.raises(nbtrain.SerializationError):
        nbtrain.launch(lambda: next(stream), devices=2, accelerator="cpu")
    assert gc.isenabled()
