"""Where a cell's time goes before and after its loop, on each side: probes for ``benchmarks/gpu.py --phases``.

:func:`install` writes a ``sitecustomize.py`` and points ``PYTHONPATH`` at it, so the warm
template that a kernel started from here starts (a template of its own, and every launcher
and rank it forks) wraps a few engine functions with probes that append ``label pid start
end`` lines to a log; the kernel's own functions are wrapped from a cell (:data:`KERNEL_CELL`).
The engine is not modified; a probe costs ~20 us. :func:`timeline` prints one run's lines
from its cell's send; :func:`uninstall` stops the template and removes the log.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import phases  # beside this script: its probe functions
import warm_start  # and its way of stopping a template of a folder's own

SITECUSTOMIZE = phases.PROBE_FUNCTIONS + r'''

if LOG and os.environ.get("NBTRAIN_ROLE") in ("template", "launcher"):
    from nbtrain.messages import sharedtensors
    from nbtrain.launch_server import server
    from nbtrain.rank import cell
    from nbtrain.rank.auto import prepare
    from nbtrain.rank.machinery import runtime

    wrap(server.Launcher, "_on_control", "launcher: the kernel's request handled (ranks forked or handed the run)")
    wrap(runtime, "_adopt_caller_state", "rank: environment, cwd, sys.path, threads")
    wrap(runtime, "_warm_device", "rank: the device warmed (a standby rank)")
    wrap(runtime, "_join_process_group", "rank: process group joined")
    wrap(sharedtensors, "loads", "rank: payload loaded (its GPU tensors copied to the GPU)")
    wrap(cell, "run_cell", "rank: run_cell (the whole cell on the rank)")
    wrap(cell._Before, "__init__", "rank 0: the shipped objects recorded before the cell")
    wrap(prepare, "auto_prepare", "rank: auto mode prepared the cell's objects")
    wrap(cell, "_execute", "rank: the cell's own code")
    wrap(cell, "_collect", "rank 0: what changed, collected and pickled")
    wrap(server.Launcher, "_hand_over", "launcher: every rank done (rank 0's result offered)")
    wrap(server.Launcher, "_release", "launcher: ranks released (the kernel has the result)")
    wrap(server.Launcher, "_on_exit", "launcher: a rank's exit seen and reaped")
    wrap(server.Launcher, "_finish", "launcher: the run's end sent to the kernel")
'''

KERNEL_CELL = """
import sitecustomize as _phases, nbtrain.messages.sharedtensors as _shared, nbtrain.kernel.client as _client
import nbtrain.kernel.run_handle as _handle, nbtrain.kernel.namespace as _ns, nbtrain.kernel.display.owntext as _out
import nbtrain.kernel.display.live as _live, nbtrain.kernel.launcher_connection as _connection
_phases.wrap(_shared, "dumps_to_shared_memory", "kernel: payload pickled (GPU tensors to shared memory)")
_phases.wrap(_client, "start_on", "kernel: the run started (payload made and sent)")
_phases.wrap(_connection.LauncherClient, "_take_result", "kernel: rank 0's memory read (a thread)")
_phases.wrap(_handle.Run, "result", "kernel: rank 0's result read")
_phases.wrap(_out.CellView, "finish", "kernel: the live view's last update")
_phases.wrap(_live.LiveView, "finish", "kernel: the live view's last update (chart)")
_phases.wrap(_ns, "decode_result", "kernel: rank 0's result unpickled")
_phases.wrap(_ns, "apply_result", "kernel: the results put into the kernel's objects")
_phases.wrap(_out, "show_summary", "kernel: the summary shown")
"""


def install() -> str:
    """Probes for every process started from now on; returns the log's path (see :func:`uninstall`)."""
    folder = tempfile.mkdtemp(prefix="nbtrain-phases-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as file:
        file.write(SITECUSTOMIZE)
    log = os.path.join(folder, "phases.log")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    os.environ["NBTRAIN_PHASES_LOG"] = log
    # A template of this run's own, started with the probes; its socket in this run's folder,
    # so a later run never reaches one whose log went with its folder.
    os.environ["NBTRAIN_TEMPLATE_DIR"] = folder
    return log


def uninstall(log: str) -> None:
    """Stop the probed template (by PID) and remove its folder and the log."""
    folder = os.path.dirname(log)
    warm_start.stop_templates(folder)
    shutil.rmtree(folder, ignore_errors=True)


def timeline(log: str, label: str, sent: float, whole: float) -> None:
    """The probes' lines that began while one cell ran (``sent`` to ``sent + whole``), from its send."""
    try:
        with open(log) as file:
            lines = [line.rstrip("\n").rsplit(" ", 3) for line in file]
    except OSError:
        return
    rows = sorted((float(t0), float(t1), name, pid) for name, pid, t0, t1 in lines if sent <= float(t0) <= sent + whole)
    # The run's rank: the one whose cell ran longest (the next standby ranks, forked as the run
    # ends, go their way through a tiny cell of their own: not this run's).
    cells = [(t1 - t0, pid) for t0, t1, name, pid in rows if name.startswith("rank: the cell's own code")]
    ranks = {max(cells)[1]} if cells else set()
    print(f"\n  {label}: where the time went (s after the cell was sent: start, end)")
    for t0, t1, name, pid in rows:
        if pid in ranks or not name.startswith("rank"):
            print(f"    {t0 - sent:7.3f} {t1 - sent:7.3f}  {name} (pid {pid})")
