"""Post-import hooks with nothing but ``sys`` and ``_thread``.

wrapt has post-import hooks too, but importing wrapt costs ~80 ms and the
start-up file must not pay that in processes that never import torch; even
``importlib.abc`` pulls in ``typing``. This finder costs one dictionary lookup
per import.
"""

import _thread
import sys

# Not `from typing import TYPE_CHECKING`: typing costs milliseconds at start-up.
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

    Hook = Callable[[Any], None]

_lock = _thread.RLock()
_hooks: "dict[str, list[Hook]]" = {}
_busy: set[str] = set()


class _ChainedLoader:
    """Runs the real loader, then the hooks for the module it just executed."""

    def __init__(self, loader: "Any") -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> "Any":
        # Resource readers, get_code, is_package ... all belong to the real loader.
        return getattr(self._loader, name)

    def create_module(self, spec: "Any") -> "Any":
        return self._loader.create_module(spec)

    def exec_module(self, module: "Any") -> None:
        self._loader.exec_module(module)
        # Put the real loader back so later introspection sees what it expects.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        _fire(module.__name__)


class _Finder:
    def find_spec(self, fullname: str, path: "Any" = None, target: "Any" = None) -> "Any":
        if fullname not in _hooks:
            return None
        with _lock:
            if fullname in _busy:
                return None
            _busy.add(fullname)
        try:
            spec = None
            # Ask the finders after us, as the import system would have.
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception:
            return None
        finally:
            with _lock:
                _busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ChainedLoader(spec.loader)
        return spec


_finder = _Finder()


def _fire(name: str) -> None:
    with _lock:
        hooks = list(_hooks.get(name, ()))
    # Hooks run outside the lock: a hook that imports another hooked module
    # must not deadlock.
    for hook in hooks:
        hook(sys.modules[name])


def register(name: str, hook: "Hook") -> None:
    """Call ``hook(module)`` once ``name`` is imported; at once if it already is."""
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        hook(module)


def unregister_all() -> None:
    """Forget every hook and take the finder off ``sys.meta_path``."""
    with _lock:
        _hooks.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
