"""A block woven as ``pieces`` keeps the user's checkpoint past dynamo's recompile limit.

Under ``pieces`` the block's checkpoint moved into its compiled graphs (each
piece is checkpointed by the region's backend, ``pieces``); the block itself
runs without it. A frame of its regions that reaches dynamo's recompile limit
runs eager from then on (dynamo's own choice, for every call no compiled
version fits): without the checkpoint, that is, holding every activation, more
than plain torch holds, which runs a checkpoint it cannot compile eager under
the checkpoint.

So, told of the limit (dynamo's warning, ``_compat.log_strings.RecompileLimit``,
naming the region's code or a resume function dynamo made of it), every block
with a region on that code is switched back to what plain torch runs: the
user's checkpoint, with its policy and options, around the block's own forward,
eager (its regions' forwards put back as the user wrote them). The graphs
compiled for the block are no longer used; the report measures the next call
again, so its headline counts the GEMMs that now run eager.

The call that hits the limit is not switched: dynamo decides while it converts
that frame and runs it eager at once, before the warning reaches anyone. That
one call holds the activations of that frame (the resume function's part of the
block, when the limit is hit there) without the checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoweave import _compat, _taps
from autoweave._compat.log_strings import RecompileLimit
from autoweave._instances import restore_forward
from autoweave._log import logger
from autoweave._state import run

KEPT_NOTE = (
    "reached dynamo's recompile limit: from the next call the block runs eager under its checkpoint, "
    "with the user's policy, as plain torch runs it (the call that hit the limit ran without it)"
)


@dataclass
class PiecesBlock:
    """An AC wrapper whose checkpoint moved into the pieces of the regions under it."""

    wrapper: Any
    # The labels (code names) of the regions under it, read when a limit is hit: a block
    # moved to a region of its own when its kind split (``shared_kinds``) is found there.
    labels_now: Callable[[], frozenset[str]]
    kept: bool = False  # switched back to its checkpoint

    @property
    def labels(self) -> frozenset[str]:
        return self.labels_now()


@dataclass
class AtRecompileLimit:
    """While a plan is applied: its pieces blocks, switched back to their checkpoint at the limit.

    ``changes`` is the plan's record of (module, forward it replaced), in the order
    installed; ``set_forward`` installs a forward and records it there, so the
    plan's revert undoes the switch too. ``on_kept`` is told after a switch.
    """

    changes: list[tuple[Any, Any]]
    set_forward: Callable[[Any, Callable[..., Any]], None]
    on_kept: Callable[[], None] | None = None
    blocks: list[PiecesBlock] = field(default_factory=list)
    _listening: Any = None

    def start(self) -> None:
        if self.blocks and self._listening is None:
            # dynamo's logger outlives the model, and this holds every module the plan
            # changed: the tap holds it weakly, and hears no more once it is gone.
            on_limit = weakref.WeakMethod(self._on_limit)

            def listener(hit: RecompileLimit) -> None:
                method = on_limit()
                if method is not None:
                    method(hit)

            self._listening = listening = _taps.listening(RecompileLimit, listener).start()
            weakref.finalize(self, listening.stop)  # the model dropped with its plan applied

    def stop(self) -> None:
        listening, self._listening = self._listening, None
        if listening is not None:
            listening.stop()

    def _on_limit(self, hit: RecompileLimit) -> None:
        hit_blocks = [b for b in self.blocks if not b.kept and any(hit.in_function(lb) for lb in b.labels)]
        for block in hit_blocks:
            block.kept = True
            self._keep(block)
            for label in block.labels:
                notes = run.region_notes.setdefault(label, [])
                if KEPT_NOTE not in notes:
                    notes.append(KEPT_NOTE)
            logger.info("%s: %s", type(block.wrapper).__name__, KEPT_NOTE)
        if hit_blocks and self.on_kept is not None:
            self.on_kept()

    def _keep(self, block: PiecesBlock) -> None:
        under = {id(m) for m in block.wrapper.modules()}
        first: dict[int, tuple[Any, Any]] = {}  # id(module) -> (module, what the plan replaced first)
        for module, previous in self.changes:
            if id(module) in under:
                first.setdefault(id(module), (module, previous))
        for module, previous in first.values():
            if module is not block.wrapper:
                # As the user wrote it; the plan's revert puts the same back again.
                restore_forward(module, previous)
        _, previous = first.get(id(block.wrapper), (block.wrapper, None))
        self.set_forward(block.wrapper, _checkpointed(block.wrapper, previous))


def _checkpointed(wrapper: Any, previous: Any) -> Callable[..., Any]:
    """The wrapper's own forward (its checkpoint around the block), never traced by dynamo."""
    original = previous if previous is not None else type(wrapper).forward.__get__(wrapper)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    # Recursive: the block's own code, whose frames are past the limit, runs eager
    # inside. A region compiled elsewhere and called from it still runs compiled.
    return _compat.dynamo.disable(forward, recursive=True)
