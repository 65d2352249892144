"""The shape of the package: who imports whom, who owns the shell and the signals, what an import starts.

The import graph is read from the source (every ``import``, at module level or inside a
function), so a cycle hidden in a function body counts as one, and so does one through a
package's ``__init__`` (``import nbtrain`` or ``from nbtrain import launch`` inside a module
that ``nbtrain/__init__.py`` imports), and so does an import of a layer above the importer's
(``LAYERS``, lowest first; its few exceptions named, with why). The import side effects are checked in a fresh
interpreter. The names and sizes are read from the source too: one name per thing (no two
modules, classes or public functions share one), no function over 50 lines of code, a
docstring on everything public, and a test file for every module.
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


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _import_sites(path: Path, modules: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, anywhere in it (absolute names), in the file's order.

    ``from P import n`` imports the submodule ``P.n`` where ``modules`` has one (P is only the
    way to it), else the package ``P`` itself: ``n`` is a name its ``__init__`` defines.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((node.lineno, submodule if submodule in modules else node.module))
    return sorted(found)


def _imports(path: Path, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module ``path`` imports, anywhere in it (see :func:`_import_sites`)."""
    return {name for _, name in _import_sites(path, modules)}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = frozenset(modules)
    return {
        name: {dep for dep in _imports(path, names) if dep in names and dep != name}
        for name, path in modules.items()
    }


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the package's own modules, packages (their ``__init__``) included, or None."""
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


def test_no_import_cycles_counting_imports_inside_functions_and_of_parent_packages():
    found = _cycle(_graph())
    assert found is None, f"import cycle: {' -> '.join(found or [])}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_counts_a_parent_package_for_its_names_not_on_the_way_to_a_submodule(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from nbtrain import launch\nfrom nbtrain.kernel import client\n"
        "def later():\n    import nbtrain.rank\n    from nbtrain.kernel.display import watch\n"
    )
    modules = frozenset(
        {"nbtrain", "nbtrain.kernel", "nbtrain.kernel.client", "nbtrain.rank", "nbtrain.kernel.display"}
    )
    # launch and watch are names that a package's __init__ defines; client is a submodule
    assert _imports(source, modules) == {"nbtrain", "nbtrain.kernel.client", "nbtrain.rank", "nbtrain.kernel.display"}


# --- layers: no module imports one of a layer above its own -------------------------------------

# The layers, lowest first: each may import its own and those below it, never one above. An entry
# holds a module or a package (its submodules too); a module is in the layer of the longest entry
# holding it; "nbtrain" is the package's __init__ alone (the public API). The process sides are
# peers: what each may take from the others is the rules above and below (the rank's doors, the
# launcher's preload list, no kernel on the rank side).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("nbtrain.errors", "nbtrain.frameworks")),  # the standard library only
    ("system", ("nbtrain.system",)),  # what nbtrain asks of the OS
    ("patch table", ("nbtrain.patches",)),  # its factories are named, imported only when installed
    ("messages", ("nbtrain.messages",)),  # what travels between processes
    ("planning", ("nbtrain.planning",)),  # the plan before any process starts
    ("options", ("nbtrain.options", "nbtrain.livestate")),  # the launch options, what the live view knows
    ("process sides", (
        "nbtrain.kernel", "nbtrain.launch_server", "nbtrain.rank", "nbtrain.cluster", "nbtrain.serverext",
    )),
    ("public API", ("nbtrain",)),
)
# (importer, imported) -> why: the imports of a higher layer allowed, each a lazy import (inside the
# function that needs it) that a lower layer's module makes on purpose. Every one must still exist.
UPWARD_ALLOWED = {
    ("nbtrain.patches", "nbtrain.rank.machinery.afterimport"): (
        "the rank's import hook: a patch whose module is not imported yet waits for it there; only such a "
        "patch imports it, as every factory of the table is imported only when its patch is installed"
    ),
    ("nbtrain.options", "nbtrain.kernel.shell"): (
        "magic_line() without a magic writes the kernel's own cell magic (%%nbtrain where another package "
        "holds %%distributed), which only the kernel's shell knows; the options stay importable without IPython"
    ),
}


