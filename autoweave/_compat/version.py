"""Which torch autoweave runs on: the tested range, and a name-by-name check of a newer torch.

An older torch turns autoweave off. A newer one is checked at start-up
(``self_check``): every private name and dynamo message the other ``_compat``
modules declare as required (``lookup.need``) is probed; autoweave turns on when
everything is there (with one notice naming the untested version) and stays off
naming what is missing otherwise; what it lacks of the optional ones is logged at
debug level. ``AUTOWEAVE_UNTESTED_TORCH=off`` keeps it off on any newer torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autoweave._compat import backends, checkpoints, dynamo, log_strings, modules, regions
from autoweave._compat.lookup import NEEDS, UnsupportedTorch, torch_version

# Every module that declares what it needs from torch (``lookup.need``): imported here, so
# ``lookup.NEEDS`` is complete whenever ``self_check`` reads it.
DECLARING = (backends, checkpoints, dynamo, log_strings, modules, regions)

# The torch releases autoweave is tested on, inclusive, as (major, minor).
TESTED_TORCH = ((2, 11), (2, 15))


def _tested() -> str:
    low, high = TESTED_TORCH
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"


@dataclass(frozen=True)
class TorchSupport:
    """What autoweave makes of the installed torch (``torch_support``)."""

    version: str
    on: bool
    untested: bool  # newer than the newest tested release
    missing: tuple[str, ...] = ()  # what ``self_check`` did not find (untested torch only)
    message: str = ""  # the one line to tell the user; empty for a tested torch

    @property
    def tag(self) -> str:
        return "untested-torch" if self.on else "unsupported-torch"


def torch_support(
    raw: str | None = None, *, untested: str = "check", check: Callable[[], list[str]] | None = None
) -> TorchSupport:
    """Decide whether autoweave runs on torch ``raw`` (default: the installed one).

    ``untested`` is the ``AUTOWEAVE_UNTESTED_TORCH`` policy: ``check`` (run
    ``check``, default ``self_check``, on a torch newer than tested) or ``off``.
    """
    if raw is None:
        import torch

        raw = str(torch.__version__)
    version = torch_version(raw)
    low, high = TESTED_TORCH
    if version < low:
        return TorchSupport(
            raw,
            on=False,
            untested=False,
            message=f"torch {raw} is not supported (autoweave supports torch {_tested()}); staying off. "
            f"Install torch>={low[0]}.{low[1]} or unset AUTOWEAVE.",
        )
    if version <= high:
        return TorchSupport(raw, on=True, untested=False)
    newest = f"{high[0]}.{high[1]}"
    if untested == "off":
        return TorchSupport(
            raw,
            on=False,
            untested=True,
            message=f"torch {raw} is newer than the newest tested ({newest}) and "
            "AUTOWEAVE_UNTESTED_TORCH=off; staying off. Unset AUTOWEAVE_UNTESTED_TORCH to let autoweave "
            "check what it needs from this torch, or install a tested torch.",
        )
    missing = tuple((check or _self_check_once)())
    log = logging.getLogger("autoweave")
    if check is None and log.isEnabledFor(logging.DEBUG) and (lacking := _optional_missing_once()):
        log.debug("torch %s lacks names autoweave does without: %s", raw, ", ".join(lacking))
    if missing:
        return TorchSupport(
            raw,
            on=False,
            untested=True,
            missing=missing,
            message=f"torch {raw} is newer than the newest tested ({newest}) and lacks what autoweave "
            f"needs: {', '.join(missing)}; staying off, torch runs unpatched. "
            f"Install a tested torch ({_tested()}) or unset AUTOWEAVE.",
        )
    return TorchSupport(
        raw,
        on=True,
        untested=True,
        message=f"torch {raw} is newer than the newest tested ({newest}); everything autoweave needs from "
        "it is there, so autoweave is on. AUTOWEAVE_UNTESTED_TORCH=off keeps it off on untested torch.",
    )


def check_torch_version(raw: str | None = None, *, untested: str = "check") -> TorchSupport:
    """``torch_support``, raising ``UnsupportedTorch`` (with the message) when autoweave must stay off."""
    support = torch_support(raw, untested=untested)
    if not support.on:
        raise UnsupportedTorch(support.message)
    return support


def _needs() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(what, probe) of every required row of ``lookup.NEEDS``: what ``self_check`` probes.

    A seam for tests, which add a row here to play a torch that lacks one.
    """
    return tuple((row.what, row.probe) for row in NEEDS if row.required)


@functools.cache
def _self_check_once() -> tuple[str, ...]:
    # The installed torch does not change within a process; the check imports dynamo.
    return tuple(self_check())


def self_check() -> list[str]:
    """What autoweave needs from the installed torch and cannot find (empty: all there).

    Run on a torch newer than ``TESTED_TORCH`` before anything is patched: a
    release that moved one of these names leaves autoweave off, naming it,
    instead of failing deep inside a patch.
    """
    return _failing(_needs())


def optional_missing() -> list[str]:
    """What the installed torch lacks of the names autoweave does without (the parts using them stay off)."""
    return _failing((row.what, row.probe) for row in NEEDS if not row.required)


@functools.cache
def _optional_missing_once() -> tuple[str, ...]:
    return tuple(optional_missing())


def _failing(rows: Iterable[tuple[str, Callable[[], Any]]]) -> list[str]:
    # Two modules may declare one name: it is reported once.
    return list(dict.fromkeys(what for what, probe in rows if not _passes(probe)))


def _passes(probe: Callable[[], Any]) -> bool:
    try:
        return bool(probe())
    except Exception:  # a moved module, a changed signature: that name is missing
        return False
