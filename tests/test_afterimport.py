"""A module changed as it is imported (nbtrain.rank.machinery.afterimport), in a fresh interpreter each."""

from __future__ import annotations

import textwrap

import pytest

from helpers import procs

pytestmark = pytest.mark.timeout(120)


def _run(tmp_path, code: str) -> str:
    (tmp_path / "libmod.py").write_text("value = 'original'\n\ndef read():\n    return value\n")
    (tmp_path / "user.py").write_text("from libmod import value\n")  # binds the name as it is imported
    return procs.python_output(textwrap.dedent(code), cwd=tmp_path)


def test_a_module_imported_later_is_changed_before_anything_binds_its_names(tmp_path):
    out = _run(
        tmp_path,
        """
        import sys
        sys.path.insert(0, '.')
        from nbtrain.rank.machinery import afterimport
        afterimport.when_imported('libmod', lambda m: setattr(m, 'value', 'changed'))
        afterimport.when_imported('libmod', lambda m: setattr(m, 'value', m.value + '-twice'))  # in order
        take_back = afterimport.when_imported('libmod', lambda m: setattr(m, 'value', 'taken back'))
        take_back()
        import user, libmod
        print(user.value, libmod.read(), 'libmod' in sys.modules)
        """,
    )
    assert out.split() == ["changed-twice", "changed-twice", "True"]


def test_a_module_already_imported_is_changed_at_once_and_forks_inherit_the_hook(tmp_path):
    out = _run(
        tmp_path,
        """
        import os, sys
        sys.path.insert(0, '.')
        import libmod
        from nbtrain.rank.machinery import afterimport
        afterimport.when_imported('libmod', lambda m: setattr(m, 'value', 'changed'))
        afterimport.when_imported('user', lambda m: setattr(m, 'seen', True))
        print(libmod.read(), flush=True)
        pid = os.fork()
        if pid == 0:
            import user
            print(user.value, user.seen, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        """,
    )
    assert out.split() == ["changed", "changed", "True"]


def test_a_missing_module_still_fails_to_import_as_usual(tmp_path):
    out = _run(
        tmp_path,
        """
        from nbtrain.rank.machinery import afterimport
        afterimport.when_imported('no_such_module_here', lambda m: None)
        try:
            import no_such_module_here
        except ModuleNotFoundError as error:
            print(type(error).__name__)
        """,
    )
    assert out.strip() == "ModuleNotFoundError"
