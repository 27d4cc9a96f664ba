"""Where in the user's source a graph break or an AC fallback is: ``file:line``, as dynamo names it.

A graph break's place comes from dynamo's own ``graph_breaks`` log record, which
carries the user stack: ``watch_graph_breaks`` listens to it without printing
anything torch would not have printed.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave import _installs
from autoweave._compat import GRAPH_BREAK_LOGGER, HOP_CHECKPOINT_NOTE  # dynamo's log signals
from autoweave._failopen import guard
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


class _Listener(logging.Handler):
    """The one handler on dynamo's graph-break logger, shared by every ``_GraphBreakWatch``.

    Listening means lowering a global logger to DEBUG (and stopping propagation,
    so torch's handlers don't show DEBUG). Watches overlap (the report's lives
    while autoweave is installed, a first call's spans that call, threads
    interleave), so the logger's state is saved by the first watch to start and
    restored by the last to stop, whatever the order; and a record is passed on
    once, however many watches hear it (as ``counting``'s fallback listener).
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._watches: list[_GraphBreakWatch] = []
        self._saved: tuple[int, bool] | None = None  # level, propagate before the first watch
        self._left: tuple[int, bool] | None = None  # level, propagate as the first watch left them
        self._shown_from: int | None = None  # level torch's handlers saw before we listened
        self._state_lock = threading.Lock()

    def add(self, watch: _GraphBreakWatch) -> None:
        with self._state_lock:
            if watch in self._watches:
                return
            if not self._watches:
                log = logging.getLogger(GRAPH_BREAK_LOGGER)
                self._saved = (log.level, log.propagate)
                self._shown_from = None
                log.addHandler(self)
                if log.getEffectiveLevel() > logging.DEBUG:
                    # Listen at DEBUG without showing DEBUG: stop propagation, pass on the rest.
                    self._shown_from = log.getEffectiveLevel() if log.propagate else logging.CRITICAL + 1
                    log.setLevel(logging.DEBUG)
                    log.propagate = False
                self._left = (log.level, log.propagate)
            self._watches.append(watch)

    def remove(self, watch: _GraphBreakWatch) -> None:
        with self._state_lock:
            if watch not in self._watches:
                return
            self._watches.remove(watch)
            if self._watches or self._saved is None:
                return
            log = logging.getLogger(GRAPH_BREAK_LOGGER)
            log.removeHandler(self)
            if (log.level, log.propagate) == self._left:  # nobody changed it since: ours to restore
                log.setLevel(self._saved[0])
                log.propagate = self._saved[1]
            self._saved = self._left = self._shown_from = None

    def emit(self, record: logging.LogRecord) -> None:
        with self._state_lock:
            watches, shown_from = list(self._watches), self._shown_from
        with guard("reading the place of a graph break", quiet=True):
            text = record.getMessage()
            site = site_of_record(text)
            if site is not None:
                reason = _REASON.search(text)
                found = BreakSite(site, reason.group(1).strip() if reason else "", text)
                for watch in watches:
                    watch.add(found)
        if shown_from is not None and record.levelno >= shown_from:
            parent = logging.getLogger(GRAPH_BREAK_LOGGER).parent
            if parent is not None:
                parent.handle(record)


_listener = _Listener()


class _GraphBreakWatch:
    """The graph-break places heard while installed."""

    def __init__(self) -> None:
        self.sites: list[BreakSite] = []
        self._lock_sites = threading.Lock()

    def add(self, site: BreakSite) -> None:
        with self._lock_sites:
            self.sites.append(site)

    def install(self) -> None:
        _listener.add(self)

    def uninstall(self) -> None:
        _listener.remove(self)


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
    """Start recording where graph breaks happen, from now on (the report turns it on).

    Installed once (``autoweave._installs``): ``autoweave.disable()`` stops it.
    """
    if not _installs.install("graph-break watch (the report's user lines)", _start_watching):
        with _watch_lock:
            if _watch is not None:
                # A new report starts: it owns the sites seen from here, not an earlier report's.
                with _watch._lock_sites:
                    _watch.sites.clear()


def _start_watching() -> Callable[[], None]:
    global _watch
    watch = _GraphBreakWatch()
    watch.install()
    with _watch_lock:
        _watch = watch

    def undo() -> None:
        global _watch
        watch.uninstall()
        with _watch_lock:
            if _watch is watch:
                _watch = None

    return undo


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
