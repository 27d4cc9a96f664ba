"""dynamo's graph breaks placed in the user's source, and ``TORCH_LOGS=autoweave``.

Where a graph break or an AC fallback is: ``file:line`` in the user's source,
as dynamo names it. Its place comes from dynamo's own ``graph_breaks`` log
record, which carries the user stack (read by ``_compat.log_strings`` as a
``GraphBreak``, placed by ``planning.sources.break_frames``): ``listening``
hears it through the logger's one tap (``autoweave._taps``), which prints
nothing torch would not have printed. The report keeps the places while it
collects; ``recording_graph_breaks`` keeps those of one block.

The ``autoweave`` logger answers torch's logging switch like torch's own:
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

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autoweave import _compat, _installs, _log, _taps
from autoweave._compat.log_strings import Break, GraphBreak
from autoweave._failopen import guard
from autoweave._log import ALIAS, TORCH_LOGS, logger, requested_level
from autoweave.planning.sources import break_frames

__all__ = ["ALIAS", "TORCH_LOGS", "register", "requested_level"]


@dataclass(frozen=True)
class BreakSite:
    site: str  # "file:line" of the user's code
    reason: str  # the break's reason, first line
    text: str  # the whole record (reason and user stack)
    in_checkpoint: bool = False  # the break was inside a traced checkpoint (that region fell back)


def site_of(found: Break) -> str | None:
    """The user's line of one break: the innermost user frame of its stack, else dynamo's own line."""
    frames = break_frames(found)
    return f"{frames[0].filename}:{frames[0].lineno}" if frames else None


def _heard(sites: list[BreakSite], found: GraphBreak) -> None:
    with guard("reading the place of a graph break", quiet=True):
        if (site := site_of(found)) is not None:
            sites.append(BreakSite(site, found.reason, found.text, found.in_checkpoint))


def listening(sites: list[BreakSite]) -> _taps.listening[GraphBreak]:
    """A listener (``start``/``stop``) that appends the place of each graph break dynamo logs to ``sites``."""
    return _taps.listening(GraphBreak, functools.partial(_heard, sites))


@contextlib.contextmanager
def recording_graph_breaks() -> Iterator[list[BreakSite]]:
    """The graph breaks dynamo logs while the block runs (``BreakSite``s, in order)."""
    sites: list[BreakSite] = []
    with listening(sites):
        yield sites


def graph_break_sites(sites: list[BreakSite], reasons: Any) -> dict[str, list[str]]:
    """For each reason dynamo counted (``counters["graph_break"]`` keys), the user lines it broke at.

    A record belongs to a reason when the record's text contains the reason's
    first line (dynamo counts ``exc.msg`` and logs ``prefix + str(exc)``). dynamo
    logs a repeated break (same kind, same place) without its stack, so these are
    places, not counts.
    """
    out: dict[str, list[str]] = {}
    for reason in reasons:
        first = reason.strip().splitlines()[0] if reason.strip() else ""
        if found := sorted({s.site for s in sites if first and first in s.text}):
            out[reason] = found
    return out


def fallback_sites(sites: list[BreakSite]) -> list[str]:
    """The user lines of breaks inside a traced checkpoint: where checkpointed regions fell back to eager."""
    return sorted({s.site for s in sites if s.in_checkpoint})


def first_site(sites: dict[str, list[str]], first_line: str) -> str:
    """`` at file:line`` for the exit summary's break line (its reason cut to the first line), or ""."""
    for reason, found in sites.items():
        if found and reason.strip().splitlines()[0][:100] == first_line:
            return f" at {found[0]}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
    return ""


TORCH_LOGS_OUT = "TORCH_LOGS_OUT"


def register(settings: object) -> None:
    """Put ``autoweave`` in torch's log registry and apply ``TORCH_LOGS`` to it (once torch is imported).

    Every change (the registry's alias, the logger's level, propagation and
    handlers) is undone by ``autoweave.disable()``: the alias by its own
    install, the logger's by ``_log.edit``.
    """
    internal = _compat.dynamo.torch_logging_internal()
    if internal is None:
        return
    # Registered only when TORCH_LOGS is set: torch then ignores set_logs(), so its
    # logging is never re-initialised. Registered without it, a later
    # set_logs(dynamo=...) would reset our logger (level, handlers, propagation)
    # even though the user asked nothing about autoweave.
    if TORCH_LOGS in os.environ and not internal.log_registry.is_log(ALIAS):
        _installs.install("torch log registry: the autoweave alias", lambda: _register_alias(internal))
    if (level := requested_level()) is None:
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
