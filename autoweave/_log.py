"""The ``autoweave`` logger: a NullHandler by default, rank-aware when configured.

The rank is decided late, each time it is asked for: a process learns it only
when ``torch.distributed`` is initialized (``mp.spawn`` workers have no ``RANK``
in the environment), and a launcher that never initializes it is not rank 0 of
anything (see ``report``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from autoweave import _installs

logger = logging.getLogger("autoweave")
# A library's logger carries a NullHandler from import on (the logging HOWTO's advice):
# the one logging change made at import, on autoweave's own logger.
logger.addHandler(logging.NullHandler())

# The name ``TORCH_LOGS`` knows this logger by (see ``_torchlogs``).
ALIAS = "autoweave"
TORCH_LOGS = "TORCH_LOGS"

# Between INFO and WARNING: the one plan summary autoweave shows by default (rank 0).
# logging knows it by name only while autoweave is installed (``name_summary_level``).
SUMMARY = 25

_handler: logging.Handler | None = None
FORMAT = "[autoweave rank%(autoweave_rank)s] %(levelname)s %(message)s"
# The (rank, world size) last read from an initialized process group: the job
# may destroy the group before exit, when the report still needs the rank.
_seen: tuple[int, int] | None = None


def _from_process_group() -> tuple[int, int] | None:
    global _seen
    # Only when the application imported it: asking must not import torch.
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return _seen
    try:
        if dist.is_available() and dist.is_initialized():
            _seen = (dist.get_rank(), dist.get_world_size())
    except Exception:  # a half-torn-down group: keep what we saw last
        pass
    return _seen


def _read(index: int, variable: str, default: int) -> int:
    seen = _from_process_group()
    if seen is not None:
        return seen[index]
    value = os.environ.get(variable, "").strip()
    return int(value) if value.isdigit() else default


def rank() -> int:
    """This process's global rank: the process group's, else ``RANK``, else 0."""
    return _read(0, "RANK", 0)


def world_size() -> int:
    """The job's world size: the process group's, else ``WORLD_SIZE``, else 1."""
    return _read(1, "WORLD_SIZE", 1)


class _RankFilter(logging.Filter):
    # A filter, not a format string baked at attach time: the handler is often
    # attached before the process group exists, and the rank must be right for
    # every record. Reading it costs a dictionary lookup and two calls.
    def filter(self, record: logging.LogRecord) -> bool:
        record.autoweave_rank = rank()
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now; silent once it is closed.

    Test runners and daemons replace or close stderr; at exit a handler bound
    to the old stream would print a "Logging error" traceback instead.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.addFilter(_RankFilter())

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(sys.stderr, "closed", False):
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # Nowhere left to report a failed write to; never raise from logging.
        if not getattr(sys.stderr, "closed", False):
            super().handleError(record)


class LoggerEdit:
    """autoweave's changes to one logger, each undone only while it is still as autoweave left it.

    ``undo()`` takes them back newest first: a level or propagation flag set
    back only if nobody set another since, a handler or filter of autoweave's
    removed (nobody else's), a handler autoweave took off put back where it was.
    """

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._undos: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def undo_with(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` too when this edit is undone (each change's own; a module's, forgetting what it attached)."""
        with self._lock:
            self._undos.append(undo)

    def set_level(self, level: int | str) -> None:
        log = self.log
        before = log.level
        log.setLevel(level)
        after = log.level
        if after != before:
            self.undo_with(lambda: log.setLevel(before) if log.level == after else None)

    def set_propagate(self, value: bool) -> None:
        log = self.log
        if log.propagate != value:  # put back only if nobody set it since
            self.undo_with(_installs.patch(log, "propagate", lambda before, on: value))

    def add_handler(self, handler: logging.Handler) -> None:
        if handler not in self.log.handlers:
            self.log.addHandler(handler)
            self.undo_with(lambda: self.log.removeHandler(handler))

    def remove_handler(self, handler: logging.Handler) -> None:
        log = self.log
        if handler not in log.handlers:
            return
        index = log.handlers.index(handler)
        log.removeHandler(handler)

        def undo() -> None:
            if handler not in log.handlers:
                log.handlers.insert(min(index, len(log.handlers)), handler)

        self.undo_with(undo)

    def add_filter(self, log_filter: Any) -> None:
        if log_filter not in self.log.filters:
            self.log.addFilter(log_filter)
            self.undo_with(lambda: self.log.removeFilter(log_filter))

    def undo(self) -> None:
        with self._lock:
            undos, self._undos = self._undos, []
        for step in reversed(undos):
            step()


_edits: dict[str, LoggerEdit] = {}
_edits_lock = threading.Lock()


def edit(name: str = "autoweave") -> LoggerEdit:
    """Where autoweave changes logger ``name`` for as long as it is installed (undone at ``disable()``).

    One edit per logger between installs, registered with ``_installs`` when
    first asked for: its changes are undone together, newest first.
    """
    with _edits_lock:
        if name in _edits:
            return _edits[name]
        current = _edits[name] = LoggerEdit(logging.getLogger(name))

    def undo() -> None:
        with _edits_lock:
            if _edits.get(name) is current:
                del _edits[name]
        current.undo()

    _installs.install(f"logger {name!r}: autoweave's changes", lambda: undo)
    return current


def name_summary_level() -> None:
    """logging knows level 25 as ``SUMMARY`` (its records say so) while autoweave is installed."""
    _installs.install("logging level name SUMMARY", _add_level_name)


def _add_level_name() -> Callable[[], None]:
    # logging has no way to forget a level name but its two tables (stable since 2.x).
    tables = ((logging._levelToName, SUMMARY), (logging._nameToLevel, "SUMMARY"))
    before = [(table, key, table.get(key)) for table, key in tables]  # type: ignore[attr-defined]
    logging.addLevelName(SUMMARY, "SUMMARY")

    def undo() -> None:
        if logging.getLevelName(SUMMARY) != "SUMMARY":
            return  # someone named it since: theirs stays
        for table, key, value in before:
            if value is None:
                table.pop(key, None)  # type: ignore[attr-defined]
            else:
                table[key] = value  # type: ignore[index]

    return undo


def _attach(level: int | str) -> None:
    global _handler
    name_summary_level()
    own = edit()
    if _handler is None:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        own.add_handler(handler)
        _handler = handler

        def forget() -> None:
            global _handler
            if _handler is handler:
                _handler = None

        own.undo_with(forget)
    own.set_level(level)


def configure(level: str | None) -> None:
    """Attach one stderr handler at ``level`` (idempotent); never touches the root logger."""
    if level is not None:
        _attach(level.upper())


def configure_default() -> None:
    """No level asked for: show the plan summary (and warnings) on rank 0 only.

    Other ranks keep Python's defaults (warnings only). When the application has
    configured logging itself (the root logger has handlers), only the level is
    set, so the summary goes through the application's handlers, once.
    """
    name_summary_level()
    # With TORCH_LOGS naming autoweave (``requested_level``), torch's switch decides.
    if _handler is not None or rank() != 0 or requested_level() is not None:
        return
    if logger.level == logging.NOTSET or logger.level > SUMMARY:
        if logging.getLogger().handlers:
            edit().set_level(SUMMARY)
        else:
            _attach(SUMMARY)


def requested_level(environ: dict[str, str] | None = None) -> int | None:
    """The level ``TORCH_LOGS`` asks for the ``autoweave`` logger, or ``None`` when it does not name it.

    Mirrors torch's parser: ``+name`` is DEBUG, ``-name`` ERROR, ``name`` INFO.
    ``all`` means torch's own loggers, not ours. Standard library only: the
    plan summary asks this before deciding to show itself.
    """
    value = (os.environ if environ is None else environ).get(TORCH_LOGS, "")
    level = None
    for item in value.replace(" ", "").strip("'\"").split(","):
        if item.lstrip("+-") == ALIAS:
            level = {"+": logging.DEBUG, "-": logging.ERROR}.get(item[0], logging.INFO)
    return level
