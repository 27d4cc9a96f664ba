"""Benchmark-side measures: GEMMs run outside compiled graphs or in backward, and the C heap in use.

The run-time side (graphs, ops, fallbacks) is ``autoweave.sense.counting``; these need
the profiler or ctypes and only benchmarks and tests ask for them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import unittest.mock
from typing import Any

# Not aten::_grouped_mm: off CUDA (and in bf16-less paths) it loops over aten::mm, and a GEMM
# nested in a GEMM counts once, so an eager grouped GEMM would count 1 where its compiled
# decomposition counts one per expert. gpu_bench adds it where it is a kernel of its own.
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
# AOTAutograd runs every compiled graph (aot_eager and inductor alike) inside
# this autograd function; its profiler range is exactly "inside a graph".
COMPILED_RANGE = "CompiledFunction"


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


def in_graph_range(compiled: Any, name: str = COMPILED_RANGE) -> Any:
    """``compiled`` (what a dynamo backend returned) called inside the range ``name``.

    AOTAutograd runs a graph inside its ``CompiledFunction`` range only when it may need a
    backward; a graph with no gradient to give (under ``no_grad``, or a resume frame that only
    routes: indices, offsets) it calls bare, and its ops would read as eager.
    """
    import torch

    if not callable(compiled):
        return compiled

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]  # dynamo passes the arguments as one list
    return call


def graphs_in_range(backend: Any) -> Any:
    """A dynamo backend: ``backend``'s, each call of a compiled graph inside the range ``GRAPH_CALL``."""

    def ranged(gm: Any, example_inputs: Any) -> Any:
        return in_graph_range(backend(gm, example_inputs), GRAPH_CALL)

    return ranged


def forward_gemms_outside_graphs(model: Any, *args: Any) -> int:
    """GEMMs one forward of ``model`` runs outside compiled graphs (profiled on the CPU)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(*args)
    return eager_gemms(prof)[0]


def backward_gemms(loss: Any) -> int:
    """``loss.backward()``, counting the GEMMs that run in it: recomputed ones and gradient ones alike.

    Counted below autograd by a dispatch mode, so what selective AC serves from
    its cache (a saved matmul) is not counted, while the profiler would count
    the call. The mode lets dynamo run compiled code under it
    (``ignore_compile_internals``): with any other mode active dynamo runs
    eager, and a recompute then differs from its forward. Ops inside compiled
    graphs are seen as their graphs call them (inductor: its extern ``.out``
    kernels; a GEMM it fuses into a kernel of its own is not a call at all).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {name.split("::", 1)[1] for name in GEMM_OPS}

    class Counting(TorchDispatchMode):
        count = 0

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket.__name__ in names:
                self.count += 1
            return func(*args, **(kwargs or {}))

    with Counting() as counting:
        loss.backward()
    return counting.count


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
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
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


# What a training step runs outside compiled graphs (issue 42's CPU proxy): profiler ranges.
COMPILED_RANGES = ("CompiledFunction", "CompiledFunctionBackward")
GRAPH_CALL = "census::graph"  # graphs_in_range's: each call of a compiled graph, with a backward or not
RECOMPUTE = "census::recompute"  # profiled_step's: an eager checkpoint's recompute (torch.utils.checkpoint)
FSDP_RANGE = "FSDP::"  # FSDP2's record_function labels: its hooks' all-gathers, copies, reduce-scatters
STEP_RANGES = ("census::forward", "census::backward")


def profiled_step(forward: Any, backward: Any) -> Any:
    """``backward(forward())`` under the CPU profiler (and CUDA's where there is one), each phase labelled.

    An eager checkpoint's recompute runs in a range of its own (``RECOMPUTE``): torch opens none,
    and one that a backward graph starts (unpacking what it saved) would read as that graph's.
    """
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _recompute_in_range(), torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP_RANGES[0]):
            out = forward()
        with torch.profiler.record_function(STEP_RANGES[1]):
            backward(out)
    return prof


@contextlib.contextmanager
def _recompute_in_range() -> Any:
    """While inside: each ``torch.utils.checkpoint`` frame made runs its recompute inside ``RECOMPUTE``.

    The non-reentrant checkpoint keeps what it recomputes in a ``_CheckpointFrame(recompute_fn, ...)``
    (torch 2.1-2.15); where that name is missing, nothing is marked (the census says less).
    """
    import torch
    import torch.utils.checkpoint as checkpoint

    frame = getattr(checkpoint, "_CheckpointFrame", None)
    if frame is None:
        yield
        return
    init = frame.__init__

    def marked_init(self: Any, recompute_fn: Any, *args: Any, **kwargs: Any) -> None:
        # ``wraps``: what reads the recompute's closure (autoweave's kwargs) unwraps to torch's.
        @functools.wraps(recompute_fn)
        def recompute(*inputs: Any, **named: Any) -> Any:
            with torch.profiler.record_function(RECOMPUTE):
                return recompute_fn(*inputs, **named)

        init(self, recompute, *args, **kwargs)

    with unittest.mock.patch.object(frame, "__init__", marked_init):
        yield


