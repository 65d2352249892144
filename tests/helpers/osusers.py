"""Other OS users for the tests: made with ``useradd`` (root only), removed with ``userdel -r``.

A test that acts as another user of the machine (a victim whose kernel runs a job, an
attacker who tries to reach it) makes them here and removes them in its teardown. The
names carry this process's pid, so helpers running tests at once never share a user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def require_root_tools() -> None:
    """Skip the test unless it can make users and act as them (root, useradd, userdel, setpriv)."""
    tools = ("useradd", "userdel", "setpriv")
    if os.getuid() != 0 or any(shutil.which(tool) is None for tool in tools):
        pytest.skip("needs root, useradd, userdel and setpriv to act as other users")


@contextmanager
def made_user(role: str) -> Iterator[pwd.struct_passwd]:
    """A new user ``nbt<role><pid>`` (no home, a login shell), removed with ``userdel -r`` after."""
    require_root_tools()
    name = f"nbt{role}{os.getpid()}"[:32]
    command = ["useradd", "--no-create-home", "--shell", "/bin/bash", name]
    made = subprocess.run(command, capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"useradd could not make {name}: {made.stderr.decode(errors='replace').strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True, check=False)


def as_user(user: pwd.struct_passwd) -> list[str]:
    """The command prefix that runs what follows as ``user``, with no capability left."""
    return [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]


def private_directory(user: pwd.struct_passwd, parent: str) -> str:
    """A new directory in ``parent`` owned by ``user``, mode 0700."""
    import tempfile

    path = tempfile.mkdtemp(prefix=f"{user.pw_name}-", dir=parent)
    os.chown(path, user.pw_uid, user.pw_gid)
    os.chmod(path, 0o700)
    return path
