"""Notebook code for the processes a rank starts: multiprocessing pickles it by value.

A rank gets the notebook's classes and functions by value (cloudpickle, see
:mod:`nbtrain.messages.codepickle`), but their ``__module__`` stays ``"__main__"``, and a
rank's ``__main__`` is nbtrain's runtime, where they are not. A process the cell starts by
``spawn`` or ``forkserver`` (Python 3.14's default on Linux; a DataLoader with
``num_workers > 0``, ``multiprocessing.Pool``, ``ProcessPoolExecutor``) gets its arguments
through multiprocessing's standard pickler, ``ForkingPickler``, which pickles a class or a
function by reference: "Can't pickle <class '__main__.Squares'>". Forked children never
pickle their arguments, which is why the same cell works under ``fork``.

The patch table's ``child processes`` group gives ``ForkingPickler`` a ``reducer_override``
(:func:`by_value_reducer`): a class or function that pickle could not find by reference
(its module ``__main__``, not imported, or without it as an attribute: cloudpickle's own
rule, the one the kernel's payload follows) travels as a cloudpickle of itself, which the
child loads with :func:`load_by_value`. Everything else is pickled as before (tensors through
torch's shared-memory reducers), and the override returns at its first test for anything
that is not a class or a function. The child installs the same group as it loads the first
such object, so what it sends back (a batch of a notebook class) travels the same way; a
class comes back as the rank's own (cloudpickle tracks classes by an id), so ``isinstance``
holds. The start method stays the one the code names, or Python's default (the comment above
:data:`FORKSERVER_PRELOAD` says why), and the rank's forkserver imports torch once for its children.

Example (a function only findable by value, pickled as a spawned child would get it)::

    >>> import contextlib, pickle
    >>> from multiprocessing.reduction import ForkingPickler
    >>> from nbtrain import patches
    >>> def square(x): return x * x  # not an attribute of its module: pickle cannot name it
    >>> with contextlib.ExitStack() as stack:
    ...     patches.install(GROUP, stack)
    ...     sent = bytes(ForkingPickler.dumps(square))
    >>> pickle.loads(sent)(3)
    9
"""

from __future__ import annotations

import multiprocessing
import pickle
import types
from typing import Any

from nbtrain import patches
from nbtrain.messages import codepickle, nestedpickling

GROUP = "child processes"  # the patch table's group (nbtrain.patches)

# Python 3.14 starts a rank's children by forkserver unless the code names a method, and a rank keeps
# that default rather than choosing fork: a rank has threads (gloo's, CUDA's, the cell's own), and a
# fork copies whatever lock another thread held at that moment into a child that can never release it,
# which is why Python moved away from fork. A forkserver is a fresh interpreter (fork+exec) that the
# rank starts at its first child; its preload of ``__main__`` finds the rank's, nbtrain's
# ``launch_server/__main__.py`` or ``rank/__main__.py``, which multiprocessing never runs again (a
# package's ``__main__`` is skipped), so nothing of nbtrain's runs there. Measured in a rank (2 ranks,
# 2 workers each, 2 busy cores; benchmarks/child_pickling.py): a loader's first batch took 0.05 s under
# fork, 4-6 s at every pass under forkserver as Python sets it up, and 1.6-2.6 s at the first pass then
# 0.1-0.2 s under forkserver with torch preloaded (below), so forkserver costs a loader one start.
#
# What a rank's forkserver imports once, before it forks any child: each worker then starts with torch
# imported (and this module, which loads the notebook's code) rather than importing it (seconds) at every
# start, which without persistent_workers is every pass over the loader. Patched in only as the rank
# first imports multiprocessing.forkserver; the user's own set_forkserver_preload replaces it. The cost:
# a process pool of plain Python functions under forkserver waits once for torch (about 2 s), where its
# workers would not have imported it; DataLoader workers, which always do, are what a rank's children are.
FORKSERVER_PRELOAD = ("torch", __name__)


def forkserver_preload(original: Any) -> Any:
    """The patch table's factory: the forkserver's preload list (``["__main__"]``) with
    :data:`FORKSERVER_PRELOAD` added.

    >>> forkserver_preload(["__main__"])
    ['__main__', 'torch', 'nbtrain.rank.machinery.childpickling']
    """
    modules = list(original or [])
    return modules + [name for name in FORKSERVER_PRELOAD if name not in modules]


def by_value_reducer(original: Any) -> Any:
    """The patch table's factory: ``ForkingPickler.reducer_override`` that sends notebook code by value.

    ``original`` is what ``ForkingPickler`` had (None: ``pickle.Pickler`` has no override of its
    own); one already there is asked after ours, for what ours leaves alone.
    """
    if original is None or original is _reducer_override:
        return _reducer_override

    def chained(pickler: Any, obj: Any) -> Any:
        reduced = _reducer_override(pickler, obj)
        return original(pickler, obj) if reduced is NotImplemented else reduced

    return chained


def _reducer_override(pickler: Any, obj: Any) -> Any:
    """``reduce_by_value(obj)``, as a pickler's method. Called for every object pickle does not
    write itself (None, bools, numbers, strings, bytes, dicts, lists, tuples and sets it does), 19
    times for a batch of two tensors (torch's rebuild functions and storage classes among them):
    the tests here are cheap."""
    if not (isinstance(obj, type) or type(obj) is types.FunctionType) or _FOUND_BY_REFERENCE.get(id(obj)) is obj:
        return NotImplemented
    return reduce_by_value(obj)


# The classes and functions found by reference once (torch's rebuild functions, a batch's classes), by id:
# cloudpickle's lookup costs about 1 us, and a forked worker's every batch meets the same ones. Kept
# whole, so that an id stays theirs; they are attributes of imported modules, which keep them anyway.
_FOUND_BY_REFERENCE: dict[int, Any] = {}


def reduce_by_value(obj: Any) -> Any:
    """``(load_by_value, (cloudpickle,))`` for a class or function only findable by value, else
    ``NotImplemented`` (pickle goes on as it would).

    >>> reduce_by_value(len), reduce_by_value(int), reduce_by_value([1])
    (NotImplemented, NotImplemented, NotImplemented)
    >>> reduce_by_value(lambda: 1)[0] is load_by_value
    True
    """
    if not nestedpickling.only_by_value(obj):
        if isinstance(obj, type) or type(obj) is types.FunctionType:
            _FOUND_BY_REFERENCE[id(obj)] = obj
        return NotImplemented
    # codepickle keeps each function's file name: a worker's traceback names the notebook's cell.
    return load_by_value, (codepickle.dumps_keeping_filenames(obj),)


def load_by_value(payload: bytes) -> Any:
    """Load what :func:`reduce_by_value` sent. A process multiprocessing started installs the
    group first, so that what it sends back (a notebook class's instance) travels by value too;
    a forked child has it from its rank already, and any other process (a test's) is left alone."""
    if _started_by_multiprocessing():

        patches.install_for_process(GROUP)
    return pickle.loads(payload)  # the rank's own pickle of its own code, over its own pipe


def _started_by_multiprocessing() -> bool:
    # A spawned or forkserver child loads its Process object (a DataLoader worker's dataset) while
    # "inheriting", before it knows its parent; a Pool's tasks come later, once it does.
    current = multiprocessing.current_process()
    return bool(getattr(current, "_inheriting", False)) or multiprocessing.parent_process() is not None
