"""Files saved by path on a run of several ranks are written whole: ``torch.save``, ``numpy.save``, ``savefig``.

Code written for one device saves its checkpoint by path (``torch.save(model.state_dict(),
"best.pt")``, an early-stopping helper's "save the best"), its predictions
(``np.save("oof.npy", preds)``) and its plots (``plt.savefig("loss.png")``), and often reads
a checkpoint back (the best weights restored after the loop). On the ranks the same line
writes the same file at about the same time, and each of these truncates the file and
rewrites it in place: a rank loading it meanwhile read a torn file (``PytorchStreamReader
failed reading zip archive``), and two ranks writing it at once could leave a file of pieces
of both. So while a cell of several ranks runs, the patch table's ``whole files`` makes them write a new file beside
the path and rename it over the path, which is atomic: a reader opens the old file or a new
one, complete. When several ranks write one path, the file is the last one's (under DDP
their weights are the same). A file object, one rank, a path whose directory does not
exist, one that is no regular file (``/dev/null``, a pipe), a directory that takes no new
file, a file system that cannot rename over a file, and a figure saved without a format
(no extension: matplotlib picks one and names the file) are saved as the library saves them.
A rank killed in the middle of a save leaves its hidden partial file, never a torn one; the
next save of the path removes it.

Importing this module does not import torch.

Example (outside a run a save is torch's own):
    >>> import io, torch
    >>> save = whole_torch_save(torch.save)
    >>> buffer = io.BytesIO(); save({"w": torch.ones(2)}, buffer)
    >>> torch.load(io.BytesIO(buffer.getvalue()))["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import os
import socket
from collections.abc import Callable
from typing import Any

from nbtrain.rank import api

_PARTIAL = ".nbtrain-partial"  # a file being written: it has this suffix until it is renamed into place
_HOST = socket.gethostname().replace("-", "_")  # its processes' ids are the ones this machine can look up
_numbers = itertools.count()
_looked_at: set[tuple[str, str]] = set()  # (directory, name): left-over partial files removed already
# What savefig writes to a file object as to a path.
_FIGURE_FORMATS = frozenset({"png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp"})


@functools.cache
def whole_torch_save(own: Any) -> Any:
    """``torch.save`` (and ``torch.serialization.save``: one for both) in a cell of several ranks
    (the patch table's ``whole files``): a save to a path writes the file whole."""

    @functools.wraps(own)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        def write(partial: str) -> None:
            own(obj, partial, *args, **kwargs)

        return _save_whole(_replaced_path(f), write, lambda: own(obj, f, *args, **kwargs))

    return save


def _save_whole(target: str | None, write: Callable[[str], Any], own: Callable[[], Any]) -> Any:
    """``write(partial)`` to a new file beside ``target``, renamed over it; ``own()`` (the library's
    own save) where there is no such target or the file system cannot."""
    partial = _new_partial(target) if target is not None else None
    if target is None or partial is None:
        return own()
    try:
        write(partial)
    except BaseException:  # a full disk, say: the file at the path is left as it was
        _remove(partial)
        raise
    try:
        os.replace(partial, target)
    except OSError:  # a file system that cannot rename over a file (some network mounts): the library's write
        _remove(partial)
        return own()
    return None


def whole_numpy_save(own: Any) -> Any:
    """``numpy.save`` in a cell of several ranks (the patch table's ``whole files``)."""

    @functools.wraps(own)
    def save(file: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
        target = _replaced_path(file)
        if target is not None and not target.endswith(".npy"):  # numpy names the file so itself
            target = _replaced_path(os.fspath(file) + ".npy")

        def write(partial: str) -> None:
            with open(partial, "wb") as opened:
                own(opened, arr, *args, **kwargs)

        _save_whole(target, write, lambda: own(file, arr, *args, **kwargs))

    return save


def whole_savefig(own: Any) -> Any:
    """``Figure.savefig`` in a cell of several ranks (the patch table's ``whole files``)."""

    @functools.wraps(own)
    def savefig(self: Any, fname: Any, *args: Any, **kwargs: Any) -> Any:
        target = _replaced_path(fname)
        kind = kwargs.get("format") or (os.path.splitext(target)[1][1:].lower() if target else "")
        if kind not in _FIGURE_FORMATS:  # no extension (matplotlib names the file), or a rare format
            return own(self, fname, *args, **kwargs)

        def write(partial: str) -> None:
            with open(partial, "wb") as opened:
                own(self, opened, *args, **{**kwargs, "format": kind})

        return _save_whole(target, write, lambda: own(self, fname, *args, **kwargs))

    return savefig


def _replaced_path(f: Any) -> str | None:
    """The file a save to ``f`` replaces whole, or None where torch's own save is what happens."""
    if api.world_size() < 2 or not isinstance(f, (str, os.PathLike)):
        return None
    path = os.fspath(f)
    if not isinstance(path, str):
        return None
    target = os.path.realpath(path)  # a link stays a link: the file it points to is replaced
    if not os.path.isdir(os.path.dirname(target)):
        return None  # torch's own error says what is wrong
    if os.path.exists(target) and not os.path.isfile(target):
        return None  # a directory (torch's error), a device such as /dev/null, a pipe: written to as it is
    return target


def _new_partial(target: str) -> str | None:
    """A new empty file beside ``target``, made as ``open(target, "wb")`` would make it (the umask applies);
    None where the directory takes no new file (the file itself may still be writable)."""
    directory, name = os.path.split(target)
    _remove_left_over(directory, name)
    while True:
        partial = os.path.join(directory, f".{name}.{_HOST}-{os.getpid()}-{next(_numbers)}{_PARTIAL}")
        try:
            os.close(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            continue  # left by a process with the same pid, killed while writing
        except OSError:
            return None
        return partial


def _remove_left_over(directory: str, name: str) -> None:
    """Remove what a process of this machine killed while saving ``name`` left beside it (once per path).

    A rank stopped in the middle of a save (another rank failed, the user pressed Stop) dies
    before it can; its partial file is hidden (a dot file) and the checkpoint it would have
    replaced is intact. The next save of that path clears it.
    """
    if (directory, name) in _looked_at:
        return
    _looked_at.add((directory, name))
    pattern = glob.escape(os.path.join(directory, f".{name}.{_HOST}-")) + "*" + _PARTIAL
    for path in glob.glob(pattern):
        pid = os.path.basename(path)[len(f".{name}.{_HOST}-") :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _remove(partial: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(partial)
