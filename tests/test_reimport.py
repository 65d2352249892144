"""The notebook's imports on a rank: in the kernel's order before the payload, a failure one line and no more."""

from __future__ import annotations

import sys
import textwrap

import pytest

from nbtrain.rank.machinery import reimport


@pytest.fixture
def modules_dir(tmp_path, monkeypatch):
    """A directory on sys.path for a test's modules; they leave sys.modules after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(reimport, "_failed_ahead", {})
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _write(directory, name, source):
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


def test_a_patching_module_changes_the_class_it_patches_before_anything_uses_it(modules_dir, capsys):
    _write(modules_dir, "shapes_r", "class Shape:\n    n = 3\nREGISTRY = {}\n")
    _write(modules_dir, "shapes_r_patch", "import shapes_r\nshapes_r.Shape.area = lambda self: self.n * 2\n"
                                          "shapes_r.REGISTRY['square'] = 1\n")

    assert reimport.import_for_run(["shapes_r", "shapes_r_patch"], report=True) == []

    import shapes_r

    assert shapes_r.Shape().area() == 6 and shapes_r.REGISTRY == {"square": 1}
    assert capsys.readouterr().err == ""


def test_a_module_that_fails_is_one_line_naming_it_its_error_and_what_to_do(modules_dir, capsys):
    _write(modules_dir, "shy_r", "raise RuntimeError('not on a rank')\n")
    (modules_dir / "shypkg_r").mkdir()
    (modules_dir / "shypkg_r" / "__init__.py").write_text("import only_in_the_kernel_r\n")
    (modules_dir / "shypkg_r" / "sub.py").write_text("")

    failed = reimport.import_for_run(["json", "shy_r", "shypkg_r", "shypkg_r.sub"], report=True)

    assert [failure.name for failure in failed] == ["shy_r", "shypkg_r"]  # the submodule adds nothing new
    lines = capsys.readouterr().err.splitlines()
    assert lines == [failure.line() for failure in failed]
    assert "the kernel imported shy_r, but the ranks could not (RuntimeError: not on a rank)" in lines[0]
    assert "ModuleNotFoundError: No module named 'only_in_the_kernel_r'" in lines[1]
    assert "import what the cell needs in the cell" in lines[0]


def test_other_ranks_import_the_same_and_say_nothing(modules_dir, capsys):
    _write(modules_dir, "shy2_r", "raise RuntimeError('no')\n")
    assert [failure.name for failure in reimport.import_for_run(["shy2_r"], report=False)] == ["shy2_r"]
    assert capsys.readouterr().err == ""


def test_a_standby_rank_imports_libraries_ahead_and_leaves_the_users_files_to_the_run(modules_dir):
    _write(modules_dir, "users_own_r", "")
    _write(modules_dir, "a_library_r", "")
    library = str(modules_dir / "a_library_r.py")

    reimport.import_ahead(["a_library_r", "users_own_r"], is_library=lambda path: path == library)

    assert "a_library_r" in sys.modules and "users_own_r" not in sys.modules


def test_a_library_that_failed_ahead_is_reported_by_the_run_without_importing_it_again(modules_dir, capsys):
    attempts = modules_dir / "attempts"
    _write(modules_dir, "fails_ahead_r", f"open({str(attempts)!r}, 'a').write('x')\nraise ImportError('no GPU here')\n")

    reimport.import_ahead(["fails_ahead_r"], is_library=lambda path: True)
    failed = reimport.import_for_run(["fails_ahead_r"], report=True)

    assert attempts.read_text() == "x"
    assert [failure.error for failure in failed] == ["ImportError: no GPU here"]
    assert "fails_ahead_r" in capsys.readouterr().err
