"""Issue 33: can a static figure read from the pieces' compiled graphs replace the first-call measure?

Under the ``pieces`` strategy a block's checkpoint moves into its compiled graphs, and at the
block's first call with grad autoweave counts what they hold for backward with saved-tensor hooks
(``weave/first_call_memory``: ``SavedBytes``), then compares it with eager selective AC's figure
(``planning/learned``: ``Verdict``, hoist above ``TOLERANCE`` times eager SAC). This script takes,
for each block shape and compiler, both figures from the same run:

- runtime: what autoweave recorded (``_state.run.learned_memory``, the ``Verdict`` of the first
  call); for a case autoweave does not measure (a strategy forced to ``pieces``), the same
  ``SavedBytes`` machinery around the block's first call, as ``FirstCall`` runs it;
- static: the tensors AOTAutograd's partitioner saves for backward in each piece (the backward
  graph's inputs other than tangents: the forward graph's outputs beyond the user's), sized from
  their fake values (symbolic sizes read from their hints), one storage counted once, the storages
  of the block's parameters and buffers (and of views of them) left out, summed over the pieces.
  Captured by wrapping the partitioner the compiler calls (``min_cut_rematerialization_partition``
  as ``aot_eager``, ``aot_eager_decomp_partition`` and inductor each reach it), so the pieces are
  compiled exactly as they are without this script.

Both are judged against the same eager-SAC figure (the block's input and the policy's saves, as
autoweave computes it; where autoweave has none, an eager run's, marked †); the verdict is
``Verdict.hoist_here``. A third figure says which is right: the C heap one forward of the block
under pieces leaves held (``benchmarks/measure.heap_in_use``; its output left out, its input
added; a few KB of autograd's own bookkeeping included). The cost of each is timed: the hooks'
overhead on a forward (the first call pays it once) and the static count's own time.

    python benchmarks/static_memory.py [--backends aot_eager,aot_eager_decomp_partition,eager]
        [--skip-inductor] [--cases NAME,...] [--reps 20] [--json out.json]

Prints a Markdown table; ``--json`` writes every row (with each piece's saved tensors) and the
settings. About a minute on two CPU cores with inductor's cache warm.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

HERE = Path(__file__).resolve().parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import autoweave  # noqa: E402
from autoweave import _state  # noqa: E402
from autoweave._state import run  # noqa: E402
from autoweave.planning.learned import TOLERANCE, Verdict  # noqa: E402
from autoweave.weave.first_call_memory import SavedBytes, tensor_bytes  # noqa: E402
from benchmarks.measure import heap_in_use  # noqa: E402
from tests import break_models as bm  # noqa: E402
from tests import decorated_models as dm  # noqa: E402
from tests import models as tm  # noqa: E402

DIM, TOKENS = 64, 128


# -- the blocks ----------------------------------------------------------------------------


class EagerExpertsBlock(dm.Block):
    """``tests/decorated_models.Block`` with its body as ``forward``: experts whose forward is
    ``torch.compiler.disable``d run eager between the pieces, and autograd saves their tensors
    there, outside any compiled graph (and, under pieces, outside any checkpoint)."""

    forward = dm.Block.body


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    policy: str | None  # a bm.POLICIES name; None: full AC (checkpoint_wrapper without context_fn)
    breaks: bool  # a graph break inside the block
    what: str
    force_pieces: bool = False  # not measured by autoweave (auto plans no pieces): measured here
    dim: int = DIM


CASES = (
    Case(
        "glue/save-nothing",
        lambda: bm.GlueGemmBlock(DIM),
        "save-nothing",
        True,
        "GlueGemmBlock, experts behind a disabled pre-hook; SAC saving nothing: pieces keep what crosses the break",
    ),
    Case(
        "glue/save-matmuls",
        lambda: bm.GlueGemmBlock(DIM),
        "save-matmuls",
        True,
        "GlueGemmBlock, SAC saving the matmuls: eager SAC keeps them too",
    ),
    Case(
        "dense/save-matmuls",
        lambda: bm.DenseTailBlock(DIM),
        "save-matmuls",
        True,
        "DenseTailBlock: its last GEMM's output, saved by the policy, is not needed by backward",
    ),
    Case(
        "glue-nobreak/save-matmuls",
        lambda: bm.GlueGemmBlock(DIM, fsdp=False),
        "save-matmuls",
        False,
        "GlueGemmBlock without the break, forced to pieces: dynamo traces the checkpoint whole (one graph); "
        "the combine's bmm output, saved by the policy, is not needed by backward",
        force_pieces=True,
    ),
    Case(
        "moe/full-AC",
        lambda: tm.Block(DIM),
        None,
        True,
        "tests/models.Block (MoE, experts behind a disabled pre-hook), full AC forced to pieces "
        "(auto plans full AC with hoist and measures nothing)",
        force_pieces=True,
    ),
    Case(
        "eager-experts/save-matmuls",
        lambda: EagerExpertsBlock(),
        "save-matmuls",
        True,
        "decorated_models.Block: experts' forward compiler.disable'd, so they run eager between pieces",
        dim=dm.DIM,
    ),
)


# The cases also run with inductor (each of its graphs is C++ code compiled: seconds each on a CPU).
INDUCTOR_CASES = (
    "glue/save-nothing",
    "glue/save-matmuls",
    "dense/save-matmuls",
    "eager-experts/save-matmuls",
)


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    block = case.make()
    if case.policy is None:
        return cw.checkpoint_wrapper(block)
    return cw.checkpoint_wrapper(block, context_fn=bm.POLICIES[case.policy])


# -- the static figure ---------------------------------------------------------------------


@dataclass
class Partition:
    """One piece as AOTAutograd partitioned it: what the forward keeps for backward."""

    inputs: list[Any]  # the real tensors dynamo handed the backend (parameters among them)
    fw: Any
    bw: Any
    seconds: float = 0.0  # time this script spent counting it


@dataclass
class Recorder:
    """Wraps the partitioner the compilers call; the backend it returns records each piece's inputs."""

    partitions: list[Partition] = field(default_factory=list)
    _inputs: list[list[Any]] = field(default_factory=list)

    def backend(self, name: str) -> Callable[..., Any]:
        """``name``'s backend, the real example inputs of each graph noted for the partitioner."""
        from torch._dynamo.backends.registry import lookup_backend

        inner = lookup_backend(name)

        def recording(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            self._inputs.append(list(example_inputs))
            try:
                return inner(gm, example_inputs, **kwargs)
            finally:
                self._inputs.pop()

        recording.__name__ = f"recording_{name}"
        return recording

    @contextlib.contextmanager
    def installed(self) -> Iterator[Recorder]:
        import torch._dynamo.backends.debugging as debugging
        import torch._inductor.compile_fx as compile_fx

        patched = [
            (debugging, "min_cut_rematerialization_partition"),
            (compile_fx, "min_cut_rematerialization_partition"),
        ]
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr in patched]
        original = saved[0][2]

        @functools.wraps(original)
        def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            fw, bw = original(joint, joint_inputs, **kwargs)
            if self._inputs:
                self.partitions.append(Partition(self._inputs[-1], fw, bw))
            return fw, bw

        for mod, attr, _ in saved:
            setattr(mod, attr, partition)
        try:
            yield self
        finally:
            for mod, attr, value in saved:
                setattr(mod, attr, value)


