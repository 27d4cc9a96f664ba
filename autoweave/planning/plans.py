"""What a plan says, and where a woven block's activation checkpointing (AC) goes.

The data: the actions, the AC a wrapper applies, one decision per module, the
plan. ``planner`` builds these, ``weave.apply_plan`` carries them out, and
``observe`` shows them.

The strategies, and the one resolver. A user asks for ``auto``, ``hoist`` or
``pieces`` (``AUTOWEAVE_STRATEGY``, ``set_mode(block, strategy=...)``). What
runs is decided once per AC wrapper, by ``resolve`` (a wrapper inside the
compile) or ``resolve_outer`` (a wrapper around an in-place compile): pure
functions of the wrapper's ``CheckpointSpec``, where it sits, what was asked and
what the run learned, each returning the strategy with the reason a plan shows.
The planner's walk then lays out the strategy's decisions; ``weave.apply``
carries out each action; ``observe.summary`` shows each action by the ``verb``
here.

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

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class Action(str, enum.Enum):
    PLAIN = "plain"  # the root compiles exactly as plain torch.compile would
    COMPILE = "compile"  # compiled whole as one region; no boundary inside
    SPLIT = "split"  # compiled as one region that dynamo splits at the boundaries inside
    WEAVE = "weave"  # own forward eager; children planned one by one
    BOUNDARY = "boundary"  # hooks stay eager; the inner forward is planned on its own
    HOIST = "hoist"  # AC wrapper stays eager around a compile of its inner module (which may split)
    PIECES = "pieces"  # AC wrapper stops checkpointing; each compiled piece below (between breaks) checkpoints itself
    # AC wrapper stays eager around its inner module's children, compiled one by one: not a
    # strategy a user picks, the planner's answer where the AC cannot move (see ``resolve``).
    CHILDREN_ONE_BY_ONE = "children-one-by-one"
    EAGER = "eager"  # left alone


@dataclass(frozen=True)
class CheckpointSpec:
    """The activation checkpointing a CheckpointWrapper applies, as the user configured it."""

    selective: bool
    reentrant: bool
    options: tuple[tuple[str, str], ...]  # printable keyword options
    known: bool = True  # torch.utils.checkpoint underneath (else a user checkpoint_fn)
    checkpoint_fn: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        kind = "selective AC" if self.selective else "full AC" if self.known else "custom AC"
        if self.reentrant:
            kind += " (reentrant)"
        return kind


@dataclass(frozen=True)
class Decision:
    path: str  # submodule path relative to the compile target ("" is the target)
    module_type: str
    action: Action
    reason: str
    region: bool = False  # this module's forward is compiled on its own
    opaque: bool = False  # kept out of the enclosing region's trace (a deliberate break)
    checkpoint: CheckpointSpec | None = None  # the AC moved into this region's pieces
    # The region is compiled without a traced checkpoint; each graph dynamo cuts it
    # into (between breaks) is checkpointed on its own (``pieces``), glue included.
    pieces: bool = False
    splits: bool = False  # dynamo may cut this region at the boundaries (or breaks) inside
    # Its only breaks are its units' hooks, and dynamo resumes each inside the unit's call (nested
    # graph breaks): the units' forwards are traced in this region, no region of their own.
    nested: bool = False
    ac: CheckpointSpec | None = None  # the AC this wrapper had (HOIST / PIECES / CHILDREN_ONE_BY_ONE)
    # ``auto`` chose pieces for this AC wrapper's kind before any block of it was measured: its
    # first call with grad measures what the pieces hold against eager selective AC.
    measure: bool = False


@dataclass(frozen=True)
class Plan:
    root_type: str
    woven: bool
    mode: str
    # The strategy that runs (``resolve``'s answer, ``hoist+pieces`` when the
    # plan's checkpointed blocks differ); what was asked when no checkpoint was placed.
    strategy: str
    fullgraph: bool
    decisions: tuple[Decision, ...]
    boundaries: tuple[tuple[str, str], ...]  # (path, reason)
    # checkpoint_wrapper(torch.compile(block)) under selective AC: the enclosing
    # wrapper's checkpoint, moved into this plan's regions (the wrapper stops checkpointing).
    outer_push_down: CheckpointSpec | None = None
    # Where each boundary sits in the user's source (path -> sources.Source), for messages.
    sources: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    asked: str = field(kw_only=True)  # the strategy asked for (auto, hoist, pieces)

    def source(self, path: str) -> Any:
        """The boundary at ``path``'s place in the user's source (``sources.Source``), or None."""
        return dict(self.sources).get(path)

    def regions(self) -> list[Decision]:
        return [d for d in self.decisions if d.region]

    def decision(self, path: str) -> Decision | None:
        return next((d for d in self.decisions if d.path == path), None)

    @classmethod
    def plain(
        cls, root: str, mode: str, asked: str, fullgraph: bool, found: tuple, reason: str, places: tuple = ()
    ) -> Plan:
        """A plan that compiles the root (of type ``root``) as plain torch.compile would, saying why."""
        decision = Decision("", root, Action.PLAIN, reason)
        return cls(root, False, mode, asked, fullgraph, (decision,), found, sources=places, asked=asked)

    def plain_instead(self, reason: str) -> Plan:
        """This plan given up for plain torch.compile (the weave failed), saying why."""
        return Plan.plain(self.root_type, self.mode, self.asked, self.fullgraph, self.boundaries, reason)

    def shown_strategy(self) -> str:
        """``pieces`` when that was asked and runs; ``auto -> pieces`` when it was resolved from another."""
        return self.strategy if self.strategy == self.asked else f"{self.asked} -> {self.strategy}"

    def headline(self) -> str:
        """One line: why plain, or how many regions (and under which mode and strategy)."""
        if not self.woven:
            return self.decisions[0].reason
        return (
            f"woven into {len(self.regions())} compiled regions "
            f"(mode={self.mode}, strategy={self.shown_strategy()})"
        )


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
    measure: bool = False  # pieces chosen by auto, not measured yet: measure the first call

    def reason(self, spec: CheckpointSpec) -> str:
        """``selective AC moved into each compiled piece below``, with the why in parentheses."""
        return f"{spec.describe()} {self.strategy.does}" + (f" ({self.why})" if self.why else "")


def resolve(
    spec: CheckpointSpec,
    *,
    asked: str,
    nested: bool = False,
    children_one_by_one: bool = False,
    shape: str | None = None,
    measured: str | None = None,
    unmeasurable: str | None = None,
    untraceable: Callable[[], str | None] = lambda: None,
) -> Resolved:
    """The strategy for an AC wrapper inside the compile: every rule, whatever was asked.

    ``nested``: it sits inside an AC already moved into compiled pieces.
    ``children_one_by_one``: the dispatcher's last resort (not a user's choice).
    ``shape``: why the wrapped block cannot be compiled as one region that dynamo
    splits (its forward loops over blocks holding boundaries, or calls
    checkpoint), or None. ``measured``: None when its pieces were never measured;
    else why they held more than eager selective AC would (``learned.Verdict``), or ""
    when they did not. ``unmeasurable``: why no pieces can be measured on this
    torch (``auto`` then plans hoist without trying them), or None. ``untraceable``: why its ``context_fn`` cannot run
    inside a compiled graph (``checkpoint_calls``), or None; called only where the
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
    if shape is not None:
        # dynamo cannot resume such a forward after a break: compiled whole, it would run
        # eager; its own forward stays eager, under the AC as written, around compiled
        # children (under pieces, that glue would run eager and unchecked).
        return Resolved(CHILDREN_ONE_BY_ONE, shape)
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
    if asked == "auto" and (measured or (unmeasurable and measured is None)):
        why = f"measured: {measured}" if measured else unmeasurable
        return Resolved(
            HOIST,
            f"{why}; eager AC around the compile holds at most eager SAC's; strategy='pieces' keeps the pieces",
        )
    if spec.reentrant:
        return Resolved(CHILDREN_ONE_BY_ONE, "reentrant AC cannot be traced into the pieces")
    # A selective policy must see the ops it was written for (an eager one around
    # compiled code sees inductor's kernels), so the checkpoint goes into the graphs.
    return Resolved(PIECES, measure=asked == "auto" and measured is None)


def resolve_outer(
    spec: CheckpointSpec, *, asked: str, untraceable: Callable[[], str | None] = lambda: None
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
