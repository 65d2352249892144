"""nbtrain's JupyterLab extension: its TypeScript logic, its installation, and the sidebar in a real JupyterLab.

- ``npm test`` in labextension/ (Node's built-in test runner) checks the TypeScript pieces
  that compute something (status text, sparkline, elapsed time, the inserted cell);
- ``jupyter labextension list`` shows the prebuilt extension enabled, and the server
  extension is enabled by the file the package installs;
- in JupyterLab with Debian's Chromium (the session of tests/test_browser.py): the sidebar
  lists a run started from a cell with its world size; its Stop ends a foreground run while
  the kernel is busy in that cell, the cell ends stopped and the kernel runs the next one;
  a kernel killed during a run (its launcher frozen, so that the ranks outlive it) leaves
  the run orphaned, and "Clean up" ends its ranks and forgets it;
- on a machine of several human accounts (the server's passwd file faked): the sentence on
  what other users could reach stands above the runs, the run it is about carries its bar,
  and with one human account nothing is said;
- in Notebook 7 (``jupyter notebook``) the same extension loads: its panel lists the run
  and its Stop ends it while the kernel is busy.

Screenshots go to ``test-artifacts/browser/<test>/`` (git-ignored); the Stop's measured
time (click to every rank gone) to ``stop-seconds.txt`` there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

import browser_helpers as bh
from browser_helpers import RUN_MS, UI_TIMEOUT_MS, Session, check_kernel_python
from helpers import procs
from nbtrain.system import processes

LABEXTENSION = Path(__file__).resolve().parent.parent / "labextension"
NPM_TEST_SECONDS = 240  # tsc, then node --test, on a loaded 2-core machine
SIDEBAR_REFRESH_MS = 2_000
RANKS_GONE_SECONDS = 10.0
LAUNCHER_GONE_SECONDS = 20.0  # a thawed launcher's shutdown: signal, reap (bounded at 2 s), exit
ORPHANED_MS = 30_000  # the kernel's death seen by the next refreshes

SETUP_CELL = (
    "%load_ext nbtrain\nimport sys, nbtrain\nnbtrain.set_defaults(devices=2, accelerator='cpu')\nprint(sys.executable)"
)
# Long enough to be running whenever the test acts; it ends only by being stopped.
LONG_CELL = """%%distributed
import time
import torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8)
y = x.sum(1, keepdim=True)
for step in range(100_000):
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.05)
"""
NEXT_CELL = "print('the next cell ran')"


def test_typescript_units() -> None:
    npm = shutil.which("npm")
    assert npm, "npm is missing: `bash .ci/setup` installs Node.js and npm (apt-get install nodejs npm)"
    if not (LABEXTENSION / "node_modules").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=LABEXTENSION, check=True, timeout=NPM_TEST_SECONDS)
    done = subprocess.run(
        [npm, "test"], cwd=LABEXTENSION, capture_output=True, text=True, timeout=NPM_TEST_SECONDS, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "# fail 0" in done.stdout and "# pass " in done.stdout, done.stdout[-2000:]


def test_jupyter_lists_both_extensions_enabled() -> None:
    jupyter = [sys.executable, "-m", "jupyter"]
    lab = subprocess.run([*jupyter, "labextension", "list"], capture_output=True, text=True, timeout=120, check=False)
    line = next((line for line in (lab.stdout + lab.stderr).splitlines() if "nbtrain v" in line), "")
    assert "enabled" in line and "OK" in line and "(python, nbtrain)" in line, lab.stdout + lab.stderr
    server = subprocess.run(
        [*jupyter, "server", "extension", "list"], capture_output=True, text=True, timeout=120, check=False
    )
    text = server.stdout + server.stderr
    assert "nbtrain.serverext" in text and "enabled" in text.split("nbtrain.serverext", 1)[1][:40], text


# -- the sidebar in a real JupyterLab ----------------------------------------------------------


def _api(session: Session, path: str) -> Any:
    return _api_root(session, f"nbtrain/api/{path}")


def _api_root(session: Session, path: str) -> Any:
    with urllib.request.urlopen(session.lab.url(path), timeout=10) as response:
        return json.loads(response.read())


def _devices_requests(session: Session, window_ms: int) -> int:
    """How many times the page asked for the devices during ``window_ms`` (a count over a window)."""
    seen: list[str] = []

    def note(request: Any) -> None:
        if "/nbtrain/api/devices" in request.url:
            seen.append(request.url)

    session.page.on("request", note)
    session.page.wait_for_timeout(window_ms)
    session.page.remove_listener("request", note)
    return len(seen)


def _open_sidebar(session: Session) -> Any:
    """Show the sidebar as a user would: JupyterLab's tab in the right side bar; in Notebook 7,
    View > Right Sidebar, which lists each panel of the right area by its caption."""
    page = session.page
    if session.lab.app == "lab":
        page.locator('.jp-SideBar li[data-id="nbtrain-sidebar"]').click()
    else:
        page.get_by_role("menuitem", name="View", exact=True).click()
        page.locator(".lm-Menu-item", has_text="Right Sidebar").click()
        page.locator(".lm-Menu-item", has_text="Show nbtrain: runs and devices").click()
    panel = page.locator("#nbtrain-sidebar")
    panel.wait_for(state="visible")
    return panel


def _start(session: Session, name: str) -> tuple[Any, Any]:
    notebook = session.open_notebook(name, [SETUP_CELL, LONG_CELL, NEXT_CELL])
    session.run_all()
    check_kernel_python(notebook.locator(".jp-Cell").nth(0))
    panel = _open_sidebar(session)
    row = panel.locator(f'.jp-nbtrain-run[data-state="running"]:has(.jp-nbtrain-title:text-is("{name}"))')
    row.wait_for(timeout=RUN_MS)
    return notebook, row


def _record(session: Session, name: str) -> dict:
    runs = [run for run in _api(session, "runs") if (run["notebook"] or "").endswith(name)]
    assert len(runs) == 1, runs
    return runs[0]


def _check_running(session: Session, row: Any, name: str) -> dict:
    """The sidebar's row and the API agree on the run: 2 live ranks of a kernel of this server."""
    assert row.get_attribute("data-world-size") == "2"
    assert "2 ranks · cpu · ddp_notebook" in row.locator(".jp-nbtrain-facts").inner_text()
    row.locator(".jp-nbtrain-spark polyline").wait_for(timeout=RUN_MS)  # two loss points: two seconds of steps
    record = _record(session, name)
    assert record["world_size"] == 2 and record["state"] == "running" and len(record["pids"]) == 2
    assert record["kernel_id"] in [kernel["id"] for kernel in session.lab.kernels() or []]
    assert all(bh.alive(pid) for pid in record["pids"]), "the ranks the sidebar names are alive"
    session.lab.remember_tree()
    session.wait_kernel("Busy")  # the kernel is in the training cell
    return record


