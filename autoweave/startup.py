"""Start-up: read the settings once, register import hooks, patch when torch loads.

Everything here is standard library only. The heavy parts (wrapt, torch, the
patches) are imported by the hooks, when torch itself is imported.
"""

import _thread
import os
import sys

from _autoweave_start import CHECKPOINT_WRAPPER_MODULE, ON_IMPORT, TORCH, _warn
from autoweave import _installs, _settings
from autoweave._settings import TYPE_CHECKING, Settings

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

_lock = _thread.RLock()
_problems_reported = False
# Why autoweave stays off in this process (a missing dependency, an unsupported
# torch), once found: told once, and the other hook does not try again.
_off_reason: "str | None" = None
# The dependencies and torch were found usable (checked once: the self-check costs seconds).
_usable = False

# The packages the patches import, with the pip requirement that fixes their absence.
DEPENDENCIES = (("wrapt", "wrapt>=1.14,!=2.2.0"),)


def _prepare() -> Settings:
    """The settings, with the log level asked for applied; once per process, each settings problem on stderr."""
    global _problems_reported
    current = _settings.current()
    if current.log_level is not None:
        from autoweave import _log

        _log.configure(current.log_level)
    if not _problems_reported:
        _problems_reported = True
        # The same settings reach every rank: told once per job, never by torchrun's launcher.
        if not is_launcher() and _tells_the_job():
            for problem in current.problems:
                _warn(f"[bad-setting] {problem}")
    return current


def startup() -> None:
    """Entry point of the start-up file (unusual AUTOWEAVE values); never raises."""
    try:
        if _prepare().enabled:
            install()
    except BaseException as exc:  # noqa: BLE001 - a .pth must never break Python
        _warn(f"[startup-failed] {type(exc).__name__}: {exc}; continuing without autoweave")


def on_import(module: "Any") -> None:
    """Hook registered by the start-up module: torch (or checkpoint_wrapper) was just imported.

    Runs inside the user's ``import torch``: whatever fails here is autoweave's,
    and torch is imported unpatched (the one guard; strict mode raises).
    """
    from autoweave._failopen import guard

    with guard(f"preparing autoweave as {module.__name__} is imported", fallback="torch runs unpatched"):
        if not _prepare().enabled:
            return
        # The start-up module registered these hooks before autoweave loaded: recorded now,
        # with their undo, so that disable() takes them off like any other install.
        _installs.begin()
        _installs.install(IMPORT_HOOKS, lambda: _unregister_hooks)
        if module.__name__ == TORCH:
            _on_torch_import(module)
        else:
            _on_checkpoint_wrapper_import(module)


# The install key of the post-import hooks on torch and checkpoint_wrapper's module.
IMPORT_HOOKS = "post-import hooks on torch and checkpoint_wrapper"


def install() -> None:
    """Patch torch now if it is imported, else when it is; idempotent (``disable()`` undoes it)."""
    with _lock:
        _prepare()  # the log level asked for, as AUTOWEAVE=1 would
        _installs.begin()
        _installs.install(IMPORT_HOOKS, _register_hooks)


def _register_hooks() -> "Callable[[], None]":
    if not _installs.registered(TORCH):  # else the start-up module's hooks already wait for torch
        # Registering is plain dictionary work; the hooks themselves carry the
        # fail-open guard (importing logging here would cost every process).
        # checkpoint_wrapper's hook first: it must be in place if torch's own import pulls it in.
        _installs.register(CHECKPOINT_WRAPPER_MODULE, _on_checkpoint_wrapper_import)
        _installs.register(TORCH, _on_torch_import)
    return _unregister_hooks


def _unregister_hooks() -> None:
    for name, own in ((TORCH, _on_torch_import), (CHECKPOINT_WRAPPER_MODULE, _on_checkpoint_wrapper_import)):
        _installs.unregister(name, ON_IMPORT)  # the start-up module's
        _installs.unregister(name, own)


def uninstall() -> None:
    """Undo every install, newest first: hooks, patches, gates, filters, handlers, listeners, callbacks."""
    with _lock:
        _installs.uninstall_all()
        # Hooks the start-up module registered in a process that never imported torch
        # (so never loaded autoweave's part of them): nothing else is left to take them off.
        _installs.unregister_all()


