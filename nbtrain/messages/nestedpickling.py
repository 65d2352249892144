"""A standard pickle made inside ours sends notebook code by value, as ours does.

Some objects pickle part of themselves with the standard pickler in their ``__getstate__``:
skorch's ``NeuralNet`` writes ``module_``, ``optimizer_`` and ``criterion_`` with
``pickle.dump`` into a bytes attribute, ``torch.save`` into a buffer does the same. That
pickler finds a class by its module and name, so a module class defined in the notebook
(its ``__module__`` is ``"__main__"``) fails where it is not in ``__main__``: on a rank
("Can't pickle <class '__main__.MyModule'>: attribute lookup MyModule on __main__ failed"),
or on arrival there from the kernel.

While one of our picklers runs (:func:`by_value`, entered by
:meth:`nbtrain.messages.codepickle.Pickler.dump`), the patch table's rows of :data:`GROUP` replace ``pickle.Pickler``
(the base of ``torch.save``'s pickler), ``pickle.dump`` and ``pickle.dumps`` with a pickler
that follows the rule multiprocessing's pickler follows on a rank
(:mod:`nbtrain.rank.machinery.childpickling`), cloudpickle's own: a class or function that
pickle could not find by reference travels as a cloudpickle of itself (made by the running
pickler's own ``dumps``), loaded by ``pickle.loads``; and that sends weak references and
locks as :mod:`nbtrain.messages.localstate` does. Anything else pickles as before. The
loading side needs only cloudpickle's loader (the kernel and the ranks have it), and a class
comes back as the kernel's own (cloudpickle tracks classes by id).
The last of our picklers to finish puts the originals back.

Example (a notebook function, only findable by value, inside a standard pickle)::

    >>> import cloudpickle, pickle
    >>> def double(x): return 2 * x
    >>> with by_value(cloudpickle.dumps):
    ...     sent = pickle.dumps(double)
    >>> pickle.loads(sent)(4)
    8
    >>> pickle.dumps is _ORIGINAL_DUMPS
    True
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import importlib
import io
import pickle
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any, cast

from nbtrain import patches
from nbtrain.messages import localstate

GROUP = "nested pickles"  # its rows are in nbtrain.patches.TABLE (Lifetime.PICKLING)

_ORIGINAL_DUMPS = pickle.dumps


def _dispatch_table() -> Any:
    # copyreg's table under ours: later registrations still count.
    return ChainMap(localstate.REDUCERS, cast("Any", copyreg.dispatch_table))


_by_reference = importlib.import_module("cloudpickle.cloudpickle")._should_pickle_by_reference


def only_by_value(obj: Any) -> bool:
    """Whether ``obj`` is a class or function that pickle cannot find by reference (a notebook's).

    cloudpickle's rule, which the payload to the ranks follows; so do a standard pickle inside ours
    and one to a rank's child processes (:mod:`nbtrain.rank.machinery.childpickling`).

    >>> only_by_value(len), only_by_value(int), only_by_value([1]), only_by_value(lambda: 1)
    (False, False, False, True)
    """
    return (isinstance(obj, type) or type(obj) is types.FunctionType) and not _by_reference(obj)


def _reduce_by_value(obj: Any) -> Any:
    """``(pickle.loads, (bytes,))`` for a class or function only findable by value, pickled by the
    running pickler's own :func:`by_value` ``dumps``; else ``NotImplemented`` (pickle goes on as it would).

    >>> import cloudpickle
    >>> with by_value(cloudpickle.dumps):
    ...     _reduce_by_value(len), _reduce_by_value(int), _reduce_by_value(lambda: 1)[0] is pickle.loads
    (NotImplemented, NotImplemented, True)
    """
    if not only_by_value(obj):
        return NotImplemented
    dumps = _Installed.dumps
    if dumps is None:  # no pickler of ours is running: nothing to follow
        return NotImplemented
    # Loaded by the standard unpickler: nothing of ours needs to be importable where it arrives.
    return pickle.loads, (dumps(obj),)


@functools.cache
def _pickler_class() -> type[pickle.Pickler]:
    """The standard pickler with the by-value rule and the process-local reducers."""

    class ByValuePickler(pickle.Pickler):
        dispatch_table = _dispatch_table()

        def reducer_override(self, obj: Any) -> Any:
            localstate.refuse_thread(obj)  # as our own pickler does: its locks would travel, it cannot
            return _reduce_by_value(obj)

    return ByValuePickler


def by_value_pickler(original: Any) -> Any:
    """The patch's factory: the pickler class that replaces ``pickle.Pickler``."""
    return _pickler_class()


def by_value_dump(original: Any) -> Any:
    """The patch's factory: ``pickle.dump`` through :func:`by_value_pickler`'s class."""

    def dump(obj: Any, file: Any, protocol: int | None = None, **options: Any) -> None:
        _pickler_class()(file, protocol, **options).dump(obj)

    return dump


def by_value_dumps(original: Any) -> Any:
    """The patch's factory: ``pickle.dumps`` through :func:`by_value_pickler`'s class."""

    def dumps(obj: Any, protocol: int | None = None, **options: Any) -> bytes:
        buffer = io.BytesIO()
        _pickler_class()(buffer, protocol, **options).dump(obj)
        return buffer.getvalue()

    return dumps


class _Installed:
    """How many of our picklers run now (in any thread, nested or not), the undo of the patch table's
    :data:`GROUP`, and how the first of them pickles code by value."""

    guard = threading.Lock()
    running = 0
    undo: contextlib.ExitStack | None = None
    dumps: Callable[[Any], bytes] | None = None


@contextlib.contextmanager
def by_value(dumps: Callable[[Any], bytes]) -> Iterator[None]:
    """The patch table's :data:`GROUP` installed while the body runs: the first to enter installs, the last undoes.

    ``dumps`` pickles a class or function by value (the caller's own: codepickle keeps file names,
    so that a traceback names the notebook's cell).
    """
    with _Installed.guard:
        if _Installed.running == 0:
            _Installed.undo = contextlib.ExitStack()
            _Installed.dumps = dumps
            patches.install(GROUP, _Installed.undo)
        _Installed.running += 1
    try:
        yield
    finally:
        with _Installed.guard:
            _Installed.running -= 1
            if _Installed.running == 0 and _Installed.undo is not None:
                _Installed.undo.close()
                _Installed.undo, _Installed.dumps = None, None
