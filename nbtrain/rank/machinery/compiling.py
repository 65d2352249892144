"""torch.compile on a rank: its share of the host's compile workers, and one private cache for every run.

Inductor, torch.compile's compiler, sizes a pool of compile workers per process from all of
the host's cores (``min(32, cores)``: threads that each run the C++ compiler on CPU,
processes that build Triton kernels on a GPU). N ranks on one host each started such a
pool: N times more compilers than cores (pytorch #190941). Its cache defaults to
``/tmp/torchinductor_<user>``, a directory of a known name in a place every user writes:
whoever makes it first owns it, and the ranks load the compiled code they find there.

So a rank's environment gets, before the cell runs (``runtime._adopt_caller_state``):

- ``TORCHINDUCTOR_COMPILE_THREADS``: the rank's share, the cores this process may run on
  (inductor's own count) over the ranks on this host, at least 1; 1 compiles in the rank's
  own thread, with no pool.
- ``TORCHINDUCTOR_CACHE_DIR``: ``nbtrain/torch-compile`` in the user's cache directory
  (``$XDG_CACHE_HOME``, else ``~/.cache``), mode 0700. Inductor keeps its FX graph cache, AOT
  autograd's, dynamo's profiles and the compiled C++ and Triton kernels there: every rank of
  every run finds what an earlier one compiled, and a re-run compiles nothing.

A value the caller's environment has already is kept, but for inductor's default cache
directory: dynamo's import writes it into the importing process's environment (the kernel's, the
launcher's, where it also makes the directory, which no rank then uses). A setting the cell makes
itself (``torch._inductor.config.compile_threads = 4``) comes later and wins. Ranks compiling one
graph at once do not corrupt the cache: inductor writes each entry to a temporary file named
by its process and thread, then renames it into place, and builds each C++ kernel under a file
lock. Non-goals: a cache shared between users, or between machines.

>>> environ = {"LOCAL_WORLD_SIZE": "4", "TORCHINDUCTOR_CACHE_DIR": "/data/mine"}
>>> variables(environ, cores=16) == {"TORCHINDUCTOR_COMPILE_THREADS": "4"}  # the user's directory stays
True
"""

from __future__ import annotations

import getpass
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from nbtrain.system import sharedhost

THREADS_VARIABLE = "TORCHINDUCTOR_COMPILE_THREADS"
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
MOST_THREADS = 32  # inductor's own ceiling for one process


def variables(environ: Mapping[str, str], cores: int | None = None) -> dict[str, str]:
    """What a rank of the run whose environment is ``environ`` (torchrun's variables in it) adds to it.

    ``cores``: those this process may run on (default: its affinity, as inductor counts).
    """
    added = {}
    if THREADS_VARIABLE not in environ:
        ranks = int(environ.get("LOCAL_WORLD_SIZE") or 1)
        added[THREADS_VARIABLE] = str(worker_share(cores or len(os.sched_getaffinity(0)), ranks))
    if CACHE_VARIABLE not in environ or inductors_default(environ[CACHE_VARIABLE]):
        directory = cache_directory(environ)
        if directory is not None:
            added[CACHE_VARIABLE] = directory
        elif environ.get("LOCAL_RANK") == "0":  # one rank says so; the others compile all the same
            print(not_private_note(environ), file=sys.stderr)
    return added


def worker_share(cores: int, ranks: int) -> int:
    """One rank's compile workers: the host's ``cores`` over its ``ranks``, at least 1, at most inductor's 32.

    >>> worker_share(16, 4), worker_share(2, 4), worker_share(128, 2)
    (4, 1, 32)
    """
    return max(1, min(MOST_THREADS, cores // max(1, ranks)))


def inductors_default(path: str) -> bool:
    """Whether ``path`` is inductor's default cache, ``torchinductor_<user>`` (in the temporary directory).

    Inductor writes its directory into the environment as dynamo is imported: a kernel that
    imported it sends that with its environment, which is not a choice of the user's.

    >>> import getpass
    >>> inductors_default(f"/tmp/torchinductor_{getpass.getuser()}"), inductors_default("/data/mine")
    (True, False)
    """
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.basename(os.path.normpath(path)) == "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def cache_location(environ: Mapping[str, str]) -> str:
    """Where the user's compile cache is (:func:`cache_directory` checks that it is private).

    >>> cache_location({"XDG_CACHE_HOME": "/home/ann/.cache"})
    '/home/ann/.cache/nbtrain/torch-compile'
    """
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "nbtrain", "torch-compile")


def cache_directory(environ: Mapping[str, str]) -> str | None:
    """The user's compile cache, made (mode 0700) if missing; None where it is not theirs alone.

    Ranks load the code they find there: a directory another user could write (or one of
    theirs) would let them run code in this user's ranks.

    >>> import tempfile
    >>> home = tempfile.mkdtemp()
    >>> cache_directory({"XDG_CACHE_HOME": home}) == cache_location({"XDG_CACHE_HOME": home})
    True
    >>> os.chmod(cache_location({"XDG_CACHE_HOME": home}), 0o755)  # others may read it now
    >>> cache_directory({"XDG_CACHE_HOME": home}) is None
    True
    >>> import shutil; shutil.rmtree(home)
    """
    return sharedhost.private_directory(cache_location(environ))


def not_private_note(environ: Mapping[str, str]) -> str:
    """What a rank says where the user's compile cache cannot be used: which, why, what to do."""
    path = cache_location(environ)
    return (
        f"nbtrain: torch.compile's cache {path} is not private to this user (or cannot be made), so the ranks "
        f"use inductor's default, which other users of this machine may reach. Run `chmod 700 {path}` if it "
        f"is yours, or set {CACHE_VARIABLE} to a directory of your own."
    )


def threads_from_environment(original: Any) -> Any:
    """``torch._inductor.config.compile_threads`` on a rank (the patch table's): decided again, by inductor's rule.

    Inductor decides it as its config is imported: in the launcher, before any run's
    environment existed. ``None`` (inductor decides later, itself) stays.
    """
    return original if original is None else sys.modules["torch._inductor.config"].decide_compile_threads()
