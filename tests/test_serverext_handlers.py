"""nbtrain's Jupyter server extension under jupyter_server's own pytest plugin (a real server, in process).

Every route of nbtrain.serverext.handlers is asked through HTTP, as the sidebar asks it; the
functions behind them are tested on their own in tests/test_serverext_runs.py and
tests/test_serverext_usage.py.

The registry records here name real processes this test starts (``sleep`` in a session
of its own, as a rank leads its own process group), so stop and clean-up are checked on
what they do to processes: the right ones end, any other is never signalled.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("pytest_jupyter") is None:  # pragma: no cover - the browser extra is missing
    if os.environ.get("NBTRAIN_SKIP_BROWSER_TESTS") != "1":
        raise ImportError("pytest-jupyter is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')")
    pytest.skip("NBTRAIN_SKIP_BROWSER_TESTS=1 and pytest-jupyter is missing", allow_module_level=True)

from tornado.httpclient import HTTPClientError

from helpers import procs
from nbtrain.system import processes, registry

pytest_plugins = ["pytest_jupyter.jupyter_server"]

GONE_SECONDS = 10.0


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbtrain.serverext": True}}}


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "registry"))
    return tmp_path / "registry"


@pytest.fixture
def stand_ins():
    """Processes standing in for ranks (or for a process that is no rank): killed by pid at the end."""
    started: list[subprocess.Popen] = []

    def start(new_session: bool = True) -> subprocess.Popen:
        process = subprocess.Popen(["sleep", "120"], start_new_session=new_session)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def _me() -> dict:
    """This test process as the run's kernel and launcher: both alive."""
    me = os.getpid()
    return {
        "kernel_pid": me,
        "kernel_start": processes.start_time(me),
        "launcher_pid": me,
        "launcher_start": processes.start_time(me),
    }


def _record(run_id: str, ranks: list[subprocess.Popen], **fields) -> registry.RunRecord:
    triples = tuple((rank, p.pid, processes.start_time(p.pid)) for rank, p in enumerate(ranks))
    values = {"state": "running", "kernel_id": "k-1", "notebook": "train.ipynb", "started": 1.0, **_me(), **fields}
    record = registry.RunRecord(id=run_id, world_size=len(ranks), ranks=triples, **values)
    registry.write(record)
    return record


async def _get(jp_fetch, *path):
    response = await jp_fetch("nbtrain", "api", *path)
    return json.loads(response.body)


async def test_runs_lists_every_record_with_its_state_and_pids(jp_fetch, stand_ins):
    ranks = [stand_ins(), stand_ins()]
    _record("aa-1", ranks, step=12, loss=0.5, losses=(1.0, 0.5), steps_per_second=4.0)
    (run,) = await _get(jp_fetch, "runs")
    assert run["id"] == "aa-1" and run["state"] == "running" and run["world_size"] == 2
    assert run["kernel_id"] == "k-1" and run["pids"] == [p.pid for p in ranks]
    assert run["live_pids"] == [p.pid for p in ranks] and run["losses"] == [1.0, 0.5]
    assert run["notebook"] == "train.ipynb" and run["step"] == 12 and run["steps_per_second"] == 4.0


async def test_each_run_names_its_notebook_as_the_contents_api_does(jp_fetch, jp_root_dir, stand_ins):
    # jupyter_server gives a kernel its notebook as a file system path (JPY_SESSION_NAME).
    _record("aa-9", [stand_ins()], notebook=str(jp_root_dir / "sub" / "train.ipynb"), started=1.0)
    _record("aa-10", [stand_ins()], notebook="/elsewhere/other.ipynb", started=2.0)
    inside, outside = await _get(jp_fetch, "runs")
    assert inside["path"] == "sub/train.ipynb" and inside["notebook"] == str(jp_root_dir / "sub" / "train.ipynb")
    assert outside["path"] is None  # outside the server's root: nothing the front end can open


