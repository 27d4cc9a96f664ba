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
plain torch leave it: a counter bumped once in each ends two higher. The same for
plain objects the call's arguments hold: a cache made per call whose slot the
forward fills (transformers' ``DynamicCache``, on in training), guarded on the
slot being empty; the recompute, finding it filled, compiled a graph that saved
other tensors (fuzzer seed 30089). What is not a number ends as the recompute
left it (plain torch's recompute would extend the slot its forward filled; with
the forward's value presented it fills it again). State that cannot be put back
this way (a list a traced hook appends to) is not: its recompute compiles again;
under ``fail_on_recompile``, where it could not, it runs what its forward ran
(``_compat.dynamo.misses_decided``, fuzzer seed 10638).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from numbers import Number
from typing import Any

import torch
import torch.nn as nn

from autoweave import _compat

_SCALARS = (bool, int, float, str, type(None))
_MISSING = object()

Restore = Callable[[], None]


def _holders(args: Iterable[Any], fn: Callable[..., Any]) -> list[Any]:
    """What a region's call reads state from: the modules it runs, and plain objects its arguments hold.

    The modules: those among its arguments, else the one its function is bound to.
    """
    roots = [a for a in args if isinstance(a, nn.Module)]
    if not roots:  # a region around an instance-level forward: the module is in its closure
        for cell in getattr(fn, "__closure__", None) or ():
            owner = getattr(cell.cell_contents, "__self__", None)
            if isinstance(owner, nn.Module):
                roots.append(owner)
    held: list[Any] = [m for root in roots for m in root.modules()]
    _objects(args, held, {id(h) for h in held}, _DEPTH)  # modules among them are skipped
    return held


_DEPTH = 3  # a cache, its list of slots, a slot


def _objects(values: Iterable[Any], into: list[Any], seen: set[int], depth: int) -> None:
    """Plain objects among ``values`` and in their attributes, lists and tuples, ``depth`` levels down."""
    for value in values:
        if depth == 0 or id(value) in seen or isinstance(value, (*_SCALARS, torch.Tensor, nn.Module, type)):
            continue
        seen.add(id(value))
        if isinstance(value, (list, tuple)):
            _objects(value, into, seen, depth - 1)
        else:
            try:  # not ``getattr``: a class's own ``__getattr__`` is never run here
                vars_of = object.__getattribute__(value, "__dict__")
            except Exception:  # ``__slots__``, a builtin
                continue
            if isinstance(vars_of, dict):
                into.append(value)
                _objects(list(vars_of.values()), into, seen, depth - 1)


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value (a tensor is never compared by value)."""
    return a is b or (isinstance(a, _SCALARS) and isinstance(b, _SCALARS) and a == b)


def _after(forward: Any, now: Any, recomputed: Any) -> Any:
    """The value after forward and recompute, as two eager runs leave it: the recompute's change on top."""
    if _same(recomputed, forward):
        return now
    if isinstance(forward, Number) and isinstance(recomputed, Number) and not isinstance(forward, bool):
        return now + (recomputed - forward)  # a counter: bumped once more
    return recomputed


class GuardedState:
    """Notes a region's guarded scalars before its forward; presents them to its recompute."""

    def __init__(self, fn: Callable[..., Any], helpers: Iterable[Any] = ()) -> None:
        self._fn = fn
        # The codes of the helper frames the region's calls converted (a set that grows): their
        # guards count too (a decorated forward whose class ``forward`` is a frame of its own
        # and reads ``self.calls``: fuzzer seed 35496).
        self._helpers = helpers
        self._names: frozenset[str] = frozenset()
        self._made = -1  # dynamo's entries made when ``_names`` was read

    def note(self, args: tuple[Any, ...], entries: int, made: int) -> list[tuple[Any, dict[str, Any]]]:
        """The scalars of what this call reads state from (``_holders``) that the region's guards read, before its forward.

        ``entries``: the region's cache entries; before its first its guards are unknown, and
        all scalars are noted. ``made``: dynamo's count of entries made (``entries_made``),
        whose change says the guards may have changed.
        """
        if entries == 0:
            return [
                (m, {k: v for k, v in m.__dict__.items() if isinstance(v, _SCALARS)})
                for m in _holders(args, self._fn)
            ]
        names = self._guarded(made)
        if not names:  # no walk of the arguments on a call whose region guards on no attribute
            return []
        modules = _holders(args, self._fn)
        return [
            (m, {k: v for k in names if isinstance(v := m.__dict__.get(k, _MISSING), _SCALARS)})
            for m in modules
        ]

    def _guarded(self, made: int) -> frozenset[str]:
        if made != self._made:  # guards are read again only when dynamo has made entries since
            self._names, self._made = _compat.backends.guarded_attributes(self._fn, self._helpers), made
        return self._names

    def present(self, noted: list[tuple[Any, dict[str, Any]]], made: int) -> Restore:
        """Put back the forward's guarded values for the recompute; the returned call settles them after it."""
        names = self._guarded(made)
        changed = [
            (m, name, scalars[name], now)
            for m, scalars in noted
            for name in names.intersection(scalars)
            if (now := m.__dict__.get(name, _MISSING)) is not _MISSING and not _same(now, scalars[name])
        ]
        for m, name, value, _ in changed:
            m.__dict__[name] = value

        def restore() -> None:
            for m, name, value, now in changed:
                m.__dict__[name] = _after(value, now, m.__dict__.get(name, value))

        return restore
