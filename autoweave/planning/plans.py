"""What a plan says: the actions, the AC a wrapper applies, one decision per module, the plan.

Data only: ``planner`` builds these, ``weave.apply_plan`` carries them out, and
``observe`` shows them.
"""

from __future__ import annotations

import enum
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
    # strategy a user picks, the planner's answer where the AC cannot move (see ``strategies``).
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
    ac: CheckpointSpec | None = None  # the AC this wrapper had (HOIST / PIECES / CHILDREN_ONE_BY_ONE)


@dataclass(frozen=True)
class Plan:
    root_type: str
    woven: bool
    mode: str
    # The strategy that runs (``strategies.resolve``'s answer, ``hoist+pieces`` when the
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
        for d in self.decisions:
            if d.path == path:
                return d
        return None

    def plain_instead(self, reason: str) -> Plan:
        """This plan given up for plain torch.compile (the weave failed), saying why."""
        decision = Decision("", self.root_type, Action.PLAIN, reason)
        return Plan(
            self.root_type,
            False,
            self.mode,
            self.asked,
            self.fullgraph,
            (decision,),
            self.boundaries,
            asked=self.asked,
        )

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
