"""The patch table's installer: patches installed in order, undone in reverse, the user's own replacement kept."""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from nbtrain import patches
from nbtrain.patches import Lifetime, Patch


def wrap_with_mark(original):
    def replacement(*args, **kwargs):
        return ("patched", original(*args, **kwargs))

    return replacement


def constant_one(original):
    return 1


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A small library module nbtrain does not own, importable as ``patchme``, forgotten afterwards."""
    (tmp_path / "patchme.py").write_text(
        textwrap.dedent(
            """
            def double(x):
                return 2 * x

            class Base:
                def name(self):
                    return "base"

            class Child(Base):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("patchme", None)
    yield "patchme"
    sys.modules.pop("patchme", None)


def _patch(group: str, target: str, attribute: str, replacement: str, on_import: bool = False) -> Patch:
    return Patch(group, target, attribute, f"{__name__}:{replacement}", Lifetime.CELL, "a test", on_import)


def test_a_patch_is_installed_and_undone(library: str) -> None:
    table = (_patch("g", library, "double", "wrap_with_mark"),)
    module = importlib.import_module(library)
    original = module.double
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
        assert module.double(2) == ("patched", 4)
    assert module.double is original


def test_patches_of_one_attribute_are_undone_in_reverse(library: str) -> None:
    table = (_patch("g", library, "double", "wrap_with_mark"), _patch("g", library, "double", "wrap_with_mark"))
    module = importlib.import_module(library)
    original = module.double
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
        assert module.double(1) == ("patched", ("patched", 2))
    assert module.double is original


def test_the_users_own_replacement_stays(library: str) -> None:
    table = (_patch("g", library, "double", "wrap_with_mark"),)
    module = importlib.import_module(library)

    def theirs(x: int) -> int:
        return 3 * x

    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
        module.double = theirs
    assert module.double is theirs


def test_an_inherited_attribute_is_given_back_to_the_base_class(library: str) -> None:
    table = (_patch("g", f"{library}:Child", "name", "constant_one"),)
    module = importlib.import_module(library)
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
        assert module.Child.name == 1
    assert "name" not in vars(module.Child)
    assert module.Child().name() == "base"


def test_a_patch_on_import_waits_for_its_module(library: str) -> None:
    table = (_patch("g", library, "double", "wrap_with_mark", on_import=True),)
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
        assert library not in sys.modules  # installing imported nothing
        module = importlib.import_module(library)
        assert module.double(1) == ("patched", 2)
    assert module.double(1) == 2


def test_a_patch_on_import_that_never_came_is_taken_back(library: str) -> None:
    table = (_patch("g", library, "double", "wrap_with_mark", on_import=True),)
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table)
    module = importlib.import_module(library)
    assert module.double(1) == 2


def test_an_unknown_group_is_named_with_the_known_ones() -> None:
    with contextlib.ExitStack() as stack, pytest.raises(ValueError, match="no patch belongs to group 'nope'"):
        patches.install("nope", stack, (_patch("g", "colorsys", "rgb_to_hsv", "constant_one"),))


def keep_it(original):
    return original


def test_a_factory_that_returns_what_is_there_changes_nothing(library: str) -> None:
    table = (_patch("g", library, "missing", "keep_it"), _patch("g", f"{library}:Child", "name", "keep_it"))
    module = importlib.import_module(library)
    with contextlib.ExitStack() as stack:
        patches.install("g", stack, table=table)
        assert not hasattr(module, "missing") and "name" not in vars(module.Child)
    assert not hasattr(module, "missing") and "name" not in vars(module.Child)
