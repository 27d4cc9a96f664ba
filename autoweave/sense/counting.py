"""What dynamo signals while it compiles: graphs and ops captured, AC fallbacks, recompile limits.

Used by the runtime (a first call's fallback), the report, the tests and the
benchmarks, so every number autoweave prints is measured one way. The
profiler-side measures only the benchmarks need (eager GEMMs, heap in use)
live with them, in ``benchmarks/measure.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoweave import _compat, _installs, _taps
from autoweave._compat.log_strings import Fallback, FallbackBreak, RecompileLimit
from autoweave._failopen import RAN_EAGER, warn_each
from autoweave.weave.pieces import graph_name, ops_in


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
        compile_inner = _compat.backends.lookup_backend(inner) if isinstance(inner, str) else inner

        def counting(gm: Any, example_inputs: Any) -> Any:
            ops = ops_in(gm)  # before the backend, which may rewrite the graph
            compiled = compile_inner(gm, example_inputs)
            self.add(graph_name(gm), ops, getattr(compiled, RAN_EAGER, None))
            return compiled

        return counting


class FallbackCounter:
    """dynamo's own "will fall back to eager-mode PyTorch" messages while installed, and the breaks behind them.

    ``breaks`` holds the break dynamo logs after each fallback, with its user
    stack (``planning.learned.locate`` maps it to the module that breaks).
    Any number may be installed at once, from any thread, uninstalled in any
    order: they share one tap on dynamo's logger (``autoweave._taps``), which
    restores the logger when the last one is uninstalled.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.breaks: list[FallbackBreak] = []
        self._fallbacks = _taps.listening(Fallback, lambda fallback: self.messages.append(fallback.text))
        self._breaks = _taps.listening(FallbackBreak, self.breaks.append)

    @property
    def count(self) -> int:
        return len(self.messages)

    def install(self) -> FallbackCounter:
        self._fallbacks.start()
        self._breaks.start()
        return self

    def uninstall(self) -> None:
        self._fallbacks.stop()
        self._breaks.stop()

    def __enter__(self) -> FallbackCounter:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


def warn_on_recompile_limit() -> None:
    """From now on, a woven region that hits dynamo's recompile limit is told in autoweave's words.

    Installed at the first woven plan (once, while autoweave is on), on dynamo's
    logger; ``autoweave.disable()`` takes it off.
    """
    if _installs.active():
        _installs.install("recompile-limit warning (a listener on dynamo's logger)", _listen_for_limits)


def _listen_for_limits() -> Callable[[], None]:
    return _taps.listening(RecompileLimit, _warn_of_limit).start().stop


def _warn_of_limit(hit: RecompileLimit) -> None:
    if "autoweave_" in hit.text:  # a woven region's code, named by ``weave.apply``
        warn_each(
            f"recompile-limit:{hit.function}",
            f"[recompile-limit] a woven region hit dynamo's recompile limit ({hit.function}): dynamo runs "
            "that frame eager from this call on, where none of its graphs fits. "
            "TORCH_LOGS=recompiles says which guard failed each time",
        )


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
    following = _compat.checkpoints.next_autograd_sequence_nr()
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

    stack: list[Any] = []  # from the outputs' nodes
    fx.node.map_aggregate(
        outputs, lambda v: stack.append(v.grad_fn) if isinstance(v, torch.Tensor) and v.grad_fn else None
    )
    seen: set[int] = set()
    keep: list[Any] = []  # the nodes seen, alive while their ids are in ``seen``
    eager = compiled = 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        number = _compat.checkpoints.autograd_sequence_nr(node)
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
