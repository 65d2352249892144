"""The launcher's records in the run registry (nbtrain.launch_server.registryentries), in a private folder.

A Board is fed what the launcher sees (a StartRun, its ranks' pids, rank 0's Metrics, the
end) and writes real registry files; each test reads them back through nbtrain.system.registry.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from nbtrain.kernel import client
from nbtrain.launch_server import registryentries
from nbtrain.messages import events
from nbtrain.planning import config
from nbtrain.planning.deviceplan import DevicePlan
from nbtrain.system import processes, registry

CHILD_SECONDS = 10.0


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    private = tmp_path / "runs"
    private.mkdir(mode=0o700)
    return private


def start_run(run_id: int, folder: Path, **environ: str) -> events.StartRun:
    cfg = config.make_config(DevicePlan("cpu", (0, 1)), strategy="ddp_notebook", timeout=None)
    start = client._StartMessage(cfg, b"", has_tensor_file=False, with_log=False)(run_id)
    env = {**start.environ, registry.DIRECTORY_VARIABLE: str(folder), **environ}
    return dataclasses.replace(start, environ=env)


def board() -> registryentries.Board:
    me = os.getpid()
    return registryentries.Board(
        registryentries.Owner("k-1", me, processes.start_time(me), me, processes.start_time(me))
    )


def records(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def metrics(step: int, when: float, **values: float) -> events.Metrics:
    return events.Metrics(1, 0, ((step, when, values),))


def test_a_started_run_is_written_at_once_with_its_ranks_and_their_start_times(folder):
    b = board()
    me = os.getpid()
    b.start(start_run(1, folder, JPY_SESSION_NAME="/home/u/train.ipynb"), [(0, me), (1, me)])
    (record,) = records(folder).values()
    assert record["id"] == f"{b.prefix}-1" and record["state"] == "running" and record["world_size"] == 2
    assert record["ranks"] == [[0, me, processes.start_time(me)], [1, me, processes.start_time(me)]]
    assert (record["notebook"], record["strategy"], record["accelerator"]) == (
        "/home/u/train.ipynb",
        "ddp_notebook",
        "cpu",
    )
    assert (record["kernel_id"], record["launcher_pid"]) == ("k-1", me)


def test_a_run_records_why_other_users_could_reach_its_process_group(folder):
    b = board()
    b.start(start_run(1, folder, NBTRAIN_PRIVATE_NETWORK="0"), [])
    place = events.NodePlace(node_rank=0, num_nodes=2, local_world_size=2, master_addr="10.0.0.1")
    b.start(dataclasses.replace(start_run(2, folder, NBTRAIN_PRIVATE_NETWORK="0"), node=place), [])
    b.start(start_run(3, folder), [])
    found = {record["id"].rsplit("-", 1)[1]: record["reachable"] for record in records(folder).values()}
    # This process never tried to make the namespaces: a covered run is said to be covered.
    assert found == {"1": "NBTRAIN_PRIVATE_NETWORK=0 is set", "2": None, "3": None}


def test_rank_0s_metrics_give_step_loss_rate_and_a_loss_point_a_second(folder):
    b = board()
    b.start(start_run(1, folder), [])
    run = b.get(1)
    assert run is not None
    run.on_metrics(metrics(10, 100.0, loss=2.0))
    run.on_metrics(metrics(30, 102.0, loss=1.0))
    run.on_metrics(metrics(40, 102.5, loss=0.5))  # under a second after the last point: no new point
    run.on_metrics(events.Metrics(1, 1, ((99, 103.0, {"loss": 9.0}),)))  # not rank 0: ignored
    assert (run.record.step, run.record.loss, run.record.losses) == (40, 0.5, (2.0, 1.0))
    assert run.record.steps_per_second == pytest.approx(30 / 2.5)
    run.on_metrics(metrics(200, 106.0, accuracy=0.9))  # no "loss": the first value stands in
    assert run.record.loss == 0.9 and run.record.losses == (2.0, 1.0, 0.9)
    assert run.record.steps_per_second == pytest.approx((200 - 30) / 4.0)  # over the last 5 s only


def test_changes_are_written_at_most_once_a_second(folder):
    b = board()
    b.start(start_run(1, folder), [])
    run = b.get(1)
    assert run is not None
    run.on_metrics(metrics(5, 1.0, loss=1.0))
    assert b.tick(run.written + registryentries.WRITE_SECONDS / 2) == [] and run.dirty  # too soon: not written
    assert records(folder)[run.record.id]["step"] is None
    b.tick(run.written + registryentries.WRITE_SECONDS)
    assert records(folder)[run.record.id]["step"] == 5 and not run.dirty


def test_a_stop_request_from_outside_is_reported_by_tick(folder):
    b = board()
    b.start(start_run(1, folder), [])
    run = b.get(1)
    assert run is not None
    (folder / f"{run.record.id}.stop").write_text("")
    assert b.stop_requested(1)
    assert b.tick(run.written + registryentries.WRITE_SECONDS) == [1]


def test_an_ended_run_is_written_kept_for_a_while_and_forgotten_at_close(folder, monkeypatch):
    monkeypatch.setattr(registryentries, "KEEP_ENDED", 2)
    b = board()
    for run_id in (1, 2, 3):
        b.start(start_run(run_id, folder), [])
        (folder / f"{b.prefix}-{run_id}.stop").write_text("")
        b.end(run_id, events.FINISHED)
    kept = records(folder)
    assert sorted(kept) == [f"{b.prefix}-2", f"{b.prefix}-3"]  # the oldest ended run went
    assert all(r["state"] == "finished" and r["ended"] for r in kept.values())
    assert list(folder.glob("*.stop")) == []  # their stop requests did their work
    b.end(99, events.FINISHED)  # a run it never tracked: nothing
    b.close()
    assert records(folder) == {}


def test_a_held_rank_is_listed_until_released_and_a_dismissed_record_stays_gone(folder):
    b = board()
    held = "rank 1 (pid 42) kept for %nbtrain_debug, holding 244 MiB of host memory"
    for run_id in (1, 2):
        b.start(start_run(run_id, folder), [])
        b.end(run_id, events.FAILED, held)
    assert [r["held"] for r in records(folder).values()] == [held, held]
    assert b.released(1) is False  # its debugger ended: the record says nothing is held
    assert records(folder)[f"{b.prefix}-1"]["held"] is None
    registry.remove(f"{b.prefix}-2", str(folder))  # the sidebar's Dismiss, which killed the rank
    assert b.released(2) is True
    assert sorted(records(folder)) == [f"{b.prefix}-1"]  # not written back
    assert b.released(2) is False  # released once


def test_a_registry_open_to_others_turns_the_registry_off_and_the_run_goes_on(folder, capfd):
    folder.chmod(0o777)
    b = board()
    b.start(start_run(1, folder), [])
    assert not b.enabled and b.get(1) is None and records(folder) == {}
    assert "nbtrain launcher: the run registry is off: nbtrain's run registry" in capfd.readouterr().err
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777  # left as it was


def test_the_kernel_id_is_read_from_its_connection_file_on_its_command_line():
    kernel_command = ["sh", "-c", "echo ready; read line", "-f", "/run/jupyter/kernel-3f2a_b-9.json"]
    kernel = subprocess.Popen(kernel_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert kernel.stdout is not None and kernel.stdout.readline() == b"ready\n"  # its command line is set
        owner = registryentries.find_owner(kernel.pid)
        assert owner.kernel_id == "3f2a_b-9" and owner.kernel_pid == kernel.pid
        assert owner.kernel_start == processes.start_time(kernel.pid) and owner.launcher_pid == os.getpid()
    finally:
        kernel.kill()
        kernel.wait(CHILD_SECONDS)
        for pipe in (kernel.stdin, kernel.stdout):
            if pipe is not None:
                pipe.close()
    assert registryentries.find_owner(kernel.pid).kernel_id is None  # gone: no command line to read
