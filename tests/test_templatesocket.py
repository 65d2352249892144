"""The warm template's socket (nbtrain.messages.templatesocket): its directory, its name, the handshake's checks.

No process is started here; tests/test_template.py runs real templates and kernels.
"""

from __future__ import annotations

import os
import socket
import sys

from nbtrain.messages import templatesocket as naming


def test_the_identity_names_the_environment_and_version():
    mine = naming.identity()
    assert mine.prefix == sys.prefix and mine.uid == os.getuid() and mine.torch
    assert naming.identity(tag="x").key() != mine.key()
    assert naming.socket_path("/run", naming.identity(tag="x")) != naming.socket_path("/run", mine)
    connection, other = socket.socketpair()
    with connection, other:
        assert naming.refusal(connection, mine, naming.Request(mine, {}, "/")) == ""
        assert naming.refusal(connection, mine, naming.Request(naming.identity(tag="x"), {}, "/")).startswith(
            "the template was started for"
        )
        assert naming.refusal(connection, mine, "hello") == "not an nbtrain template request"


def test_the_socket_directory_must_be_the_users_own_and_private(tmp_path):
    folder = tmp_path / "x"
    assert naming.socket_directory({naming.DIRECTORY_VARIABLE: str(folder)}) == str(folder)
    assert folder.stat().st_mode & 0o777 == 0o700  # made private
    folder.chmod(0o755)
    assert naming.socket_directory({naming.DIRECTORY_VARIABLE: str(folder)}) is None  # others may enter: no template
    folder.chmod(0o700)
    os.symlink(folder, tmp_path / "link")
    assert naming.socket_directory({naming.DIRECTORY_VARIABLE: str(tmp_path / "link")}) is None  # a link is not it


def test_the_lock_sits_beside_the_socket():
    path = naming.socket_path("/run/user/1000/nbtrain-1000", naming.identity())
    assert naming.lock_path(path) == path[: -len(".sock")] + ".lock"
