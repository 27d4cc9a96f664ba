"""Where in the user's source a graph break or an AC fallback is: ``file:line``, as dynamo names it.

A graph break's place comes from dynamo's own ``graph_breaks`` log record, which
carries the user stack (read by ``_compat.log_strings`` as a ``GraphBreak``, placed
by ``planning.sources.break_frames``): ``watch_graph_breaks`` listens to it through
the logger's one tap (``autoweave._taps``), which prints nothing torch would not
have printed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave import _installs, _taps
from autoweave._compat.log_strings import Break, GraphBreak
from autoweave._failopen import guard
from autoweave.planning.sources import break_frames


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


class _GraphBreakWatch:
    """The graph-break places heard while installed."""

    def __init__(self) -> None:
        self.sites: list[BreakSite] = []
        self._lock_sites = threading.Lock()
        self._listening = _taps.listening(GraphBreak, self._on_break)

    def _on_break(self, found: GraphBreak) -> None:
        with guard("reading the place of a graph break", quiet=True):
            site = site_of(found)
            if site is not None:
                with self._lock_sites:
                    self.sites.append(BreakSite(site, found.reason, found.text, found.in_checkpoint))

    def install(self) -> None:
        self._listening.start()

    def uninstall(self) -> None:
        self._listening.stop()


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
    return sorted({s.site for s in _sites() if s.in_checkpoint})


def first_site(sites: dict[str, list[str]], first_line: str) -> str:
    """`` at file:line`` for the exit summary's break line (its reason cut to the first line), or ""."""
    for reason, found in sites.items():
        if found and reason.strip().splitlines()[0][:100] == first_line:
            return f" at {found[0]}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
    return ""