def _stop_from_sidebar(session: Session, notebook: Any, row: Any, record: dict) -> float:
    """Stop in the sidebar while the kernel is busy in the run's cell: the ranks go, the cell
    ends stopped at a step with the state there, the kernel runs the next cell. The seconds
    from the click to every rank gone."""
    page = session.page
    stop = row.locator(".jp-nbtrain-action", has_text="Stop")
    stop.wait_for()
    clicked = time.monotonic()  # before the click: the figure includes Playwright's own click
    stop.click()
    left = bh.wait_gone(record["pids"], RANKS_GONE_SECONDS)
    seconds = time.monotonic() - clicked
    assert not left, f"ranks alive {RANKS_GONE_SECONDS} s after Stop: {[bh.describe(pid) for pid in left]}"
    (session.artifacts / "stop-seconds.txt").write_text(f"{seconds:.3f}\n")
    print(f"browser Stop ({session.lab.app}): every rank gone {seconds:.3f} s after the click")

    train, after = notebook.locator(".jp-Cell").nth(1), notebook.locator(".jp-Cell").nth(2)
    # Every rank ended at one optimizer step, and what the cell made there is in the kernel.
    kept = re.compile(r"RunStoppedError: the run was stopped at step \d+ on every rank; the cell's results at that")
    error = train.locator(".jp-OutputArea").get_by_text(kept)
    error.wait_for(timeout=RUN_MS)
    assert "Where each rank was" not in error.inner_text(), error.inner_text()
    session.wait_idle(RUN_MS)  # the training cell is over, as after the view's Stop
    # Run All stopped at the error: the user runs the next cell, and the kernel runs it.
    after.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    after.locator(".jp-OutputArea-output").get_by_text("the next cell ran").wait_for(timeout=RUN_MS)
    name = record["notebook"].rsplit("/", 1)[-1]
    stopped = f'.jp-nbtrain-run[data-state="stopped"]:has(.jp-nbtrain-title:text-is("{name}"))'
    page.locator(stopped).wait_for(timeout=RUN_MS)
    return seconds


