"""Which modules the notebook imported (the rule, pure), and a real kernel's 2 CPU ranks having them.

The kernel tests write, beside the notebook, a module whose import adds a method to a class
of another module and fills that module's registry (fastai's ``patch_to``, our own way): the
kernel imports the patching module only, and the cell calls the method on the ranks.
"""

from __future__ import annotations

import importlib.machinery
import sys
import textwrap
import types

import pytest

from kernel_helpers import nbtrain_kernel, wait_for_standby
from nbtrain.kernel import importedmodules
from nbtrain.launch_server.server import IMPORTS_AHEAD


def _module(name: str, spec_name: str | None = "", file: str | None = "/x.py") -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = file
    if spec_name is not None:
        module.__spec__ = importlib.machinery.ModuleSpec(spec_name or name, None)
    return module


def test_the_modules_of_the_notebooks_packages_go_in_the_kernels_order_and_only_those_importable_by_name():
    modules = {
        "fastai": _module("fastai"),
        "IPython": _module("IPython"),
        "fastai.learner": _module("fastai.learner"),
        "fastai.callback.schedule": _module("fastai.callback.schedule"),
        "fastai.made_in_memory": _module("fastai.made_in_memory", spec_name=None),
        "fastai.alias": _module("fastai.alias", spec_name="fastai.learner"),
        "__main__": _module("__main__"),
        "not_a_module": None,
    }
    chosen = importedmodules.select_modules(modules, {"fastai", "__main__"})
    assert chosen == ("fastai", "fastai.learner", "fastai.callback.schedule")


def test_a_namespace_packages_distributions_are_packages_of_their_own():
    google = types.ModuleType("google")
    google.__path__ = []  # a namespace package: no file of its own
    modules = {"google": google, "google.colab": _module("google.colab"), "torch": _module("torch")}
    assert importedmodules.package_of("google.colab._shell", modules) == "google.colab"
    assert importedmodules.package_of("google.protobuf.message", modules) == "google.protobuf"
    assert importedmodules.package_of("torch.nn.modules", modules) == "torch"


class _Point:
    pass


def test_the_users_names_give_their_packages_not_ipythons_nor_the_output_cache():
    import json
    import os.path

    hidden = {"exit": json.JSONDecoder(), "In": [], "get_ipython": os.getcwd}
    namespace = {
        **hidden,
        "json_module": json,  # a module
        "join": os.path.join,  # a function: its module's package (posixpath)
        "p": _Point(),  # an object: its type's
        "numbers": [1, 2],  # builtins: nothing to import
        "_": textwrap,  # the output cache
        "_i3": "import textwrap",
    }
    found = importedmodules.namespace_packages(namespace, hidden)
    assert found == {"json", os.path.join.__module__, __name__.partition(".")[0]}
    # A hidden name the user bound again is theirs.
    assert "textwrap" in importedmodules.namespace_packages({"exit": textwrap}, hidden)


def test_the_kernels_own_packages_are_those_of_the_shells_and_kernels_classes():
    shell_class = type("Shell", (), {"__module__": "someshell.core"})
    kernel_class = type("Kernel", (), {"__module__": "somekernel.kernelbase"})
    shell = shell_class()
    shell.kernel = kernel_class()
    assert importedmodules.kernel_packages(shell) == {"someshell", "somekernel", "nbtrain"}
    assert importedmodules.kernel_packages(None) == {"nbtrain"}


