"""What a region's recompute reads: the values its forward's guards saw.

A block's forward may change plain Python state its compiled code is guarded
on: ``self.calls += 1``, a flag set on the first call. Under an eager checkpoint
the recompute then meets other values than the forward did, fits none of the
region's cache entries and compiles another graph, which may save other tensors
than the forward's (a float on the module made dynamic by then): CheckpointError
where plain torch, running the block eager, trains (fuzzer seed 10090).

So the scalars on the block's modules that the region's guards read are noted
before the forward and presented to the recompute, and what the recompute itself
changes is applied on top of what the forward left, as the two eager runs of
plain torch leave it: a counter bumped once in each ends two higher. State that
cannot be put back this way (a list a traced hook appends to) is not: its
recompute compiles again; under ``fail_on_recompile``, where it could not, it runs
what its forward ran (``_compat.dynamo.misses_decided``, fuzzer seed 10638).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from numbers import Number
from typing import Any

import torch.nn as nn

from autoweave import _compat

_SCALARS = (bool, int, float, str, type(None))
_MISSING = object()

Restore = Callable[[], None]


def _modules(args: Iterable[Any], fn: Callable[..., Any]) -> list[nn.Module]:
    """The modules a region's call runs: those among its arguments, else the one its function is bound to."""
    roots = [a for a in args if isinstance(a, nn.Module)]
    if not roots:  # a region around an instance-level forward: the module is in its closure
        for cell in getattr(fn, "__closure__", None) or ():
            owner = getattr(cell.cell_contents, "__self__", None)
            if isinstance(owner, nn.Module):
                roots.append(owner)
    return [m for root in roots for m in root.modules()]


def _after(forward: Any, now: Any, recomputed: Any) -> Any:
    """The value after forward and recompute, as two eager runs leave it: the recompute's change on top."""
    if recomputed == forward:
        return now
    if isinstance(forward, Number) and isinstance(recomputed, Number) and not isinstance(forward, bool):
        return now + (recomputed - forward)  # a counter: bumped once more
    return recomputed


class GuardedState:
    """Notes a region's guarded scalars before its forward; presents them to its recompute."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._names: frozenset[str] = frozenset()
        self._made = -1  # dynamo's entries made when ``_names`` was read

    def note(self, args: tuple[Any, ...], entries: int, made: int) -> list[tuple[nn.Module, dict[str, Any]]]:
        """The scalars of the modules this call runs that the region's guards read, before its forward.

        ``entries``: the region's cache entries; before its first its guards are unknown, and
        all scalars are noted. ``made``: dynamo's count of entries made (``entries_made``),
        whose change says the guards may have changed.
        """
        modules = _modules(args, self._fn)
        if entries == 0:
            return [(m, {k: v for k, v in m.__dict__.items() if isinstance(v, _SCALARS)}) for m in modules]
        names = self._guarded(made)
        if not names:
            return []
        return [
            (m, {k: v for k in names if isinstance(v := m.__dict__.get(k, _MISSING), _SCALARS)})
            for m in modules
        ]

    def _guarded(self, made: int) -> frozenset[str]:
        if made != self._made:  # guards are read again only when dynamo has made entries since
            self._names, self._made = _compat.backends.guarded_attributes(self._fn), made
        return self._names

    def present(self, noted: list[tuple[nn.Module, dict[str, Any]]], made: int) -> Restore:
        """Put back the forward's guarded values for the recompute; the returned call settles them after it."""
        names = self._guarded(made)
        changed = [
            (m, name, scalars[name], now)
            for m, scalars in noted
            for name in names.intersection(scalars)
            if (now := m.__dict__.get(name, _MISSING)) is not _MISSING and now != scalars[name]
        ]
        for m, name, value, _ in changed:
            m.__dict__[name] = value

        def restore() -> None:
            for m, name, value, now in changed:
                m.__dict__[name] = _after(value, now, m.__dict__.get(name, value))

        return restore