def _training_calls(events: list[Any]) -> set[int]:
    """The ``GRAPH_CALL`` ranges (ids) inside which AOTAutograd opened its ``CompiledFunction``.

    Such a graph has a backward, and what runs in the call outside ``CompiledFunction`` is
    AOTAutograd's runtime glue (an output that is a view of an intermediate, replayed): eager. A call
    without one is a graph with no backward, run bare: all of it is the graph.
    """
    calls = set()
    for event in events:
        if (
            event.name == COMPILED_RANGE
            and (call := _range_above(event)) is not None
            and call.name == GRAPH_CALL
        ):
            calls.add(id(call))
    return calls


def _range_above(event: Any) -> Any:
    """The nearest graph range (``COMPILED_RANGES``, ``GRAPH_CALL``) above ``event``, or None."""
    node = event.cpu_parent
    while node is not None and node.name not in (*COMPILED_RANGES, GRAPH_CALL):
        node = node.cpu_parent
    return node


def _place(event: Any, training: set[int]) -> tuple[str, str | None, bool]:
    """Where ``event`` runs, the outermost aten op at or above it there, and whether it is nested in one.

    Where: ``forward`` or ``backward`` (in a compiled graph), ``fsdp`` (FSDP2's hooks), ``recompute``
    (eager work of a checkpoint's recompute) or ``eager``.
    """
    outer, nested, node = None, False, event
    while node is not None:  # from the event itself (a range may launch kernels) up
        if node.name == "CompiledFunctionBackward":
            return "backward", None, nested
        if node.name == COMPILED_RANGE or (node.name == GRAPH_CALL and id(node) not in training):
            return "forward", None, nested
        if node.name.startswith(FSDP_RANGE):
            return "fsdp", outer, nested
        if node.name == RECOMPUTE:
            return "recompute", outer, nested
        if node.name.startswith("aten::"):
            outer, nested = node.name, outer is not None
        node = node.cpu_parent
    return "eager", outer, nested


def _graph_kind(event: Any) -> str | None:
    """``forward``/``backward`` where ``event`` opens a graph's call (one per call: a ``CompiledFunction``
    inside ``GRAPH_CALL`` is that call's), else None."""
    if event.name == "CompiledFunctionBackward":
        return "backward"
    if event.name == GRAPH_CALL:
        return "forward"
    if event.name == COMPILED_RANGE:
        above = _range_above(event)
        return None if above is not None and above.name == GRAPH_CALL else "forward"
    return None


def _phases(events: list[Any]) -> list[tuple[str, list[Any]]]:
    """Each phase of ``profiled_step`` (``forward``, ``backward``) and the events that start within its
    label's interval (the backward's may run on autograd's own threads, outside its range's nesting)."""
    spans = {e.name: (e.time_range.start, e.time_range.end) for e in events if e.name in STEP_RANGES}
    phases = []
    for label in STEP_RANGES:
        start, end = spans.get(label, (0, -1))
        inside = [e for e in events if e.name not in STEP_RANGES and start <= e.time_range.start <= end]
        phases.append((label.split("::", 1)[1], inside))
    return phases