def test_sidebar_stops_a_foreground_run_while_its_kernel_is_busy(session: Session) -> None:
    page = session.page
    notebook, row = _start(session, "sidebar.ipynb")
    record = _check_running(session, row, "sidebar.ipynb")
    page.locator(".jp-nbtrain-status").get_by_text("nbtrain: 1 run · 2 ranks").wait_for()
    # The API lives in the server's own web application: the server listens on its port only.
    assert session.lab.process is not None
    server = psutil.Process(session.lab.process.pid)
    listening = {c.laddr.port for c in server.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert listening == {session.lab.port}, listening
    session.screenshot("01-sidebar-running.png")

    _check_readable(session, "light")
    _stop_from_sidebar(session, notebook, row, record)
    assert page.locator(".jp-nbtrain-status").inner_text() == ""
    session.screenshot("02-sidebar-stopped.png")
    _check_readable(session, "light")
    _open_from_sidebar(session, "sidebar.ipynb")

    _insert_distributed_cell(session, notebook)
    _dark_theme(session)
    _check_readable(session, "dark")
    session.screenshot("04-sidebar-dark.png")


def _open_from_sidebar(session: Session, name: str) -> None:
    """With a Launcher tab in front of the notebook, the run's Open brings the notebook back."""
    page = session.page
    current = ".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current"
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill("New Launcher")
    page.keyboard.press("Enter")
    page.locator(current, has_text="Launcher").wait_for()
    row = page.locator(f'.jp-nbtrain-run:has(.jp-nbtrain-title:text-is("{name}"))')
    row.locator(".jp-nbtrain-open").click()
    page.locator(current, has_text=name).wait_for()


@pytest.mark.parametrize("session", ["notebook"], indirect=True)
def test_notebook7_loads_the_sidebar_which_stops_a_run(session: Session) -> None:
    """In Notebook 7 (``jupyter notebook``): the same prebuilt extension loads, its panel in
    the right area lists the run with its world size, and its Stop ends the run while the
    kernel is busy; the palette command inserts the cell. (Notebook 7 has no status bar.)"""
    notebook, row = _start(session, "notebook7.ipynb")
    assert session.page.locator(".jp-NotebookPanel").count() == 1 and "/notebooks/" in session.page.url
    record = _check_running(session, row, "notebook7.ipynb")
    _check_readable(session, "Notebook 7's light")
    session.screenshot("01-notebook7-running.png")
    _stop_from_sidebar(session, notebook, row, record)
    session.screenshot("02-notebook7-stopped.png")
    _insert_distributed_cell(session, notebook)


def _insert_distributed_cell(session: Session, notebook: Any) -> None:
    """The palette command adds a cell with the kernel's session defaults (set by the first cell)."""
    page = session.page
    notebook.locator(".jp-Cell").nth(2).click()
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill("Insert an nbtrain cell")
    page.keyboard.press("Enter")
    inserted = notebook.locator(".jp-Cell").nth(3)
    inserted.get_by_text("%%distributed --devices 2 --accelerator cpu --strategy ddp_notebook").wait_for()
    session.screenshot("03-inserted-cell.png")


# The text of the sidebar, against what it is drawn on (the first ancestor with a background).
_COLOURS_JS = """element => {
  const parse = text => (text.match(/[\\d.]+/g) || []).map(Number);
  let node = element, background = null;
  while (node && !background) {
    const colour = parse(getComputedStyle(node).backgroundColor);
    if (colour.length === 3 || (colour.length === 4 && colour[3] > 0)) background = colour;
    node = node.parentElement;
  }
  return [parse(getComputedStyle(element).color), background || [255, 255, 255]];
}"""
READABLE = 4.5  # WCAG's contrast ratio for normal text (AA)


def _luminance(rgb: list[float]) -> float:
    def linear(value: float) -> float:
        value /= 255
        return value / 12.92 if value <= 0.03928 else ((value + 0.055) / 1.055) ** 2.4

    red, green, blue = (linear(value) for value in rgb[:3])
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


def _contrast(element: Any) -> float:
    """WCAG contrast ratio of an element's text over its background (a translucent text
    colour blended over the background first, as the browser draws it)."""
    text, background = element.evaluate(_COLOURS_JS)
    alpha = text[3] if len(text) == 4 else 1.0
    drawn = [alpha * t + (1 - alpha) * b for t, b in zip(text[:3], background[:3], strict=True)]
    light, dark = sorted((_luminance(drawn), _luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def _check_readable(session: Session, theme: str) -> None:
    """Every kind of text of the sidebar (headings, run title, state badge, facts, devices,
    ranks' memory while they run) reads well: WCAG's AA contrast for normal text."""
    panel = session.page.locator("#nbtrain-sidebar")
    kinds = [".jp-nbtrain-heading", ".jp-nbtrain-title", ".jp-nbtrain-state", ".jp-nbtrain-facts", ".jp-nbtrain-host"]
    if panel.locator(".jp-nbtrain-rank-memory").count():
        kinds.append(".jp-nbtrain-rank-memory")
    ratios = {selector: round(_contrast(panel.locator(selector).first), 2) for selector in kinds}
    state = panel.locator(".jp-nbtrain-state").first.inner_text()
    assert min(ratios.values()) >= READABLE, f"{theme} theme, a {state} run: contrast ratios {ratios}"


def _dark_theme(session: Session) -> None:
    page = session.page
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill("Use Theme: JupyterLab Dark")
    page.keyboard.press("Enter")
    page.locator("body[data-jp-theme-name='JupyterLab Dark']").wait_for(state="attached")
    page.locator("#jupyterlab-splash").wait_for(state="detached")  # the overlay shown while the theme loads


def _freeze(pid: int, started: int) -> None:
    """SIGSTOP the process ``pid`` if it is still the one that started at ``started``."""
    assert processes.start_time(pid) == started, f"pid {pid} is no longer the run's launcher"
    os.kill(pid, signal.SIGSTOP)


def test_a_killed_kernel_leaves_an_orphaned_run_that_clean_up_removes(session: Session) -> None:
    """Ranks die with their launcher (PDEATHSIG), and a launcher stops its ranks when its
    kernel dies: ranks outlive their kernel only while their launcher lives but cannot act
    (stopped, frozen by a cgroup or a debugger, stuck). So the test freezes the launcher
    (SIGSTOP) and then kills the kernel: the ranks survive, and only Clean up ends them."""
    page = session.page
    _start(session, "orphan.ipynb")
    record = _record(session, "orphan.ipynb")
    session.lab.remember_tree()
    launcher = record["launcher_pid"]
    _freeze(launcher, record["launcher_start"])
    try:
        os.kill(record["kernel_pid"], signal.SIGKILL)
        orphaned = page.locator(
            '.jp-nbtrain-run[data-state="orphaned"]:has(.jp-nbtrain-title:text-is("orphan.ipynb"))'
        )
        orphaned.wait_for(timeout=ORPHANED_MS)
        assert _record(session, "orphan.ipynb")["state"] == "orphaned"
        _check_readable(session, "light")
        assert procs.wait_gone([record["kernel_pid"]], RANKS_GONE_SECONDS, reaped=False) == []
        assert all(bh.alive(pid) for pid in record["pids"]), "the ranks outlive their kernel: only Clean up ends them"
        # JupyterLab says the kernel died (and starts a new one): the user acknowledges it.
        page.locator(".jp-Dialog").get_by_role("button", name="Ok").click()
        session.screenshot("01-orphaned.png")
        orphaned.locator(".jp-nbtrain-action", has_text="Clean up").click()
        orphaned.wait_for(state="detached", timeout=UI_TIMEOUT_MS)
        assert [run for run in _api(session, "runs") if run["id"] == record["id"]] == []
        left = bh.wait_gone(record["pids"], RANKS_GONE_SECONDS)
        assert not left, f"ranks of the orphaned run still alive after clean-up: {[bh.describe(p) for p in left]}"
        session.screenshot("02-cleaned.png")
    finally:
        os.kill(launcher, signal.SIGCONT)
    # Thawed, the launcher finds its kernel gone and exits; the run stays forgotten.
    assert bh.wait_gone([launcher], LAUNCHER_GONE_SECONDS) == [], bh.describe(launcher)
    assert [run for run in _api(session, "runs") if run["id"] == record["id"]] == []

    # The sidebar refreshes every 2 s while shown, and asks nothing while hidden.
    assert _devices_requests(session, 3 * SIDEBAR_REFRESH_MS) >= 2
    page.locator('.jp-SideBar li[data-id="nbtrain-sidebar"]').click()
    page.locator("#nbtrain-sidebar").wait_for(state="hidden")
    assert _devices_requests(session, 3 * SIDEBAR_REFRESH_MS) == 0


# -- the sentence on a machine of several people --------------------------------------------

REACHABLE_OFF = {"NBTRAIN_PRIVATE_NETWORK": "0"}  # a run its user kept out of a network of its own


@pytest.fixture
def several_people(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Session, Path]:
    """The browser session, its server reading the machine's accounts from a passwd file of the test
    (``sharedhost.PASSWD``, the one boundary faked, set by the server's config file before it starts:
    the suite's machine has one person). The file, rewritten later, is read at each refresh."""
    passwd = tmp_path / "passwd"
    config = tmp_path / "config"  # the session's JUPYTER_CONFIG_DIR (browser_helpers.JupyterLab)
    config.mkdir()
    (config / "jupyter_server_config.py").write_text(
        f"from nbtrain.system import sharedhost\nsharedhost.PASSWD = {str(passwd)!r}\n"
    )
    _write_passwd(passwd, 3)
    return request.getfixturevalue("session"), passwd


def _write_passwd(path: Path, people: int) -> None:
    """root, a service account and ``people`` human accounts, replaced whole (a reader sees one file)."""
    lines = ["root:x:0:0::/root:/bin/bash", "svc:x:999:999::/:/usr/sbin/nologin"]
    lines += [f"p{i}:x:{1000 + i}:{1000 + i}::/home/p{i}:/bin/bash" for i in range(people)]
    path.with_suffix(".new").write_text("\n".join(lines) + "\n")
    path.with_suffix(".new").replace(path)


def _put_run(session: Session, run_id: str, rank: subprocess.Popen, reachable: str | None) -> None:
    """A running run in the server's registry (this test as its kernel and launcher, ``rank`` its one rank),
    with its launcher's reason why other users could reach its sockets (None: nobody could)."""
    from nbtrain.system import registry

    me, started = os.getpid(), processes.start_time(os.getpid())
    ranks = ((0, rank.pid, processes.start_time(rank.pid)),)
    values = {"kernel_id": "k-1", "kernel_pid": me, "kernel_start": started, "launcher_pid": me}
    values.update(launcher_start=started, strategy="ddp_notebook", accelerator="cpu", started=time.time())
    notebook = str(session.lab.root / f"{run_id}.ipynb")
    record = registry.RunRecord(run_id, 1, "running", ranks, notebook=notebook, reachable=reachable, **values)
    runtime = {"JUPYTER_RUNTIME_DIR": str(session.lab.base / "runtime")}  # where the server looks
    registry.write(record, registry.runs_directory(environ=runtime))


_LAYOUT_JS = """panel => {
  const sentence = panel.querySelector('.jp-nbtrain-shared-host').getBoundingClientRect();
  const first = panel.querySelector('.jp-nbtrain-run');
  return {
    sentence_bottom: sentence.bottom,
    sentence_height: sentence.height,
    first_run_top: first ? first.getBoundingClientRect().top : null,
    marked: [...panel.querySelectorAll('.jp-nbtrain-run.jp-nbtrain-run-shared-host')].map(run => run.dataset.runId)
  };
}"""


def test_on_a_machine_of_several_people_the_sidebar_says_so_above_the_runs(several_people) -> None:
    from nbtrain.system import sharedhost

    session, passwd = several_people
    page = session.page
    reason = sharedhost.run_gap("cpu", "ddp", False, REACHABLE_OFF)
    assert reason is not None
    rank = subprocess.Popen(["sleep", "120"], start_new_session=True)  # stands in for the runs' rank
    try:
        _put_run(session, "covered", rank, None)  # in a network of its own: nobody else could reach it
        _put_run(session, "shared", rank, reason)
        page.goto(session.lab.url("lab"))
        panel = _open_sidebar(session)
        row = panel.locator('.jp-nbtrain-run:has(.jp-nbtrain-title:text-is("shared.ipynb"))')
        panel.locator('.jp-nbtrain-run:has(.jp-nbtrain-title:text-is("covered.ipynb"))').wait_for()
        said = panel.locator(".jp-nbtrain-shared-host")
        said.get_by_text("this machine has 3 user accounts").wait_for()
        assert said.inner_text() == sharedhost.sentence(reason, 3)
        row.wait_for()
        # Measured in one go: the runs are drawn afresh at each refresh.
        layout = panel.evaluate(_LAYOUT_JS)
        assert layout["sentence_bottom"] <= layout["first_run_top"], layout
        assert layout["marked"] == ["shared"], layout  # the run it is about carries its bar, the other not
        assert "see the note above the runs" in (row.get_attribute("title") or "")  # the bar's words, on hover
        ratio = _contrast(said)
        assert ratio >= READABLE, f"the sentence's contrast ratio {ratio:.2f}"
        session.screenshot("01-several-people.png")

        _write_passwd(passwd, 1)  # one person: nobody else to reach the run, nothing said
        page.wait_for_function(
            "() => document.querySelector('.jp-nbtrain-shared-host').textContent === ''",
            timeout=3 * SIDEBAR_REFRESH_MS + UI_TIMEOUT_MS,
        )
        layout = panel.evaluate(_LAYOUT_JS)
        assert layout["sentence_height"] == 0 and layout["marked"] == [], layout
        assert row.is_visible(), "the run is still listed"
        session.screenshot("02-one-person.png")
    finally:
        rank.kill()
        rank.wait(timeout=bh.GONE_SECONDS)
