"""The kernel's side of the warm template (nbtrain.kernel.warm): where it answers None.

The kernel then starts its own launcher, as before the template. Real templates and
kernels are in tests/test_template.py.
"""

from __future__ import annotations

import os

from nbtrain import templatesocket as naming
from nbtrain.kernel import warm


def test_where_no_template_can_be_used_the_kernel_starts_its_own_launcher(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "1")
    monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(folder / "runtime"))
    if os.getuid() == 0:  # root writes anywhere: a directory not private to the user stands in
        folder.chmod(0o755)
        monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(folder))
    assert warm.forked_launcher() is None
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "0")
    assert warm.forked_launcher() is None


def test_switched_off_nothing_is_started(tmp_path, monkeypatch):
    monkeypatch.setenv(naming.ENABLED_VARIABLE, "off")
    monkeypatch.setenv(naming.DIRECTORY_VARIABLE, str(tmp_path / "runtime"))
    warm.ensure_template()
    assert not (tmp_path / "runtime").exists()  # not even its directory
