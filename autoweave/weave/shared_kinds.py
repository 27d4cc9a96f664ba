"""One compiled region per kind of identical blocks, split only where dynamo specializes.

Identical blocks (same code, structure, shapes, hooks and checkpoint: ``apply``'s
region key) share one compiled region, so compile cost stays flat in depth.
What the key cannot see is a number on a block that dynamo guards on:
transformers' decoder layers read ``self.layer_idx`` to pick their cache slot
when a cache is passed (``use_cache=True``), and dynamo then specializes each
layer's graphs on it (guards ``layer_idx == 0``, ``cache.layers[0]...``). Stacked
in one shared cache those graphs run past dynamo's recompile limit (8), after
which the recompute of a compiled forward runs eager and the checkpoint fails.
Without a cache the same forward never reads ``layer_idx``, dynamo does not
guard on it, and one region serves every layer.

So the split is decided on dynamo's evidence, not on what the bytecode mentions:
after each compile of the kind, the guards of its cache entries (and of the
resume functions it broke into) are read (``_compat.backends.guarded_attributes``); a
public number or flag of the block's modules that dynamo guards on becomes part
of the kind's key, and each value gets a region of its own (its own code
object, so its own cache and recompile limit). Blocks move at the next compile of
the kind; the region that already ran keeps the block it was compiled for.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from autoweave import _compat, _log

# Per-module values dynamo can specialize on (a guard ``self.layer_idx == 3``).
_CONSTANT_TYPES = (bool, int, float, str, type(None))

# (the compiled region, the function it compiles, its RegionBackend or None, its label)
Region = tuple[Callable[..., Any], Callable[..., Any], Any, str]
Build = Callable[[tuple], Region]  # build(split) -> the region of the blocks whose guarded numbers are split


def constants_of(module: nn.Module) -> tuple[tuple[str, str, Any], ...]:
    """(submodule path, attribute, value) of every public number, string or flag on ``module``'s modules."""
    return tuple(
        (path, name, value)
        for path, sub in module.named_modules()
        for name, value in sorted(vars(sub).items())
        if not name.startswith("_") and type(value) in _CONSTANT_TYPES
    )


# install(block, forward, label): holds nothing of the block, which the kind must not keep alive.
Install = Callable[[nn.Module, Callable[..., Any], str], None]


class KindRegion:
    """The regions of one kind of block, and which block runs on which.

    Each block's forward is ``partial(region, block)`` on a compiled region, so a
    call costs what it did with one region per kind; blocks are moved to a region
    of their own split when the evidence comes (read whenever the kind's backend
    is handed a graph: the guards of every compile before it are built by then).
    """

    def __init__(self, build: Build) -> None:
        self._build = build
        self._split_names: frozenset[str] = frozenset()
        self._all: list[Region] = []  # every region of the kind (the latest last), for their guards
        self._first: tuple | None = None  # constants of the first block (the base region's)
        self._blocks: weakref.WeakKeyDictionary[nn.Module, Install] = weakref.WeakKeyDictionary()
        self._placed: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # -> label
        self.base = self._new_region(())
        # The first block runs on the base region: its guards are the evidence a split is read from.
        self._by_split: dict[tuple, Region] = {(): self.base}

    def bind(self, module: nn.Module, install: Install) -> None:
        """Run ``module`` on its region of the kind (``install``), and move it if the kind splits later."""
        if self._first is None:
            self._first = constants_of(module)
        self._blocks[module] = install
        self._place(module, install, moved_only=False)  # a plan applied again installs again

    def _place(self, module: nn.Module, install: Install, *, moved_only: bool) -> None:
        split = self._split(constants_of(module)) if self._split_names else ()
        region = self._by_split.get(split)
        if region is None:
            region = self._by_split[split] = self._new_region(split)
        previous = self._placed.get(module)
        # A block that stays put keeps its forward: dynamo guards on it, a new one recompiles.
        if moved_only and previous == region[3]:
            return
        self._placed[module] = region[3]
        forward = functools.partial(region[0], module)
        if not moved_only or previous is None:
            install(module, forward, region[3])
            return
        # The split is read while a block of the kind compiles: that block (and any other
        # whose forward ran on the old region) still has a checkpoint's recompute to run,
        # which must run the graph its forward ran. So a moved block changes region at its
        # next forward, never in a recompute.
        old = next(r[0] for r in reversed(self._all) if r[3] == previous)
        move = functools.partial(install, module, forward, region[3])
        install(module, _moving(functools.partial(old, module), forward, move), previous)

    def _new_region(self, split: tuple) -> Region:
        region = self._build(split)
        self._all.append(region)
        if region[2] is not None:  # compiled as asked (AOTInductor): no graphs seen, no evidence
            region[2].before_graph.append(self._read_guards)
        return region

    def _read_guards(self) -> None:
        guarded = frozenset().union(*(_compat.backends.guarded_attributes(fn) for _, fn, _, _ in self._all))
        names = self._split_names | (guarded & {name for _, name, _ in self._first or ()})
        if names == self._split_names:
            return
        self._split_names = frozenset(names)
        _log.logger.debug(
            "%s: dynamo guards on %s: blocks of this kind split by their values",
            self.base[3],
            ", ".join(sorted(names)),
        )
        # The base region keeps the block it was compiled for (its guards hold that block's values).
        self._by_split = {self._split(self._first or ()): self.base}
        for module, install in list(self._blocks.items()):
            self._place(module, install, moved_only=True)

    def _split(self, constants: tuple[tuple[str, str, Any], ...]) -> tuple:
        return tuple(c for c in constants if c[1] in self._split_names)


def _moving(old: Callable[..., Any], new: Callable[..., Any], move: Callable[[], None]) -> Callable[..., Any]:
    """A moved block's forward until its next call outside backward: then ``move`` and run ``new``."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if _compat.checkpoints.in_backward():  # the recompute of a forward that ran on the old region
            return old(*args, **kwargs)
        move()
        return new(*args, **kwargs)

    return forward