def _passwd(tmp_path, people: int) -> str:
    """A passwd file with root, a service account and ``people`` human accounts."""
    lines = ["root:x:0:0::/root:/bin/bash", "svc:x:999:999::/:/usr/sbin/nologin"]
    lines += [f"p{i}:x:{1000 + i}:{1000 + i}::/home/p{i}:/bin/bash" for i in range(people)]
    path = tmp_path / f"passwd-{people}"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("people", [1, 3])
async def test_on_a_machine_of_several_people_each_reachable_run_says_what_and_what_to_do(
    jp_fetch, stand_ins, tmp_path, monkeypatch, people
):
    from nbtrain.system import sharedhost

    # The machine's accounts, as /etc/passwd lists them (the one boundary faked: the suite's
    # machine has one person).
    monkeypatch.setattr(sharedhost, "PASSWD", _passwd(tmp_path, people))
    _record("aa-1", [stand_ins()], reachable="the nccl backend is not covered (only CPU runs on gloo are)")
    _record("aa-2", [stand_ins()], started=2.0)  # covered: nobody else could reach it
    reachable, covered = await _get(jp_fetch, "runs")
    assert covered["shared_host"] is None
    if people == 1:
        assert reachable["shared_host"] is None
        return
    said = reachable["shared_host"]
    assert said.startswith("nbtrain: this machine has 3 user accounts, and this run's process-group sockets")
    assert "the nccl backend is not covered" in said and "standby_idle=None" in said
    assert said == sharedhost.sentence("the nccl backend is not covered (only CPU runs on gloo are)", 3)


async def test_every_route_refuses_a_request_without_the_token(jp_fetch, stand_ins):
    _record("aa-1", [stand_ins()])
    routes = (
        ("GET", "runs", None),
        ("GET", "devices", None),
        ("POST", "runs/aa-1/stop", b""),
        ("POST", "runs/aa-1/clean", b""),
    )
    for method, path, body in routes:
        with pytest.raises(HTTPClientError) as refused:
            await jp_fetch("nbtrain", "api", *path.split("/"), method=method, body=body, headers={"Authorization": ""})
        assert refused.value.code == 403, path
    assert registry.read("aa-1").state == "running" and not registry.stop_requested("aa-1")


async def test_stop_signals_the_ranks_and_leaves_a_stop_request(jp_fetch, stand_ins):
    ranks = [stand_ins(), stand_ins()]
    _record("aa-2", ranks)
    response = await jp_fetch("nbtrain", "api", "runs", "aa-2", "stop", method="POST", body=b"")
    outcome = json.loads(response.body)
    assert sorted(outcome["signalled"]) == sorted(p.pid for p in ranks) and outcome["refused"] == []
    assert [p.wait(timeout=GONE_SECONDS) for p in ranks] == [-15, -15]
    assert registry.stop_requested("aa-2")


async def test_stop_never_signals_a_pid_that_is_not_the_runs_rank(jp_fetch, stand_ins):
    other = stand_ins()
    # The record names other's pid with another start time: the pid was reused (or the record is forged).
    stale = registry.RunRecord(
        id="aa-3", world_size=1, state="running", ranks=((0, other.pid, processes.start_time(other.pid) - 1),), **_me()
    )
    registry.write(stale)
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("nbtrain", "api", "runs", "aa-3", "stop", method="POST", body=b"")
    assert refused.value.code == 409
    outcome = json.loads(refused.value.response.body)
    assert outcome["refused"] == [other.pid] and outcome["signalled"] == []
    assert "started at another time than the run's ranks did" in outcome["message"]
    with pytest.raises(subprocess.TimeoutExpired):
        other.wait(timeout=1.5)  # past the SIGKILL that follows a stop: still running


async def test_a_process_outside_its_own_group_is_no_rank(jp_fetch, stand_ins):
    shares_our_group = stand_ins(new_session=False)
    _record("aa-4", [shares_our_group])
    response = await jp_fetch("nbtrain", "api", "runs", "aa-4", "stop", method="POST", body=b"")
    assert json.loads(response.body)["signalled"] == []
    with pytest.raises(subprocess.TimeoutExpired):
        shares_our_group.wait(timeout=1.5)


