"""The ``autoweave`` logger: a NullHandler by default, rank-aware when configured."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("autoweave")
logger.addHandler(logging.NullHandler())

_handler: logging.Handler | None = None


def rank() -> int:
    """This process's rank as the launcher set it (0 when not distributed)."""
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def configure(level: str | None) -> None:
    """Attach one stderr handler at ``level`` (idempotent); never touches the root logger."""
    global _handler
    if level is None:
        return
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter(f"[autoweave rank{rank()}] %(levelname)s %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(level.upper())
