"""A real JupyterLab and a real browser for tests: started by the test, ended by PID.

:class:`JupyterLab` starts ``python -m jupyter lab`` (or ``jupyter notebook``, Notebook 7,
with ``app="notebook"``) from this venv on a free port of
127.0.0.1, with a token, a temporary root directory and temporary Jupyter/IPython
config, data and runtime directories (so nothing of the user's setup leaks in), in a
process group of its own. :func:`open_browser` starts Debian's Chromium through
Playwright (never a downloaded browser) with a profile in the same temporary directory.

Every process the test starts carries ``NBTRAIN_BROWSER_TEST=<id>`` in its environment:
the server, each kernel it starts, nbtrain's launcher and ranks (they inherit it), and
Chromium. :func:`marked_processes` finds them by that mark, even ones that lost their
parent, so the test can check that none is left at the end.

Every wait has a deadline; nothing sleeps to let something happen.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import procs

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MARK = "NBTRAIN_BROWSER_TEST"
SERVER_READY_SECONDS = 60.0  # a cold JupyterLab start on a loaded 2-core machine
SERVER_STOP_SECONDS = 20.0  # SIGTERM: the server shuts its kernels down, then exits
GONE_SECONDS = 10.0
POLL = 0.1
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
# The front ends to start: JupyterLab, or Notebook 7 (built on JupyterLab's components, it
# loads the same prebuilt extensions). Each with its own application's option names.
APPS = {
    "lab": ("lab", "LabApp", ["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]),
    "notebook": ("notebook", "JupyterNotebookApp", []),
    # Classic Notebook 6.5 (Colab's pin, in .venv-colab): its own server, not jupyter_server.
    "classic": ("notebook", "NotebookApp", []),
}


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_notebook(path: Path, sources: Iterable[str]) -> None:
    """A notebook (nbformat 4) of code cells with the python3 kernel."""
    cells = [
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
        for source in sources
    ]
    notebook = {
        "cells": cells,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for number, cell in enumerate(cells):
        cell["id"] = f"cell-{number}"
    path.write_text(json.dumps(notebook, indent=1))


class JupyterLab:
    """A JupyterLab (or, with ``app="notebook"``, Notebook 7) server of this venv on
    127.0.0.1, its root a temporary directory.

    Example::

        lab = JupyterLab(tmp_path, log_path, mark="test-1")
        try:
            lab.start()
            page.goto(lab.url("lab/tree/x.ipynb"))
        finally:
            leftovers = lab.stop()
    """

    def __init__(self, base: Path, log_path: Path, mark: str, theme: str = "light", app: str = "lab"):
        if theme not in THEMES:
            raise ValueError(f"theme must be one of {', '.join(THEMES)}, not {theme!r}")
        if app not in APPS:
            raise ValueError(f"app must be one of {', '.join(APPS)}, not {app!r}")
        self.theme = theme
        self.app = app
        self.base = base
        self.root = base / "root"
        self.log_path = log_path
        self.mark = mark
        self.port = 0
        self.token = secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self.seen: set[int] = set()  # every PID of the server's tree seen so far
        self._log: Any = None

    def url(self, path: str = "") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={self.token}"

    def start(self) -> None:
        """Start the server and wait (bounded) until its API answers."""
        self.root.mkdir(parents=True, exist_ok=True)
        dirs = {name: self.base / name for name in ("config", "data", "runtime", "ipython", "workspaces")}
        for path in dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        # No news or update-check pop-ups over the notebook.
        (dirs["config"] / "labconfig").mkdir(exist_ok=True)
        (dirs["config"] / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
        )
        # The theme, as a user who picked it in Settings would have it (user settings live
        # under JUPYTER_CONFIG_DIR/lab/user-settings).
        themes = dirs["config"] / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
        themes.mkdir(parents=True, exist_ok=True)
        (themes / "themes.jupyterlab-settings").write_text(json.dumps({"theme": THEMES[self.theme]}))
        env = dict(os.environ)
        env.update(
            {
                "JUPYTER_CONFIG_DIR": str(dirs["config"]),
                "JUPYTER_DATA_DIR": str(dirs["data"]),
                "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
                "IPYTHONDIR": str(dirs["ipython"]),
                "JUPYTER_PLATFORM_DIRS": "1",
                MARK: self.mark,
            }
        )
        env.pop("JUPYTER_PATH", None)
        env.pop("JUPYTERLAB_SETTINGS_DIR", None)  # the theme written above is the one that counts
        # The server and its kernels keep their run registry under their own runtime dir, as
        # a user's do: the sidebar lists this session's runs, not those of the test process.
        env.pop("NBTRAIN_RUNTIME_DIR", None)
        self.port = free_port()
        subcommand, app_class, app_options = APPS[self.app]
        command = [
            sys.executable,
            "-m",
            "jupyter",
            subcommand,
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--port-retries=0",
            *self._server_options(app_class, dirs),
            *app_options,
        ]
        if os.geteuid() == 0:  # CI containers run as root; jupyter_server refuses that without this
            command.append("--allow-root")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes it until stop() closes it
        self.process = subprocess.Popen(
            command,
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends it as a whole
        )
        self.seen.add(self.process.pid)
        self._wait_ready()

    def _server_options(self, app_class: str, dirs: dict[str, Path]) -> list[str]:
        if self.app == "classic":  # Notebook 6's server takes them all on NotebookApp; it has no workspaces
            server = "NotebookApp"
            options = [f"--NotebookApp.token={self.token}", f"--NotebookApp.notebook_dir={self.root}"]
        else:
            server = "ServerApp"
            options = [
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                f"--{app_class}.workspaces_dir={dirs['workspaces']}",
            ]
        return [*options, f"--{server}.allow_remote_access=False", f"--{server}.terminals_enabled=False"]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_READY_SECONDS
        last_error = ""
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as error:
                last_error = str(error)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"JupyterLab did not answer within {SERVER_READY_SECONDS} s ({last_error}):\n{self.log_tail()}"
                )
            try:  # the poll interval: a bounded wait on the server exiting
                self.process.wait(timeout=POLL)
            except subprocess.TimeoutExpired:
                pass

    def api(self, path: str) -> Any:
        """GET ``path`` of the server's REST API (with the token), as JSON."""
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return json.loads(response.read())

    def kernels(self) -> list[dict[str, Any]] | None:
        """The server's kernels, or None while one is starting: jupyter_server (2.21) lists a
        kernel before it sets the kernel's ``last_activity`` and answers GET /api/kernels with
        500 in that window (a TraitError in its log), which is no failure of the page."""
        try:
            kernels: list[dict[str, Any]] = self.api("api/kernels")
        except urllib.error.HTTPError as error:
            if error.code != 500 or "TraitError: The 'last_activity' trait" not in self.log_tail(20000):
                raise
            return None
        return kernels

    def wait_kernel_connected(self, timeout: float) -> None:
        """Until a page holds a connection to a kernel: before that the page's session has no
        kernel, and a cell run then is dropped (Notebook 7 shows "idle" while it connects)."""
        procs.wait_for(
            lambda: any(kernel.get("connections") for kernel in self.kernels() or []),
            timeout,
            f"no page connected to a kernel of the server on port {self.port}",
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def remember_tree(self) -> None:
        """Note the PIDs of the server and everything under it now (kernels, launchers, ranks)."""
        if self.process is None:
            return
        try:
            server = psutil.Process(self.process.pid)
            self.seen.update(child.pid for child in server.children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> list[str]:
        """End the server and every process it started; what did not end by itself (should be nothing).

        SIGTERM to the server's process group: jupyter_server then shuts its kernels down,
        and each kernel's launcher and ranks end with it. Whatever is still there after a
        bounded wait is reported and gets SIGKILL, by PID: the group, then every PID seen
        in the tree.
        """
        if self.process is None:
            return []
        problems = []
        self.remember_tree()
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=SERVER_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            problems.append(f"JupyterLab ({self.process.pid}) still ran {SERVER_STOP_SECONDS} s after SIGTERM")
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=GONE_SECONDS)
        left = wait_gone(self.seen - {self.process.pid}, GONE_SECONDS)
        problems += [f"{describe(pid)} (still alive {GONE_SECONDS} s after the server ended)" for pid in left]
        kill_and_wait(left)
        if self._log is not None:
            self._log.close()
        return problems


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait (bounded) until none of ``pids`` lives; those still alive at the deadline."""
    return procs.wait_gone(pids, timeout, reaped=False)


def kill_and_wait(pids: Iterable[int]) -> list[int]:
    """Give ``pids`` a bounded time to go by themselves, SIGKILL the rest; those still alive."""
    return procs.kill_and_wait(pids, GONE_SECONDS, reaped=False)


def describe(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        return f"{pid} {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return str(pid)


def marked_processes(mark: str) -> list[int]:
    """Every live process whose environment has ``NBTRAIN_BROWSER_TEST=mark`` (this test's)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            with open(f"/proc/{process.pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if needle in environ and alive(process.pid):
            found.append(process.pid)
    return found


def chromium_problem(app: str = "lab") -> str | None:
    """Why the browser test of ``app`` cannot run here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing: run `bash .ci/browser-setup` (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401 - only whether it imports
    except ImportError:
        return "the playwright package is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')"
    if app == "classic":
        return None  # the classic test checks Notebook 6 itself (it runs in .venv-colab only)
    try:
        import jupyterlab  # noqa: F401 - only whether it imports
        import notebook  # noqa: F401 - Notebook 7, for the extension's test there
    except ImportError as error:
        return f"{error.name} is missing: run `bash .ci/browser-setup` (pip install -e '.[browser]')"
    return None


def open_browser(playwright: Any, base: Path, mark: str) -> Any:
    """A headless Chromium context (Debian's /usr/bin/chromium) with everything it writes under ``base``.

    The profile is ``base/chromium-profile``; XDG_CONFIG_HOME and XDG_CACHE_HOME point
    into ``base`` too, so Chromium's crash handler keeps its database there (and not in
    ~/.config), and it exits with the browser.
    """
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(base / "chromium-config"),
        "XDG_CACHE_HOME": str(base / "chromium-cache"),
        MARK: mark,
    }
    return playwright.chromium.launch_persistent_context(
        str(base / "chromium-profile"),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_ARGS,
        env=env,
        viewport={"width": 1280, "height": 1000},
        timeout=60_000,
    )


# -- the session fixture of the browser tests (registered by tests/conftest.py) ----------

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"
UI_TIMEOUT_MS = 30_000  # any one click or element in the UI
KERNEL_READY_MS = 60_000  # the kernel starts (and imports IPython) on a loaded 2-core machine
RUN_MS = 90_000  # torch imports in the launcher, the ranks start, train and end


def _requirements(app: str) -> None:
    problem = chromium_problem(app)
    if problem is None:
        return
    if os.environ.get("NBTRAIN_SKIP_BROWSER_TESTS") == "1":
        pytest.skip(f"NBTRAIN_SKIP_BROWSER_TESTS=1 and {problem}")
    pytest.fail(f"the browser test cannot run: {problem} (or set NBTRAIN_SKIP_BROWSER_TESTS=1 to skip it)")


class Session:
    """The running JupyterLab, the browser page, and where this test's artifacts go."""

    def __init__(self, lab: JupyterLab, page: Any, artifacts: Path):
        self.lab = lab
        self.page = page
        self.artifacts = artifacts

    def open_notebook(self, name: str, sources: list[str]) -> Any:
        """Write the notebook, open it, wait until its kernel is idle; the notebook panel."""
        write_notebook(self.lab.root / name, sources)
        self.page.goto(self.lab.url(f"lab/tree/{name}" if self.lab.app == "lab" else f"notebooks/{name}"))
        if self.lab.app == "classic":
            notebook = self.page.locator("#notebook-container", has=self.page.locator(".cell"))
        else:
            notebook = self.page.locator(".jp-NotebookPanel", has=self.page.locator(".jp-Notebook .jp-Cell"))
        notebook.wait_for(state="visible")
        self.wait_idle(KERNEL_READY_MS)
        return notebook

    def wait_idle(self, timeout_ms: int) -> None:
        """The kernel is idle (started, or done with the cells)."""
        self.wait_kernel("Idle", timeout_ms)

    def wait_kernel(self, state: str, timeout_ms: int = UI_TIMEOUT_MS) -> None:
        """The kernel's state as the page shows it: JupyterLab's status bar names the kernel
        and its state; Notebook 7 has no status bar, its toolbar's indicator carries it."""
        if self.lab.app == "lab":
            self.page.get_by_text(f"Python 3 (ipykernel) | {state}").wait_for(timeout=timeout_ms)
        elif self.lab.app == "classic":  # Notebook 6: the icon in the menu bar's corner
            self.lab.wait_kernel_connected(timeout_ms / 1000)
            icon = f"#kernel_indicator_icon.kernel_{state.lower()}_icon"
            self.page.locator(icon).wait_for(state="attached", timeout=timeout_ms)
        else:
            self.lab.wait_kernel_connected(timeout_ms / 1000)
            indicator = f'.jp-Notebook-ExecutionIndicator[data-status="{state.lower()}"]'
            self.page.locator(indicator).wait_for(state="attached", timeout=timeout_ms)

    def run_all(self) -> None:
        """Run > Run All Cells, as a user would."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.locator("li[data-command='runmenu:run-all']").click()

    def screenshot(self, name: str) -> Path:
        path = self.artifacts / name
        self.page.screenshot(path=str(path))
        return path

    def save_png(self, src: str | None, name: str) -> bytes:
        """Decode an ``<img>``'s data URL, save it, return the PNG bytes."""
        prefix = "data:image/png;base64,"
        assert src and src.startswith(prefix), f"the chart is not an inline PNG: {(src or '')[:80]!r}"
        data = base64.b64decode(src[len(prefix) :])
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), "the chart's data is not a PNG"
        (self.artifacts / name).write_bytes(data)
        return data

    def ranks(self) -> list[int]:
        """PIDs of nbtrain's ranks under this server's kernels (the launchers' children)."""
        assert self.lab.process is not None
        found = []
        try:
            tree = psutil.Process(self.lab.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for process in tree:
            try:
                if "nbtrain.launch_server" in " ".join(process.cmdline()):
                    found += [child.pid for child in process.children() if alive(child.pid)]
            except psutil.Error:
                continue
        return sorted(set(found))


def _publish(staging: Path, final: Path) -> None:
    """Move this run's artifacts into place (the last run of the test wins, whole)."""
    shutil.rmtree(final, ignore_errors=True)
    try:
        staging.rename(final)
    except OSError:  # another run of the suite published at the same moment: keep ours aside
        print(f"browser test artifacts left in {staging}", file=sys.stderr)


@pytest.fixture
def session(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Session]:
    """JupyterLab (light theme, or the theme given as the fixture's parameter; "notebook":
    Notebook 7 instead, light; "classic": Notebook 6, in .venv-colab)
    and Chromium, started here and ended here, every process checked gone."""
    param = getattr(request, "param", "light")
    app = param if param in ("notebook", "classic") else "lab"
    _requirements(app)
    from playwright.sync_api import sync_playwright

    theme = "light" if app != "lab" else param
    name = request.node.originalname.removeprefix("test_")
    final = ARTIFACTS / (name if param == "light" else f"{name}-{param}")
    # Written aside, then moved into place: two runs of the suite at once do not mix files.
    staging = ARTIFACTS / f".{final.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    mark = uuid.uuid4().hex
    ours_before = {p.pid for p in psutil.Process().children(recursive=True)}
    lab = JupyterLab(tmp_path, staging / "jupyterlab.log", mark, theme, app)
    leftovers: list[str] = []
    try:
        lab.start()
        with sync_playwright() as playwright:
            context = open_browser(playwright, tmp_path, mark)
            try:
                context.set_default_timeout(UI_TIMEOUT_MS)
                page = context.pages[0] if context.pages else context.new_page()
                try:
                    yield Session(lab, page, staging)
                finally:
                    lab.remember_tree()
                    # What the page showed at the end (after a failure: where it stopped).
                    try:
                        page.screenshot(path=str(staging / "99-teardown.png"), timeout=UI_TIMEOUT_MS)
                    except Exception as error:  # noqa: BLE001 - a crashed page: the cleanup goes on
                        print(f"no teardown screenshot: {error}", file=sys.stderr)
            finally:
                context.close()
    finally:
        try:
            leftovers += lab.stop()
            # Anything of this test still alive: the mark is in the environment of the
            # server, its kernels, nbtrain's launchers and ranks (inherited) and Chromium.
            marked = wait_gone(marked_processes(mark), GONE_SECONDS)
            leftovers += [describe(pid) for pid in marked]
            kill_and_wait(marked)
            # ...and the Playwright driver, a child of this process.
            new = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in ours_before]
            new = wait_gone(new, GONE_SECONDS)
            leftovers += [describe(pid) for pid in new]
            kill_and_wait(new)
        finally:
            _publish(staging, final)
    assert not leftovers, f"processes of the browser test outlived it: {leftovers}"


def check_kernel_python(cell: Any) -> None:
    """The kernel is this venv's python, so it runs the nbtrain under test."""
    output = cell.locator(".jp-OutputArea-output")
    output.wait_for(timeout=KERNEL_READY_MS)
    assert str(Path(sys.executable).parent) in output.inner_text()
