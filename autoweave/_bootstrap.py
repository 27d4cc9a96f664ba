"""Start-up: read the settings once, register import hooks, patch when torch loads.

Everything here is standard library only. The heavy parts (wrapt, torch, the
patches) are imported by the hooks, when torch itself is imported.
"""

import _thread
import sys

from _autoweave_start import CHECKPOINT_WRAPPER_MODULE, TORCH, _warn
from autoweave import _importhook
from autoweave._settings import TYPE_CHECKING, Settings

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

_lock = _thread.RLock()
_settings: "Settings | None" = None
_hooks_registered = False
_problems_reported = False


def settings() -> Settings:
    """The settings of this process, read from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings.from_environ()
    return _settings


def reload_settings(new: "Settings | None" = None) -> Settings:
    """Re-read the environment (or take ``new``); for tests and ``enable()``."""
    global _settings
    _settings = Settings.from_environ() if new is None else new
    return _settings


def _prepare(current: Settings) -> None:
    """Once per process: the log level asked for, and each settings problem on stderr."""
    global _problems_reported
    if current.log_level is not None:
        from autoweave import _log

        _log.configure(current.log_level)
    if _problems_reported:
        return
    _problems_reported = True
    for problem in current.problems:
        _warn(problem)


def startup() -> None:
    """Entry point of the start-up file (unusual AUTOWEAVE values); never raises."""
    try:
        current = settings()
        _prepare(current)
        if current.enabled:
            install()
    except BaseException as exc:  # noqa: BLE001 - a .pth must never break Python
        _warn(f"[startup-failed] {type(exc).__name__}: {exc}; continuing without autoweave")


def on_import(module: "Any") -> None:
    """Hook registered by the start-up module: torch (or checkpoint_wrapper) was just imported."""
    global _hooks_registered
    _hooks_registered = True
    current = settings()
    _prepare(current)
    if not current.enabled:
        return
    if module.__name__ == TORCH:
        _on_torch_import(module)
    else:
        _on_checkpoint_wrapper_import(module)


def install() -> None:
    """Patch torch now if it is imported, else when it is; idempotent."""
    global _hooks_registered
    with _lock:
        if _hooks_registered or _importhook.registered(TORCH):
            _hooks_registered = True  # the start-up module's hooks already wait for torch
            return
        _hooks_registered = True
        # Registering is plain dictionary work; the hooks themselves carry the
        # fail-open guard (importing logging here would cost every process).
        _importhook.register(CHECKPOINT_WRAPPER_MODULE, _on_checkpoint_wrapper_import)
        _importhook.register(TORCH, _on_torch_import)


def uninstall() -> None:
    """Remove the import hooks and every patch (restoring the originals)."""
    global _hooks_registered
    with _lock:
        _importhook.unregister_all()
        _hooks_registered = False
        if TORCH in sys.modules:
            from autoweave import patches

            patches.revert_all()


def _on_torch_import(module: "Any") -> None:
    from autoweave._failopen import guard

    with guard("patching torch", fallback="torch runs unpatched"):
        from autoweave import patches

        patches.apply_torch(settings())
    with guard("applying TORCH_LOGS to the autoweave logger"):  # autoweave/_torchlogs.py
        from autoweave import _torchlogs

        _torchlogs.register(settings())


def _on_checkpoint_wrapper_import(module: "Any") -> None:
    from autoweave._failopen import guard

    with guard("patching checkpoint_wrapper", fallback="checkpoint_wrapper runs unpatched"):
        from autoweave import patches

        patches.apply_checkpoint_wrapper(settings(), module)