def step_census(profile: Any) -> dict[str, Any]:
    """What one profiled step (``profiled_step``) ran, by phase: graphs called, and aten ops outside graphs.

    ``eager_ops``: aten ops (the outermost of a nest: ``addmm`` calling ``mm`` counts once) run outside
    every compiled graph and outside FSDP's hooks, by name; ``fsdp_ops``: those inside FSDP's ranges
    (the units' own copies and collectives); ``graphs``: compiled forward graphs called (in backward: a
    checkpoint's recompute running them again) and backward graphs. A phase is the interval of its
    label (``_phases``). Graphs without a backward run outside AOTAutograd's ``CompiledFunction``: with the backend
    wrapped by ``graphs_in_range`` they are told apart (else their ops read as eager). A recompute
    that a backward graph starts (unpacking what it saved) runs inside that graph's range: its graphs
    count as recomputed, and its eager ops as eager (``recompute_eager_ops`` of them), since
    ``profiled_step`` marks an eager checkpoint's recompute (``RECOMPUTE``).
    """
    import collections

    events = list(profile.events())
    training = _training_calls(events)
    out: dict[str, Any] = {}
    for phase, inside in _phases(events):
        eager: collections.Counter[str] = collections.Counter()
        fsdp: collections.Counter[str] = collections.Counter()
        graphs: collections.Counter[str] = collections.Counter()
        recomputed = 0
        for event in inside:
            kind = _graph_kind(event)
            if kind is not None:
                graphs[kind] += 1
                continue
            if not event.name.startswith("aten::"):
                continue
            where, _, nested = _place(event, training)
            if not nested and where in ("eager", "fsdp", "recompute"):
                (fsdp if where == "fsdp" else eager)[event.name] += 1
                recomputed += where == "recompute"
        out[phase] = {
            "eager_ops": sum(eager.values()),
            "recompute_eager_ops": recomputed,  # of eager_ops: run by an eager checkpoint's recompute
            "fsdp_ops": sum(fsdp.values()),
            "forward_graphs": graphs["forward"],
            "backward_graphs": graphs["backward"],
            "eager_by_op": dict(eager.most_common()),
        }
    return out


# Host waits for the device: ``.item()`` (a scalar read back) and explicit synchronizations.
HOST_SYNCS = (
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)
BREAKDOWN = ("graphs", "recompute", "backward graphs", "fsdp", "eager", "idle")


def _category(event: Any, phase: str, training: set[int]) -> tuple[str, str | None]:
    """Where ``event``'s time belongs (``BREAKDOWN``), and for eager time the outermost aten op (``host``: none)."""
    where, outer, _ = _place(event, training)
    if where == "forward":
        return ("recompute" if phase == "backward" else "graphs"), None
    if where == "backward":
        return "backward graphs", None
    if where == "fsdp":
        return "fsdp", None
    if where == "recompute":
        return "recompute", None
    return "eager", outer or "host"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def step_breakdown(profile: Any) -> dict[str, Any]:
    """Where one profiled step's time went (``profiled_step``), per phase and category (issue 42, item 1).

    Categories: ``graphs`` (compiled forward graphs), ``recompute`` (a checkpoint's recompute: forward
    graphs run again in backward, and an eager checkpoint's eager work), ``backward graphs``, ``fsdp``
    (inside FSDP2's ranges: the units' copies and collectives), ``eager`` (everything else, by the
    outermost aten op it ran under; ``host``: under none, as autograd's nodes, hooks and Python) and,
    on a GPU, ``idle`` (the device waiting within the phase's span of kernels). With CUDA activity the
    time is each kernel's, charged to the CPU op that launched it; without (the CPU proxy) it is each
    CPU event's self time. Also: kernels per category, and host syncs (``.item()``, explicit
    synchronizations), which stall the launch queue on a GPU.
    """
    from torch.autograd import DeviceType

    cpu = DeviceType.CPU
    events = list(profile.events())
    training = _training_calls(events)
    device = any(getattr(e, "kernels", None) for e in events)
    out: dict[str, Any] = {"time_kind": "device kernels" if device else "cpu self time"}
    for phase, inside in _phases(events):
        ms = dict.fromkeys(BREAKDOWN, 0.0)
        kernels = dict.fromkeys(BREAKDOWN, 0)
        eager_ms: dict[str, float] = {}
        syncs, launched = 0, []
        for event in inside:
            if event.device_type != cpu:
                launched.append(
                    (event.time_range.start, event.time_range.end)
                )  # a kernel, on the device's clock
                continue
            syncs += event.name in HOST_SYNCS
            own = getattr(event, "kernels", None) or []
            spent = sum(k.duration for k in own) if device else event.self_cpu_time_total
            if not spent:
                continue
            category, op = _category(event, phase, training)
            ms[category] += spent / 1e3
            kernels[category] += len(own)
            if op is not None:
                eager_ms[op] = eager_ms.get(op, 0.0) + spent / 1e3
        if device and launched:
            first, last = min(s for s, _ in launched), max(e for _, e in launched)
            ms["idle"] = (last - first - _busy_us(launched)) / 1e3
        else:
            ms["idle"] = None
        out[phase] = {
            "ms": ms,
            "kernels": kernels if device else None,
            "host_syncs": syncs,
            "eager_ms_by_op": dict(sorted(eager_ms.items(), key=lambda kv: -kv[1])),
        }
    return out
