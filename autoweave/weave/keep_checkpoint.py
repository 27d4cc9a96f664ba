"""The user's checkpoint, kept: past dynamo's recompile limit, and in torch 2.15's decorator form.

**At the recompile limit** (``AtRecompileLimit``, ``PiecesBlock``): a block woven as ``pieces``
keeps the user's checkpoint.

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

**The decorator form** (``make_traceable``): torch 2.15 lets ``checkpoint`` decorate a function (``@checkpoint(use_reentrant=False)`` on a
method, ``checkpoint(**options)(fn)``): the result is a ``_CheckpointedFunction``. dynamo does
not turn it into its checkpoint operator: it skips torch's checkpoint code and compiles the
decorated function as a frame of its own, so in backward the recompute calls that function
outside the compile, eagerly, and non-reentrant checkpoint finds other saved tensors than the
forward's: ``CheckpointError`` in the first backward (measured: torch 2.15.0, aot_eager, with
and without a graph break inside).

A module compiled through autoweave whose ``forward`` is such a function gets an instance
``forward`` that makes the same call in the form dynamo traces, ``checkpoint(forward, *args,
**options)`` with the decorator's options, so it is planned and compiled as any block that
checkpoints in its forward (a break inside is woven around). Only the instance attribute
changes, through ``_instances`` (a pickle or copy sheds it): the class, parameters and
``state_dict`` are untouched, and a pickle or copy gets the decorated forward back.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autoweave import _compat, _instances, _taps
from autoweave._compat.log_strings import RecompileLimit
from autoweave._failopen import warn_each
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
    labels: Callable[[], frozenset[str]]
    kept: bool = False  # switched back to its checkpoint


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
        hit_blocks = [b for b in self.blocks if not b.kept and any(hit.in_function(lb) for lb in b.labels())]
        for block in hit_blocks:
            block.kept = True
            self._keep(block)
            for label in block.labels():
                run.note_region(label, KEPT_NOTE)
            # Said for what happened to this block: its strategy, and where its checkpoint went.
            warn_each(
                f"recompile-limit:kept:{min(block.labels(), default='')}",
                f"[recompile-limit] {type(block.wrapper).__name__} (woven as pieces, its checkpoint in its "
                f"graphs) {KEPT_NOTE}",
            )
        if hit_blocks and self.on_kept is not None:
            self.on_kept()

    def _keep(self, block: PiecesBlock) -> None:
        under = {id(m) for m in block.wrapper.modules()}
        # id(module) -> (module, what the plan replaced first): read backwards, the earliest record wins.
        first = {id(m): (m, previous) for m, previous in reversed(self.changes) if id(m) in under}
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


def decorated_forward(module: nn.Module) -> Any:
    """The ``_CheckpointedFunction`` that is ``module``'s forward (instance or class), or None."""
    cls = _compat.checkpoints.checkpointed_function_class()
    if cls is None:
        return None
    found = module.__dict__.get("forward")
    if found is None:
        found = next((c.__dict__["forward"] for c in type(module).__mro__ if "forward" in c.__dict__), None)
    return found if isinstance(found, cls) else None


def _call_form(module: nn.Module, decorated: Any, options: dict[str, Any]) -> Any:
    """``module``'s decorated forward as the call ``checkpoint(forward, *args, **options)``."""
    function = decorated.function
    if getattr(function, "__self__", None) is None:
        function = functools.partial(function, module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Keyword arguments are bound here: they must not be read as checkpoint's own options.
        return checkpoint(functools.partial(function, **kwargs) if kwargs else function, *args, **options)

    return forward


def make_traceable(root: nn.Module) -> int:
    """Give every module under ``root`` whose forward is a decorated checkpoint the call form.

    Only non-reentrant checkpoints (the decorator's own reentrant path takes no keyword
    arguments and is left as written). The call form is a stand-in for the user's
    forward (``_instances.install_stand_in``): a module pickled or copied afterwards
    carries its decorated forward, as in plain torch, and loads without autoweave.
    Returns how many modules changed; idempotent.
    """
    changed = 0
    for module in root.modules():
        if _instances.stands_in(module.__dict__.get("forward")):
            continue  # already in the call form
        decorated = decorated_forward(module)
        if decorated is None or decorated.checkpoint_kwargs.get("use_reentrant") is not False:
            continue
        _instances.install_stand_in(
            module, _call_form(module, decorated, _options(decorated.checkpoint_kwargs))
        )
        changed += 1
        logger.debug(
            "%s: forward decorated with checkpoint(...) is called as checkpoint(forward, ...) "
            "so the compile traces the checkpoint",
            type(module).__name__,
        )
    return changed


def _options(given: dict[str, Any]) -> dict[str, Any]:
    """The decorator's options that differ from ``checkpoint``'s defaults.

    dynamo's checkpoint operator rejects some defaults passed explicitly
    (``context_fn=noop_context_fn``: "checkpoint not implemented for ... context_fn").
    """
    import inspect

    defaults = {
        name: p.default
        for name, p in inspect.signature(inspect.unwrap(checkpoint)).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {k: v for k, v in given.items() if k == "use_reentrant" or defaults.get(k, _UNSET) is not v}


_UNSET = object()