def _layer(name: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> tuple[int, str] | None:
    """(position, name) of the layer that holds module ``name``, or None: no entry holds it."""
    holding = [
        (len(entry), index, layer)
        for index, (layer, entries) in enumerate(layers)
        for entry in entries
        if name == entry or (entry != "nbtrain" and name.startswith(entry + "."))
    ]
    return max(holding)[1:] if holding else None


def upward_imports(
    package: Path,
    layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
    allowed: frozenset[tuple[str, str]] = frozenset(UPWARD_ALLOWED),
) -> list[str]:
    """Every import in ``package`` of a module of a higher layer than the importer's, not ``allowed``:
    ``file:line: importer (its layer) imports module (its layer)``."""
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}
    names = frozenset(modules)
    found = []
    for name, path in sorted(modules.items()):
        own = _layer(name, layers)
        for line, dep in _import_sites(path, names):
            theirs = _layer(dep, layers) if dep in names else None
            if own and theirs and theirs[0] > own[0] and (name, dep) not in allowed:
                where = path.relative_to(package.parent).as_posix()
                found.append(f"{where}:{line}: {name} ({own[1]}) imports {dep} ({theirs[1]})")
    return found


def unmarked_function_imports(package: Path) -> list[str]:
    """Each import inside a function with no comment saying why, on its line or its block's first line's above
    (start-up time, an optional dependency): ``file:line``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            marked = False  # a comment above the first of consecutive imports marks them all
            for node in function.body if hasattr(function, "body") else ():
                for inner in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
                    if not isinstance(inner, (ast.Import, ast.ImportFrom)):
                        continue
                    above = next(line.strip() for line in reversed(lines[: inner.lineno - 1]) if line.strip())
                    follows = marked and above.startswith(("import", "from"))  # the same block, sections apart
                    marked = "#" in lines[inner.lineno - 1] or above.startswith("#") or follows
                    if not marked:
                        found.append(f"{path.relative_to(package.parent).as_posix()}:{inner.lineno}")
    return found


def test_every_import_inside_a_function_says_why_it_is_there():
    assert unmarked_function_imports(PACKAGE) == []


def test_the_import_marker_check_finds_an_unmarked_import(tmp_path):
    package = tmp_path / "nbtrain"
    package.mkdir()
    (package / "a.py").write_text(
        "def f():\n    # deferred: start-up time (torch)\n    import torch\n    import numpy\n\n"
        "def g():\n    x = 1\n    import json\n    return x\n"
    )
    assert unmarked_function_imports(package) == ["nbtrain/a.py:8"]


def test_no_module_imports_a_higher_layer():
    assert upward_imports(PACKAGE) == []


def test_every_module_is_in_a_layer():
    assert [name for name in sorted(_modules()) if _layer(name) is None] == []


def test_every_allowed_upward_import_is_still_made():
    # An exception nobody needs any more is removed, not kept for the next import to hide behind.
    graph = _graph()
    assert [pair for pair in UPWARD_ALLOWED if pair[1] not in graph.get(pair[0], set())] == []
    assert all((_layer(low) or (0, ""))[0] < (_layer(high) or (0, ""))[0] for low, high in UPWARD_ALLOWED)  # upward


def test_the_layer_check_finds_each_upward_import_by_file_and_line(tmp_path):
    package = tmp_path / "nbtrain"
    for folder in ("system", "rank", "kernel"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from nbtrain.kernel import magic\n")  # the top: anything
    (package / "errors.py").write_text("import os\n")
    (package / "kernel" / "magic.py").write_text("from nbtrain import errors\nfrom nbtrain.rank import api\n")
    (package / "rank" / "api.py").write_text("from nbtrain.kernel import magic\n")  # peers: not this check's
    (package / "system" / "low.py").write_text(
        "from nbtrain.errors import Error\n"
        "def later():\n    import nbtrain.rank.api\n"
        "def hook():\n    from nbtrain.kernel import magic\n"
        "def api():\n    import nbtrain\n"
    )
    layers = (
        ("base", ("nbtrain.errors",)),
        ("system", ("nbtrain.system",)),
        ("sides", ("nbtrain.kernel", "nbtrain.rank")),
        ("public API", ("nbtrain",)),
    )
    allowed = frozenset({("nbtrain.system.low", "nbtrain.kernel.magic")})
    assert upward_imports(package, layers, allowed) == [
        "nbtrain/system/low.py:3: nbtrain.system.low (system) imports nbtrain.rank.api (sides)",
        "nbtrain/system/low.py:7: nbtrain.system.low (system) imports nbtrain (public API)",
    ]
    assert _layer("nbtrain.system.low", layers) == (1, "system") and _layer("nbtrain.elsewhere", layers) is None


def test_the_rank_side_never_imports_the_kernel_side():
    graph = _graph()
    offenders = {name: sorted(dep for dep in deps if dep.startswith("nbtrain.kernel")) for name, deps in graph.items()}
    assert {name: deps for name, deps in offenders.items() if name.startswith("nbtrain.rank") and deps} == {}


# The rank side's doors. Everything outside nbtrain/rank/ imports from it only the cell's entry
# point (run_cell, CellSpec, and the loaders' length rule the kernel sizes a cell with) and the
# rank's public API. Three modules have more: the public API itself (nbtrain/__init__.py exports
# prepare and the debugger's stop_at), the launcher (what its preload list names, see below), and
# the patch table (the rank's import hook, which its on_import patches need).
RANK_ENTRY_POINTS = {"nbtrain.rank", "nbtrain.rank.cell", "nbtrain.rank.api"}
RANK_DOORS_EXEMPT = {"nbtrain", "nbtrain.patches"}
LAUNCHER = "nbtrain.launch_server"
PRELOAD_SOURCE = PACKAGE / "launch_server" / "server.py"  # its PRELOAD: the one list of what the launcher imports ahead


def _in(package: str, name: str) -> bool:
    return name == package or name.startswith(package + ".")


def _rank_imports(graph: dict[str, set[str]], allowed: dict[str, set[str]], default: set[str]) -> dict[str, list[str]]:
    """Modules outside nbtrain.rank that import a rank module not allowed to them: ``allowed`` by
    package (the launcher's preload list), else ``default`` (the cell's entry point and the API)."""
    offenders = {}
    for name, deps in graph.items():
        if _in("nbtrain.rank", name) or name in RANK_DOORS_EXEMPT:
            continue
        doors = next((doors for package, doors in allowed.items() if _in(package, name)), default)
        if found := sorted(dep for dep in deps if _in("nbtrain.rank", dep) and dep not in doors):
            offenders[name] = found
    return offenders


def _preload() -> tuple[str, ...]:
    """The launcher's PRELOAD, read from its source (importing the launcher is not needed)."""
    for node in ast.parse(PRELOAD_SOURCE.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["PRELOAD"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"no PRELOAD in {PRELOAD_SOURCE}")


def test_the_kernel_side_imports_from_the_rank_only_the_cells_entry_point_and_the_public_api():
    graph = _graph()
    launcher_may = {name for name in _preload() if _in("nbtrain.rank", name)}
    assert _rank_imports(graph, {LAUNCHER: launcher_may}, RANK_ENTRY_POINTS) == {}


def test_the_launcher_imports_from_the_rank_only_what_its_preload_list_names():
    graph = _graph()
    imported = {dep for name, deps in graph.items() if _in(LAUNCHER, name) for dep in deps if _in("nbtrain.rank", dep)}
    assert imported - set(_preload()) == set()


def test_every_nbtrain_module_the_preload_list_names_exists():
    # preload() skips a module it cannot import (an optional library): a renamed module of ours
    # would silently stop being imported ahead, and every rank would pay for it.
    modules = _modules()
    assert [name for name in _preload() if _in("nbtrain", name) and name not in modules] == []


def test_the_rank_door_check_finds_a_module_that_reaches_past_them():
    graph = {
        "nbtrain.kernel.x": {"nbtrain.rank.cell", "nbtrain.rank.auto.preparedloaders"},
        "nbtrain.launch_server.y": {"nbtrain.rank.machinery.runtime", "nbtrain.rank.auto.wrapping"},
        "nbtrain.rank.auto.z": {"nbtrain.rank.auto.preparedloaders"},  # inside the rank side: anything
        "nbtrain": {"nbtrain.rank.auto.prepare"},  # the public API
    }
    allowed = {LAUNCHER: {"nbtrain.rank.machinery.runtime"}}
    assert _rank_imports(graph, allowed, RANK_ENTRY_POINTS) == {
        "nbtrain.kernel.x": ["nbtrain.rank.auto.preparedloaders"],
        "nbtrain.launch_server.y": ["nbtrain.rank.auto.wrapping"],
    }


def test_records_imports_only_the_standard_library():
    imported = _imports(PACKAGE / "messages" / "records.py")
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
    """Whether ``path``'s code calls ``print(...)`` or ``write`` on ``sys.stdout``/``sys.stderr``, directly or
    through a name assigned from them (``stream = sys.stderr if ... else sys.stdout``); not docstrings."""
    tree = ast.parse(path.read_text())
    std = ("sys.stdout", "sys.stderr")
    streams = set(std)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(name in ast.unparse(node.value) for name in std):
            streams.update(ast.unparse(target) for target in node.targets)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                return True
            if isinstance(func, ast.Attribute) and func.attr == "write" and ast.unparse(func.value) in streams:
                return True
    return False


def test_only_the_display_package_writes_to_a_cell():
    kernel = PACKAGE / "kernel"
    writing = {_module_name(path) for path in kernel.rglob("*.py") if _writes_to_a_stream(path)}
    assert writing and all(name.startswith("nbtrain.kernel.display") for name in writing), writing


def test_only_processes_installs_signal_handlers():
    assert _calls("signal") == {"nbtrain.system.processes"}


def test_the_public_api_is_what_all_lists():
    public = {name for name in vars(nbtrain) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(nbtrain, name)).__name__ == "module"}
    # Submodules appear as attributes once imported; everything else public is in __all__.
    hooks = {"load_ipython_extension", "unload_ipython_extension", "annotations"}  # IPython's, not the API
    assert public - modules - hooks == set(nbtrain.__all__)
    assert {"last_run", "watch", "prewarm", "launch", "start", "runs"} <= set(nbtrain.__all__)


