"""What every client worker measures, the same way with autoweave on or off.

A worker (``tests/clients/<client>_worker.py``) runs a client's own code path in a
subprocess (torchrun for the distributed ones) and prints one line,
``CLIENT_RESULT {json}``, from rank 0. Nothing here changes how the client
compiles: the counting backend is installed *under dynamo's registry name*
(``aot_eager``/``inductor``), so the client still passes its string and dynamo
still sees one backend object for every compile; the fallback counter listens
on dynamo's log; the compile counters are dynamo's own callbacks.

Measured, per run:
- ``graphs``/``ops``: graphs the backend was handed and their ``call_function`` nodes;
- ``compiles``/``recompiles``: dynamo's compile callbacks (a compile id ``f/n`` with ``n > 0``
  is a recompile of frame ``f``), and ``unique_graphs`` from ``counters["stats"]``;
- ``frames``: the distinct frames dynamo compiled, the ``f`` of those compile ids (a frame
  counts once however often it recompiles); ``compiles_per_step``, when the worker calls
  ``end_step()`` after each step: how many compiles (recompiles included) each step started;
- ``step1_cpu_s`` (every worker ``benchmarks/clients.py`` runs, and ``example_worker``): CPU seconds of the first step, user and system,
  of this process and of its waited-for children (compiler subprocesses), summed over the ranks
  (``cpu_seconds``, ``sum_over_ranks``);
- ``fallbacks``: dynamo's "will fall back to eager-mode PyTorch" messages (AC regions that
  ran eager), counted by ``autoweave.sense.counting.FallbackCounter``;
- ``graph_breaks``: ``counters["graph_break"]``, reasons included;
- ``recompile_limit_hits``: dynamo's recompile-limit warnings;
- ``fwd_gemms_eager``/``fwd_gemms_compiled``: GEMMs of one profiled forward outside/inside
  compiled graphs (``benchmarks/measure.py``);
- ``bwd_gemms``: GEMMs run in one ``backward()`` (recompute and gradients);
- ``act_bytes``: the C heap grown across one forward with grad (the activations kept for backward);
- losses, and the time of the first step and of the rest.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULT_TAG = "CLIENT_RESULT "


def _load_measure() -> Any:
    spec = importlib.util.spec_from_file_location("_aw_bench_measure", ROOT / "benchmarks" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


measure = _load_measure()


def autoweave_setting() -> str:
    """How this process runs: ``plain`` (AUTOWEAVE off) or ``autoweave[:strategy]``."""
    on = os.environ.get("AUTOWEAVE", "").strip().lower() not in ("", "0", "off", "false", "no")
    if not on:
        return "plain"
    strategy = os.environ.get("AUTOWEAVE_STRATEGY", "").strip()
    return f"autoweave:{strategy}" if strategy and strategy != "auto" else "autoweave"


def autoweave_active() -> bool:
    """Whether autoweave's patches are installed in this process (the start-up file fired)."""
    if "autoweave" not in sys.modules:
        return False
    try:
        from autoweave import _installs

        return bool(_installs.active())
    except Exception:
        return False


class _LimitCounter(logging.Handler):
    NEEDLES = ("recompile_limit", "cache_size_limit", "recompile limit")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(n in message for n in self.NEEDLES):
            self.messages.append(message.strip().splitlines()[0][:300])


