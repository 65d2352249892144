"""Weak references and locks travel as what they are in the process that loads them.

A weak reference and a lock are state of one process: pickle refuses both ("cannot pickle
'weakref.ReferenceType'", "cannot pickle '_thread.lock'"), and so an object that keeps one
(an ignite ``Engine`` with event handlers, a transformers ``Trainer``, a ``queue.Queue``)
could not go to the ranks nor come back from rank 0. :data:`REDUCERS`, a pickler's
dispatch table entries (:mod:`nbtrain.messages.codepickle`), send them as their meaning:

- a weak reference goes as a weak reference to the same object *within the same pickle*:
  its referent is pickled with it (the memo makes it the very object that others in the
  pickle hold), so a handler's ``weakref.ref(engine)`` arrives pointing at the arriving
  engine. What holds the referent strongly decides, as in the sending process, whether it
  outlives the load; a dead reference arrives dead. ``WeakMethod``, the ``KeyedRef`` of a
  ``WeakValueDictionary`` and the weak containers are rebuilt the same way.
- a lock (``Lock``, ``RLock``) goes as a new, unlocked lock of its kind: whoever held it
  held it in the sending process, and nothing the loading process does can release it
  there. A ``Condition`` is rebuilt around its (new) lock; ``Event``, ``Semaphore``,
  ``Barrier`` and ``queue.Queue`` keep their counters and flags and pickle through these.
- a thread is refused (:func:`refuse_thread`), as it was while its locks were: it runs in
  the sending process only, and a copy would arrive looking started yet run nothing.

Example (an object holding a lock and a weak reference to itself)::

    >>> import argparse, copyreg, io, pickle, threading, weakref
    >>> holder = argparse.Namespace(lock=threading.Lock())
    >>> holder.me = weakref.ref(holder)
    >>> holder.lock.acquire()
    True
    >>> buffer = io.BytesIO()
    >>> pickler = pickle.Pickler(buffer)
    >>> pickler.dispatch_table = {**copyreg.dispatch_table, **REDUCERS}
    >>> pickler.dump(holder)
    >>> copy = pickle.loads(buffer.getvalue())
    >>> copy.me() is copy, copy.lock.locked()
    (True, False)
"""

from __future__ import annotations

import _thread
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any


class _Gone:
    """Something a dead reference can have pointed to (a weak reference needs a referent)."""


def dead_reference() -> weakref.ReferenceType[Any]:
    """A weak reference whose referent is gone, as the one pickled was.

    >>> dead_reference()() is None
    True
    """
    # CPython frees the temporary at once (reference counting): the reference is dead on return.
    return weakref.ref(_Gone())


def _ref_reduce(ref: weakref.ReferenceType[Any]) -> Any:
    referent = ref()
    if referent is None:
        return dead_reference, ()
    # The callback goes too (a WeakValueDictionary's own is rebuilt by the dictionary's reducer).
    return (type(ref), (referent,)) if ref.__callback__ is None else (type(ref), (referent, ref.__callback__))


def _keyed_ref_reduce(ref: weakref.KeyedRef[Any, Any]) -> Any:
    referent = ref()
    return (dead_reference, ()) if referent is None else (weakref.KeyedRef, (referent, ref.__callback__, ref.key))


def _weak_method_reduce(ref: weakref.WeakMethod[Any]) -> Any:
    method = ref()  # a bound method made anew from the weakly held object and function
    if method is None:
        return dead_reference, ()
    return (
        (weakref.WeakMethod, (method,))
        if ref.__callback__ is None
        else (
            weakref.WeakMethod,
            (method, ref.__callback__),
        )
    )


def _weak_mapping_reduce(mapping: weakref.WeakValueDictionary[Any, Any] | weakref.WeakKeyDictionary[Any, Any]) -> Any:
    # The items after the mapping exists (pickle's dict items): an item that holds the mapping finds it
    # in the memo. Its own callbacks (closures over a weak reference to itself) are made by __init__.
    return type(mapping), (), None, None, iter(list(mapping.items()))


def _weak_set_reduce(items: weakref.WeakSet[Any]) -> Any:
    return type(items), (), list(items), None, None, _fill_weak_set


def _fill_weak_set(items: weakref.WeakSet[Any], state: Iterable[Any]) -> None:
    items.update(state)


def _lock_reduce(lock: Any) -> Any:
    return _thread.allocate_lock, ()


def _rlock_reduce(lock: Any) -> Any:
    return _thread.RLock, ()


def _condition_reduce(condition: threading.Condition) -> Any:
    # Its own lock, made anew: two conditions over one lock keep sharing it (the pickle's memo).
    return threading.Condition, (condition._lock,)  # type: ignore[attr-defined]


def refuse_thread(obj: Any) -> None:
    """Raise ``PicklingError`` for a thread (a reducer for ``reducer_override``); None for anything else.

    >>> import threading
    >>> refuse_thread(threading.Thread(name="loader"))
    Traceback (most recent call last):
    ...
    _pickle.PicklingError: cannot pickle a thread (loader): it runs in this process only; start it inside the cell
    """
    if isinstance(obj, threading.Thread):
        raise pickle.PicklingError(
            f"cannot pickle a thread ({obj.name}): it runs in this process only; start it inside the cell"
        )


REDUCERS: dict[type, Callable[[Any], Any]] = {
    weakref.ReferenceType: _ref_reduce,
    weakref.KeyedRef: _keyed_ref_reduce,
    weakref.WeakMethod: _weak_method_reduce,
    weakref.WeakValueDictionary: _weak_mapping_reduce,
    weakref.WeakKeyDictionary: _weak_mapping_reduce,
    weakref.WeakSet: _weak_set_reduce,
    _thread.LockType: _lock_reduce,
    _thread.RLock: _rlock_reduce,
    threading.Condition: _condition_reduce,
}
"""Each process-local type, exactly (a pickler's dispatch table is looked up by type), with its reducer."""
