"""Measuring what compiled: graphs, ops captured, graph breaks, eager GEMMs, AC fallbacks.

Used by the report, the tests and the benchmark, so every number autoweave
prints is measured one way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
# AOTAutograd runs every compiled graph (aot_eager and inductor alike) inside
# this autograd function; its profiler range is exactly "inside a graph".
COMPILED_RANGE = "CompiledFunction"
FALLBACK_LOGGER = "torch._dynamo.variables.higher_order_ops"
FALLBACK_NEEDLE = "fall back to eager-mode PyTorch"
# dynamo's warning when a frame's cache is full and it runs eager from then on.
RECOMPILE_LIMIT_LOGGER = "torch._dynamo.convert_frame"
RECOMPILE_LIMIT_NEEDLE = "hit config."


@dataclass
class GraphRecord:
    name: str
    ops: int  # call_function nodes: the ops captured in this graph


@dataclass
class Capture:
    """Counts collected by a counting backend."""

    graphs: list[GraphRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def ops(self) -> int:
        return sum(g.ops for g in self.graphs)

    def backend(self, inner: str | Callable[..., Any] = "aot_eager") -> Callable[..., Any]:
        """A dynamo backend that records each graph, then compiles it with ``inner``."""
        from torch._dynamo.backends.registry import lookup_backend

        compile_inner = lookup_backend(inner) if isinstance(inner, str) else inner

        def counting(gm: Any, example_inputs: Any) -> Any:
            # Higher-order ops (the checkpoint of a traced AC region) keep their
            # bodies in sub-GraphModules: count those ops too.
            ops = sum(
                1
                for module in gm.modules()
                if hasattr(module, "graph")
                for node in module.graph.nodes
                if node.op == "call_function"
            )
            with self._lock:
                self.graphs.append(GraphRecord(gm._get_name() if hasattr(gm, "_get_name") else "graph", ops))
            return compile_inner(gm, example_inputs)

        return counting


def eager_gemms(profile: Any) -> tuple[int, int]:
    """(GEMMs outside compiled graphs, GEMMs inside) from a ``torch.profiler`` run."""
    outside = inside = 0
    for event in profile.events():
        if event.name not in GEMM_OPS:
            continue
        parent = event.cpu_parent
        nested_gemm = False
        in_graph = False
        while parent is not None:
            if parent.name == COMPILED_RANGE:
                in_graph = True
                break
            if parent.name in GEMM_OPS:
                nested_gemm = True  # e.g. addmm calling mm: count the outer one only
            parent = parent.cpu_parent
        if nested_gemm:
            continue
        if in_graph:
            inside += 1
        else:
            outside += 1
    return outside, inside


class FallbackCounter(logging.Handler):
    """Counts dynamo's own "will fall back to eager-mode PyTorch" messages while installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self._logger = logging.getLogger(FALLBACK_LOGGER)
        self._saved: tuple[int, bool, int] | None = None

    @property
    def count(self) -> int:
        return len(self.messages)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if FALLBACK_NEEDLE in message:
            self.messages.append(message)
        # We may have stopped propagation to listen at INFO: pass on what torch's
        # own handlers would have shown.
        if self._saved is not None and not self._saved[1] and record.levelno >= self._saved[2]:
            parent = self._logger.parent
            if parent is not None:
                parent.handle(record)

    def install(self) -> FallbackCounter:
        if self._saved is None:
            self._saved = (self._logger.level, self._logger.propagate, self._logger.getEffectiveLevel())
            self._logger.addHandler(self)
            if self._logger.getEffectiveLevel() > logging.INFO:
                # Listen at INFO without showing INFO to torch's handlers.
                self._logger.setLevel(logging.INFO)
                self._logger.propagate = False
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            self._logger.removeHandler(self)
            self._logger.setLevel(self._saved[0])
            self._logger.propagate = self._saved[1]
            self._saved = None

    def __enter__(self) -> FallbackCounter:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [
        (name, __import__("ctypes").c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out now (glibc ``mallinfo2``), or ``None`` where unavailable.

    CPU tensors are allocated from it, so the difference across a forward is the
    activation memory held for backward: what an AC strategy changes.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)
