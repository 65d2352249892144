"""Experiment trackers in a real kernel on 2 CPU ranks: one run, rank 0's, read back by each tracker's own reader.

Each cell trains on a sharded loader (8 steps a rank) and logs ``10 * rank + step`` at each
step, so rank 0's values are the steps themselves and any other rank's are 10 or more.
Real packages (TensorBoard, wandb offline, MLflow on SQLite, trackio local), no network.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sqlite3
import struct

import psutil
import pytest

from helpers import procs
from kernel_helpers import REGRESSION_SETUP, NotebookKernel

pytestmark = pytest.mark.timeout(600)

HEAD = "%%distributed --devices 2 --accelerator cpu\nimport nbtrain\nr = nbtrain.rank()\n"
LOOP = (
    "model = nn.Linear(8, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "for step, (x, y) in enumerate(loader):\n"
    "    opt.zero_grad()\n"
    "    loss = loss_fn(model(x), y)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    {log}\n"
)
RANK0_STEPS = list(range(8))  # 16 batches of the 256 samples, half on each rank


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
        "TRACKIO_DIR": str(root / "trackio"),
    }
    kernel = NotebookKernel(env=env)
    try:
        kernel.run_ok("%load_ext nbtrain")
        kernel.run_ok(REGRESSION_SETUP + f"import nbtrain\nROOT = {str(root)!r}\n")
        yield kernel, root
    finally:
        kernel.shutdown()


def _tracker_processes(kernel: NotebookKernel) -> list[psutil.Process]:
    """wandb's service (wandb-core) and anything else a tracker started, under the kernel."""
    found = []
    for process in kernel.descendants():
        try:
            if "wandb" in " ".join(process.cmdline()) or "trackio" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _scalars(log_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_a_summary_writer_in_the_cell_writes_one_event_file_of_rank_0s_steps(tracking):
    pytest.importorskip("tensorboard")
    kernel, root = tracking
    out = kernel.run(
        HEAD
        + "from torch.utils.tensorboard import SummaryWriter\n"
        + "writer = SummaryWriter(ROOT + '/tb')\n"
        + "made_dir = writer.log_dir\n"
        + LOOP.format(log="writer.add_scalar('rank_value', 10.0 * r + step, step)")
        + "writer.add_scalars('pair', {'a': 1.0 * step, 'b': 2.0}, step)\n"
        + "writer.add_histogram('weights', model.weight, step)\n"
        + "writer.add_image('image', torch.rand(3, 4, 4), step)\n"
        + "writer.flush()\n"
        + "writer.close()\n"
    )
    assert out.error is None, out.text
    files = glob.glob(f"{root}/tb/events.out.tfevents*")
    assert len(files) == 1, files  # rank 0's; add_scalars' own sub-writers are rank 0's too
    assert _scalars(f"{root}/tb", "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    assert _tags(f"{root}/tb", "histograms") == ["weights"] and _tags(f"{root}/tb", "images") == ["image"]
    metrics = kernel.value("[sorted(row[2]) for row in nbtrain.last_run().metrics[0] if 'rank_value' in row[2]][:1]")
    assert metrics == [["rank_value"]]
    charted = kernel.value("sorted({n for row in nbtrain.last_run().metrics[0] for n in row[2]})")
    assert {"loss", "rank_value", "pair/a", "pair/b"} <= set(charted), charted  # the loss is still captured
    rank_1 = kernel.value("sorted({n for row in nbtrain.last_run().metrics.get(1, ()) for n in row[2]})")
    assert "rank_value" not in rank_1, rank_1  # rank 1's writer logged nothing anywhere


def test_a_tensorboardx_summary_writer_in_the_cell_writes_one_event_file_of_rank_0s_steps(tracking):
    pytest.importorskip("tensorboardX")
    kernel, root = tracking
    out = kernel.run(
        HEAD
        + "from tensorboardX import SummaryWriter\n"
        + "writer = SummaryWriter(ROOT + '/tbx')\n"
        + "made_dir = writer.logdir\n"
        + LOOP.format(log="writer.add_scalar('rank_value', 10.0 * r + step, step)")
        + "writer.add_histogram('weights', model.weight.detach().numpy(), step)\n"
        + "writer.add_image('image', torch.rand(3, 4, 4).numpy(), step)\n"
    )  # left open: closed (flushed) at the cell's end, with a note
    assert out.error is None, out.text
    assert "SummaryWriter(" in out.text and "was still open at the cell's end" in out.text, out.text
    assert len(glob.glob(f"{root}/tbx/events.out.tfevents*")) == 1
    assert _scalars(f"{root}/tbx", "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    assert _tags(f"{root}/tbx", "histograms") == ["weights"] and _tags(f"{root}/tbx", "images") == ["image"]
    assert kernel.value("made_dir") == f"{root}/tbx"
    charted = kernel.value("sorted({n for row in nbtrain.last_run().metrics[0] for n in row[2]})")
    assert {"loss", "rank_value"} <= set(charted), charted


def _tags(log_dir: str, kind: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"images": 0, "histograms": 0})
    events.Reload()
    return sorted(events.Tags()[kind])


def test_wandb_in_the_cell_makes_one_offline_run_and_no_service_is_left(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    out = kernel.run(
        HEAD
        + "import wandb\n"
        + "run = wandb.init(project='one', config={'lr': 0.01})\n"
        + "run_id, run_dir = run.id, run.dir\n"
        + "wandb.config.update({'batch': 16})\n"
        + LOOP.replace("opt = ", "wandb.watch(model, log='all', log_freq=1)\nopt = ").format(
            log="wandb.log({'rank_value': 10.0 * r + step}, step=step)"
        )
        + "run.summary['final'] = 10.0 * r\n"
        + "run.finish()\n"
    )
    assert out.error is None, out.text
    runs = glob.glob(f"{root}/wandb/offline-run-*")
    assert len(runs) == 1, runs
    assert _wandb_history(runs[0], "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    watched = {key for key in _wandb_keys(runs[0]) if key.startswith(("gradients/", "parameters/"))}
    assert {"gradients/weight/values", "parameters/weight/values"} <= watched, watched  # wandb.watch's histograms
    assert not _tracker_processes(kernel)


def _wandb_keys(run_dir: str) -> set[str]:
    """Every key logged to an offline run's history."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(f"{run_dir}/*.wandb")
    keys = set()
    for data in _log_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    return keys


def test_rank_1_starts_no_wandb_service_while_rank_0s_runs(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    go = root / "service-go"
    msg_id = kernel.start_cell(
        HEAD + "import os, time, wandb\nrun = wandb.init(project='service')\nwandb.log({'v': 1.0})\n"
        "print('pid', r, os.getpid(), flush=True)\n"
        f"deadline = time.monotonic() + 120\nwhile not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"  # the test looks at the ranks' processes meanwhile
        "run.finish()\n"
    )
    try:
        text = kernel.wait_for_stream(msg_id, ["pid 0 ", "pid 1 "], timeout=120)
        pids = {int(rank): int(pid) for rank, pid in re.findall(r"pid (\d) (\d+)", text)}
        procs.wait_for(lambda: _wandb_descendants(pids[0]), 30.0, "rank 0's wandb service")  # the check can see one
        assert _wandb_descendants(pids[1]) == [], "rank 1 started a wandb service"
    finally:
        go.touch()
    _, out = kernel.wait_for_reply(msg_id, timeout=120)
    assert out.error is None, out.text


def _wandb_descendants(pid: int) -> list[str]:
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if "wandb" in command:
            found.append(command)
    return found


def _wandb_history(run_dir: str, key: str) -> list[tuple[int, float]]:
    """The (step, value) rows of ``key`` in an offline run's .wandb file, parsed with wandb's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(f"{run_dir}/*.wandb")
    rows = []
    for data in _log_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if key in items:
                rows.append((int(items["_step"]), float(items[key])))
    return rows


def _log_records(path: str) -> list[bytes]:
    """The records of a .wandb file: a 7-byte W&B header, then LevelDB's log format (32 KiB blocks of
    chunks, each with a 7-byte header: checksum, length, kind 1 whole / 2 first / 3 middle / 4 last)."""
    with open(path, "rb") as file:
        data = file.read()
    assert data[:4] == b":W&B", data[:8]
    records, position, pending, block = [], 7, b"", 32768
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's padding
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def test_mlflow_in_the_cell_makes_one_run_in_the_sqlite_store(tracking):
    pytest.importorskip("mlflow")
    kernel, root = tracking
    out = kernel.run(
        HEAD
        + "import mlflow, os\n"
        # artifacts under ROOT, not the kernel's working directory (MLflow's default ./mlruns)
        + "experiment = mlflow.create_experiment('one', artifact_location=ROOT + '/mlartifacts')\n"
        + "active = mlflow.start_run(run_name='one', experiment_id=experiment)\n"
        + "run_id = active.info.run_id\n"
        + "mlflow.log_param('lr', 0.01)\n"
        + "mlflow.log_params({'rank': r, 'batch': 16})\n"
        + LOOP.format(log="mlflow.log_metric('rank_value', 10.0 * r + step, step=step)")
        + "mlflow.log_metrics({'last': 10.0 * r, 'twice': 20.0 * r}, step=step)\n"
        + "os.makedirs(f'{ROOT}/rank{r}', exist_ok=True)\n"
        + "open(f'{ROOT}/rank{r}/note.txt', 'w').write(f'rank {r}')\n"
        + "mlflow.log_artifact(f'{ROOT}/rank{r}/note.txt')\n"
        + "mlflow.end_run()\n"
    )
    assert out.error is None, out.text
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("one").experiment_id])
    assert len(runs) == 1, runs
    history = client.get_metric_history(runs[0].info.run_id, "rank_value")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in RANK0_STEPS]
    assert runs[0].data.params == {"lr": "0.01", "rank": "0", "batch": "16"}
    assert (runs[0].data.metrics["last"], runs[0].data.metrics["twice"]) == (0.0, 0.0)
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id)] == ["note.txt"]
    with open(client.download_artifacts(runs[0].info.run_id, "note.txt", str(root))) as note:
        assert note.read() == "rank 0"
    assert kernel.value("run_id") == runs[0].info.run_id  # the kernel holds rank 0's run id


