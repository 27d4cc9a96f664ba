"""The planner's inputs, assembled in one place for whoever asks: a dispatcher, ``autoweave.plan()``, explain.

A plan depends on more than the module: how it was compiled (``fullgraph``,
whether ``torch.compile`` traces its ``__call__``), the AC wrapper around an
in-place compile, the mode and strategy (arguments, then ``set_mode``, then the
settings), what a fallback taught its dispatcher, and what the run learned
(``planning/learned``). A ``Request`` holds what belongs to one compile (its
dispatcher makes it; ``request_of`` finds it); ``plan`` adds the mode, the
strategy and what the run learned, the same way for every caller, so
``autoweave.plan(model)`` after a run is the plan its dispatcher runs.

The side effects planning needs happen here, not in ``planning/``: the boundary
plug-ins are loaded (once, before the first plan) and the checkpoints'
``context_fn``s are probed (lazily, at the planner's first lookup).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch.nn as nn

from autoweave import _instances, _settings
from autoweave._failopen import swallowed
from autoweave._log import logger
from autoweave.dispatch import context_probe
from autoweave.planning import boundaries, planner
from autoweave.planning.learned import Learned


@dataclass(frozen=True)
class Request:
    """What a compile of ``module`` asks for, besides what the run learned.

    ``outer``: the AC wrapper around an in-place compiled block
    (``checkpoint_wrapper(torch.compile(block))``), if any. ``taught``: what a
    fallback taught this target's dispatcher: its own ``breaks`` (ids -> why),
    a forced ``mode``, and ``children_one_by_one`` (the last resort when a
    learned plan would not weave).
    """

    module: nn.Module
    fullgraph: bool = False
    outer: nn.Module | None = None
    call_traced: bool = True  # torch.compile(module) traces __call__; in-place compile does not
    taught: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def request_of(module: nn.Module, *, fullgraph: bool | None = None) -> Request:
    """The request behind ``module``: its dispatcher's when it was compiled, else ``torch.compile(module)``'s.

    ``fullgraph`` None: as compiled (False for a module not compiled).
    """
    dispatcher = _instances.dispatcher_of(module)
    if dispatcher is None:
        return Request(module, fullgraph=bool(fullgraph))
    request = dispatcher.request()
    return request if fullgraph is None else dataclasses.replace(request, fullgraph=fullgraph)


def plan(request: Request, *, mode: str | None = None, strategy: str | None = None) -> planner.Plan:
    """The plan for ``request`` now; ``mode`` / ``strategy`` win over what was taught, set or configured."""
    load_boundary_plugins()
    taught = request.taught
    mode, strategy = _settings.mode_and_strategy(
        request.module, mode or taught.get("mode"), strategy or taught.get("strategy")
    )
    outer = request.outer
    learned = Learned.for_target(
        request.module,
        breaks=taught.get("breaks"),
        untraceable=context_probe.Lazily(request.module, outer, strategy=strategy, mode=mode),
    )
    return planner.plan(
        request.module,
        mode=mode,
        strategy=strategy,
        fullgraph=request.fullgraph,
        outer_ac=planner.checkpoint_spec(outer) if outer is not None else None,
        call_traced=request.call_traced,
        learned=learned,
        children_one_by_one=bool(taught.get("children_one_by_one")),
    )


# -- boundary plug-ins ---------------------------------------------------------------------

_plugins_loaded = False


def load_boundary_plugins() -> None:
    """Register the boundary kinds third-party packages declare (entry points), once per process.

    At the first plan, not at start-up: start-up never pays for the metadata
    scan. What it registers is autoweave's own list of classifiers (nothing on
    torch or logging), so it stays for the process, like a ``register_boundary``.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        # The standard library's reader (3.10+ selects by group): importing the
        # importlib_metadata backport would put its finder on sys.meta_path for good.
        import importlib.metadata

        found = importlib.metadata.entry_points(group=boundaries.ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - metadata is best effort
        logger.debug("could not read entry points %s", boundaries.ENTRY_POINT_GROUP, exc_info=True)
        return
    for entry_point in found:
        try:
            boundaries.register_boundary(entry_point.load(), name=f"{entry_point.name} (plug-in)")
        except Exception as exc:
            swallowed(
                "boundary-plugin",
                f"plugin:{entry_point.name}",
                f"the boundary plug-in {entry_point.name!r} ({entry_point.value}) failed to load: "
                f"{type(exc).__name__}: {exc}; planning goes on without it",
                exc,
            )