async def test_a_run_whose_kernel_is_gone_is_orphaned_until_cleaned_up(jp_fetch, stand_ins):
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    gone_start = processes.start_time(gone.pid)
    await gone.wait()
    ranks = [stand_ins(), stand_ins()]
    _record("aa-5", ranks, kernel_pid=gone.pid, kernel_start=gone_start or 1)
    (run,) = await _get(jp_fetch, "runs")
    assert run["state"] == "orphaned" and run["recorded_state"] == "running"
    await jp_fetch("nbtrain", "api", "runs", "aa-5", "clean", method="POST", body=b"")
    assert [p.wait(timeout=GONE_SECONDS) for p in ranks] == [-9, -9]
    assert await _get(jp_fetch, "runs") == []


async def test_stop_works_after_the_kernel_died(jp_fetch, stand_ins):
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    gone_start = processes.start_time(gone.pid)
    await gone.wait()
    ranks = [stand_ins(), stand_ins()]
    _record("aa-8", ranks, kernel_pid=gone.pid, kernel_start=gone_start or 1)
    response = await jp_fetch("nbtrain", "api", "runs", "aa-8", "stop", method="POST", body=b"")
    assert sorted(json.loads(response.body)["signalled"]) == sorted(p.pid for p in ranks)
    assert [p.wait(timeout=GONE_SECONDS) for p in ranks] == [-15, -15]


async def test_a_live_run_cannot_be_cleaned_up_before_it_is_stopped(jp_fetch, stand_ins):
    rank = stand_ins()
    _record("aa-6", [rank])
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("nbtrain", "api", "runs", "aa-6", "clean", method="POST", body=b"")
    assert refused.value.code == 409 and b"stop it first" in refused.value.response.body
    assert rank.poll() is None and registry.read("aa-6") is not None


async def test_an_unknown_run_is_404_with_what_to_do(jp_fetch):
    with pytest.raises(HTTPClientError) as missing:
        await jp_fetch("nbtrain", "api", "runs", "nope-1", "stop", method="POST", body=b"")
    assert missing.value.code == 404 and b"Refresh the list of runs" in missing.value.response.body


async def test_devices_reports_host_and_each_live_ranks_memory(jp_fetch, stand_ins):
    ranks = [stand_ins(), stand_ins()]
    _record("aa-7", ranks)
    devices = await _get(jp_fetch, "devices")
    assert devices["gpus"] == []  # no NVIDIA driver on CI machines
    host = devices["host"]
    assert host["cpus"] >= 1 and 0 < host["memory_used"] < host["memory_total"] and 0 <= host["cpu_percent"] <= 100
    shown = {(r["run"], r["rank"], r["pid"]) for r in devices["ranks"]}
    assert shown == {("aa-7", 0, ranks[0].pid), ("aa-7", 1, ranks[1].pid)}
    assert all(r["rss"] > 0 for r in devices["ranks"])


@pytest.fixture
def template_on(tmp_path, monkeypatch):
    """The warm template switched on, in a directory of this test's; its templates killed after."""
    folder = tmp_path / "template"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("NBTRAIN_TEMPLATE", "1")
    monkeypatch.setenv("NBTRAIN_TEMPLATE_DIR", str(folder))
    yield str(folder)
    found = procs.template_pids(str(folder))
    procs.kill_pids(found)
    assert procs.wait_gone(found, GONE_SECONDS, reaped=False) == []


async def test_the_server_starts_the_warm_template_as_it_starts(template_on, jp_serverapp):
    deadline = asyncio.get_running_loop().time() + 60
    while not [name for name in os.listdir(template_on) if name.endswith(".sock")]:
        assert asyncio.get_running_loop().time() < deadline, "the server started no template"
        await asyncio.sleep(0.05)
    assert len(procs.template_pids(template_on)) == 1
