"""The one backend a woven region hands dynamo: compile, fail open per graph, pieces, observers.

dynamo calls a region's backend once per graph it traces (a region that breaks
is several graphs). ``RegionBackend`` is that backend, alone between torch's own
``_TorchCompileWrapper`` (which ``torch.compile`` puts around any backend) and
the callable torch would have built from the user's ``backend``/``mode``/
``options``. It owns every reason autoweave has to touch a graph:

- compiling it with the user's backend;
- failing open, graph by graph: a graph the backend fails on runs eager, in the
  same call, the rest stays compiled (torch's ``suppress_errors`` would run the
  whole frame eager instead);
- pieces, when the region's checkpoint moved into it: each graph wrapped in
  torch's checkpoint operator (``pieces.CheckpointPieces``, the helper that
  knows how);
- publishing each graph (``_events.GRAPH_COMPILED``; the report subscribes):
  observing hands dynamo the very same backend, so a run with the report on
  compiles exactly what a run without it does;
- counting the graphs it was handed, compiled or run eager, per region
  (``_state.run.region_graphs``, always: once per graph, never per call), so the
  plan summary says what ran, not only what was planned.

``apply`` builds one backend per region key, so identical blocks share it by
construction, and dynamo (which matches a frame's cached graphs to the current
backend with ``==``) shares their graphs. (The one exception: a region of an
instance-level forward under pieces has one of its own, since its pieces
measure what that region holds.) Backends of different regions compare equal
when they compile alike (the same inner backend, no pieces), as torch's own
wrappers do: a submodule's class ``forward`` that dynamo traces as a frame of
its own after a break (it runs on the class's shared code) is reached from the
regions of every layer, and unequal backends would recompile it per layer up
to the recompile limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave import _compat, _events
from autoweave._failopen import RAN_EAGER, first_line, runs_eager, swallowed
from autoweave._log import logger
from autoweave._state import run
from autoweave.weave.pieces import CheckpointPieces


def ops_in(gm: Any) -> int:
    """The ops of a graph dynamo traced (``call_function`` nodes), its sub-graphs' included.

    Higher-order ops (the checkpoint of a traced AC region) keep their bodies in
    sub-GraphModules.
    """
    return sum(
        1
        for module in gm.modules()
        if hasattr(module, "graph")
        for node in module.graph.nodes
        if node.op == "call_function"
    )


def graph_name(gm: Any) -> str:
    return type(gm).__name__  # fx names each GraphModule's class (``_get_name`` reads the same)


@dataclass(frozen=True)
class CompiledGraph:
    """What a region's backend did with one graph dynamo handed it (``_events.GRAPH_COMPILED``)."""

    label: str  # the region's label (shared by identical blocks)
    name: str  # the graph module's name
    ops: int  # its ops as dynamo traced them (``ops_in``), before pieces or the backend touched it
    eager: str | None  # why it runs eager instead of compiled; None: compiled
    seconds: float  # time spent in the backend on it


class RegionBackend(_compat.backends.ForwardsToInner):
    """The backend of one kind of woven region (see the module docstring)."""

    def __init__(self, inner: Callable[..., Any], label: str, checkpoint_fn: Any = None) -> None:
        super().__init__(inner)
        self.label = label
        # Told before each graph dynamo hands this backend (``shared_kinds`` reads the kind's
        # guards then): nothing runs on a call that compiles nothing.
        self.before_graph: list[Callable[[], None]] = []
        # The region's checkpoint, applied to each graph piece; None: graphs compiled as they are.
        self.pieces = None if checkpoint_fn is None else CheckpointPieces(checkpoint_fn, label)
        run.region_graphs.setdefault(label, (0, 0))  # counted from now on: 0 graphs is a fact

    def __eq__(self, other: object) -> bool:
        # Equal when compiling alike: the same inner backend and no pieces (a pieces
        # backend checkpoints its graphs its own way: equal to itself only).
        if other is self:
            return True
        return (
            type(other) is type(self)
            and self.pieces is None
            and other.pieces is None  # type: ignore[attr-defined]
            and bool(self.inner == other.inner)  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash(type(self.inner))  # equal backends wrap equal inner backends, of one type

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        for listener in self.before_graph:
            try:
                listener()
            except Exception as exc:  # reading evidence must never fail a compile
                logger.debug("a listener of %s failed", self.label, exc_info=exc)
        if not _events.listened(_events.GRAPH_COMPILED):
            return self._count(self._compile(gm, example_inputs))
        ops = ops_in(gm)  # before the backend, which may rewrite the graph
        start = time.perf_counter()
        compiled = self._count(self._compile(gm, example_inputs))
        seconds = time.perf_counter() - start
        graph = CompiledGraph(self.label, graph_name(gm), ops, getattr(compiled, RAN_EAGER, None), seconds)
        _events.publish(_events.GRAPH_COMPILED, graph)
        return compiled

    def _count(self, compiled: Any) -> Any:
        done, eager = run.region_graphs.get(self.label, (0, 0))
        ran_eager = getattr(compiled, RAN_EAGER, None) is not None
        run.region_graphs[self.label] = (done + (not ran_eager), eager + ran_eager)
        return compiled

    def _compile(self, gm: Any, example_inputs: Any) -> Any:
        try:
            if self.pieces is not None:
                return self.pieces.compile(gm, example_inputs, self.inner)
            return self.inner(gm, example_inputs)
        except _compat.conversion.backend_errors_dynamo_handles():
            raise  # a restart, a skip, a graph break, a dim error of the user's: dynamo's to act on
        except Exception as exc:
            why = first_line(exc)
            swallowed(
                "graph-eager",
                f"graph:{why}",
                f"the backend {self.__name__!r} failed on a graph of the woven region {self.label} ({why}); "
                "that graph runs eager, the rest stays compiled",
                exc,
            )
            forward = gm.forward

            def eager(*args: Any) -> Any:
                return forward(*args)

            return runs_eager(eager, f"the backend failed on it ({why})")


def region_kwargs(kwargs: dict[str, Any], label: str, checkpoint_fn: Any = None) -> dict[str, Any]:
    """``torch.compile`` kwargs that compile as ``kwargs`` asks, through a new ``RegionBackend``.

    ``backend``, ``mode`` and ``options`` become the one callable torch would
    build from them, held by the region's backend (``_compat.backends.wrap_backend``).
    Raises ``_compat.lookup.UnsupportedTorch`` where that callable cannot be rebuilt
    (AOTInductor options).
    """
    return _compat.backends.wrap_backend(kwargs, lambda inner: RegionBackend(inner, label, checkpoint_fn))
