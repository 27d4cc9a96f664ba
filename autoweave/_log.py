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

logger = logging.getLogger("autoweave")
logger.addHandler(logging.NullHandler())

# The name ``TORCH_LOGS`` knows this logger by (see ``_torchlogs``).
ALIAS = "autoweave"
TORCH_LOGS = "TORCH_LOGS"

# Between INFO and WARNING: the one plan summary autoweave shows by default (rank 0).
SUMMARY = 25
logging.addLevelName(SUMMARY, "SUMMARY")

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


def _from_environ(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def rank() -> int:
    """This process's global rank: the process group's, else ``RANK``, else 0."""
    seen = _from_process_group()
    if seen is not None:
        return seen[0]
    value = _from_environ("RANK")
    return 0 if value is None else value


def world_size() -> int:
    """The job's world size: the process group's, else ``WORLD_SIZE``, else 1."""
    seen = _from_process_group()
    if seen is not None:
        return seen[1]
    value = _from_environ("WORLD_SIZE")
    return 1 if value is None else value


def distributed() -> bool:
    """Did this process join a job (process group seen, or ``RANK`` set by a launcher)?"""
    return _from_process_group() is not None or _from_environ("RANK") is not None


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
        if getattr(sys.stderr, "closed", False):
            return
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # Nowhere left to report a failed write to; never raise from logging.
        if getattr(sys.stderr, "closed", False):
            return
        super().handleError(record)


def _attach(level: int | str) -> None:
    global _handler
    if _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(_handler)
    logger.setLevel(level)


def configure(level: str | None) -> None:
    """Attach one stderr handler at ``level`` (idempotent); never touches the root logger."""
    if level is None:
        return
    _attach(level.upper())


def configure_default() -> None:
    """No level asked for: show the plan summary (and warnings) on rank 0 only.

    Other ranks keep Python's defaults (warnings only). When the application has
    configured logging itself (the root logger has handlers), only the level is
    set, so the summary goes through the application's handlers, once.
    """
    if _handler is not None or rank() != 0:
        return
    if requested_level() is not None:  # TORCH_LOGS names autoweave: torch's switch decides
        return
    if logger.level == logging.NOTSET or logger.level > SUMMARY:
        if logging.getLogger().handlers:
            logger.setLevel(SUMMARY)
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
        name = item.lstrip("+-")
        if name != ALIAS:
            continue
        level = (
            logging.DEBUG if item.startswith("+") else logging.ERROR if item.startswith("-") else logging.INFO
        )
    return level
