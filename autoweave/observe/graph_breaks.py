"""Where in the user's source a graph break or an AC fallback is: ``file:line``, as dynamo names it.

A graph break's place comes from dynamo's own ``graph_breaks`` log record, which
carries the user stack: ``watch_graph_breaks`` listens to it without printing
anything torch would not have printed.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from autoweave._compat import GRAPH_BREAK_LOGGER, HOP_CHECKPOINT_NOTE  # dynamo's log signals
from autoweave.planning.sources import is_user_file

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_AT = re.compile(r"in user code at (.+?):(\d+)")
_REASON = re.compile(r"Graph Break Reason: (.*)")


@dataclass(frozen=True)
class BreakSite:
    site: str  # "file:line" of the user's code
    reason: str  # the break's reason, first line
    text: str  # the whole record (reason and user stack)


def site_of_record(text: str) -> str | None:
    """The user's line in one graph-break record: the innermost user frame of its stack, else dynamo's."""
    user = [f"{f}:{n}" for f, n, _ in _FRAME.findall(text) if is_user_file(f)]
    if user:
        return user[-1]
    at = _AT.search(text)
    if at and is_user_file(at.group(1)):
        return f"{at.group(1)}:{at.group(2)}"
    return None


class _GraphBreakWatch(logging.Handler):
    """Listens to dynamo's graph-break records; passes on what torch would have shown anyway."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: list[BreakSite] = []
        self._lock_sites = threading.Lock()
        self._logger = logging.getLogger(GRAPH_BREAK_LOGGER)
        self._shown_from: int | None = None  # level torch's handlers saw before we listened

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            site = site_of_record(text)
            if site is not None:
                reason = _REASON.search(text)
                with self._lock_sites:
                    self.sites.append(BreakSite(site, reason.group(1).strip() if reason else "", text))
        except Exception:
            pass
        if self._shown_from is not None and record.levelno >= self._shown_from:
            parent = self._logger.parent
            if parent is not None:
                parent.handle(record)

    def install(self) -> None:
        log = self._logger
        self._saved = (log.level, log.propagate)
        log.addHandler(self)
        if log.getEffectiveLevel() > logging.DEBUG:
            # Listen at DEBUG without showing DEBUG: stop propagation, pass on the rest.
            self._shown_from = log.getEffectiveLevel() if log.propagate else logging.CRITICAL + 1
            log.setLevel(logging.DEBUG)
            log.propagate = False

    def uninstall(self) -> None:
        log = self._logger
        log.removeHandler(self)
        if not any(isinstance(h, _GraphBreakWatch) for h in log.handlers):
            log.setLevel(self._saved[0])
            log.propagate = self._saved[1]


_watch: _GraphBreakWatch | None = None
_watch_lock = threading.Lock()


class recording_graph_breaks:  # noqa: N801 - used like a function: `with recording_graph_breaks() as sites:`
    """The graph breaks dynamo logs while the block runs (``BreakSite``s, in order)."""

    def __enter__(self) -> list[BreakSite]:
        self._watch = _GraphBreakWatch()
        self._watch.install()
        return self._watch.sites

    def __exit__(self, *exc: Any) -> None:
        self._watch.uninstall()


def watch_graph_breaks() -> None:
    """Start recording where graph breaks happen, from now on (the report turns it on)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = _GraphBreakWatch()
            _watch.install()
        else:
            # A new report starts: it owns the sites seen from here, not an earlier report's.
            with _watch._lock_sites:
                _watch.sites.clear()


def _sites() -> list[BreakSite]:
    if _watch is None:
        return []
    with _watch._lock_sites:
        return list(_watch.sites)


def graph_break_sites(reasons: Any = ()) -> dict[str, list[str]]:
    """For each reason dynamo counted (``counters["graph_break"]`` keys), the user lines it broke at.

    A record belongs to a reason when the record's text contains the reason's
    first line (dynamo counts ``exc.msg`` and logs ``prefix + str(exc)``). dynamo
    logs a repeated break (same kind, same place) without its stack, so these are
    places, not counts.
    """
    sites = _sites()
    out: dict[str, list[str]] = {}
    for reason in reasons:
        first = reason.strip().splitlines()[0] if reason.strip() else ""
        found = sorted({s.site for s in sites if first and first in s.text})
        if found:
            out[reason] = found
    return out


def fallback_sites() -> list[str]:
    """The user lines of breaks inside a traced checkpoint: where checkpointed regions fell back to eager."""
    return sorted({s.site for s in _sites() if HOP_CHECKPOINT_NOTE in s.text})


def first_site(sites: dict[str, list[str]], first_line: str) -> str:
    """`` at file:line`` for the exit summary's break line (its reason cut to the first line), or ""."""
    for reason, found in sites.items():
        if found and reason.strip().splitlines()[0][:100] == first_line:
            return f" at {found[0]}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
    return ""
