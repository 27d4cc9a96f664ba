"""Where a woven block's activation checkpointing (AC) goes: the strategies, and the one resolver.

A user asks for ``auto``, ``hoist`` or ``pieces`` (``AUTOWEAVE_STRATEGY``,
``set_mode(block, strategy=...)``). What runs is decided once per AC wrapper, by
``resolve`` (a wrapper inside the compile) or ``resolve_outer`` (a wrapper around
an in-place compile): pure functions of the wrapper's ``CheckpointSpec``, where it
sits, what was asked and what the run learned, each returning the strategy with
the reason a plan shows. The planner's walk then lays out the strategy's
decisions; ``weave.apply`` carries out each action; ``observe.summary`` shows each
action by the ``verb`` here.

- ``hoist``: the wrapper stays eager around a compile of its inner block that
  dynamo splits at the breaks; everything but the breaks compiles, the recompute too.
- ``pieces``: the wrapper stops checkpointing; the inner block compiles and splits
  at its breaks, and each compiled piece is ``checkpoint(piece, same options)``, so
  a selective policy sees the ops it was written for.
- ``children one by one`` (never asked for): the wrapper stays eager around its
  inner block's children, each compiled on its own. Where the AC can neither move
  into the graphs nor sit around one compile: nested AC, reentrant AC under
  ``pieces``, and the dispatcher's last resort after a fallback it could not locate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoweave.planning.plans import Action, CheckpointSpec


@dataclass(frozen=True)
class Strategy:
    name: str  # as the plan shows it
    action: Action  # the decision an AC wrapper planned with it gets
    verb: str  # the plan summary's short word for that action
    does: str  # what becomes of the wrapper's AC (the decision's reason)


HOIST = Strategy("hoist", Action.HOIST, "AC eager", "stays eager around a compile of the inner block")
PIECES = Strategy(
    "pieces", Action.PIECES, "AC in each compiled piece", "moved into each compiled piece below"
)
CHILDREN_ONE_BY_ONE = Strategy(
    "children-one-by-one",
    Action.CHILDREN_ONE_BY_ONE,
    "AC eager around children",
    "stays eager around compiled children",
)

VERBS = {s.action: s.verb for s in (HOIST, PIECES, CHILDREN_ONE_BY_ONE)}


@dataclass(frozen=True)
class Resolved:
    strategy: Strategy
    why: str = ""  # why, when it is not what was asked (nor auto's choice for this kind of AC)

    def reason(self, spec: CheckpointSpec) -> str:
        """``selective AC moved into each compiled piece below``, with the why in parentheses."""
        return f"{spec.describe()} {self.strategy.does}" + (f" ({self.why})" if self.why else "")


def _unknown() -> str | None:
    return None


def resolve(
    spec: CheckpointSpec,
    *,
    asked: str,
    nested: bool = False,
    children_one_by_one: bool = False,
    measured: str | None = None,
    untraceable: Callable[[], str | None] = _unknown,
) -> Resolved:
    """The strategy for an AC wrapper inside the compile.

    ``nested``: it sits inside an AC already moved into compiled pieces.
    ``children_one_by_one``: the dispatcher's last resort (not a user's choice).
    ``measured``: its pieces were measured holding more than eager selective AC
    would, and why (``memory``). ``untraceable``: why its ``context_fn`` cannot run
    inside a compiled graph (``traced_contexts``), or None; called only where the
    answer matters, since the first call probes the user's ``context_fn``s.
    """
    if children_one_by_one:
        return Resolved(
            CHILDREN_ONE_BY_ONE, "re-planned after dynamo fell back in code autoweave cannot read"
        )
    if nested:
        # Moving it into the pieces of the AC around it would checkpoint twice; one
        # compile under it would hold the breaks the AC around it was moved to avoid.
        return Resolved(CHILDREN_ONE_BY_ONE, "nested inside an AC moved into the pieces: kept as written")
    if asked == "hoist":
        return Resolved(HOIST)
    if not spec.known:
        # Pieces are torch's own checkpoint; only eager AC runs a custom checkpoint_fn as written.
        return Resolved(
            HOIST, "a custom checkpoint_fn: eager AC calls it as written, around a compile that splits"
        )
    if asked == "auto" and not spec.selective:
        # Full AC: eager AC around a compile that splits captures everything and
        # recomputes compiled; it has no policy that must see individual ops.
        return Resolved(HOIST)
    why_not_traced = untraceable()
    if why_not_traced is not None:
        return Resolved(HOIST, f"{why_not_traced}: eager AC calls it as the wrapper does")
    if asked == "auto" and measured is not None:
        return Resolved(
            HOIST,
            f"measured: {measured}; eager AC around the compile holds at most eager SAC's; "
            "strategy='pieces' keeps the pieces",
        )
    if spec.reentrant:
        return Resolved(CHILDREN_ONE_BY_ONE, "reentrant AC cannot be traced into the pieces")
    # A selective policy must see the ops it was written for (an eager one around
    # compiled code sees inductor's kernels), so the checkpoint goes into the graphs.
    return Resolved(PIECES)


def resolve_outer(
    spec: CheckpointSpec, *, asked: str, untraceable: Callable[[], str | None] = _unknown
) -> Resolved:
    """The strategy for an AC wrapper around an in-place compile (``checkpoint_wrapper(torch.compile(b))``).

    ``hoist``: it stays outside, eager, as plain torch runs it (the why names the
    AC, for the plan's reason). ``pieces``: its checkpoint moves into the pieces of
    this plan's regions and the wrapper skips its own.
    """
    if spec.reentrant:
        return Resolved(HOIST, spec.describe())
    if not spec.known:
        return Resolved(HOIST, f"{spec.describe()}: its checkpoint_fn is called as written")
    why_not_traced = untraceable()
    if why_not_traced is not None:
        return Resolved(HOIST, f"{spec.describe()}: {why_not_traced}")
    if spec.selective:
        # Under hoist too: an eager policy around compiled code would see inductor's kernels.
        return Resolved(PIECES, "" if asked != "hoist" else "an eager policy would see inductor's kernels")
    if asked == "pieces":
        return Resolved(PIECES)
    return Resolved(HOIST, spec.describe())
