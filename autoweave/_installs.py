"""Everything autoweave installs outside its own objects, in one registry, each with its undo.

A patch on torch, a gate on a checkpoint wrapper, a log filter, a logger's level,
a handler, a plan listener, a dynamo callback, an exit hook, an import hook:
each goes in through ``install(key, apply)``, which runs ``apply`` once per key
(applying twice is a no-op) and keeps the undo it returns. ``uninstall_all()``
(``autoweave.disable()``) runs the undos newest first, so torch and logging end
as they were before the first install: OpenTelemetry's instrument/uninstrument.

Each undo reverts only what is still as autoweave left it: a function
restored only if our wrapper is still on top, a logger's level only if nobody
set another since (see ``autoweave._log.LoggerEdit``), a handler removed but
nobody else's. What it must leave is left, and the owner says so
(``[patch-shadowed]``).

``active()`` says whether autoweave is on now: ``begin()`` (``enable()``, the
start-up hook) to ``uninstall_all()``. A dispatcher asks it at a compiled
module's first forward: a module compiled while autoweave was on and first
called after ``disable()`` runs what plain torch.compile would.

Standard library only and cheap to import (``startup`` records the import hooks
here, in every process with ``AUTOWEAVE`` on): no logging until an undo fails.

The post-import hooks are here too (``register``, ``unregister``): their one
finder lives in the top-level start-up module (see there), so a process has one
whichever way autoweave was turned on."""

from __future__ import annotations

import _thread
import sys
from types import ModuleType as _ModuleType

import _autoweave_start as _start
from _autoweave_start import register, registered, unregister_all  # noqa: F401 (the post-import hooks)

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Iterator
    from typing import Any

    Undo = Callable[[], None]

_lock = _thread.RLock()
# key -> undo, in install order (dicts keep it; popitem() takes the newest).
_undos: dict[str, Undo] = {}
_busy: set[str] = set()  # keys whose apply() is running
_on = False


def begin() -> None:
    """autoweave is on from now on (idempotent): compiled modules may weave at their first call."""
    global _on
    _on = True


def active() -> bool:
    """Is autoweave on now (between ``begin()`` and ``uninstall_all()``)? One global read."""
    return _on


def install(key: str, apply: Callable[[], Undo | None]) -> bool:
    """Run ``apply()`` unless ``key`` is installed (or being installed); keep its undo. True if it ran.

    The undo is what ``apply`` returns (None: nothing to undo; the key still
    marks it installed). An ``apply`` that raises installs nothing and must
    leave nothing behind.
    """
    with _lock:
        if key in _undos or key in _busy:
            return False
        _busy.add(key)
    # ``apply`` runs outside the lock, as wrapt runs its import hooks: it may import
    # (torch's import lock), and a hook on another thread may be installing too.
    try:
        returned = apply()
    finally:
        with _lock:
            _busy.discard(key)
    with _lock:
        _undos[key] = returned or (lambda: None)
    return True


def keys() -> list[str]:
    """What is installed now, oldest first (the keys name each install for people)."""
    with _lock:
        return list(_undos)


def uninstall(key: str) -> bool:
    """Undo one install now (its owner stops it early); False if it was not installed."""
    with _lock:
        undo = _undos.pop(key, None)
    if undo is None:
        return False
    _run(key, undo)
    return True


def forget(key: str) -> None:
    """The owner undid ``key`` itself: drop its undo without running it."""
    with _lock:
        _undos.pop(key, None)


def uninstall_all() -> None:
    """Turn autoweave off and run every undo, newest first.

    Undos run outside the lock (one may log, flush or join a thread). One that
    installs something while it runs (the plan summary flushed at ``disable()``
    sets the logger's level) is undone in the same pass.
    """
    global _on
    _on = False
    while True:
        with _lock:
            if not _undos:
                return
            key, undo = _undos.popitem()
        _run(key, undo)


_MISSING = object()


def _attribute(owner: Any, name: str) -> Any:
    # A class's or an instance's own entry, read through ``__dict__`` (no descriptor bound); a
    # module's (torch's config modules keep their values elsewhere) and anything inherited by
    # ``getattr``.
    own = getattr(owner, "__dict__", None)
    if isinstance(owner, _ModuleType) or own is None or name not in own:
        return getattr(owner, name, _MISSING)
    return own[name]


def patch(
    owner: Any,
    name: str,
    make: Callable[[Any, Callable[[], bool]], Any],
    on_shadowed: Callable[[str], None] | None = None,
) -> Undo:
    """Put ``make(original, on)`` on ``owner.name``; return its undo. The one way autoweave patches.

    ``on()`` is True until the undo runs: a wrapper passes calls straight through
    once it is False. The undo puts the original back only where ours is still on
    top (an attribute the owner inherited is deleted from it again); where
    someone put theirs on top since, it leaves both, ours passing through, and
    tells ``on_shadowed`` (``owner.name``). The undo returns whether it put the original back.
    """
    inherited = _inherited(owner, name)
    original = _attribute(owner, name)
    if original is _MISSING:
        raise AttributeError(f"{owner!r} has no attribute {name!r} to patch")
    on = [True]
    ours = make(original, lambda: on[0])
    setattr(owner, name, ours)

    def undo() -> bool:
        on[0] = False
        if _attribute(owner, name) is not ours:
            if on_shadowed is not None:
                on_shadowed(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
            return False
        if inherited:  # it was its class's: the owner holds none of its own again
            delattr(owner, name)
        else:
            setattr(owner, name, original)
        return True

    return undo


def _inherited(owner: Any, name: str) -> bool:
    """Does ``owner`` get ``name`` from its class (a method an instance does not hold itself)?"""
    if isinstance(owner, _ModuleType) or name in (getattr(owner, "__dict__", None) or {}):
        return False
    for klass in type(owner).__mro__:
        if name in vars(klass):
            # A data descriptor (a function's ``__defaults__``, a property) holds the owner's own value.
            return not hasattr(vars(klass)[name], "__set__")
    return False


def chain(obj: Any, through: tuple[str, ...] = ("__wrapped__",), depth: int = 16) -> Iterator[Any]:
    """``obj`` and each object it wraps (found under the first of ``through`` it has), outermost first."""
    seen: set[int] = set()
    while obj is not None and depth > 0 and id(obj) not in seen:
        yield obj
        seen.add(id(obj))
        depth -= 1
        obj = next((inner for attr in through if (inner := getattr(obj, attr, None)) is not None), None)


def shadowed_message(what: str) -> str:
    """The ``[patch-shadowed]`` warning: a patch's undo found someone else's wrapper on top of ours."""
    return (
        f"[patch-shadowed] not restoring {what}: something else wrapped autoweave's wrapper since "
        "autoweave was enabled; leaving both, autoweave's now passes every call straight through"
    )


def _run(key: str, undo: Undo) -> None:
    try:
        undo()
    except Exception as exc:  # one failed undo must not keep the others from running
        import logging

        logging.getLogger("autoweave").warning(
            "could not undo %s (%s: %s); it stays in place", key, type(exc).__name__, exc
        )


def unregister(name: str, hook: _start.Hook) -> None:
    """Forget one hook; the finder leaves ``sys.meta_path`` with the last one.

    Written here, not in the start-up module: an editable install keeps its own
    copy of that module in site-packages, which may be older than this package.
    """
    with _start._lock:
        hooks = _start._hooks.get(name, [])
        if hook in hooks:
            hooks.remove(hook)
        if not hooks:
            _start._hooks.pop(name, None)
        if not _start._hooks and _start._finder in sys.meta_path:
            sys.meta_path.remove(_start._finder)
