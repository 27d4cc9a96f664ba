"""What autoweave attaches to the user's module instances, and how the modules shed it.

The weave changes modules in place, through instance attributes (a ``forward``
of autoweave's, a dispatcher behind a compiled module). None of that may travel
with a module that is pickled, saved or copied: plain torch saves these
modules, and a saved file must load where autoweave is not installed. So:

- dispatchers live in a weak table here, never on the module (the module holds only
  the dispatcher's ``call``, in torch's compiled slot, as it would hold torch's own);
- every module that carries an install of autoweave's also carries an instance
  ``__getstate__`` (pickle, ``copy`` and ``torch.save`` look it up on the
  instance) that returns the class's state minus autoweave's installs, so the
  copy is exactly what plain torch would have copied.

Two kinds of forward are installed. A weave's forward (``install_forward``)
runs compiled regions; planning looks through it to the user's code (``users_own``).
A stand-in (``install_stand_in``) is the user's own forward rewritten into a form
dynamo traces (torch 2.15's decorated checkpoints): planning reads it as the user's
code, and pickling and copying shed it like any install.

Standard library only; the bottom layer of the package.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

# Attribute on every forward autoweave installs: the instance forward it replaced (or None).
PRIOR = "__autoweave_prior__"
# Attribute on a stand-in for the user's forward: the instance forward it stands in for (or None).
STANDS_IN = "__autoweave_stands_in__"
_GETSTATE = "__getstate__"
_DEEPCOPY = "__deepcopy__"

_lock = threading.RLock()
# module -> its dispatcher, held weakly too: a dispatcher holds the module it compiles, and a
# weak table's value that holds its key keeps both for the life of the process. The module's
# compiled slot holds the dispatcher's ``call``, so it lives as long as that forward does.
_dispatchers: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def dispatcher_of(module: Any) -> Any:
    """The dispatcher autoweave put behind ``module`` (a compile target), or None."""
    ref = _dispatchers.get(module)
    return None if ref is None else ref()


def attach(module: Any, dispatcher: Any) -> None:
    """Put ``dispatcher`` behind ``module``, which holds it (its ``call`` in the compiled slot)."""
    with _lock:
        _dispatchers[module] = weakref.ref(dispatcher)


def installed(forward: Any) -> bool:
    """Is this forward one of autoweave's installs (it knows what it replaced)?"""
    return forward is not None and hasattr(forward, PRIOR)


def stands_in(forward: Any) -> bool:
    """Is this forward a stand-in of autoweave's for the user's own (``install_stand_in``)?"""
    return forward is not None and hasattr(forward, STANDS_IN)


def users_own(forward: Any) -> Any:
    """Peel autoweave's installs off an instance forward: the user's own (or its stand-in), or None."""
    while installed(forward):
        forward = getattr(forward, PRIOR)
    return forward


def _sheds(forward: Any) -> bool:
    return installed(forward) or stands_in(forward)


def install_forward(module: Any, forward: Any) -> Any:
    """Put ``forward`` on ``module`` (an instance attribute); returns the forward it replaced."""
    previous = module.__dict__.get("forward")
    setattr(forward, PRIOR, previous)
    _put(module, forward)
    return previous


def install_stand_in(module: Any, forward: Any) -> None:
    """Put ``forward`` on ``module`` in place of the user's own forward (instance or class).

    Planning reads it as the user's code; a pickle or copy of ``module`` gets
    the user's forward back.
    """
    setattr(forward, STANDS_IN, module.__dict__.get("forward"))
    _put(module, forward)


def _put(module: Any, forward: Any) -> None:
    with _lock:
        module.__dict__["forward"] = forward
        if _GETSTATE not in module.__dict__:
            module.__dict__[_GETSTATE] = _Shed(module)


def restore_forward(module: Any, previous: Any) -> None:
    """Undo ``install_forward``: the instance forward is ``previous`` again (None: the class's)."""
    with _lock:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        if not _sheds(module.__dict__.get("forward")) and isinstance(module.__dict__.get(_GETSTATE), _Shed):
            del module.__dict__[_GETSTATE]


def strip(state: Any) -> Any:
    """A module's pickled state without autoweave's installs (a new dict; ``state`` is untouched)."""
    if not isinstance(state, dict):
        return state
    out = dict(state)
    if isinstance(out.get(_GETSTATE), _Shed):
        del out[_GETSTATE]
    if isinstance(out.get(_DEEPCOPY), CopyHook):
        del out[_DEEPCOPY]
    if _sheds(out.get("forward")):
        own = users_own(out["forward"])
        if stands_in(own):
            own = getattr(own, STANDS_IN)
        if own is None:
            del out["forward"]
        else:
            out["forward"] = own
    return out


class _Shed:
    """An instance ``__getstate__``: the class's state, minus autoweave's installs.

    Holds the module weakly: it lives in the module's own ``__dict__``.
    """

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)

    def __call__(self) -> Any:
        module = self._module()
        if module is None:  # pragma: no cover - called through the module itself
            return None
        return strip(type(module).__getstate__(module))


class CopyHook:
    """An instance ``__deepcopy__`` for a compiled module with a dispatcher behind it.

    torch's ``OptimizedModule`` copies as ``OptimizedModule(copy of the module,
    copy of the compile context)``, which would leave the copy unwoven. This
    makes exactly that copy, then lets ``rebuild(original, copy)`` put a
    dispatcher behind it. A class-level ``__deepcopy__`` (FSDP's, which raises)
    still wins, as it does in plain torch.
    """

    def __init__(self, module: Any, rebuild: Any) -> None:
        self._module = weakref.ref(module)
        self._rebuild = rebuild

    def __call__(self, memo: dict[int, Any] | None = None) -> Any:
        import copy

        module = self._module()
        own = getattr(type(module), _DEEPCOPY, None)
        if own is not None:
            return own(module, memo)
        with _lock:
            del module.__dict__[_DEEPCOPY]
            try:
                duplicate = copy.deepcopy(module, memo)
            finally:
                module.__dict__[_DEEPCOPY] = self
        self._rebuild(module, duplicate)
        return duplicate