def test_trackio_in_the_cell_makes_one_run_in_its_local_store(tracking):
    pytest.importorskip("trackio")
    kernel, root = tracking
    out = kernel.run(
        HEAD
        + "import trackio\n"
        + "trackio.init(project='one', name='only')\n"
        + LOOP.format(log="trackio.log({'rank_value': 10.0 * r + step}, step=step)")
        + "trackio.finish()\n"
    )
    assert out.error is None, out.text
    [database] = glob.glob(f"{root}/trackio/one.db")
    with sqlite3.connect(database) as connection:
        names = connection.execute("select distinct run_name from metrics").fetchall()
        rows = connection.execute("select step, metrics from metrics order by step").fetchall()
    assert names == [("only",)], names
    values = [(step, json.loads(metrics).get("rank_value")) for step, metrics in rows]
    assert [(s, v) for s, v in values if v is not None] == [(s, float(s)) for s in RANK0_STEPS]


def test_a_run_left_open_is_closed_at_the_cells_end_and_the_summary_says_so(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    before = set(glob.glob(f"{root}/wandb/offline-run-*"))
    out = kernel.run(
        HEAD + "import wandb\nrun = wandb.init(project='open')\n" + LOOP.format(log="wandb.log({'v': 10.0 * r + step})")
    )
    assert out.error is None, out.text
    assert "was still open at the cell's end: nbtrain closed it on rank 0" in out.text, out.text
    [made] = set(glob.glob(f"{root}/wandb/offline-run-*")) - before
    assert [v for _, v in _wandb_history(made, "v")] == [float(s) for s in RANK0_STEPS]
    assert not _tracker_processes(kernel)


def test_a_failing_rank_leaves_no_tracker_process_and_the_next_cell_logs(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    out = kernel.run(
        HEAD + "import wandb\nrun = wandb.init(project='fails')\nwandb.log({'v': 1.0})\n"
        "if r == 1:\n    raise RuntimeError('rank 1 fails')\n"
        "torch.distributed.barrier()\n"
    )
    assert out.error is not None and "rank 1 fails" in out.text, out.text
    procs.wait_gone([p.pid for p in _tracker_processes(kernel)], 30.0)
    assert not _tracker_processes(kernel)
    before = set(glob.glob(f"{root}/wandb/offline-run-*"))
    out = kernel.run(HEAD + "import wandb\nrun = wandb.init(project='after')\nwandb.log({'v': 10.0 * r})\nrun.finish()")
    assert out.error is None, out.text
    [made] = set(glob.glob(f"{root}/wandb/offline-run-*")) - before
    assert [v for _, v in _wandb_history(made, "v")] == [0.0]


def test_an_interrupt_stops_at_a_step_with_rank_0s_run_flushed_and_no_tracker_process_left(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    before = set(glob.glob(f"{root}/wandb/offline-run-*"))
    msg_id = kernel.start_cell(
        HEAD + "import time, wandb\nrun = wandb.init(project='interrupted')\n"
        "model = nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for step in range(100000):\n"
        "    opt.zero_grad()\n    loss_fn(model(X[:16]), Y[:16]).backward()\n    opt.step()\n"
        "    wandb.log({'v': 10.0 * r + step}, step=step)\n"
        "    if step == 3:\n        print('logging', r, flush=True)\n"
        "    time.sleep(0.01)\n"
    )
    kernel.wait_for_stream(msg_id, ["logging 0", "logging 1"], timeout=120)
    kernel.interrupt()  # a stop at the next step every rank reaches
    _, out = kernel.wait_for_reply(msg_id, timeout=120)
    assert out.error is not None, out.text
    procs.wait_gone([p.pid for p in _tracker_processes(kernel)], 30.0)
    assert not _tracker_processes(kernel)
    [made] = set(glob.glob(f"{root}/wandb/offline-run-*")) - before
    history = _wandb_history(made, "v")
    assert len(history) > 3 and history == [(s, float(s)) for s in range(len(history))], history  # rank 0's, flushed
    out = kernel.run(
        HEAD + "from torch.utils.tensorboard import SummaryWriter\nw = SummaryWriter(ROOT + '/next')\n"
        "w.add_scalar('v', 10.0 * r, 0)\nw.close()"
    )
    assert out.error is None, out.text
    assert os.path.isdir(f"{root}/next"), f"rank 0 wrote no run after the interrupted cell; the cell said:\n{out.text}"
    assert _scalars(f"{root}/next", "v") == [(0, 0.0)]


def test_the_live_views_last_frame_charts_a_tracker_scalar_beside_the_loss(tracking):
    pytest.importorskip("tensorboard")
    kernel, _ = tracking
    out = kernel.run(
        HEAD + "from torch.utils.tensorboard import SummaryWriter\nwriter = SummaryWriter(ROOT + '/live')\n"
        + LOOP.format(log="writer.add_scalar('accuracy', 0.5 + 0.01 * step, step)")
        + "writer.close()\n"
    )
    assert out.error is None, out.text
    assert "accuracy" in out.live_view and "loss" in out.live_view, out.live_view


def test_a_summary_writer_opened_in_the_kernel_gets_rank_0s_scalars_and_stays_open(tracking):
    pytest.importorskip("tensorboard")
    kernel, root = tracking
    kernel.run_ok("from torch.utils.tensorboard import SummaryWriter\nkernel_writer = SummaryWriter(ROOT + '/ktb')")
    out = kernel.run(
        HEAD
        + LOOP.format(log="kernel_writer.add_scalar('rank_value', 10.0 * r + step, step)")
        + "kernel_writer.add_histogram('weights', model.weight, step)\n"
        + "kernel_writer.flush()\n"
        + "seen_dir = kernel_writer.log_dir\n"
    )
    assert out.error is None, out.text
    assert kernel.value("seen_dir") == f"{root}/ktb"
    kernel.run_ok("kernel_writer.add_scalar('after', 1.0, 0)\nkernel_writer.flush()")  # still the kernel's, open
    assert len(glob.glob(f"{root}/ktb/events.out.tfevents*")) == 1
    assert _scalars(f"{root}/ktb", "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    assert _scalars(f"{root}/ktb", "after") == [(0, 1.0)]
    charted = kernel.value("sorted({n for row in nbtrain.last_run().metrics[0] for n in row[2]})")
    assert "rank_value" in charted, charted
    kernel.run_ok("kernel_writer.close()")


def test_a_wandb_run_opened_in_the_kernel_gets_rank_0s_logs_and_stays_open(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    before = set(glob.glob(f"{root}/wandb/offline-run-*"))
    kernel.run_ok("import wandb\nkernel_run = wandb.init(project='kernel')")
    out = kernel.run(
        HEAD
        + "kernel_run.config.update({'lr': 0.01})\n"
        + LOOP.format(log="wandb.log({'rank_value': 10.0 * r + step}, step=step)")
        + "kernel_run.log({'last': 10.0 * r}, step=step)\n"
        + "kernel_run.summary['best'] = 10.0 * r\n"
        + "seen_id = kernel_run.id\n"
    )
    assert out.error is None, out.text
    assert kernel.value("seen_id") == kernel.value("kernel_run.id")
    assert kernel.value("kernel_run.config['lr']") == 0.01
    assert kernel.value("kernel_run.summary['best']") == 0.0
    kernel.run_ok("kernel_run.log({'after': 1.0}, step=100)\nkernel_run.finish()\nwandb.teardown()")  # it was open
    [made] = set(glob.glob(f"{root}/wandb/offline-run-*")) - before
    assert _wandb_history(made, "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    assert _wandb_history(made, "after") == [(100, 1.0)]
    procs.wait_gone([p.pid for p in _tracker_processes(kernel)], 30.0)
    assert not _tracker_processes(kernel)


def test_wandb_log_in_a_cell_that_imports_wandb_itself_reaches_the_kernels_run(tracking):
    pytest.importorskip("wandb")
    kernel, root = tracking
    before = set(glob.glob(f"{root}/wandb/offline-run-*"))
    kernel.run_ok("import wandb\nkernel_run = wandb.init(project='imported')")
    out = kernel.run(HEAD + "import wandb\n" + LOOP.format(log="wandb.log({'rank_value': 10.0 * r + step}, step=step)"))
    assert out.error is None, out.text
    kernel.run_ok("kernel_run.finish()\nwandb.teardown()")
    [made] = set(glob.glob(f"{root}/wandb/offline-run-*")) - before  # the kernel's: the cell opened none
    assert _wandb_history(made, "rank_value") == [(s, float(s)) for s in RANK0_STEPS]
    procs.wait_gone([p.pid for p in _tracker_processes(kernel)], 30.0)
    assert not _tracker_processes(kernel)


def test_a_background_run_logs_one_run_and_reaches_a_kernel_writer_as_a_foreground_one(tracking):
    pytest.importorskip("tensorboard")
    kernel, root = tracking
    kernel.run_ok("from torch.utils.tensorboard import SummaryWriter\nback_writer = SummaryWriter(ROOT + '/bk')")
    out = kernel.run(
        "%%distributed --devices 2 --accelerator cpu --background\nimport nbtrain\nr = nbtrain.rank()\n"
        "from torch.utils.tensorboard import SummaryWriter\nown = SummaryWriter(ROOT + '/bown')\n"
        + LOOP.format(log="own.add_scalar('rank_value', 10.0 * r + step, step)")
        + "    back_writer.add_scalar('rank_value', 10.0 * r + step, step)\n"
        + "own.close()\n"
    )
    assert out.error is None, out.text
    kernel.run_ok("nbtrain.runs()[-1].wait()\nback_writer.flush()")
    for name in ("bk", "bown"):
        assert len(glob.glob(f"{root}/{name}/events.out.tfevents*")) == 1, name
        assert _scalars(f"{root}/{name}", "rank_value") == [(s, float(s)) for s in RANK0_STEPS], name
    kernel.run_ok("back_writer.close()")
