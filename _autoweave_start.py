"""autoweave's start-up: run in every Python process by ``autoweave.pth`` (``autoweave.start`` on 3.15+).

One module, standard library only. With ``AUTOWEAVE`` off it returns at once;
with it on it registers post-import hooks on torch and imports nothing else:
the autoweave package (and wrapt, ~80 ms) loads when torch does. It also holds
the post-import hook machinery (``autoweave._installs`` re-exports it), so a
process has one finder whichever way autoweave was turned on.

wrapt has post-import hooks too, but importing it at start-up would cost every
process; even ``importlib.abc`` pulls in ``typing``. The finder costs one
dictionary lookup per import.
"""

import _thread
import os
import sys

OFF = ("", "0", "false", "no", "off")
ON = ("1", "true", "yes", "on")
TORCH = "torch"
CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

# Not `from typing import ...`: typing costs milliseconds at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

    # A callable, or "package.module:function" resolved when it fires (as
    # wrapt's post-import hooks allow): this module imports nothing of autoweave.
    Hook = Callable[[Any], None] | str

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
        function = _resolve(hook) if isinstance(hook, str) else hook
        if function is not None:
            _call(function, sys.modules[name])


def _call(function: "Callable[..., Any]", module: "Any") -> None:
    # A hook runs inside the user's `import torch`: its failure is autoweave's, never the
    # import's (autoweave's own hooks guard themselves; this catches what slips past).
    try:
        function(module)
    except Exception as exc:
        if os.environ.get("AUTOWEAVE_STRICT", "").strip().lower() in ON:
            raise
        _warn(f"[startup-failed] a hook on {module.__name__} failed: {exc!r}; it runs unpatched")


def _resolve(target: str) -> "Callable[..., Any] | None":
    """``"package.module:function"`` imported now; a broken install warns and yields None."""
    module_name, _, attribute = target.partition(":")
    try:
        __import__(module_name)
        return getattr(sys.modules[module_name], attribute)
    except Exception as exc:  # a broken install must not break `import torch`
        _warn(f"[startup-failed] cannot import autoweave: {exc!r}; torch runs unpatched")
        return None


def register(name: str, hook: "Hook") -> None:
    """Call ``hook(module)`` once ``name`` is imported; at once if it already is."""
    with _lock:
        hooks = _hooks.setdefault(name, [])
        if hook in hooks:
            return  # start-up files can run twice (venvs): one hook, one patch
        hooks.append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        function = _resolve(hook) if isinstance(hook, str) else hook
        if function is not None:
            _call(function, module)


def unregister_all() -> None:
    """Forget every hook and take the finder off ``sys.meta_path``."""
    with _lock:
        _hooks.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def registered(name: str) -> bool:
    """Is a hook waiting for ``name``?"""
    with _lock:
        return bool(_hooks.get(name))


# What runs when torch (or the checkpoint_wrapper module) finishes importing.
ON_IMPORT = "autoweave.startup:on_import"
# What decides (and explains) an unusual AUTOWEAVE value.
STARTUP = "autoweave.startup:startup"


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"autoweave: {message}\n")
    except Exception:
        pass


def main() -> None:
    """Entry point of the start-up files; never raises."""
    try:
        value = os.environ.get("AUTOWEAVE", "").strip().lower()
        if value in OFF:
            return
        if value not in ON or os.environ.get("AUTOWEAVE_DISABLE", "").strip():
            # Unusual values: the full settings reader decides and explains.
            startup = _resolve(STARTUP)
            if startup is not None:
                startup()
            return
        # The checkpoint_wrapper hook first: it must be in place if torch's own
        # import pulls that module in.
        register(CHECKPOINT_WRAPPER_MODULE, ON_IMPORT)
        register(TORCH, ON_IMPORT)
    except BaseException as exc:  # noqa: BLE001 - start-up must never break Python
        _warn(f"[startup-failed] {type(exc).__name__}: {exc}; continuing without autoweave")
