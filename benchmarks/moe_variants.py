"""Build the example MoE under each way users (and hand-written weaves) apply AC, compile and FSDP,
train a few steps, and measure what compiled. One torchrun worker for the tests and the benchmark.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/moe_variants.py \\
        --variants compile_ac:on,compile_ac:off --steps 3 --out results.json

A variant is ``ORDER:AUTOWEAVE[:STRATEGY]`` (``on``/``off``; ``hoist``, ``pieces``);
``--ac`` picks full or selective AC.
Rank 0 writes one JSON record per variant. ``--warmup`` compiles a throw-away function
first, so the first compiled variant does not pay the process's one-time compiler start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from measure import eager_gemms as count_eager_gemms  # noqa: E402 - benchmarks/measure.py
from measure import heap_in_use  # noqa: E402

import autoweave  # noqa: E402
from autoweave.sense import counting  # noqa: E402


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples" / "train_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module
    spec.loader.exec_module(module)
    return module


tm = load_example()


def _ckpt_wrapper() -> Callable[..., nn.Module]:
    # Looked up at call time so autoweave's patch (when on) is the one called.
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    return cw.checkpoint_wrapper


# (op, decision) pairs the selective policy was asked about during a variant: eager SAC
# asks at every forward and recompute, a compiled region while it is traced.
POLICY_SEEN: set[tuple[str, str]] = set()


def _recording_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    decision = tm._selective_policy(ctx, op, *args, **kwargs)
    POLICY_SEEN.add((str(op), decision.name))
    return decision


def _ac_kwargs(ac: str) -> dict[str, Any]:
    if ac == "selective":
        import functools

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _recording_policy)}
    return {}


def _fsdp(model: nn.Module, mesh: Any, expert_mesh: Any, *, block: bool = True, experts: bool = True) -> None:
    for b in model.layers.values():
        inner = tm._unwrap(b)
        if experts and getattr(inner, "moe_enabled", False):
            fully_shard(inner.moe.experts, mesh=expert_mesh)
        if block:
            fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)


class CheckpointedFFNBlock(tm.TransformerBlock):
    """A block that calls torch.utils.checkpoint inside its own forward (no AC wrapper)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + torch.utils.checkpoint.checkpoint(ffn, self.ffn_norm(h), use_reentrant=False)


class BreakingExperts(tm.GroupedExperts):
    """Experts that break dynamo's graph themselves (a kernel dynamo cannot trace, say)."""

    def forward(self, x: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x, expert_weights)


def _break_experts(model: nn.Module) -> None:
    for b in model.layers.values():
        if b.moe_enabled:
            b.moe.experts.__class__ = BreakingExperts


class StackedExperts(tm.GroupedExperts):
    """Every expert's output, stacked: ``(T, D) -> (E, T, D)``; the MoE combines them."""

    def forward(self, x: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)
        h = F.silu(torch.bmm(xe, self.w1.transpose(1, 2))) * torch.bmm(xe, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2))


class EinsumMoE(tm.MoE):
    """A different block layout: the combine is an einsum (a ``bmm``) in the MoE's own forward.

    That GEMM is the block's glue, run between the router and the experts' FSDP unit and after
    it: what ``pieces`` compiles under the checkpoint.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        top_scores, selected = self.router(tokens)
        weights = torch.zeros(tokens.shape[0], self.n_routed_experts, dtype=top_scores.dtype).scatter(
            1, selected, top_scores
        )
        routed = torch.einsum("etd,te->td", self.experts(tokens, weights), weights)
        return (routed + self.shared_experts(tokens)).reshape(bsz, seqlen, dim)


class GlueBreakMoE(EinsumMoE):
    """A graph break in the MoE's own glue (not at a boundary): fullgraph=True must refuse it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        torch._dynamo.graph_break()
        return out


# --glue-gemm: MoE blocks combine with an einsum in their own forward (EinsumMoE).
GLUE_GEMM = False


def _glue_gemm(model: nn.Module, moe_class: type = EinsumMoE) -> None:
    for b in model.layers.values():
        if b.moe_enabled:
            b.moe.__class__ = moe_class
            b.moe.experts.__class__ = StackedExperts


def _sibling_weave(block: nn.Module, backend: Any) -> None:
    """The hand-written weave trainers write: compile each child, and the experts' inner forward."""
    for name, child in block.named_children():
        if name == "moe":
            for sub_name, sub in child.named_children():
                if sub_name == "experts":
                    sub.forward = torch.compile(sub.forward, backend=backend)
                else:
                    child.register_module(sub_name, torch.compile(sub, backend=backend))
        else:
            block.register_module(name, torch.compile(child, backend=backend))


