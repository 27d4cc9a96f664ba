"""``TORCH_LOGS=autoweave``: the ``autoweave`` logger answers torch's logging switch like torch's own.

``TORCH_LOGS=autoweave`` shows autoweave's INFO lines, ``+autoweave`` its DEBUG
lines, ``-autoweave`` only its errors (the default plan summary too is hidden),
with torch's handler and format, as for ``TORCH_LOGS=dynamo``.

torch reads ``TORCH_LOGS`` while it is imported, before autoweave's import hook
runs, so ``register`` (called from that hook) applies the setting for our
logger itself; it is idempotent and never undoes what torch already did.
``AUTOWEAVE_LOG_LEVEL``, being more specific, wins over ``TORCH_LOGS`` for the
``autoweave`` logger: its level and autoweave's own rank-prefixed handler.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from autoweave import _compat, _installs, _log
from autoweave._log import ALIAS, TORCH_LOGS, logger, requested_level

__all__ = ["ALIAS", "TORCH_LOGS", "register", "requested_level"]

TORCH_LOGS_OUT = "TORCH_LOGS_OUT"


def register(settings: object) -> None:
    """Put ``autoweave`` in torch's log registry and apply ``TORCH_LOGS`` to it (once torch is imported).

    Every change (the registry's alias, the logger's level, propagation and
    handlers) is undone by ``autoweave.disable()``: the alias by its own
    install, the logger's by ``_log.edit``.
    """
    internal = _internal()
    if internal is None:
        return
    # Registered only when TORCH_LOGS is set: torch then ignores set_logs(), so its
    # logging is never re-initialised. Registered without it, a later
    # set_logs(dynamo=...) would reset our logger (level, handlers, propagation)
    # even though the user asked nothing about autoweave.
    if TORCH_LOGS in os.environ and not internal.log_registry.is_log(ALIAS):
        _installs.install("torch log registry: the autoweave alias", lambda: _register_alias(internal))
    level = requested_level()
    if level is None:
        return
    own = _log.edit()
    if getattr(settings, "log_level", None) is not None:
        _drop_torch_handlers(own)
        return
    # torch usually did this already (it accepts any importable module name in
    # TORCH_LOGS); a torch that did not gets the same result here.
    own.set_level(level)
    own.set_propagate(False)
    if not any(_compat.dynamo.is_torch_log_handler(h) for h in logger.handlers):
        before = list(logger.handlers)
        _compat.dynamo.add_torch_log_handlers(logger, os.environ.get(TORCH_LOGS_OUT))
        for handler in [h for h in logger.handlers if h not in before]:
            own.undo_with(lambda handler=handler: logger.removeHandler(handler))


def _register_alias(internal: object) -> Callable[[], None]:
    internal.register_log(ALIAS, ALIAS)  # type: ignore[attr-defined]
    aliases = internal.log_registry.log_alias_to_log_qnames  # type: ignore[attr-defined]
    ours = aliases.get(ALIAS)

    def undo() -> None:
        if aliases.get(ALIAS) is ours:
            del aliases[ALIAS]

    return undo


def _drop_torch_handlers(own: _log.LoggerEdit) -> None:
    # AUTOWEAVE_LOG_LEVEL attached our handler already: one handler, one line per record.
    for handler in [h for h in logger.handlers if _compat.dynamo.is_torch_log_handler(h)]:
        own.remove_handler(handler)
    own.set_propagate(True)


def _internal() -> object | None:
    return _compat.dynamo.torch_logging_internal()
