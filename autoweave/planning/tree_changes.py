"""One number that changes whenever a compiled module's plan might: the tree-change signal.

A plan depends on the module tree under the compile target (which children,
which of them are FSDP units, what the user marked) and on what the run
learned. Re-reading the tree at every forward costs time proportional to the
number of submodules; instead each dispatcher remembers the generation it
planned at and re-reads the tree only after the generation moved.

This module only keeps the counter (on ``_state.run``). What moves it:
``dispatch/tree_watch`` (a submodule registered into a watched module, a hook
registered on one or removed, ``fully_shard`` running), autoweave's own marks (``boundary``, ``set_mode``,
``register_boundary``) and what a run learns (``planning/learned``). A spurious
bump costs one tree walk per compiled module; a missed one would keep a stale
plan, so every source bumps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autoweave._state import run


def bump() -> None:
    """Something a plan depends on may have changed."""
    run.generation += 1


def watch(modules: Iterable[Any]) -> None:
    """A tree walk read ``modules``: a registration into any of them from now on bumps."""
    run.watched.update(modules)