IMPORT_PROBE = """
import atexit, json, logging, os, sys  # logging registers its own atexit hook when first imported
before = atexit._ncallbacks()
import nbtrain, nbtrain.planning.steptotal, nbtrain.kernel.magic, nbtrain.kernel.background, nbtrain.kernel.display
from nbtrain.system import processes
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


# --- one name per thing, short functions, docstrings, a test file per module ---------------------

TESTS = Path(__file__).parent
LONGEST_FUNCTION = 50  # lines of code: blank lines, comment lines and the docstring left out
ENTRY_POINTS = {"main"}  # each process's entry point is called main, by convention


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in sorted(_modules().items())}


def _shared(owners: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in sorted(owners.items()) if len(places) > 1}


def _own_modules() -> list[Path]:
    """The package's modules other than ``__init__`` and ``__main__``."""
    return sorted(path for path in PACKAGE.rglob("*.py") if path.stem not in ("__init__", "__main__"))


def test_no_two_modules_share_a_basename():
    owners: dict[str, list[str]] = {}
    for path in _own_modules():
        owners.setdefault(path.stem, []).append(_module_name(path))
    assert _shared(owners) == {}


def test_no_two_classes_share_a_name():
    owners: dict[str, list[str]] = {}
    for module, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                owners.setdefault(node.name, []).append(module)
    assert _shared(owners) == {}


