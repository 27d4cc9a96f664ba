"""What dynamo signals while it compiles: graphs and ops captured, AC fallbacks, recompile limits.

Used by the runtime (a first call's fallback), the report, the tests and the
benchmarks, so every number autoweave prints is measured one way. The
profiler-side measures only the benchmarks need (eager GEMMs, heap in use)
live with them, in ``benchmarks/measure.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# dynamo's log signals, named where every private torch name is (``_compat``).
from autoweave import _compat, _installs
from autoweave._compat import (  # noqa: F401 - re-exported for the runtime, report and tests
    FALLBACK_LOGGER,
    FALLBACK_NEEDLE,
    RECOMPILE_LIMIT_LOGGER,
    RECOMPILE_LIMIT_NEEDLE,
)
from autoweave._failopen import RAN_EAGER, warn_each
from autoweave.weave.region_backend import graph_name, ops_in


@dataclass
class GraphRecord:
    name: str
    ops: int  # call_function nodes: the ops captured in this graph
    eager: str | None = None  # why this graph runs eager instead (a piece under its checkpoint, say)


@dataclass
class Capture:
    """Counts collected by a counting backend.

    A graph the backend handed back to run eager (``_failopen.runs_eager``) is
    recorded apart: it was traced, not compiled, and counts in neither
    ``graph_count`` nor ``ops``.
    """

    graphs: list[GraphRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def compiled(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.eager is None]

    @property
    def eager(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.eager is not None]

    @property
    def graph_count(self) -> int:
        return len(self.compiled)

    @property
    def ops(self) -> int:
        return sum(g.ops for g in self.compiled)

    @property
    def eager_ops(self) -> int:
        return sum(g.ops for g in self.eager)

    def add(self, name: str, ops: int, eager: str | None = None) -> None:
        """Record a graph of ``ops`` ops: compiled, or run eager (and why)."""
        with self._lock:
            self.graphs.append(GraphRecord(name, ops, eager))

    def backend(self, inner: str | Callable[..., Any] = "aot_eager") -> Callable[..., Any]:
        """A dynamo backend that records each graph, then compiles it with ``inner`` (tests, benchmarks)."""
        compile_inner = _compat.lookup_backend(inner) if isinstance(inner, str) else inner

        def counting(gm: Any, example_inputs: Any) -> Any:
            ops = ops_in(gm)  # before the backend, which may rewrite the graph
            compiled = compile_inner(gm, example_inputs)
            self.add(graph_name(gm), ops, getattr(compiled, RAN_EAGER, None))
            return compiled

        return counting


class _FallbackListener(logging.Handler):
    """The one handler on dynamo's fallback logger, shared by every ``FallbackCounter``.

    Listening means lowering a global logger to INFO (and stopping propagation,
    so torch's handlers don't show INFO). Counters overlap (the report's lives as
    long as the process, the runtime's spans one call, threads interleave), so
    the logger's state is saved by the first counter to start and restored by
    the last to stop, whatever the order: a reference count under a lock.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._counters: list[FallbackCounter] = []
        self._saved: tuple[int, bool, int] | None = None  # level, propagate, effective level
        self._silenced = False  # we turned propagation off to listen at INFO
        self._state_lock = threading.Lock()

    def add(self, counter: FallbackCounter) -> None:
        with self._state_lock:
            if counter in self._counters:
                return
            if not self._counters:
                log = logging.getLogger(FALLBACK_LOGGER)
                self._saved = (log.level, log.propagate, log.getEffectiveLevel())
                log.addHandler(self)
                # Listen at INFO without showing INFO to torch's handlers.
                self._silenced = log.getEffectiveLevel() > logging.INFO and log.propagate
                if log.getEffectiveLevel() > logging.INFO:
                    log.setLevel(logging.INFO)
                    log.propagate = False
            self._counters.append(counter)

    def remove(self, counter: FallbackCounter) -> None:
        with self._state_lock:
            if counter not in self._counters:
                return
            self._counters.remove(counter)
            if self._counters or self._saved is None:
                return
            log = logging.getLogger(FALLBACK_LOGGER)
            log.removeHandler(self)
            log.setLevel(self._saved[0])
            log.propagate = self._saved[1]
            self._saved, self._silenced = None, False

    def emit(self, record: logging.LogRecord) -> None:
        with self._state_lock:
            counters, saved, silenced = list(self._counters), self._saved, self._silenced
        message = record.getMessage()
        if FALLBACK_NEEDLE in message:
            for counter in counters:
                counter.messages.append(message)
        # We may have stopped propagation to listen at INFO: pass on, once, what
        # torch's own handlers would have shown.
        if silenced and saved is not None and record.levelno >= saved[2]:
            parent = logging.getLogger(FALLBACK_LOGGER).parent
            if parent is not None:
                parent.handle(record)


_listener = _FallbackListener()


class FallbackCounter:
    """Counts dynamo's own "will fall back to eager-mode PyTorch" messages while installed.

    Any number may be installed at once, from any thread, uninstalled in any
    order; dynamo's logger is restored when the last one is uninstalled.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []

    @property
    def count(self) -> int:
        return len(self.messages)

    def install(self) -> FallbackCounter:
        _listener.add(self)
        return self

    def uninstall(self) -> None:
        _listener.remove(self)

    def __enter__(self) -> FallbackCounter:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


class _RecompileLimitWarning(logging.Filter):
    """Turns dynamo's recompile-limit warning for a woven region into an autoweave warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if RECOMPILE_LIMIT_NEEDLE in message and "autoweave_" in message:
            where = message.splitlines()[1].strip() if "\n" in message else message
            warn_each(
                f"recompile-limit:{where}",
                f"[recompile-limit] a woven region hit dynamo's recompile limit and now runs eager: {where}. "
                "TORCH_LOGS=recompiles says which guard failed each time",
            )
        return True


def warn_on_recompile_limit() -> None:
    """From now on, a woven region that hits dynamo's recompile limit is told in autoweave's words.

    Installed at the first woven plan (once, while autoweave is on), on dynamo's
    logger; ``autoweave.disable()`` takes it off.
    """
    if _installs.active():
        _installs.install("recompile-limit warning (a filter on dynamo's logger)", _add_recompile_filter)


def _add_recompile_filter() -> Callable[[], None]:
    log = logging.getLogger(RECOMPILE_LIMIT_LOGGER)
    warning = _RecompileLimitWarning()
    log.addFilter(warning)
    return lambda: log.removeFilter(warning)


# -- forward GEMMs outside compiled graphs, from autograd's record ---------------------------
#
# Every GEMM run eagerly with grad leaves its own node in the autograd graph
# (``MmBackward0``, ``AddmmBackward0``...); a compiled graph leaves one
# ``CompiledFunctionBackward``, whatever it holds. So the nodes a forward
# created say how many of its GEMMs ran outside compiled graphs, and nothing
# is added to the run to learn it: no dispatch mode, no profiler, no hook.
# The nodes created by one call are those numbered from autograd's next node
# number read just before it (autograd numbers nodes in creation order, per
# thread). Reading it runs no op: a probe tensor made inside the user's
# selective checkpoint would be an op its forward saw and its recompute did
# not (SAC raises "encountered during backward but not found in storage"). A
# grouped GEMM (``torch._grouped_mm``) is one node, as it is one kernel on a
# GPU; the CPU profiler sees one ``mm`` per group. GEMMs under a reentrant
# checkpoint hide in its one node and are not seen.

GEMM_NODES = frozenset(
    {
        "MmBackward0",
        "AddmmBackward0",
        "BmmBackward0",
        "BaddbmmBackward0",
        "AddbmmBackward0",
        "MvBackward0",
        "AddmvBackward0",
        "LinearBackward0",
        "_GroupedMmBackward0",
        "GroupedMmBackward0",
        "_ScaledMmBackward0",
    }
)
_COMPILED_NODE = "CompiledFunction"
_MAX_NODES = 200_000


def autograd_mark() -> int | None:
    """autograd's node number now: nodes a later call creates are numbered above it (None: no grad)."""
    import torch

    if not torch.is_grad_enabled():
        return None
    following = _compat.next_autograd_sequence_nr()
    return None if following is None else following - 1


@dataclass(frozen=True)
class AutogradGemms:
    """What one forward left in the autograd graph: GEMMs run eagerly, compiled graphs run."""

    eager: int
    compiled_graphs: int


def autograd_gemms(outputs: Any, since: int) -> AutogradGemms | None:
    """GEMM nodes and compiled-graph nodes reachable from ``outputs`` and created after ``since``."""
    import torch
    import torch.fx as fx

    roots: list[Any] = []
    fx.node.map_aggregate(
        outputs, lambda v: roots.append(v.grad_fn) if isinstance(v, torch.Tensor) and v.grad_fn else None
    )
    seen: set[int] = set()
    keep: list[Any] = []  # the nodes seen, alive while their ids are in ``seen``
    eager = compiled = 0
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        number = _compat.autograd_sequence_nr(node)
        if number is None:
            return None
        if number <= since:
            continue  # made before this call (an earlier block, a parameter's unshard)
        seen.add(id(node))
        keep.append(node)
        if len(keep) > _MAX_NODES:
            return None
        name = node.name()
        if name in GEMM_NODES:
            eager += 1
        elif _COMPILED_NODE in name:
            compiled += 1
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return AutogradGemms(eager, compiled)