def _hint(value: Any) -> tuple[int, bool]:
    """(an int, whether it was symbolic) for a size, read from its hint without guarding."""
    if isinstance(value, int):
        return value, False
    node = value.node
    hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
    return int(hint), True


def _count_piece(part: Partition, leave_out: set[int]) -> dict[str, Any]:
    """What one piece's forward graph keeps for backward, by its fake values (see ``static_saved``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = [n for n in part.fw.graph.nodes if n.op == "placeholder"]
    params: set[Any] = set()
    mapped = len(placeholders) == len(part.inputs)  # else AOTAutograd merged duplicate inputs
    if mapped:
        for node, real in zip(placeholders, part.inputs, strict=True):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or not isinstance(real, torch.Tensor):
                continue
            if isinstance(real, nn.Parameter) or real.untyped_storage().data_ptr() in leave_out:
                params.add(StorageWeakRef(val.untyped_storage()))
    storages: dict[Any, int] = {}
    shapes, symbolic, tensors = [], False, 0
    for node in part.bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # a saved SymInt or RNG seed as an int: no storage
        tensors += 1
        ref = StorageWeakRef(val.untyped_storage())
        if ref in params or ref in storages:
            continue
        storages[ref], sym = _hint(val.untyped_storage().nbytes())
        symbolic |= sym
        shapes.append(f"{node.name}{list(val.shape)}:{str(val.dtype).removeprefix('torch.')}")
    return {
        "bytes": sum(storages.values()),
        "saved": shapes,
        "symbolic": symbolic,
        "tensors": tensors,
        "mapped": mapped,
    }


def static_saved(partitions: list[Partition], leave_out: set[int], repeats: int = 5) -> dict[str, Any]:
    """Bytes the pieces' forward graphs keep for backward, by their fake values.

    ``leave_out``: data pointers of the block's parameters and buffers. Storages are counted once
    within a piece (views share their base's fake storage); across pieces a tensor cannot be
    matched statically (a piece's output is the next one's input only at run time). Its cost is
    the quickest of ``repeats`` counts.
    """
    pieces = []
    for part in partitions:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            counted = _count_piece(part, leave_out)
            times.append(time.perf_counter() - start)
        part.seconds = min(times)
        pieces.append(counted)
    return {
        "bytes": sum(p["bytes"] for p in pieces),
        "symbolic": any(p["symbolic"] for p in pieces),
        "saved_tensors": sum(p["tensors"] for p in pieces),
        "unmapped_pieces": sum(not p["mapped"] for p in pieces),
        "pieces": [{"bytes": p["bytes"], "saved": p["saved"]} for p in pieces],
        "seconds": sum(p.seconds for p in partitions),
    }


# -- eager selective AC, for reference ----------------------------------------------------


def eager_reference(case: Case, x: torch.Tensor) -> int:
    """What eager (selective) AC of the whole block keeps: its input, and the outputs its policy saves.

    autoweave's own figure counts the policy's saves as the pieces' tracing showed them; this one
    runs the block eagerly under its checkpoint (no compile) and counts them there, so a save made
    by code that runs eager between the pieces (and so is never traced) counts too. Full AC: the input.
    """
    from autoweave._compat.checkpoints import observe_sac_policy
    from autoweave.weave.pieces import _fresh_bytes, _saves

    if case.policy is None:
        return tensor_bytes(x)
    user = bm.POLICIES[case.policy]
    saved = [0]

    def observe(policy: Callable[..., Any]) -> Callable[..., Any]:
        def observed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and _saves(decision):
                saved[0] += _fresh_bytes(op, ctx.op_output) or 0
            return decision

        return observed

    def context_fn() -> Any:
        contexts = user()
        observe_sac_policy(contexts, observe)
        return contexts

    torch.manual_seed(0)
    block = cw.checkpoint_wrapper(case.make(), context_fn=context_fn)
    with autoweave.disabled():
        block(x)
    return tensor_bytes(x) + saved[0]


# -- one run -------------------------------------------------------------------------------


def _leave_out(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def _policy_bytes() -> int | None:
    pieces = [entry[2].pieces for entry in run.region_backends.values() if entry[2] is not None]
    pieces = [p for p in pieces if p is not None and p.traced]
    if not pieces:
        return None
    sizes = [p.policy_saved_bytes for p in pieces]
    return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[arg-type]


def _forward_seconds(model: nn.Module, x: torch.Tensor, hooks: bool, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if hooks:
            with SavedBytes():
                out = model(x)
        else:
            out = model(x)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def measure(case: Case, backend: str, dynamic: bool, reps: int) -> dict[str, Any]:
    torch._dynamo.reset()
    _state.reset()
    gc.collect()
    wrapper = build(case)
    if case.force_pieces:
        autoweave.set_mode(wrapper, strategy="pieces")
    recorder = Recorder()
    torch.manual_seed(1)
    x = torch.randn(TOKENS, case.dim)
    with recorder.installed():
        model = torch.compile(wrapper, backend=recorder.backend(backend), dynamic=dynamic or None)
        start = time.perf_counter()
        if case.force_pieces:
            # autoweave does not measure a strategy the user chose: FirstCall's own steps, here.
            with SavedBytes() as saved:
                out = model(x)
            saved.leave_out(wrapper)
            policy = _policy_bytes()
            eager_sac = None if policy is None else tensor_bytes(((x,), {})) + policy
            runtime = Verdict(saved.total, eager_sac)
            source = "SavedBytes (forced pieces)"
        else:
            out = model(x)
            verdicts = list(run.learned_memory.values())
            runtime = verdicts[0] if verdicts else None
            source = "autoweave (learned_memory)"
        first_call = time.perf_counter() - start
        out.square().mean().backward()
    static = static_saved(recorder.partitions, _leave_out(wrapper))
    reference = eager_reference(case, x)
    eager_sac = runtime.eager_sac if runtime is not None else None
    # Where autoweave has no eager-SAC figure (full AC; a block dynamo traced whole), the verdicts
    # are taken against the eager reference instead (marked in the table).
    judged_against = eager_sac if eager_sac is not None else reference
    if runtime is not None:
        runtime = Verdict(runtime.held, judged_against, runtime.failed)
    static_verdict = Verdict(static["bytes"], judged_against)
    row: dict[str, Any] = {
        "case": case.name,
        "what": case.what,
        "policy": case.policy or "full AC",
        "breaks": case.breaks,
        "backend": backend,
        "dynamic": dynamic,
        "source": source,
        "pieces": len(recorder.partitions),
        "runtime_bytes": None if runtime is None else runtime.held,
        "eager_sac_bytes": eager_sac,
        "eager_reference_bytes": reference,
        "judged_against": "autoweave's eager SAC" if eager_sac is not None else "eager reference",
        "input_bytes": tensor_bytes(x),
        "static_bytes": static["bytes"],
        "static_symbolic": static["symbolic"],
        "static_unmapped_pieces": static["unmapped_pieces"],
        "static_pieces": static["pieces"],
        "runtime_hoist": None if runtime is None else runtime.hoist_here,
        # No AOTAutograd partition (a backend that runs dynamo's graphs as they are): no figure.
        "static_hoist": static_verdict.hoist_here if recorder.partitions else None,
        "first_call_seconds": first_call,
        "static_count_seconds": static["seconds"],
    }
    if runtime is not None and runtime.failed:
        row["failed"] = list(runtime.failed)
    # The hooks' cost on a forward: what the first call pays once, on top of compiling. Timed on a
    # copy forced to pieces (the measured model may have been re-planned with hoist by now).
    if reps:
        torch._dynamo.reset()
        _state.reset()
        timed = build(case)
        autoweave.set_mode(timed, strategy="pieces")
        timed_model = torch.compile(timed, backend=backend, dynamic=dynamic or None)
        with SavedBytes() as saved:  # also compiles it
            timed_model(x).sum().backward()
        row["saved_tensors"] = saved.count
        # The C heap a forward leaves held (its output included): what the figures stand for.
        gc.collect()
        before = heap_in_use()
        held = timed_model(x)
        after = heap_in_use()
        if before is not None and after is not None:
            # The input was allocated before: added, as both figures count it.
            row["heap_held_bytes"] = after - before - tensor_bytes(held) + tensor_bytes(x)
            row["heap_hoist"] = Verdict(row["heap_held_bytes"], judged_against).hoist_here
        del held
        row["forward_seconds"] = _forward_seconds(timed_model, x, False, reps)
        row["forward_with_hooks_seconds"] = _forward_seconds(timed_model, x, True, reps)
    return row


# -- the table -----------------------------------------------------------------------------


def _kb(value: int | None) -> str:
    return "—" if value is None else f"{value / 1024:.1f}"


def _verdict(hoist: bool | None) -> str:
    return "—" if hoist is None else "hoist" if hoist else "pieces"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | break | backend | runtime KB | static KB | static ÷ runtime | heap Δ + input KB | eager SAC KB "
        "| runtime verdict | static verdict | heap verdict | static = runtime | hooks' cost µs | static cost µs |",
        "|:--|:--|:--|--:|--:|--:|--:|--:|:--|:--|:--|:--|--:|--:|",
    ]
    for r in rows:
        rt, st = r["runtime_bytes"], r["static_bytes"]
        ratio = "—" if not rt or not r["pieces"] else f"{st / rt:.2f}×"
        static = f"{_kb(st)}{' (sym)' if r['static_symbolic'] else ''}" if r["pieces"] else "0 (no AOT graph)"
        backend = r["backend"] + (" dyn" if r["dynamic"] else "")
        cost = (
            f"{(r['forward_with_hooks_seconds'] - r['forward_seconds']) * 1e6:.0f}"
            if "forward_seconds" in r
            else "—"
        )
        same = None if r["static_hoist"] is None else r["runtime_hoist"] == r["static_hoist"]
        against = r["eager_sac_bytes"] if r["eager_sac_bytes"] is not None else r["eager_reference_bytes"]
        mark = "" if r["eager_sac_bytes"] is not None else " †"
        ref = "" if r["eager_reference_bytes"] == against else f" (eager {_kb(r['eager_reference_bytes'])})"
        lines.append(
            f"| {r['case']} | {'yes' if r['breaks'] else 'no'} | {backend} | {_kb(rt)} | {static} | {ratio} | {_kb(r.get('heap_held_bytes'))} "
            f"| {_kb(against)}{mark}{ref} | {_verdict(r['runtime_hoist'])} | {_verdict(r['static_hoist'])} "
            f"| {_verdict(r.get('heap_hoist'))} "
            f"| {'—' if same is None else 'yes' if same else '**no**'} | {cost} | {r['static_count_seconds'] * 1e6:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends",
        default="aot_eager,aot_eager_decomp_partition,eager",
        help="backends every case runs with (eager: dynamo's graphs run as they are, no AOTAutograd)",
    )
    parser.add_argument(
        "--skip-inductor", action="store_true", help="no inductor rows (C++ codegen: slow on CPU)"
    )
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--reps", type=int, default=20, help="forwards timed with and without hooks")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autoweave.enable()
    wanted = [c for c in CASES if c.name in args.cases.split(",")]
    runs = [(c, b, False) for b in args.backends.split(",") for c in wanted]
    # Symbolic sizes: the two glue cases compiled with dynamic=True.
    runs += [(c, "aot_eager", True) for c in wanted if c.name.startswith("glue/")]
    if not args.skip_inductor:
        runs += [(c, "inductor", False) for c in wanted if c.name in INDUCTOR_CASES]
    rows = []
    for case, backend, dynamic in runs:
        try:
            row = measure(case, backend, dynamic, args.reps)
        except Exception as exc:  # a case that fails is a result too
            row = {
                "case": case.name,
                "backend": backend,
                "dynamic": dynamic,
                "error": f"{type(exc).__name__}: {exc}"[:300],
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(
            json.dumps({k: v for k, v in row.items() if k not in ("static_pieces", "what")}),
            file=sys.stderr,
            flush=True,
        )
    print(table(rows))
    print(
        f"\nverdict: hoist when held > {TOLERANCE} × eager SAC; KB = 1024 bytes; † no autoweave figure: "
        "judged against the eager reference (eager AC run, its policy's saves counted)"
    )
    if args.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "dim": DIM,
            "tokens": TOKENS,
            "tolerance": TOLERANCE,
        }
        Path(args.json).write_text(json.dumps({"settings": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
