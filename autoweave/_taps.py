"""One tap per dynamo logger: autoweave hears dynamo's messages without changing what torch shows.

dynamo says what autoweave must react to only in log records, on loggers whose
level usually hides them (a checkpoint's fallback is INFO, a graph break's user
stack DEBUG). Many listeners overlap (the report's lives as long as the process,
a first call's spans one call, threads interleave). So each logger has one
``Tap``, shared by every subscriber to its messages and reference-counted: the
first subscription attaches it, the last one takes it back, whatever the order.

The tap never touches the logger's level: torch sets levels whenever it likes
(``TORCH_LOGS`` is applied at the end of ``import torch``, ``set_logs`` resets
them all), and so may the user. It wraps the logger's ``isEnabledFor`` instead,
so that the records a subscriber needs are made, and sits as a *filter* on the
logger: it sees each record before the logger's handlers and propagation do,
hands the parsed message (``autoweave._compat.log_strings``) to the
subscribers, then lets through only what the logger's own ``isEnabledFor``
says it shows *now* (what torch would have shown without the tap), and nothing
a subscriber consumed. What torch's own handlers show stays as it was.

Both changes are one ``_log.LoggerEdit`` (undone only while it is still as the
tap left it), installed through ``_installs`` while the tap is attached:
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
        # What the logger shows without the tap: its ``isEnabledFor`` before the tap wrapped it.
        self._shows: Callable[[int], bool] = logging.getLogger(name).isEnabledFor
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
            else:
                self._level = min(self._level, kind.LEVEL)  # type: ignore[attr-defined]

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
        # The instance's own ``isEnabledFor`` where someone set one (torch does on its trace
        # log), else the class's: asked at each call, it follows every level torch or the user
        # sets meanwhile, and ``logging.disable``.
        own = vars(log).get("isEnabledFor")
        shows = self._shows = log.isEnabledFor

        def is_enabled_for(level: int) -> bool:
            # A subscriber hears its level even where ``logging.disable`` hides it: the filter
            # still shows only what ``shows`` allows.
            return shows(level) or (self._edit is edit and level >= self._level)

        def unwrap() -> None:
            attrs = vars(log)
            if attrs.get("isEnabledFor") is not is_enabled_for:
                return  # wrapped again since: ours stays, a pass-through once detached
            if own is None:
                del attrs["isEnabledFor"]
            else:
                attrs["isEnabledFor"] = own

        vars(log)["isEnabledFor"] = is_enabled_for  # on the instance, as torch does on its trace log
        edit.undo_with(unwrap)
        edit.add_filter(self)
        self._edit = edit
        return self._detach

    def _detach(self) -> None:
        with self._lock:
            edit, self._edit = self._edit, None
            self._listeners.clear()
        if edit is not None:
            edit.undo()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            listeners, shows = list(self._listeners), self._shows
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
        return not consumed and shows(record.levelno)


_taps: dict[str, Tap] = {}
_taps_lock = threading.Lock()


def tap(name: str) -> Tap:
    """The tap on dynamo's logger ``name`` (one per name, for the process)."""
    with _taps_lock:
        if name not in _taps:
            _taps[name] = Tap(name)
        return _taps[name]


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