def test_no_two_public_functions_share_a_name():
    owners: dict[str, list[str]] = {}
    for module, tree in _trees().items():
        if module == "nbtrain":  # the public API: its functions stand for the modules' own
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not node.name.startswith("_") and node.name not in ENTRY_POINTS:
                owners.setdefault(node.name, []).append(module)
    assert _shared(owners) == {}


def _lines_of_code(function: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """``function``'s lines that hold code: not blank, not only a comment, not its docstring."""
    skipped: set[int] = set()
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skipped = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(
        1
        for number in range(function.lineno, (function.end_lineno or function.lineno) + 1)
        if number not in skipped and source[number - 1].strip() and not source[number - 1].strip().startswith("#")
    )


def _long_functions(tree: ast.Module, source: list[str], limit: int) -> dict[str, int]:
    """Functions and methods (by line) over ``limit`` lines of code, with their counts."""
    return {
        f"{node.name} (line {node.lineno})": lines
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (lines := _lines_of_code(node, source)) > limit
    }


def test_the_line_counter_leaves_out_the_docstring_comments_and_blank_lines():
    source = 'def f():\n    """Does.\n\n    More.\n    """\n    # why\n\n    a = 1\n    return a\n'
    tree = ast.parse(source)
    assert _long_functions(tree, source.splitlines(), 1) == {"f (line 1)": 3}  # def, a = 1, return
    assert _long_functions(tree, source.splitlines(), 3) == {}


def test_no_function_is_over_50_lines_of_code():
    long = {}
    for module, path in sorted(_modules().items()):
        text = path.read_text()
        if found := _long_functions(ast.parse(text), text.splitlines(), LONGEST_FUNCTION):
            long[module] = found
    assert long == {}


def _undocumented(tree: ast.Module) -> list[str]:
    """Public classes and functions of ``tree`` (and public methods of its public classes) without a docstring."""
    missing = []
    pending: list[tuple[str, ast.stmt]] = [("", node) for node in tree.body]
    while pending:
        prefix, node = pending.pop(0)
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None:
            missing.append(f"{prefix}{node.name}")
        if isinstance(node, ast.ClassDef):
            pending.extend((f"{prefix}{node.name}.", child) for child in node.body)
    return missing


def test_the_docstring_finder_finds_public_names_only():
    tree = ast.parse(
        "class A:\n    def m(self): pass\n    def _p(self): pass\n    def __init__(self): pass\n"
        "class _B:\n    def m(self): pass\n"
        "def f():\n    def inner(): pass\n"
        'def g():\n    """Has one."""\n'
    )
    assert _undocumented(tree) == ["A", "f", "A.m"]


def test_every_public_class_function_and_method_has_a_docstring():
    missing = {module: names for module, tree in _trees().items() if (names := _undocumented(tree))}
    assert missing == {}


def _test_files(module: Path) -> list[Path]:
    """Where ``module``'s tests may live: tests/test_<module>.py, tests/test_<package>_<module>.py,
    and for the cluster engine's modules tests/cluster/test_<module>.py."""
    parts = module.relative_to(PACKAGE).with_suffix("").parts
    candidates = [TESTS / f"test_{parts[-1]}.py"]
    if len(parts) > 1:
        candidates.append(TESTS / f"test_{parts[-2]}_{parts[-1]}.py")
    if parts[0] == "cluster":
        candidates.append(TESTS / "cluster" / f"test_{parts[-1]}.py")
    return candidates


def _has_a_test(path: Path) -> bool:
    if not path.is_file():
        return False
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            return True
    return False


def test_the_test_file_names_follow_the_module():
    assert [path.relative_to(TESTS).as_posix() for path in _test_files(PACKAGE / "cluster" / "engine.py")] == [
        "test_engine.py",
        "test_cluster_engine.py",
        "cluster/test_engine.py",
    ]
    assert _has_a_test(Path(__file__)) and not _has_a_test(TESTS / "test_no_such_module.py")


def test_every_module_has_its_own_test_file():
    untested = [
        _module_name(path) for path in _own_modules() if not any(_has_a_test(file) for file in _test_files(path))
    ]
    assert untested == []


def test_the_server_config_the_install_wrote_enables_the_server_extension_package():
    from nbtrain import serverext

    source = PACKAGE.parent / "jupyter-config" / "server-config" / "nbtrain.json"
    assert json.loads(source.read_text()) == {"ServerApp": {"jpserver_extensions": {"nbtrain.serverext": True}}}
    assert serverext._jupyter_server_extension_points() == [{"module": serverext.__name__}]
    installed = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "nbtrain.json"
    assert installed.read_text() == source.read_text(), (
        f"{installed} is not the one this tree installs: reinstall nbtrain (bash .ci/setup, or pip install -e .)"
    )


# --- every change to a library's attribute is in the patch table ----------------------------------

PATCH_TABLE = "patches.py"  # nbtrain/patches.py: the one module that may replace a library's attribute
# What hands out a library's module by name.
_LOOKUPS = {("sys", "modules"), ("importlib", "import_module"), ("ledger", "torch_module")}
# Attributes set through a library's own API for it, not replacements of its code: ctypes'
# declaration of a foreign function's types, and torch's cuDNN switches set as the kernel has them.
# ctypes' declarations of a function's types; a pass's state that accelerate's own loaders keep (in_pass_books).
_NOT_PATCHES = {
    ("processes.py", "restype"), ("processes.py", "argtypes"), ("sharedtensors.py", "argtypes"),
    ("frameworks.py", "end_of_dataloader"),
}
_SETTINGS = {"torchsettings.py"}


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _library_names(tree: ast.Module) -> set[str]:
    """Names in ``tree`` that stand for a library's module or class (anywhere in the file): bound by
    an import of a module other than nbtrain's, a parameter annotated ``ModuleType``, a module looked
    up by name, a loop over such things, or an attribute of one (``owner = torch.amp.GradScaler``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] != "nbtrain":
                    names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.partition(".")[0] not in ("nbtrain", "__future__"):
                names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.arg) and isinstance(node.annotation, ast.Name) and node.annotation.id == "ModuleType":
            names.add(node.arg)
    before = -1
    while len(names) != before:  # aliases of aliases
        before = len(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if _stands_for_a_library(node.value, names):
                    names.add(node.targets[0].id)
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                items = node.iter.elts if isinstance(node.iter, (ast.Tuple, ast.List)) else []
                if items and all(_stands_for_a_library(item, names) for item in items):
                    names.add(node.target.id)
    return names


def _stands_for_a_library(value: ast.expr, names: set[str]) -> bool:
    if isinstance(value, ast.Call):
        func = value.func
        lookup = func.value if isinstance(func, ast.Attribute) and func.attr == "get" else func
        chain = (getattr(lookup, "value", None), getattr(lookup, "attr", None))
        return isinstance(chain[0], ast.Name) and (chain[0].id, chain[1]) in _LOOKUPS
    if isinstance(value, ast.Subscript):
        return _stands_for_a_library(ast.Call(func=ast.Attribute(value=value.value, attr="get")), names)
    while isinstance(value, ast.Attribute):  # an attribute of one (a call's result is no module's)
        value = value.value
    return isinstance(value, ast.Name) and value.id in names


def _library_assignments_in(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, code) of each replacement of a library's attribute in ``tree``: ``torch.save = ...``,
    ``setattr(DataLoader, ...)``, ``vars(module).update(...)``; an item (``os.environ[...]``) is not one."""
    names = _library_names(tree)

    def library(node: ast.expr) -> bool:
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in names

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for each in node.targets for t in (each.elts if isinstance(each, ast.Tuple) else [each])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [node.args[0]] if library(node.args[0]) else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            owner = node.func.value
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "vars":
                targets = [owner.args[0]] if owner.args and library(owner.args[0]) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and library(target) or isinstance(node, ast.Call):
                found.append((node.lineno, ast.unparse(node).splitlines()[0]))
                break
    return found


def library_assignments(package: Path) -> list[str]:
    """Every replacement of a library's attribute in ``package`` outside its patch table: ``file:line: code``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == PATCH_TABLE:
            continue
        if path.name in _SETTINGS:
            continue
        for line, code in _library_assignments_in(ast.parse(path.read_text())):
            if any(path.name == name and f".{attribute} =" in code for name, attribute in _NOT_PATCHES):
                continue
            found.append(f"{path.relative_to(package.parent).as_posix()}:{line}: {code}")
    return found


def test_nothing_outside_the_patch_table_replaces_a_librarys_attribute():
    assert library_assignments(PACKAGE) == []


def test_the_patch_finder_finds_each_way_of_replacing_a_librarys_attribute(tmp_path):
    package = tmp_path / "nbtrain"
    package.mkdir()
    (package / "patches.py").write_text("import torch\ntorch.save = print\n")  # the table's own: allowed
    (package / "each.py").write_text(
        "import builtins, os, sys, torch\n"
        "from torch.utils.data import DataLoader\n"
        "from nbtrain.messages import records\n"
        "from types import ModuleType\n"
        "torch.save = print\n"
        "DataLoader.__iter__ = iter\n"
        "sys.stdout = None\n"
        "builtins.input = input\n"
        "os.environ['X'] = '1'\n"  # an item, not an attribute
        "records.x = 1\n"  # nbtrain's own
        "def f(numpy: ModuleType, obj):\n"
        "    numpy.save = print\n"
        "    scaler = torch.amp.GradScaler\n"
        "    scaler.unscale_ = print\n"
        "    setattr(sys.modules['pdb'], 'set_trace', print)\n"
        "    vars(numpy).update(load=print)\n"
        "    obj.step = print\n"  # an object's own attribute
    )
    found = [line.split(": ", 1)[1] for line in library_assignments(package)]
    assert found == [
        "torch.save = print",
        "DataLoader.__iter__ = iter",
        "sys.stdout = None",
        "builtins.input = input",
        "numpy.save = print",
        "scaler.unscale_ = print",
        "setattr(sys.modules['pdb'], 'set_trace', print)",
        "vars(numpy).update(load=print)",
    ]


def test_docs_list_every_patch_of_the_table():
    from nbtrain import patches

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [
        f"{patch.target} {patch.attribute}"
        for patch in patches.TABLE
        if f"| {patch.group} | `{patch.target}` | `{patch.attribute}` | {patch.lifetime.value} |" not in text
    ]
    assert missing == []
