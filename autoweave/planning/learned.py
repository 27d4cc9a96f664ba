"""What the run learned, as the one value a plan reads: ``Learned``.

Three things a compile cannot read from the module tree are learned while the
run goes, each from one block, and kept for every block like it:

- breaks: where dynamo broke a checkpointed region, from its fallback at a
  first call (``locate``). Kept by forward code: identical blocks share
  dynamo's cache for the checkpoint wrapper's code, so only the first block to
  compile logs the fallback; the others silently run the cached eager one.
- memory verdicts (``Verdict``): what a block woven as pieces held at its first
  call against eager selective AC. Kept by kind of block (``kind``).
- context verdicts: whether a checkpoint traced inside a compiled graph can
  take a ``context_fn`` (``checkpoint_calls.why_not_traceable``). Kept per
  ``context_fn`` object.

The tables live on ``_state.run`` (``_state.reset()`` forgets them) and are
written and read only here. ``Learned.for_target`` turns them into one frozen
value for a compile target; ``planner.plan`` reads nothing else of the run.

Breaks: where dynamo broke a checkpointed region, its user stack mapped to the
modules that hold it. When dynamo cannot trace a checkpoint as one graph it logs
(INFO) that it falls back to eager, then logs the ``Unsupported`` error itself,
with the user's frames from the compiled frame down to the break (read by
``sense.counting.FallbackCounter`` as ``FallbackBreak``s). The innermost frame
that runs a module's forward names the module that breaks (``locate``): the
planner then treats it as a boundary and compiles around it.

Memory verdicts: the activation memory a block woven as ``pieces`` holds,
measured against eager selective AC's. ``pieces`` keeps for backward every
tensor that crosses a break and is needed there (the experts' input and output,
the routing weights): whole-block eager selective AC would recompute them from
the block's input. With a policy that saves the GEMM outputs that costs nothing
(eager SAC keeps those too); with one that saves little it can cost several
times eager SAC's memory. Which it is depends on the model, the break and the
policy, so it is measured, once per kind of block, at the first call that builds
a graph for backward:

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

Here is the judgement (``Verdict``, the ``TOLERANCE`` rule, which blocks are of
one ``kind``) and the verdicts kept; the measure runs in
``weave/first_call_memory``.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave._compat.log_strings import Break
from autoweave._state import run
from autoweave.planning import boundaries, kinds, sources

_lock = threading.Lock()


def _nothing() -> Mapping[int, str]:
    return types.MappingProxyType({})


@dataclass(frozen=True)
class Learned:
    """What the run learned about the modules under one compile target, keyed by ``id``.

    ``breaks``: modules dynamo was seen breaking in, with why (boundaries of the
    plan). ``measured``: AC wrappers whose pieces were measured, with why they
    held more than eager selective AC would (``auto`` plans them with hoist), or ""
    when they did not. ``untraceable``:
    checkpoints, by ``id`` of their ``checkpoint_fn``, whose ``context_fn`` a
    traced checkpoint cannot take, with why; it may be a lazy mapping that
    probes at its first lookup (``dispatch/plan_inputs``), so a plan that
    looks nothing up calls no ``context_fn``. ``unmeasurable``: why no pieces can
    be measured against eager selective AC on this torch, or None.
    """

    breaks: Mapping[int, str] = field(default_factory=_nothing)
    measured: Mapping[int, str] = field(default_factory=_nothing)
    untraceable: Mapping[int, str] = field(default_factory=_nothing)
    unmeasurable: str | None = None

    @classmethod
    def for_target(
        cls,
        target: Any,
        *,
        breaks: Mapping[int, str] | None = None,
        untraceable: Mapping[int, str] | None = None,
    ) -> Learned:
        """What the run learned under ``target``.

        ``breaks``: the target's own, from a fallback it saw (they win over
        what other blocks taught); ``untraceable``: its checkpoints' context
        verdicts (nothing is probed here).
        """
        return cls(
            breaks=types.MappingProxyType({**_breaks_under(target), **(breaks or {})}),
            measured=types.MappingProxyType(_measured_under(target)),
            untraceable=_nothing() if untraceable is None else untraceable,
            unmeasurable=None if _compat.checkpoints.policy_sees_outputs() else UNMEASURABLE,
        )


# -- breaks --------------------------------------------------------------------------------


def learn_breaks(target: Any, located: Mapping[int, str]) -> None:
    """Remember the forward code of each located module (ids from ``locate``) as breaking."""
    for module in target.modules():
        reason = located.get(id(module))
        if reason is not None and (code := forward_code(module)) is not None:
            run.learned_breaks.setdefault(code, reason)


def _breaks_under(target: Any) -> dict[int, str]:
    learned = run.learned_breaks  # keyed by code objects only (never None: see learn_breaks)
    if not learned:
        return {}
    return {id(m): learned[code] for m in target.modules() if (code := forward_code(m)) in learned}


# -- memory verdicts -----------------------------------------------------------------------


def learn_verdict(wrapper: Any, verdict: Verdict) -> None:
    """Remember ``verdict`` for every block of ``wrapper``'s kind; a hoist verdict re-plans them."""
    key = kind(wrapper)
    if key is None:
        return
    with _lock:
        run.learned_memory.setdefault(key, verdict)
    if verdict.hoist:
        boundaries.bump()  # the dispatchers holding blocks of this kind re-read their tree


