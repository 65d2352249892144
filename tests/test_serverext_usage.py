"""What the sidebar's device list shows (nbtrain.serverext.usage): GPUs through NVML, the host, each rank.

The host figures are compared with /proc, read here independently. The GPUs come from a
simulated NVML (``tests/helpers/fake_nvml``) in a real subprocess, as in tests/test_freegpus.py;
the ranks are real processes (``sleep`` in a session of its own, as a rank leads its group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nbtrain.planning import probe
from nbtrain.serverext import usage
from nbtrain.system import processes, registry

GIB = 2**30
FAKE_NVML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "fake_nvml")
SUBPROCESS_SECONDS = 60


@pytest.fixture(autouse=True)
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.DIRECTORY_VARIABLE, str(tmp_path / "registry"))
    return tmp_path / "registry"


@pytest.fixture
def ranks():
    """Two processes standing in for a run's ranks: killed and reaped by pid at the end."""
    started = [subprocess.Popen(["sleep", "120"], start_new_session=True) for _ in range(2)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def _record(run_id: str, members: list[subprocess.Popen], state: str = "running") -> registry.RunRecord:
    me = os.getpid()
    record = registry.RunRecord(
        id=run_id,
        world_size=len(members),
        state=state,
        ranks=tuple((rank, p.pid, processes.start_time(p.pid) or 0) for rank, p in enumerate(members)),
        kernel_pid=me,
        kernel_start=processes.start_time(me),
        launcher_pid=me,
        launcher_start=processes.start_time(me),
    )
    registry.write(record)
    return record


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as file:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in file}


def test_the_host_sample_is_this_machines_cpus_and_memory():
    sampler = usage.HostSampler()
    first, second = sampler.sample(), sampler.sample()  # back to back: measured over a short moment
    memory = _meminfo()
    for host in (first, second):
        assert host["cpus"] == probe.cpu_count() and 0.0 <= host["cpu_percent"] <= 100.0
        assert host["memory_total"] == memory["MemTotal"]
        assert 0 < host["memory_used"] < host["memory_total"]


def test_each_live_rank_of_a_running_run_is_listed_with_its_memory(ranks):
    _record("gp-1", ranks)
    ranks[1].kill()
    ranks[1].wait()
    shown = usage.snapshot(usage.HostSampler())
    assert [(r["run"], r["rank"], r["pid"]) for r in shown["ranks"]] == [("gp-1", 0, ranks[0].pid)]  # not the dead one
    assert shown["ranks"][0]["rss"] > 0
    assert shown["ranks"][0]["gpu_memory"] is None  # no GPU here holds it


SNAPSHOT = """
import json
from nbtrain.serverext import usage
print(json.dumps(usage.snapshot(usage.HostSampler())))
"""


def test_each_gpu_and_what_each_rank_holds_on_them_through_nvml(ranks, registry_dir):
    _record("gp-2", ranks)
    machine = {
        "gpus": [
            {"uuid": "GPU-aa11", "name": "NVIDIA A100", "total": 80 * GIB, "free": 60 * GIB,
             "processes": [{"pid": ranks[0].pid, "used": 12 * GIB}]},
            {"uuid": "GPU-bb22", "name": "NVIDIA A100", "total": 80 * GIB, "free": 70 * GIB,
             "processes": [{"pid": ranks[0].pid, "used": 2 * GIB}, {"pid": ranks[1].pid, "used": 8 * GIB}]},
        ]
    }
    path = os.pathsep.join(p for p in (FAKE_NVML, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "NBTRAIN_FAKE_NVML": json.dumps(machine), "NBTRAIN_PREWARM": "0"}
    done = subprocess.run(
        [sys.executable, "-c", SNAPSHOT], env=env, capture_output=True, text=True, timeout=SUBPROCESS_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(g["index"], g["memory_used"], g["memory_total"]) for g in shown["gpus"]] == [
        (0, 20 * GIB, 80 * GIB),
        (1, 10 * GIB, 80 * GIB),
    ]
    held = {r["pid"]: r["gpu_memory"] for r in shown["ranks"]}
    assert held == {ranks[0].pid: 14 * GIB, ranks[1].pid: 8 * GIB}  # summed over the GPUs
