"""A dispatcher's life: its states, why it moves, and the moves it may make, in one place.

``dispatchers._Dispatcher._enter`` is the only writer of a dispatcher's state
and checks every move against ``_TRANSITIONS``; a move not in the table is
refused (strict mode raises, otherwise the module runs plain torch.compile).
The table holds exactly the moves the dispatcher's code makes.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    """Where a dispatcher is in its life; ``_Dispatcher.state`` holds one, ``_TRANSITIONS`` the moves."""

    UNPLANNED = "unplanned"  # attached to a compiled module; its first forward decides
    PLAIN = "plain"  # runs what plain torch.compile would (the plan weaves nothing, or it was given up)
    WATCHING = "watching"  # plain, and the next call is watched for dynamo's silent AC fallback
    LEARNED = "learned"  # a fallback taught where a block breaks: the new plan applies at the next call
    # Woven; the next call is the regions' first, which compiles them (it runs once, whatever fails).
    TRIAL = "trial"
    WOVEN = "woven"  # woven and compiled: every call runs the installed regions
    GIVEN_UP = "given-up"  # fullgraph=True met a break outside the boundaries: plain torch (which raises)


class Why(enum.Enum):
    """Each way a dispatcher plans again or falls back, named (the debug log and ``history`` say which)."""

    PLANNED = "planned at the first call"
    TREE_CHANGED = "the module tree under the target changed: planned again"
    OFF = "autoweave was turned off before the plan was applied: plain torch.compile"
    FAILED = "planning or applying a plan failed (autoweave's own error): plain torch.compile"
    WATCHED = "the watched first call ran: plain from now on unless dynamo fell back"
    FELL_BACK = "dynamo ran a checkpointed region eager: re-planned around the break, applied next call"
    APPLIED = "the plan learned from a fallback is applied"
    COMPILED = "the woven regions ran their first call"
    FULLGRAPH_BREAK = "fullgraph=True and a graph break outside the boundaries: plain torch.compile"
    RELEASED = "compiled again in place: the newer dispatcher takes over"
    STEADY_STATE = "dynamo still converted frames at every call after warm-up: plain torch.compile"
    REFUSED = "a move the state machine forbids was refused (autoweave's own error): plain torch.compile"


# The moves a dispatcher makes, in one place, and no others (``_enter`` refuses
# the rest). Planning (``_decide``: the first call, a changed tree) and
# ``retire`` start from any state and land on PLAIN or TRIAL; a plan that
# fails after it was entered lands on PLAIN, whatever it entered.
_PLANNED = frozenset({State.PLAIN, State.TRIAL})
_TRANSITIONS: dict[State, frozenset[State]] = {
    State.UNPLANNED: _PLANNED,
    # WATCHING: a plain plan that traces a checkpoint; LEARNED: the watched call (now PLAIN) fell back.
    State.PLAIN: _PLANNED | {State.WATCHING, State.LEARNED},
    State.WATCHING: _PLANNED,  # PLAIN: the watched call begins
    State.LEARNED: _PLANNED | {State.GIVEN_UP},  # the learned plan applied (or not); GIVEN_UP: see TRIAL
    # WOVEN: the first call ran; LEARNED: it fell back; GIVEN_UP: fullgraph=True met a break
    # outside the boundaries (after a fallback in the same call too: from LEARNED).
    State.TRIAL: _PLANNED | {State.WOVEN, State.LEARNED, State.GIVEN_UP},
    State.WOVEN: _PLANNED,
    State.GIVEN_UP: _PLANNED,
}
# States that run installed regions: entered only with regions installed.
_RUNS_REGIONS = frozenset({State.TRIAL, State.WOVEN})