def test_a_cells_imports_count_and_what_nbtrains_cell_adds_to_a_package_the_kernel_had_is_its_own(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cellimported_m").mkdir()
    (tmp_path / "cellimported_m" / "__init__.py").write_text("")
    (tmp_path / "cellimported_m" / "lazy.py").write_text("")
    (tmp_path / "resultimported_m.py").write_text("")
    cells = importedmodules.CellImports()
    try:
        cells.before_cell(types.SimpleNamespace(raw_cell="import cellimported_m"))
        import cellimported_m
        cells.after_cell()
        cells.before_cell(types.SimpleNamespace(raw_cell="%%distributed --devices 2\nx = 1"))
        import cellimported_m.lazy  # noqa: F401  # nbtrain's own, meanwhile, in a package the kernel had
        import resultimported_m  # noqa: F401  # a new package: the ranks' results brought it
        cells.after_cell()
    finally:
        for name in ("cellimported_m", "cellimported_m.lazy", "resultimported_m"):
            sys.modules.pop(name, None)
    assert cells.packages == {"cellimported_m"}
    assert cells.own == {"cellimported_m.lazy"}


def test_only_what_the_engine_was_not_sent_goes():
    assert importedmodules.not_sent(["a", "b", "a.c"], {"a"}) == ("b", "a.c")
    assert importedmodules.not_sent(["a"], {"a"}) == ()


# --- a real kernel, 2 CPU ranks ----------------------------------------------------------------

SHAPES = """
class Shape:
    def __init__(self, n):
        self.n = n
REGISTRY = {}
"""
SHAPES_PATCH = """
import shapes_k
def area(self):
    return self.n * self.n
shapes_k.Shape.area = area  # a method added at import, as fastcore's patch_to does
shapes_k.REGISTRY["square"] = area
"""
SHY = """
import os
if os.environ.get("RANK") is not None:
    raise RuntimeError("shy_k stays in the kernel")
"""


# A library (in a site-packages directory) whose import notes which process imported it and when.
AHEAD = """
import os, time
with open(os.path.join(os.path.dirname(__file__), f"imported-by-{os.getpid()}"), "w") as note:
    note.write(repr(time.time()))
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    directory = tmp_path_factory.mktemp("beside_the_notebook")
    for name, source in (("shapes_k", SHAPES), ("shapes_k_patch", SHAPES_PATCH), ("shy_k", SHY)):
        (directory / f"{name}.py").write_text(textwrap.dedent(source))
    library = directory / "site-packages"
    library.mkdir()
    (library / "ahead_k.py").write_text(textwrap.dedent(AHEAD))
    (library / "first_k.py").write_text(textwrap.dedent(AHEAD))
    yield from nbtrain_kernel(f"import sys\nsys.path[:0] = [{str(directory)!r}, {str(library)!r}]")


NOTES = """
def notes(module, count, since):
    # The pids that imported `module` (its notes beside it), once `count` of them have, within 60 s.
    found = []
    while len(found) < count + 1 and time.time() - since < 60:  # the kernel's own note, and theirs
        found = glob.glob(os.path.join(os.path.dirname(module.__file__), 'imported-by-*'))
        time.sleep(0.02)
    return {int(n.rsplit('-', 1)[1]) for n in found} - {os.getpid()}  # not the kernel's own
"""


@pytest.mark.skipif(not IMPORTS_AHEAD, reason="the launcher imports ahead only on a machine without an NVIDIA device")
@pytest.mark.timeout(300)
def test_a_first_runs_ranks_have_the_libraries_the_notebook_imported_from_their_launcher(kernel):
    # Before any run (no standby ranks): the launcher imports the library while it waits, and the first
    # run's ranks, forked from it, have it without importing it themselves.
    kernel.run_ok("import glob, os, time\nfrom nbtrain.kernel import launcher_connection\n" + NOTES)
    kernel.run_ok("import first_k\nimported_at = time.time()\n")
    kernel.run_ok("ahead = sorted(notes(first_k, 1, imported_at))")
    kernel.run_ok("launcher = launcher_connection.get_client().process.pid")
    assert kernel.value("ahead") == [kernel.value("launcher")]
    kernel.run_ok("%%distributed --devices 2\nimport os, torch.distributed as dist\npids = [None, None]\n"
                  "dist.all_gather_object(pids, (os.getpid(), first_k.__name__))\n")
    pids = kernel.value("pids")
    assert [name for _, name in pids] == ["first_k", "first_k"]
    assert kernel.value("sorted(notes(first_k, 1, time.time()))") == [kernel.value("launcher")]  # no rank did


@pytest.mark.timeout(300)
def test_a_method_and_a_registration_the_kernels_import_added_are_there_on_every_rank(kernel):
    kernel.run_ok("import shapes_k_patch\nshape = shapes_k_patch.shapes_k.Shape(3)\n")
    kernel.run_ok(
        "%%distributed --devices 2\n"
        "import torch.distributed as dist, shapes_k\n"
        "seen = [None, None]\n"
        "dist.all_gather_object(seen, (shape.area(), sorted(shapes_k.REGISTRY)))\n"
    )
    assert kernel.value("seen") == [[9, ["square"]], [9, ["square"]]]
    # The next run sends torch's, as the cell bound `dist`; then nothing is left to send: the launcher kept the list.
    kernel.run_ok("%%distributed --devices 2\nagain = shape.area()\n")
    kernel.run_ok(
        "from nbtrain.kernel import importedmodules, launcher_connection\n"
        "sent = launcher_connection.get_client().modules_sent\n"
        "now = importedmodules.notebook_modules(get_ipython())\n"
    )
    assert kernel.value("'shapes_k_patch' in sent and 'shapes_k' in sent")
    assert kernel.value("importedmodules.not_sent(now, sent)") == []


@pytest.mark.timeout(300)
def test_a_module_a_rank_cannot_import_is_one_line_and_the_cell_goes_on(kernel):
    kernel.run_ok("import shy_k\nvalue = 2\n")
    out = kernel.run_ok("%%distributed --devices 2\nvalue = value + 1\n")
    assert kernel.value("value") == 3
    lines = [line for line in out.text.splitlines() if "shy_k" in line]
    assert len(lines) == 1, out.text
    assert "the kernel imported shy_k, but the ranks could not (RuntimeError: shy_k stays in the kernel)" in lines[0]
    assert "Traceback" not in out.text


@pytest.mark.timeout(300)
def test_standby_ranks_import_a_library_a_cell_imports_while_they_wait(kernel):
    kernel.run_ok("%%distributed --devices 2\nx = 1\n")
    assert wait_for_standby(kernel, bound=60.0)[1]
    kernel.run_ok("import ahead_k, glob, os, time\nbefore_the_run = time.time()\n")
    # Bounded: each standby rank imports it as it hears of it, well before a user's next cell; so does
    # the launcher (a third note), for the ranks it forks after.
    kernel.run_ok(NOTES + "ahead = notes(ahead_k, 3, before_the_run)\n")
    kernel.run_ok("%%distributed --devices 2\nimport os\nrank_pid = os.getpid()\n")
    ahead = set(kernel.value("sorted(ahead)"))
    assert kernel.value("rank_pid") in ahead  # noted before the run, by its rank 0
    launcher = kernel.value("launcher_connection.get_client().process.pid")
    assert (launcher in ahead) is IMPORTS_AHEAD