class Metrics:
    """Installed once per process, before the client compiles anything."""

    BACKENDS = ("aot_eager", "inductor", "eager")

    def __init__(self) -> None:
        self.graphs = 0
        self.ops = 0
        self.compiles = 0
        self.recompiles = 0
        self.frames: set[int] = set()
        self._compiles_at_step_end: list[int] = []
        self._lock = threading.Lock()
        self.fallbacks: Any = None
        self.limits = _LimitCounter()

    def install(self) -> Metrics:
        import torch._dynamo  # noqa: F401
        from torch._dynamo.backends import registry

        from autoweave.sense.counting import FallbackCounter

        self.fallbacks = FallbackCounter().install()
        logging.getLogger("torch._dynamo").addHandler(self.limits)
        registry._lazy_import()
        for name in self.BACKENDS:
            try:
                inner = registry.lookup_backend(name)
            except Exception:
                continue
            registry._COMPILER_FNS[name] = self._counting(inner)
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._on_start)
        return self

    def _counting(self, inner: Any) -> Any:
        metrics = self

        def counting(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            ops = sum(
                1
                for module in gm.modules()
                if hasattr(module, "graph")
                for node in module.graph.nodes
                if node.op == "call_function"
            )
            with metrics._lock:
                metrics.graphs += 1
                metrics.ops += ops
            return measure.in_graph_range(inner(gm, example_inputs, **kwargs))

        # dynamo and torch.compile read attributes off a backend (compiler_name, ...)
        for attr, value in getattr(inner, "__dict__", {}).items():
            try:
                setattr(counting, attr, value)
            except Exception:
                pass
        counting.__name__ = getattr(inner, "__name__", "counting")
        return counting

    def _on_start(self, args: Any = None, *_: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if trigger != "DYNAMO":
            return
        match = re.search(r"(\d+)/(\d+)", str(getattr(args, "compile_id", "")))
        with self._lock:
            self.compiles += 1
            self.recompiles += bool(match and int(match.group(2)) > 0)
            if match:
                self.frames.add(int(match.group(1)))

    def end_step(self) -> None:
        """Mark the end of a training step: ``compiles_per_step`` counts the compiles between marks."""
        with self._lock:
            self._compiles_at_step_end.append(self.compiles)

    def snapshot(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        breaks = dict(counters.get("graph_break", {}))
        stats = dict(counters.get("stats", {}))
        marks = self._compiles_at_step_end
        per_step = [b - a for a, b in zip([0, *marks], marks, strict=False)]
        return {
            "graphs": self.graphs,
            "ops": self.ops,
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "frames": len(self.frames),
            "compiles_per_step": per_step,
            # 1-based; 0 when no step compiled anything
            "last_compiling_step": max((i + 1 for i, n in enumerate(per_step) if n), default=0),
            "unique_graphs": int(stats.get("unique_graphs", 0)),
            "calls_captured": int(stats.get("calls_captured", 0)),
            "fallbacks": self.fallbacks.count if self.fallbacks is not None else 0,
            "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": {k[:200]: v for k, v in sorted(breaks.items(), key=lambda kv: -kv[1])[:8]},
            "recompile_limit_hits": len(self.limits.messages),
            "recompile_limit_messages": self.limits.messages[:4],
        }


def tiny_qwen3_moe_config(layers: int, **overrides: Any) -> Any:
    """The lane's tiny transformers Qwen3-MoE config (4 experts, top 2, 32 wide), ``overrides`` applied."""
    from transformers import Qwen3MoeConfig

    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3MoeConfig(**{**fields, **overrides})


def gemms_of_forward(forward: Any) -> tuple[int, int]:
    """(GEMMs outside compiled graphs, inside) of one call of ``forward()``, profiled on the CPU.

    ``forward()`` runs once unprofiled first: a call that (re)compiles would count the GEMMs
    dynamo and AOTAutograd trace on fake tensors as eager ones.
    """
    import torch

    forward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward()
    return measure.eager_gemms(prof)


def activation_bytes(forward: Any) -> tuple[Any, int | None]:
    """(the forward's output, C heap grown across it): what the forward keeps for backward."""
    import gc

    forward()  # compiled, warm: no compile's memory in the difference
    gc.collect()
    before = measure.heap_in_use()
    out = forward()
    after = measure.heap_in_use()
    return out, (None if before is None or after is None else after - before)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that ended (compiler subprocesses)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def sum_over_ranks(value: float) -> float:
    """``value`` summed over the ranks of the default process group (itself without one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0"))


def emit(result: dict[str, Any]) -> None:
    """Rank 0 prints the result line; every rank flushes."""
    if rank() == 0:
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)
    sys.stdout.flush()


def error_record(exc: BaseException) -> dict[str, Any]:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb[-8:]]
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}",
        "error_type": type(exc).__name__,
        "where": frames,
    }


def run_main(body: Any) -> None:
    """Run a worker's body, turning an exception into a result line (and a non-zero exit)."""
    result: dict[str, Any] = {"setting": autoweave_setting()}
    start = time.perf_counter()
    code = 0
    try:
        result.update(body())
        result.setdefault("ok", True)
    except BaseException as exc:  # noqa: BLE001 - the result line says what failed
        traceback.print_exc()
        result.update(error_record(exc))
        code = 1
    result["autoweave_active"] = autoweave_active()
    result["wall_s"] = round(time.perf_counter() - start, 2)
    emit(result)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)  # not os._exit: autoweave's exit summary and report still get written


def max_rel_diff(a: list[float], b: list[float]) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def backward_gemms(make_loss: Any) -> tuple[int | None, str]:
    """(GEMMs run in one backward, how they were counted) for the loss ``make_loss()`` returns.

    First by ``benchmarks/measure.backward_gemms`` (a dispatch mode: a matmul selective AC
    serves from its cache is not counted). That mode has no rule for the RNG-preserving
    checkpoint's higher-order ops (``run_with_rng_state``, used when an eager checkpoint
    recomputes with ``preserve_rng_state=True``, as transformers' layers do): then a fresh
    forward's backward is counted with the profiler instead (every GEMM call, outermost only).
    """
    import torch

    try:
        return measure.backward_gemms(make_loss()), "dispatch"
    except NotImplementedError as exc:
        if "HigherOrderOperator" not in str(exc):
            raise
    loss = make_loss()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    outside, inside = measure.eager_gemms(prof)
    return outside + inside, "profiler"


def measurements(forward: Any, forward_for_memory: Any, make_loss: Any) -> dict[str, Any]:
    """The ``--measure`` fields every worker reports: forward GEMMs outside graphs, activations, backward GEMMs."""
    eager, compiled = gemms_of_forward(forward)
    _, act = activation_bytes(forward_for_memory)
    bwd, how = backward_gemms(make_loss)
    return {
        "fwd_gemms_eager": eager,
        "fwd_gemms_compiled": compiled,
        "act_bytes": act,
        "bwd_gemms": bwd,
        "bwd_gemms_by": how,
    }
