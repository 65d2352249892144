"""The shape of the package: who imports whom, who owns the shell and the signals, what an import starts.

The import graph is read from the source (every ``import``, at module level or inside a
function), so a cycle hidden in a function body counts as one. The import side effects
are checked in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import nbtrain

PACKAGE = Path(nbtrain.__file__).parent
STDLIB = sys.stdlib_module_names


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # ``from nbtrain.kernel import magic`` imports the submodule nbtrain.kernel.magic
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: {dep for dep in _imports(path) if dep in modules and dep != name} for name, path in modules.items()}


def _packages() -> set[str]:
    return {_module_name(path) for path in PACKAGE.rglob("__init__.py")}


def _cycle(graph: dict[str, set[str]], inits: frozenset[str] = frozenset()) -> list[str] | None:
    """One import cycle among the package's own modules (``inits``: packages, left out), or None.

    ``from nbtrain.server import runs`` names the package only to reach its submodule.
    """
    edges = {name: deps - inits for name, deps in graph.items() if name not in inits}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(edges.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(edges):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_cycles_counting_imports_inside_functions():
    inits = frozenset(_packages())
    assert _cycle(_graph(), inits) is None, f"import cycle: {' -> '.join(_cycle(_graph(), inits) or [])}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_rank_side_never_imports_the_kernel_side():
    graph = _graph()
    offenders = {name: sorted(dep for dep in deps if dep.startswith("nbtrain.kernel")) for name, deps in graph.items()}
    assert {name: deps for name, deps in offenders.items() if name.startswith("nbtrain.rank") and deps} == {}


def test_records_imports_only_the_standard_library():
    imported = _imports(PACKAGE / "records.py")
    assert {name for name in imported if name.split(".")[0] not in STDLIB and name != "__future__"} == set()


def _calls(attribute: str) -> set[str]:
    """Modules whose code calls ``<something>.<attribute>(...)`` or ``<attribute>(...)``."""
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name == attribute:
                    callers.add(_module_name(path))
    return callers


def test_only_the_shell_module_asks_ipython_for_the_shell():
    assert _calls("get_ipython") == {"nbtrain.kernel.shell"}


def test_only_the_display_package_shows_anything_in_a_cell():
    showing = {
        _module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(name.startswith(("IPython.display", "ipywidgets")) for name in _imports(path))
    }
    assert showing == {"nbtrain.kernel.display.show", "nbtrain.kernel.display.live", "nbtrain.kernel.display.form"}


def _writes_to_a_stream(path: Path) -> bool:
    """Whether ``path``'s code calls ``print(...)`` or ``sys.stdout.write``/``sys.stderr.write`` (docstrings aside)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                return True
            if isinstance(func, ast.Attribute) and func.attr == "write" and ast.unparse(func.value) in (
                "sys.stdout", "sys.stderr"
            ):
                return True
    return False


def test_only_the_display_package_writes_to_a_cell():
    kernel = PACKAGE / "kernel"
    writing = {_module_name(path) for path in kernel.rglob("*.py") if _writes_to_a_stream(path)}
    assert writing and all(name.startswith("nbtrain.kernel.display") for name in writing), writing


def test_only_processes_installs_signal_handlers():
    assert _calls("signal") == {"nbtrain.processes"}


def test_the_public_api_is_what_all_lists():
    public = {name for name in vars(nbtrain) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(nbtrain, name)).__name__ == "module"}
    # Submodules appear as attributes once imported; everything else public is in __all__.
    assert public - modules - {"load_ipython_extension", "annotations"} == set(nbtrain.__all__)
    assert {"last_run", "watch", "prewarm", "launch", "start", "runs"} <= set(nbtrain.__all__)


IMPORT_PROBE = """
import atexit, json, logging, os, sys  # logging registers its own atexit hook when first imported
before = atexit._ncallbacks()
import nbtrain, nbtrain.cellplan, nbtrain.kernel.magic, nbtrain.kernel.background, nbtrain.kernel.display
from nbtrain import processes
print(json.dumps({
    "children": processes.children(os.getpid()),
    "atexit": atexit._ncallbacks() - before,
    "launcher": nbtrain.kernel.launcher_connection._client is not None,
    "torch": "torch" in sys.modules,
}))
"""


def test_importing_nbtrain_starts_nothing():
    env = {key: value for key, value in os.environ.items() if key not in ("NBTRAIN_PREWARM", "NBTRAIN_ROLE")}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"children": [], "atexit": 0, "launcher": False, "torch": False}, done.stderr


def test_only_the_compat_module_knows_which_jupyter_stack_it_runs_on():
    # IPython 7 vs 8/9, ipykernel 6 vs 7, ipywidgets 7 vs 8: nbtrain.kernel.compat owns each
    # difference; nothing else reads a version or reaches for a generation's private API.
    markers = (
        "version_info", "importlib.metadata", ".__version__",
        "._repr_mimebundle_", "_handle_displayed", "_model_id", "_filename_map",
    )
    offenders = {
        _module_name(path): [marker for marker in markers if marker in path.read_text()]
        for path in PACKAGE.rglob("*.py")
        if _module_name(path) != "nbtrain.kernel.compat"
    }
    assert {name: found for name, found in offenders.items() if found} == {}