# How torchrun's launcher runs: the ``torchrun`` script, or ``python -m`` one of these.
# It inherits AUTOWEAVE and imports torch, but never compiles: autoweave stays out of it.
_LAUNCHER_SCRIPTS = ("torchrun",)
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_launcher(argv: "list[str] | None" = None, orig_argv: "list[str] | None" = None) -> bool:
    """Is this process torchrun's launcher (not one of its workers)?"""
    argv = sys.argv if argv is None else argv
    orig_argv = list(getattr(sys, "orig_argv", ())) if orig_argv is None else orig_argv
    if argv and os.path.basename(argv[0]) in _LAUNCHER_SCRIPTS:
        return True
    # ``python -m torch.distributed.run``: while torch imports, sys.argv[0] is still "-m".
    for i, arg in enumerate(orig_argv[:-1]):
        if arg == "-m":
            return orig_argv[i + 1] in _LAUNCHER_MODULES
    return False


def _tells_the_job() -> bool:
    """Start-up notices (not problems) are told once per job: by global rank 0, or a lone process."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _environment_problem(torch_module: "Any") -> "str | None":
    # Not internal errors: the environment lacks something, so the message names
    # it and the fix, and no traceback is needed.
    for name, requirement in DEPENDENCIES:
        try:
            __import__(name)
        except ImportError as exc:
            return (
                f"[missing-dependency] autoweave needs the package {name!r}, which cannot be imported "
                f"in this Python ({sys.executable}: {exc}); staying off, torch runs unpatched. "
                f"Fix: pip install '{requirement}' (or unset AUTOWEAVE)"
            )
    version = getattr(torch_module, "__version__", None)
    if version is None:
        return None  # torch still importing: patches.apply_torch checks it again
    from autoweave import _compat

    try:
        support = _compat.version.torch_support(str(version), untested=_settings.current().untested_torch)
    except _compat.lookup.UnsupportedTorch as exc:  # an unreadable version
        return f"[unsupported-torch] {exc}"
    if not support.on:
        return f"[{support.tag}] {support.message}"
    if support.message and _tells_the_job():
        _warn(f"[{support.tag}] {support.message}")  # on, on an untested torch: one notice
    return None


def _can_patch(torch_module: "Any") -> bool:
    """Are the dependencies and torch usable? Says why not, once per process."""
    global _off_reason, _usable
    with _lock:
        if _off_reason is None and is_launcher():
            # torchrun's launcher never compiles: no patches, no messages, no report.
            _off_reason = "torchrun's launcher process: autoweave stays out of it"
            return False
        if _usable:
            return True
        if _off_reason is None:
            problem = _environment_problem(torch_module)
            if problem is None:
                # Decided once torch's version is known (the checkpoint_wrapper hook
                # can fire while torch is still importing, before it is).
                _usable = getattr(torch_module, "__version__", None) is not None
                return True
            _off_reason = problem
            if _tells_the_job() or problem.startswith("[missing-dependency]"):
                _warn(problem)  # the torch verdict is the same on every rank: told once per job
        return False


def off_reason() -> "str | None":
    """Why autoweave stays off in this process despite being enabled, if it does."""
    return _off_reason


def _on_torch_import(module: "Any") -> None:
    if not _can_patch(module):
        return
    from autoweave._failopen import guard

    with guard("patching torch", fallback="torch runs unpatched"):
        from autoweave.dispatch import patches

        patches.apply_torch(_settings.current())
    with guard("starting the report", fallback="no plan summary or report at exit"):
        # The plan summary at exit (when no second step logged it) and, with
        # AUTOWEAVE_REPORT, the report.
        from autoweave.observe import report_exit

        report_exit.install(_settings.current())
    with guard("applying TORCH_LOGS to the autoweave logger"):  # autoweave/sense/graph_breaks.py
        from autoweave import _log
        from autoweave.sense import graph_breaks

        _log.name_summary_level()  # the plan summary's level, by name, while installed
        graph_breaks.register(_settings.current())


def _on_checkpoint_wrapper_import(module: "Any") -> None:
    if not _can_patch(sys.modules.get(TORCH)):
        return
    from autoweave._failopen import guard

    with guard("patching checkpoint_wrapper", fallback="checkpoint_wrapper runs unpatched"):
        from autoweave.dispatch import patches

        patches.apply_checkpoint_wrapper(_settings.current(), module)