def verdict_of(module: Any) -> Verdict | None:
    """What a block of ``module``'s kind was measured to hold (None: not measured yet)."""
    # Keyed by kind only (learn_verdict keeps no None key); the check skips reading the kind.
    return run.learned_memory.get(kind(module)) if run.learned_memory else None


def hoist_reason(module: Any) -> str | None:
    """Why a block of ``module``'s kind is to be planned with hoist; None when it is not."""
    verdict = verdict_of(module)
    return verdict.describe() if verdict is not None and verdict.hoist else None


def _measured_under(target: Any) -> dict[int, str]:
    # Every block measured, heavier or not ("": the pieces held no more than eager SAC), so
    # the planner knows which blocks still have their first call measured.
    if not run.learned_memory:
        return {}
    verdicts = ((m, verdict_of(m)) for m in target.modules())
    return {id(m): (v.describe() if v.hoist else "") for m, v in verdicts if v is not None}


# -- context verdicts ----------------------------------------------------------------------

UNJUDGED = object()  # context_verdict's answer for a context_fn nobody judged yet


def context_verdict(context_fn: Any) -> Any:
    """Why a traced checkpoint cannot take ``context_fn`` (None: it can), or ``UNJUDGED``."""
    kept = run.context_verdicts.get(id(context_fn))
    # By id, with the object kept: an id reused by a new function is not its verdict.
    return kept[1] if kept is not None and kept[0] is context_fn else UNJUDGED


def learn_context(context_fn: Any, verdict: str | None) -> None:
    """Remember what ``context_fn`` was judged (``checkpoint_calls.why_not_traceable``)."""
    run.context_verdicts[id(context_fn)] = (context_fn, verdict)


def _span(code: Any) -> tuple[str, int, int] | None:
    lines = [line for _, _, line in code.co_lines() if line is not None] if hasattr(code, "co_lines") else []
    return (os.path.abspath(code.co_filename), min(lines), max(lines)) if lines else None


def locate(target: nn.Module, breaks: list[Break]) -> dict[int, str]:
    """Modules of ``target`` (by id) whose own forward holds a break, with a reason naming file:line.

    For each break, the innermost of its user frames (``sources.break_frames``)
    inside a module's forward wins. Several instances of one class all match
    (they run the same code).
    """
    spans = [  # wrappers' forwards are torch's
        (span, m)
        for m in target.modules()
        if (span := _span(forward_code(m))) is not None and not sources.torch_file(span[0])
    ]
    found: dict[int, str] = {}
    for brk in breaks:
        for frame in sources.break_frames(brk):
            filename = os.path.abspath(frame.filename)
            hits = [m for (f, first, last), m in spans if f == filename and first <= frame.lineno <= last]
            if not hits:
                continue
            where = f"{os.path.basename(filename)}:{frame.lineno}"
            for module in hits:
                found.setdefault(id(module), f"graph break in its forward at {where} ({brk.reason})")
            break
    return found


def forward_code(module: nn.Module) -> Any:
    """The code object of ``module``'s user forward (what identical blocks share), or None."""
    forward = boundaries.user_forward(module)
    return getattr(getattr(forward, "__func__", forward), "__code__", None)


# Why ``auto`` plans selective AC with hoist from the start on a torch whose SAC policy
# never sees an op's output: the first-call measure could not compare, and would only
# compile the pieces to re-plan every block with hoist after them.
UNMEASURABLE = (
    "this torch's selective-AC policy is not shown the op's output (no op_output, as on torch 2.11), "
    "so what pieces hold cannot be compared with eager selective AC"
)

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
        """This rank's measure says hoist: pieces ran eager, or may hold more than eager SAC would.

        Where eager SAC's figure cannot be told, pieces cannot be shown to hold no
        more, and hoist holds at most eager SAC's: on torch 2.11, whose policy
        context has no ``op_output``, pieces held 1.10x eager SAC's activations on
        an H200 (``benchmarks/results/gpu/h200_torch211.md``).
        """
        if self.failed:
            return True
        return self.held is not None and (self.eager_sac is None or self.held > self.eager_sac * TOLERANCE)

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
            return (
                f"pieces hold {size_text(self.held)} for backward, eager selective AC's could not be told "
                "(a policy context without op_output, as on torch 2.11, or a context_fn not torch's SAC)"
            )
        return (
            f"pieces hold {size_text(self.held)} for backward, eager selective AC "
            f"{size_text(self.eager_sac)} (its input and its policy's saves)"
        )


def kind(wrapper: Any) -> tuple | None:
    """The kind a memory verdict is kept for: ``wrapper``'s block's ``BlockKind``, less its dtypes."""
    inner = _compat.modules.children_of(wrapper).get(_compat.modules.CHECKPOINT_WRAPPED)
    return None if inner is None else kinds.block_kind(inner, _compat.modules.checkpoint_fn(wrapper)).memory()
