"""The activation memory a block woven as ``pieces`` holds, measured against eager selective AC's.

``pieces`` keeps for backward every tensor that crosses a break and is needed
there (the experts' input and output, the routing weights): whole-block eager
selective AC would recompute them from the block's input. With a policy that
saves the GEMM outputs that costs nothing (eager SAC keeps those too); with
one that saves little it can cost several times eager SAC's memory. Which it
is depends on the model, the break and the policy, so it is measured, once
per kind of block, at the first call that builds a graph for backward:

- what pieces hold: the bytes autograd saves during the block's forward. Every
  piece is a compiled graph that checkpoints inside itself, so each tensor it
  keeps passes through saved-tensor hooks installed around the call (none of
  torch's eager checkpoints runs inside, whose own hooks would take precedence);
  a storage counts once, parameters not at all (they are kept anyway);
- what eager selective AC would hold: its checkpoint keeps the block's tensor
  inputs, and its policy's saves (the outputs of the ops it saves, as the
  pieces' tracing showed them to it).

When pieces hold more than ``TOLERANCE`` times that, the block and every block
of its kind is planned again from its next call with ``hoist``: eager AC around
the compiled block holds at most eager SAC's memory. What that costs (it
recomputes each compiled graph whole; with inductor its policy sees inductor's
kernels, so it recomputes what full AC does) is in README "Limits" and
``benchmarks/sac_memory.py``. When the caller's own saved-tensor hooks are in
force around that first call (activation offloading, an eager checkpoint
around the model), nothing is measured: ours would shadow theirs.

This module is the judgement only (``Verdict``, the ``TOLERANCE`` rule, which
blocks are of one ``kind``); the measure runs in ``weave/first_call_memory``
and what it found is kept by ``planning/learned``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from autoweave import _compat

# Pieces may hold this much more than eager SAC before the block is planned with hoist.
TOLERANCE = 1.05


def size_text(size: int) -> str:
    """``0.61 MB``, or ``13.7 KB`` below a megabyte."""
    return f"{size / 2**20:.2f} MB" if size >= 2**20 else f"{size / 2**10:.1f} KB"


@dataclass(frozen=True)
class Verdict:
    """One measured first call of a block woven as pieces."""

    held: int | None  # bytes the pieces kept for backward (None: not measured on this rank)
    eager_sac: int | None  # bytes eager selective AC would keep (None: cannot be told)
    failed: tuple[str, ...] = ()  # why pieces autoweave could not compile ran eager instead
    # Another rank running the block measured a hoist verdict (``dispatch/agreement``): its data
    # differ (a longer sequence); every rank plans the block alike, or they could hang.
    elsewhere: bool = False

    @property
    def hoist_here(self) -> bool:
        """This rank's measure says hoist: pieces ran eager, or hold more than eager SAC would."""
        if self.failed:
            return True
        return self.held is not None and self.eager_sac is not None and self.held > self.eager_sac * TOLERANCE

    @property
    def hoist(self) -> bool:
        """Plan the block with ``hoist`` instead: this rank's measure says so, or another rank's did."""
        return self.hoist_here or self.elsewhere

    def describe(self) -> str:
        if self.elsewhere and not self.hoist_here:
            return (
                f"another rank running it measured that it should be planned with hoist; here {self._here()}"
            )
        return self._here()

    def _here(self) -> str:
        if self.failed:
            return f"{len(self.failed)} of its pieces ran eager under their checkpoint: {self.failed[0]}"
        if self.held is None:
            return "not measured (saved-tensor hooks were in force around its first call)"
        if self.eager_sac is None:
            return f"pieces hold {size_text(self.held)} for backward (eager selective AC's could not be told)"
        return (
            f"pieces hold {size_text(self.held)} for backward, eager selective AC "
            f"{size_text(self.eager_sac)} (its input and its policy's saves)"
        )


# -- what one block taught its kind ---------------------------------------------------------


def identity(value: Any, _depth: int = 0) -> Any:
    """A hashable key for a policy or option value: equal for the same functions, partials and constants.

    Closures made by one factory per block (a ``context_fn`` built per layer, as
    torchtitan's and NeMo's recipes build them) are equal when they run the same
    code over equal captured values (``_captured``): blocks that differ only in
    such a closure then share one compiled region, where a key by object kept
    every block apart, compiling each on its own.
    """
    if _depth > 8:
        return ("deep", id(value))
    func = getattr(value, "func", None)
    if func is not None:  # functools.partial: the function and its arguments
        return (
            "partial",
            identity(func, _depth + 1),
            tuple(identity(a, _depth + 1) for a in value.args),
            identity(value.keywords, _depth + 1),
        )
    if isinstance(value, dict):
        return tuple(sorted((k, identity(v, _depth + 1)) for k, v in value.items()))
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, types.FunctionType) and value.__closure__:
        return (
            "closure",
            id(value.__code__),
            id(value.__globals__),
            tuple(_captured(cell, _depth + 1) for cell in value.__closure__),
            _captured_value(value.__defaults__, _depth + 1),
        )
    return id(value)


def _captured(cell: Any, depth: int) -> Any:
    try:
        contents = cell.cell_contents
    except ValueError:  # a cell not filled yet
        return ("empty",)
    return _captured_value(contents, depth)


def _captured_value(value: Any, depth: int) -> Any:
    """A captured value's key: constants and frozen collections by value, anything mutable by object.

    A dict, a list or any object a closure captures may be state it changes
    (a per-block counter): two closures are equal only when they share it. A
    set (a policy's op list) or tuple is read-only in practice and compared by
    its items.
    """
    if isinstance(value, (tuple, frozenset, set)) and len(value) <= 256:
        items = [_captured_value(item, depth + 1) for item in value]
        if isinstance(value, tuple):
            return ("tuple", tuple(items))
        try:
            return ("set", frozenset(items))
        except TypeError:
            return id(value)
    if isinstance(value, dict):
        return id(value)
    return identity(value, depth)


def kind(wrapper: Any) -> tuple | None:
    """Blocks of one kind hold the same for backward: same code, parameter shapes and checkpoint."""
    inner = _compat.modules.children_of(wrapper).get(_compat.modules.CHECKPOINT_WRAPPED)
    if inner is None:
        return None
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in inner.named_parameters())
    return (type(inner), shapes, identity(_compat.modules.checkpoint_fn(wrapper)))
