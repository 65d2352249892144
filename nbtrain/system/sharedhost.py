"""Saying, once, what of a run another user of this machine could still reach, and what to do.

A single-machine run's store is a nameless file (nbtrain.system.rendezvous) and, where the OS allows,
its process group's sockets live in a network of the user's own (nbtrain.system.privatenet). Where
they cannot, gloo's listeners (one per rank, on 127.0.0.1, open while the ranks live: standby
ranks' up to their idle limit) or NCCL's bootstrap sockets accept connections from any local
user. The kernel says so once: after the first such run's summary on a machine with more than
one human account, or when ``nbtrain.runs()`` is asked.

Measured by ``tests/test_sharedhost.py`` (another user tries every listening TCP and Unix socket
in the run's processes' ``/proc`` tables, while the run trains and while its standby ranks
wait): before this design 3 reached (rank 0's TCPStore, one gloo listener per rank); now 0 where
user namespaces are allowed, 2 (gloo's) where they are not. gloo authenticates nothing. Measured
(torch 2.13, 2 ranks): a stranger's connection is accepted and held; random bytes, or the
sequence numbers a pair would announce itself with, are ignored and the group's answers stay
right. Not proven harmless: gloo matches a connection to a pair by that number, so one that
announces a pair not connected yet (a group made later) could take its place, and what a peer
sends to ``broadcast_object_list``/``all_gather_object`` is unpickled.

>>> import tempfile
>>> with tempfile.NamedTemporaryFile("w", suffix="passwd", delete=False) as f:
...     _ = f.write("root:x:0:0::/root:/bin/bash\\nann:x:1000:1000::/home/ann:/bin/bash\\n"
...                 "svc:x:1001:1001::/:/usr/sbin/nologin\\nbob:x:1002:1002::/home/bob:/bin/zsh\\n")
>>> human_accounts(f.name)
2
>>> said = sentence("the nccl backend is not covered (only CPU runs on gloo are)", 2)
>>> said.startswith("nbtrain: this machine has 2 user accounts, and this run's process-group sockets")
True
>>> "standby_idle=None" in said
True
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from nbtrain.system import privatenet

PASSWD = "/etc/passwd"
_NO_LOGIN = ("nologin", "false", "sync", "shutdown", "halt")
_said: list[str] = []  # what was said, once per kernel

_WHAT_TO_DO = {
    "refuses": "Ask the machine's administrator to allow unprivileged user namespaces "
    "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, or on Ubuntu "
    "kernel.apparmor_restrict_unprivileged_userns=0; a container needs a seccomp profile that allows "
    "unshare), or use a machine of your own",
    privatenet.SWITCH_VARIABLE: f"Unset {privatenet.SWITCH_VARIABLE}=0 to keep them in a network of your own",
    "ddp_spawn": "Use strategy ddp (forked ranks) to keep them in a network of your own",
    "TORCH_GLOO_LAZY_INIT": "Unset TORCH_GLOO_LAZY_INIT to keep them in a network of your own",
}
_OTHERWISE = (
    "Use a machine (or container) of your own for work others must not touch, and "
    "`nbtrain.set_defaults(standby_idle=None)` to keep no ranks waiting between runs"
)


def human_accounts(passwd: str | None = None) -> int:
    """How many accounts of ``passwd`` (default /etc/passwd) are people's: uid >= 1000 (not nobody), a login shell."""
    try:
        with open(passwd or PASSWD) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    accounts = [fields for fields in (line.split(":") for line in lines) if len(fields) >= 7 and fields[2].isdigit()]
    logins = [fields for fields in accounts if fields[6] and not fields[6].endswith(_NO_LOGIN)]
    return sum(1 for fields in logins if 1000 <= int(fields[2]) < 65534)


def sentence(reason: str, accounts: int) -> str:
    """What the user is told: what stayed reachable, by whom, for how long, why, and what to do."""
    key = next((key for key in _WHAT_TO_DO if key in reason), None)
    todo = _WHAT_TO_DO[key] if key is not None else _OTHERWISE
    who = f"this machine has {accounts} user accounts, and" if accounts > 1 else "on this machine"
    return (
        f"nbtrain: {who} this run's process-group sockets (gloo's listeners or NCCL's bootstrap, on 127.0.0.1, "
        f"open while its ranks and standby ranks live) accepted connections from any of them: {reason}. {todo}."
    )


def standing(reason: str | None, accounts: int | None = None) -> str | None:
    """The sentence for a run its launcher found reachable (``reason``), every time asked (the sidebar),
    on a machine of several people (``accounts``: its human accounts, read from /etc/passwd if None).

    >>> standing("NBTRAIN_PRIVATE_NETWORK=0 is set", 3).startswith("nbtrain: this machine has 3 user accounts")
    True
    >>> standing("NBTRAIN_PRIVATE_NETWORK=0 is set", 1), standing(None, 3)
    (None, None)
    """
    if reason is None:
        return None
    accounts = human_accounts() if accounts is None else accounts
    return sentence(reason, accounts) if accounts > 1 else None


def run_gap(accelerator: str, strategy: str, on_cluster: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a run of these facts leaves its process group reachable by other users, or None."""
    environ = os.environ if environ is None else environ
    backend = "gloo" if accelerator == "cpu" else "nccl"
    start_method = "spawn" if strategy == "ddp_spawn" else "fork"
    if on_cluster:  # the cluster engine's threat model is its own (docs/architecture.md)
        return None
    reason = privatenet.uncovered_by(backend, {accelerator}, start_method, False, environ, "")
    return privatenet.probe() if reason == "" else reason  # covered where the OS allows: ask it


def after_run(accelerator: str, strategy: str, on_cluster: bool) -> str | None:
    """The sentence for the first run that leaves something reachable on a machine of several people; else None."""
    return _once(accelerator, strategy, on_cluster, several_people=True)


def when_asked(accelerator: str, strategy: str, on_cluster: bool) -> str | None:
    """The sentence when ``nbtrain.runs()`` is asked after such a run (once, and not if said already)."""
    return _once(accelerator, strategy, on_cluster, several_people=False)


def _once(accelerator: str, strategy: str, on_cluster: bool, several_people: bool) -> str | None:
    """The sentence for such a run, if none was said yet in this kernel (and, if ``several_people``, the
    machine has more than one person's account)."""
    accounts = None if _said else human_accounts()
    if accounts is None or (several_people and accounts <= 1):
        return None
    reason = run_gap(accelerator, strategy, on_cluster)
    if reason is None:
        return None
    _said.append(sentence(reason, accounts))
    return _said[0]


def private_directory(path: str) -> str | None:
    """``path``, made (mode 0700) if missing, when it is a directory of this user's that nobody else may
    enter; else None (another user's, open to others, a link, or not to be made).

        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> private_directory(folder) == folder
        True
        >>> os.chmod(folder, 0o755)  # others may enter: what nbtrain keeps there would be theirs to read
        >>> private_directory(folder) is None
        True
        >>> os.rmdir(folder)
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o077 == 0
    return path if private else None
