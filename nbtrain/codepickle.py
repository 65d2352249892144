"""cloudpickle that keeps each function's source file name, so tracebacks can name it.

cloudpickle 3.1.3 writes every pickled function's ``co_filename`` as ``"<dynamic-code>"``
(for deterministic payloads). A rank's traceback then cannot show the line of a function
defined in a notebook cell or a module (``Cell In[7], line 4`` and the source line under
it): the rank knows the cell's lines by file name. :class:`Pickler` puts the real name
back; with an older cloudpickle, which kept it, it changes nothing.

Example:
    >>> import pickle
    >>> def where(): return 1
    >>> pickle.loads(dumps(where)).__code__.co_filename == where.__code__.co_filename
    True
"""

from __future__ import annotations

import importlib
import io
import pickle
import types
from collections import ChainMap
from collections.abc import MutableMapping
from typing import Any, cast

import cloudpickle

_ERASED = "<dynamic-code>"
# The module inside cloudpickle that holds its reducers (``_code_reduce`` among them).
_INTERNALS = importlib.import_module("cloudpickle.cloudpickle")


def _code_reduce(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the file name it erased put back."""
    constructor, args = _INTERNALS._code_reduce(code)
    return constructor, tuple(code.co_filename if arg == _ERASED else arg for arg in args)


def _dispatch_table() -> Any:
    overrides = {types.CodeType: _code_reduce} if hasattr(_INTERNALS, "_code_reduce") else {}
    # cloudpickle's own table is a ChainMap over copyreg's: later registrations still count.
    return ChainMap(overrides, cast("MutableMapping[Any, Any]", cloudpickle.Pickler.dispatch_table))


class Pickler(cloudpickle.Pickler):
    """``cloudpickle.Pickler`` whose functions keep their ``co_filename``."""

    dispatch_table = _dispatch_table()


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)`` (highest protocol), file names kept."""
    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
