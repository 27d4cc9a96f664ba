"""One tap per dynamo logger: autoweave hears dynamo's messages without changing what torch shows.

dynamo says what autoweave must react to only in log records, on loggers whose
level usually hides them (a checkpoint's fallback is INFO, a graph break's user
stack DEBUG). Listening means lowering a global logger's level; many listeners
overlap (the report's lives as long as the process, a first call's spans one
call, threads interleave). So each logger has one ``Tap``, shared by every
subscriber to its messages and reference-counted: the first subscription
lowers the level and adds the tap as a filter on the logger, the last one
takes both back, whatever the order.

The tap is a *filter*, not a handler: it sees each record before the logger's
handlers and propagation do, hands the parsed message
(``autoweave._compat.log_strings``) to the subscribers, then lets through only
what the logger would have shown before it was lowered, and nothing a subscriber
consumed. What torch's own handlers show stays as it was.

Each change to the logger is a ``_log.LoggerEdit`` (undone only while it is still
as the tap left it), installed through ``_installs`` while the tap is attached:
``autoweave.disable()`` detaches every tap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from autoweave import _installs
from autoweave._compat import log_strings
from autoweave._log import LoggerEdit, logger

M = TypeVar("M")
# Called with each message of its kind, inside dynamo's logging call (so on dynamo's
# thread, with dynamo's frames up the stack); returns True to consume it (torch's
# handlers then do not show it).
Listener = Callable[[Any], "bool | None"]


class Tap(logging.Filter):
    """The one filter autoweave keeps on one of dynamo's loggers while anyone listens to it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger_name = name
        self._key = f"tap on dynamo's logger {name!r}"
        self._listeners: list[tuple[type, Listener]] = []
        self._level = logging.CRITICAL  # the lowest level a subscriber needs
        self._shown = logging.NOTSET  # what the logger showed before the tap lowered it
        self._edit: LoggerEdit | None = None
        # Re-entrant: the undo that ``disable()`` runs takes it, and so may a listener.
        self._lock = threading.RLock()

    def subscribe(self, kind: type, listener: Listener) -> Callable[[], None]:
        """Hand each message of type ``kind`` to ``listener`` from now on; returns the unsubscribe."""
        entry = (kind, listener)
        with self._lock:
            self._listeners.append(entry)
            if self._edit is None:
                self._level = kind.LEVEL  # type: ignore[attr-defined]
                try:
                    _installs.install(self._key, self._attach)
                except BaseException:
                    self._listeners.remove(entry)
                    raise
            elif kind.LEVEL < self._level:  # type: ignore[attr-defined]
                self._level = kind.LEVEL  # type: ignore[attr-defined]
                self._lower(self._edit)

        def unsubscribe() -> None:
            with self._lock:
                if entry not in self._listeners:
                    return  # unsubscribed already, or the tap was detached (``disable()``)
                self._listeners.remove(entry)
                if not self._listeners:
                    _installs.uninstall(self._key)

        return unsubscribe

    def _attach(self) -> Callable[[], None]:
        log = logging.getLogger(self.logger_name)
        edit = LoggerEdit(log)
        self._shown = log.getEffectiveLevel()
        self._lower(edit)
        edit.add_filter(self)
        self._edit = edit
        return self._detach

    def _lower(self, edit: LoggerEdit) -> None:
        if edit.log.getEffectiveLevel() > self._level:
            edit.set_level(self._level)

    def _detach(self) -> None:
        with self._lock:
            edit, self._edit = self._edit, None
            self._listeners.clear()
        if edit is not None:
            edit.undo()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            listeners, shown = list(self._listeners), self._shown
        consumed = False
        try:
            message = log_strings.read(record)
        except Exception:  # a reworded message must never break dynamo's logging call
            logger.debug("could not read dynamo's %s record", record.name, exc_info=True)
            message = None
        for kind, listener in listeners if message is not None else ():
            if not isinstance(message, kind):
                continue
            try:
                consumed = bool(listener(message)) or consumed
            except Exception:  # autoweave's listener failing must not fail dynamo's compile
                logger.debug("a listener on dynamo's %s failed", record.name, exc_info=True)
        return not consumed and record.levelno >= shown


_taps: dict[str, Tap] = {}
_taps_lock = threading.Lock()


def tap(name: str) -> Tap:
    """The tap on dynamo's logger ``name`` (one per name, for the process)."""
    with _taps_lock:
        found = _taps.get(name)
        if found is None:
            found = _taps[name] = Tap(name)
        return found


class listening(Generic[M]):  # noqa: N801 - used like a function: `with listening(Fallback, seen.append):`
    """While inside, each dynamo message of type ``kind`` goes to ``listener``.

    ``kind`` is a ``log_strings`` message class; it names its logger and level.
    ``start``/``stop`` do the same for a span that is not a block.
    """

    def __init__(self, kind: type[M], listener: Callable[[M], bool | None]) -> None:
        self._kind, self._listener = kind, listener
        self._stop: Callable[[], None] | None = None

    def start(self) -> listening[M]:
        if self._stop is None:
            self._stop = tap(self._kind.LOGGER).subscribe(self._kind, self._listener)  # type: ignore[attr-defined]
        return self

    def stop(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def __enter__(self) -> listening[M]:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