def build(order: str, ac: str, backend: Any, mesh: Any, expert_mesh: Any, args: Any) -> nn.Module:
    """The model parallelized the way ``order`` says (see ORDERS)."""
    model = tm.Transformer(args)
    model.init_weights(0)
    if GLUE_GEMM:
        _glue_gemm(model)
    ckw = _ac_kwargs(ac)
    wrap = _ckpt_wrapper()
    layers = model.layers
    if order == "eager":
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
        _fsdp(model, mesh, expert_mesh)
    elif order == "compile_ac":  # torch.compile(checkpoint_wrapper(block)), then FSDP (torchtitan)
        for k, b in layers.items():
            layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        _fsdp(model, mesh, expert_mesh)
    elif order == "inplace_fullgraph":  # checkpoint_wrapper(block).compile(fullgraph=True)
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
            layers[k].compile(backend=backend, fullgraph=True)
        _fsdp(model, mesh, expert_mesh)
    elif order == "fullgraph_glue_break":  # inplace_fullgraph, and a break in the MoE's own glue
        _glue_gemm(model, GlueBreakMoE)
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
            layers[k].compile(backend=backend, fullgraph=True)
        _fsdp(model, mesh, expert_mesh)
    elif order == "ac_compile":  # checkpoint_wrapper(torch.compile(block))
        for k, b in layers.items():
            layers[k] = wrap(torch.compile(b, backend=backend), preserve_rng_state=False, **ckw)
        _fsdp(model, mesh, expert_mesh)
    elif order == "fsdp_then_compile":  # FSDP on experts and blocks first, compile after
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
        for b in layers.values():
            inner = tm._unwrap(b)
            if inner.moe_enabled:
                fully_shard(inner.moe.experts, mesh=expert_mesh)
            fully_shard(b, mesh=mesh)
        for b in layers.values():
            b.compile(backend=backend)
        fully_shard(model, mesh=mesh)
    elif order == "no_block_fsdp":  # only the experts and the root are FSDP units
        for k, b in layers.items():
            layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        _fsdp(model, mesh, expert_mesh, block=False)
    elif order == "ckpt_in_forward":  # torch.utils.checkpoint inside the block's forward
        for k, b in layers.items():
            b.__class__ = CheckpointedFFNBlock
            layers[k] = torch.compile(b, backend=backend)
        _fsdp(model, mesh, expert_mesh)
    elif order == "compile_twice":  # pipeline code compiling a stage's blocks twice
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
            layers[k].compile(backend=backend)
            layers[k].compile(backend=backend)
        _fsdp(model, mesh, expert_mesh)
    elif order == "whole_model":  # AC and FSDP per block, then the whole model compiled (HF Trainer)
        for k, b in layers.items():
            layers[k] = wrap(b, preserve_rng_state=False, **ckw)
        _fsdp(model, mesh, expert_mesh)
        model.compile(backend=backend)
    elif order == "break_compile_ac":  # a graph break in the experts, no FSDP unit there
        _break_experts(model)
        for k, b in layers.items():
            layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        _fsdp(model, mesh, expert_mesh, experts=False)
    elif order == "break_ac_compile":  # the same model, AC outside the compile (plain torch copes)
        _break_experts(model)
        for k, b in layers.items():
            layers[k] = wrap(torch.compile(b, backend=backend), preserve_rng_state=False, **ckw)
        _fsdp(model, mesh, expert_mesh, experts=False)
    elif order == "hand_siblings":  # hand-written sibling weave under eager AC
        for k, b in layers.items():
            if b.moe_enabled:
                _sibling_weave(b, backend)
                layers[k] = wrap(b, preserve_rng_state=False, **ckw)
            else:
                layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        _fsdp(model, mesh, expert_mesh)
    elif order == "hand_ac_compile":  # hand-written AC(Compile(block)) for MoE blocks
        for k, b in layers.items():
            if b.moe_enabled:
                b.moe.experts.forward = torch.compile(b.moe.experts.forward, backend=backend)
                layers[k] = wrap(torch.compile(b, backend=backend), preserve_rng_state=False, **ckw)
            else:
                layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        _fsdp(model, mesh, expert_mesh)
    elif order == "upper_bound":  # experts share the block's FSDP unit: no nested unit at all
        for k, b in layers.items():
            layers[k] = torch.compile(wrap(b, preserve_rng_state=False, **ckw), backend=backend)
        for b in layers.values():
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise SystemExit(f"unknown order {order!r}")
    return model


ORDERS = (
    "compile_ac",
    "inplace_fullgraph",
    "fullgraph_glue_break",
    "ac_compile",
    "fsdp_then_compile",
    "no_block_fsdp",
    "ckpt_in_forward",
    "compile_twice",
    "whole_model",
    "break_compile_ac",
    "break_ac_compile",
    "hand_siblings",
    "hand_ac_compile",
    "upper_bound",
)


