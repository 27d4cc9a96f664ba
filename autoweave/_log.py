"""The ``autoweave`` logger: a NullHandler by default, rank-aware when configured."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("autoweave")
logger.addHandler(logging.NullHandler())

# Between INFO and WARNING: the one plan summary autoweave shows by default (rank 0).
SUMMARY = 25
logging.addLevelName(SUMMARY, "SUMMARY")

_handler: logging.Handler | None = None


def rank() -> int:
    """This process's rank as the launcher set it (0 when not distributed)."""
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.strip().isdigit() else 1


def _attach(level: int | str) -> None:
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter(f"[autoweave rank{rank()}] %(levelname)s %(message)s"))
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
    from autoweave._torchlogs import requested_level  # TORCH_LOGS names autoweave: torch's switch decides

    if requested_level() is not None:
        return
    if logger.level == logging.NOTSET or logger.level > SUMMARY:
        if logging.getLogger().handlers:
            logger.setLevel(SUMMARY)
        else:
            _attach(SUMMARY)
