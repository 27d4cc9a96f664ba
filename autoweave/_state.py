"""What autoweave learns and records while a process runs, in one place, with one reset.

Installed things (patches, import hooks, log handlers, dynamo callbacks) belong
to whoever installs them and are undone by uninstalling. Everything else a run
accumulates lives on ``run``: the tree-change counter, warnings already given,
graph breaks learned, shared compiled regions, recorded plans, the labels the report
counts plain compiles under, the structured trace's regions and the live
dispatchers. ``reset()`` forgets it all (tests, and
a process that wants to start over), in place, so modules holding ``run`` keep
seeing the current state.
"""

from __future__ import annotations

import weakref
from typing import Any


class RunState:
    def __init__(self, generation: int = 0) -> None:
        # Bumped whenever a module tree may have changed (see ``planning/boundaries``);
        # dispatchers re-read their tree only when it moved.
        self.generation = generation
        # planning/boundaries: every module a dispatcher's tree walk read; only registrations
        # into these move the counter (a slice's fresh ModuleList is not one).
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()
        # _failopen: the one internal-error warning, and the per-key warnings given.
        self.warned_keys: set[str] = set()  # fail-open warnings already written (once per key)
        self.swallowed: dict[str, int] = {}  # slug -> how many failures of autoweave's own failed open
        # What the run learned, written and read only by planning/learned (its ``Learned`` value):
        # forward code object -> why it breaks (what one block taught the others);
        self.learned_breaks: dict[Any, str] = {}
        # dispatch/first_call: autoweave reset dynamo's cache of some code (a fallback learned),
        # whose entries plain torch would still hold (``fail_on_recompile`` must not meet it).
        self.codes_reset = False
        # kind of block -> what its pieces were measured to hold against eager SAC;
        self.learned_memory: dict[tuple, Any] = {}
        # id(context_fn) -> (context_fn, why a traced checkpoint cannot take it, or None).
        self.context_verdicts: dict[int, tuple[Any, str | None]] = {}
        # weave: region key -> its label, compile kwargs and RegionBackend (None: compiled as
        # asked), and its compiled function; identical blocks share both.
        self.region_backends: dict[tuple, tuple[str, dict[str, Any], Any]] = {}
        self.shared_regions: dict[tuple, Any] = {}
        # pieces: region label -> what its compile had to do differently (a piece left
        # unchecked, say), for the plan log and the report.
        self.region_notes: dict[str, list[str]] = {}
        # weave/pieces (RegionBackend): region label -> (graphs compiled, graphs run eager) its backend was
        # handed; a label is here from its backend's making (the plan summary says what ran).
        self.region_graphs: dict[str, tuple[int, int]] = {}
        # observe/summary: id(dispatcher) -> its latest plan entry; not yet summarised; a summary waiting.
        self.plans: dict[int, Any] = {}
        self.unsummarised: list[int] = []
        self.summary_pending = False
        self.summarised: dict[int, Any] = {}  # id(dispatcher) -> the entry the last summary showed
        # first_call_memory: the pieces blocks' measures (``FirstCall``); the summary waits for them.
        self.measuring: weakref.WeakSet[Any] = weakref.WeakSet()
        # observe/summary: each model (root module) a plan was found in -> (its class, index among that class's).
        self.models: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()
        # observe/trace: region label -> what its structured-trace artifact says.
        self.trace_regions: dict[str, dict[str, Any]] = {}
        # report: the label each plain compile autoweave routed is counted under.
        self.plain_labels: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.plain_count = 0
        # dispatch/dispatchers: every dispatcher alive, told to re-plan when another learns a break.
        self.live: weakref.WeakSet[Any] = weakref.WeakSet()

    def note_region(self, label: str, text: str) -> None:
        """Add ``text`` to what region ``label``'s compile had to do differently, once."""
        notes = self.region_notes.setdefault(label, [])
        if text not in notes:
            notes.append(text)


run = RunState()


def reset() -> None:
    """Forget everything the process learned and recorded; installed patches stay.

    The tree-change counter moves on rather than back, so every dispatcher
    re-reads its tree at its next call.
    """
    run.__init__(generation=run.generation + 1)  # type: ignore[misc]