def _grad_norms(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = float(g.float().norm())
    return out


def _clean_name(name: str) -> str:
    for seg in ("._orig_mod", "._checkpoint_wrapped_module", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(seg, "")
    return name


def run_variant(
    order: str,
    weave_on: bool,
    ac: str,
    steps: int,
    args: Any,
    inner_backend: str,
    timing_steps: int,
    strategy: str | None = None,
) -> dict[str, Any]:
    from autoweave import _settings
    from autoweave._settings import Settings

    saved_settings = _settings.current()
    if strategy:
        _settings.reload(Settings(enabled=True, strategy=strategy))
    try:
        record = _run_variant(order, weave_on, ac, steps, args, inner_backend, timing_steps)
    finally:
        _settings.reload(saved_settings)
    record["strategy"] = strategy or "auto"
    return record


def _run_variant(
    order: str, weave_on: bool, ac: str, steps: int, args: Any, inner_backend: str, timing_steps: int
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    POLICY_SEEN.clear()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    expert_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep_fsdp",))
    torch._dynamo.reset()
    rss_scope = _reset_peak_rss()
    cap = counting.Capture()
    backend = cap.backend(inner_backend)
    ctx = contextlib.nullcontext() if weave_on else autoweave.disabled()
    fallbacks = counting.FallbackCounter().install()
    try:
        with ctx:
            model = build(order, ac, backend, mesh, expert_mesh, args)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        local_bs = 4 // world
        losses, grads, step_times = [], {}, []
        eager_gemms = inside_gemms = -1
        held_mb: float | None = None
        first_step = 0.0
        for step in range(steps + timing_steps):
            inputs, targets = tm.make_batch(step, 0, 4, args)
            shard = slice(rank * local_bs, (rank + 1) * local_bs)
            start = time.perf_counter()
            if step == steps - 1:  # after every compile (fake-tensor tracing shows in the profiler)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    logits = model(inputs[shard])
                eager_gemms, inside_gemms = count_eager_gemms(prof)
            elif step == max(steps - 2, 0):
                # Activation memory held for backward: what an AC strategy changes.
                before = heap_in_use()
                logits = model(inputs[shard])
                after = heap_in_use()
                if before is not None and after is not None:
                    held_mb = (after - before) / 2**20
            else:
                logits = model(inputs[shard])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[shard].flatten())
            loss.backward()
            if step == 0:
                grads = {_clean_name(k): v for k, v in _grad_norms(model).items()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if step == 0:
                first_step = elapsed
            elif step >= steps:
                step_times.append(elapsed)
            g = loss.detach().clone()
            dist.all_reduce(g)
            if step < steps:
                losses.append(g.item() / world)
        peak = _peak_rss_mb()
        record = {
            "order": order,
            "autoweave": weave_on,
            "ac": ac,
            "losses": losses,
            "grad_norms": grads,
            "graphs": cap.graph_count,
            "ops": cap.ops,
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "fallbacks": fallbacks.count,
            "eager_gemms": eager_gemms,
            "compiled_gemms": inside_gemms,
            "state_dict_keys": sorted(model.state_dict().keys()),
            "first_step_s": first_step,
            "step_s": statistics.median(step_times) if step_times else None,
            "peak_rss_mb": peak,
            "peak_rss_scope": rss_scope,
            "policy": sorted(POLICY_SEEN),
            "activation_mb": held_mb,
        }
    finally:
        fallbacks.uninstall()
        torch._dynamo.utils.counters.clear()
    return record


def _reset_peak_rss() -> str:
    """Reset the peak-RSS mark so peak_rss_mb covers this variant: "variant" if Linux allows, else "process"."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, which getrusage's ru_maxrss reads
    except OSError:
        return "process"
    return "variant"


def _warmup(backend: str) -> None:
    """Compile and run a throw-away function (forward and backward) with ``backend``."""
    x = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)(x).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True, help="comma list of ORDER:on|off (or ORDER for eager)")
    p.add_argument("--ac", default="full", choices=("full", "selective"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timing-steps", type=int, default=0)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", action="store_true", help="compile a throw-away function before the variants")
    p.add_argument("--glue-gemm", action="store_true", help="MoE blocks combine with an einsum (EinsumMoE)")
    a = p.parse_args(argv)
    global GLUE_GEMM
    GLUE_GEMM = a.glue_gemm
    dist.init_process_group("gloo")
    autoweave.enable()
    if a.warmup:
        _warmup(a.backend)
    args = tm.ModelArgs(
        n_layers=a.layers, dim=a.dim, vocab_size=128, seq_len=16, moe_inter_dim=16, inter_dim=64
    )
    records = []
    for item in a.variants.split(","):
        order, _, rest = item.partition(":")
        state, _, strategy = rest.partition(":")
        try:
            records.append(
                run_variant(
                    order, state != "off", a.ac, a.steps, args, a.backend, a.timing_steps, strategy or None
                )
            )
        except Exception as exc:  # plain torch raises for some orders (fullgraph): record it
            records.append(
                {
                    "order": order,
                    "autoweave": state != "off",
                    "ac": a.ac,
                    "strategy": strategy or "auto",
                    "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                }
            )
        dist.barrier()
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(records, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
