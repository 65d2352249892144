"""cloudpickle that keeps each function's source file name, so tracebacks can name it.

cloudpickle 3.1.3 writes every pickled function's ``co_filename`` as ``"<dynamic-code>"``
(for deterministic payloads). A rank's traceback then cannot show the line of a function
defined in a notebook cell or a module (``Cell In[7], line 4`` and the source line under
it): the rank knows the cell's lines by file name. :class:`Pickler` puts the real name
back; with an older cloudpickle, which kept it, it changes nothing.

Example:
    >>> import pickle
    >>> def where(): return 1
    >>> pickle.loads(dumps_keeping_filenames(where)).__code__.co_filename == where.__code__.co_filename
    True
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import MutableMapping
from typing import Any, cast

import cloudpickle

from nbtrain.messages import localstate, nestedpickling, processlocal, trackerruns

_ERASED = "<dynamic-code>"
# The module inside cloudpickle that holds its reducers (``_code_reduce`` among them).
_INTERNALS = importlib.import_module("cloudpickle.cloudpickle")


def _code_reduce(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the file name it erased put back."""
    constructor, args = _INTERNALS._code_reduce(code)
    return constructor, tuple(code.co_filename if arg == _ERASED else arg for arg in args)


def _dispatch_table() -> Any:
    # Weak references and locks as their meaning in the loading process (nbtrain.messages.localstate).
    overrides: dict[type, Any] = dict(localstate.REDUCERS)
    if hasattr(_INTERNALS, "_code_reduce"):
        overrides[types.CodeType] = _code_reduce
    # cloudpickle's own table is a ChainMap over copyreg's: later registrations still count.
    return ChainMap(overrides, cast("MutableMapping[Any, Any]", cloudpickle.Pickler.dispatch_table))


class Pickler(cloudpickle.Pickler):
    """``cloudpickle.Pickler`` whose functions keep their ``co_filename``, optimizers their
    attributes, parametrized modules (``weight_norm``, ``spectral_norm``) travel, a
    tracker's run the kernel opened travels as a stand-in (:mod:`nbtrain.messages.trackerruns`),
    weak references and locks as :mod:`nbtrain.messages.localstate` says, and a standard
    pickle made inside it sends notebook code by value (:mod:`nbtrain.messages.nestedpickling`)."""

    dispatch_table = _dispatch_table()

    def dump(self, obj: Any) -> None:
        """Pickle ``obj``; a ``pickle.dump`` or ``torch.save`` that its ``__getstate__`` makes
        sends the notebook's classes and functions by value meanwhile."""
        with nestedpickling.by_value(dumps_keeping_filenames):
            super().dump(obj)

    def reducer_override(self, obj: Any) -> Any:
        """Optimizers (:func:`optimizer_reduce`) and parametrized modules (:func:`parametrized_reduce`)
        their own way; everything else as cloudpickle does."""
        # A tracker's run the kernel opened goes as a stand-in that calls it back.
        for reduce in (
            optimizer_reduce,
            parametrized_reduce,
            trackerruns.stand_in,
            processlocal.reduce_shared_state,
            localstate.refuse_thread,  # its locks travel (localstate.REDUCERS), it does not
        ):
            reduced = reduce(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def parametrized_reduce(obj: Any) -> Any:
    """A reduction of a module with torch parametrizations, or None for anything else.

    ``register_parametrization`` (behind ``parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``) swaps the module's class for a generated subclass
    whose ``__getstate__`` refuses to pickle. Everything the module holds (the originals,
    the parametrization modules) is ordinary: it travels as the module of its own class
    and gets the generated class back on arrival, as ``register_parametrization`` made it.
    The state is set after the object exists, so references back to it (a hook's closure)
    come out as the same object.
    """
    nn = sys.modules.get("torch.nn")
    if nn is None or not isinstance(obj, nn.Module):
        return None
    for cls in type(obj).__mro__[:3]:  # the generated class, under a one-rank run's class of its own
        base = cls.__bases__[0] if cls.__bases__ else object
        if cls.__name__ == f"Parametrized{base.__name__}" and "__getstate__" in vars(cls):
            return _new_module, (base,), dict(vars(obj)), None, None, _set_parametrized_state
    return None


def _new_module(cls: type) -> Any:
    return object.__new__(cls)  # a module's __dict__ comes next, from the state


def _set_parametrized_state(module: Any, state: dict[str, Any]) -> None:
    from torch.nn.utils import parametrize

    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    for name in module.parametrizations:
        parametrize._inject_property(module, name)


# What torch's Optimizer.__setstate__ makes anew, or an LR scheduler sets on the optimizer
# (its step wrapper; nbtrain.rank.cell puts that back): never sent.
_REMADE = frozenset({"step", "_opt_called", "_zero_grad_profile_name", "_warned_capturable_if_run_uncaptured"})


def optimizer_reduce(obj: Any) -> Any:
    """A torch optimizer's reduction that keeps its plain attributes, or None for anything else.

    ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``: an
    optimizer that keeps more (``LBFGS._params``, ``_numel_cache``; third-party optimizers'
    own settings) would arrive without it and fail at its first ``step``. The attributes
    added here are those of plain data (numbers, strings, tensors, optimizers, lists,
    tuples and dicts of them), so nothing that cannot travel is added; the pickle's memo keeps
    ``LBFGS._params`` the very list in ``param_groups[0]``.
    """
    home = sys.modules.get("torch.optim.optimizer")
    if home is None or not isinstance(obj, home.Optimizer):
        return None
    state = obj.__getstate__()
    extra = own_attributes(obj)
    if not extra or not isinstance(state, dict):
        return None
    # copyreg.__newobj__ is what pickle itself uses for a class instance (typeshed lacks it).
    return copyreg.__newobj__, (type(obj),), {**state, **extra}  # type: ignore[attr-defined]


def own_attributes(optimizer: Any, *, optimizers: bool = True) -> dict[str, Any]:
    """The plain attributes ``optimizer`` keeps beside what ``Optimizer.__getstate__`` returns.

    ``optimizers=False`` leaves out those that hold an optimizer (one it wraps).
    """
    state = optimizer.__getstate__()
    return {
        key: value
        for key, value in vars(optimizer).items()
        if key not in state
        and key not in _REMADE
        and not key.startswith("_optimizer_")
        and _plain_data(value, optimizers=optimizers)
    }


def _plain_data(value: Any, depth: int = 0, *, optimizers: bool = True) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        return optimizers  # one another wraps (a lookahead's inner optimizer) is reduced the same way
    if depth >= 3:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain_data(item, depth + 1, optimizers=optimizers) for item in value)
    if isinstance(value, dict):
        return all(
            _plain_data(k, depth + 1, optimizers=optimizers) and _plain_data(v, depth + 1, optimizers=optimizers)
            for k, v in value.items()
        )
    return False


def dumps_keeping_filenames(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)`` (highest protocol), file names kept."""
    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
