"""Step time where it counts: autoweave beside the fallback and the hand weaves, on one GPU.

One process, one device. A DeepSeek-style MoE stack (the example's ``Transformer``, one dense first
block, the MoE blocks dispatching tokens to their experts with grouped GEMMs) on FSDP2 over a 1-rank
mesh, the routed experts their own ``fully_shard`` unit, trained under full and under selective AC
in every variant below; each variant builds a fresh model from the same seed, after
``torch._dynamo.reset()``. Per variant: first-step (compile) time, median step time (CUDA events;
``perf_counter`` on CPU), tokens/s, MFU from the model's FLOPs, peak memory, forward GEMMs run outside
compiled graphs (one profiled forward), graph breaks, AC fallbacks, losses against eager; a table on
stdout, ``gpu_bench.json``, ``gpu_bench.md`` and (with matplotlib) ``gpu_bench.png`` under ``--out``.

    python benchmarks/gpu_bench.py --out OUT --cache-dir /tmp/gpu_bench_cache   # a GPU: bf16, inductor
    python benchmarks/gpu_bench.py --smoke --out OUT                            # CPU, tiny, aot_eager

``--smoke`` runs the same code with other sizes, dtype, device and backend. ``--budget-s`` bounds the
run: timed steps are cut, then whole variants skipped (recorded with the reason), the important ones
running first. See docs/gpu_bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import traceback
import types
from pathlib import Path
from typing import Any

if importlib.util.find_spec("tqdm") is None:  # examples/train_moe.py imports it; only its main() uses it
    sys.modules["tqdm"] = types.SimpleNamespace(tqdm=None)  # type: ignore[assignment]

import measure  # noqa: E402 - benchmarks/measure.py, beside this script
import moe_variants as mv  # noqa: E402 - the example model (mv.tm), the hand sibling weave, peak RSS
import qwen3_client  # noqa: E402 - the second model (--model qwen3)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402

import autoweave  # noqa: E402 - standard library only until enabled
from autoweave.sense import counting
from tests.break_models import fsdp_like  # noqa: E402 - the FSDP-hook stand-in (a disabled pre-hook)

tm = mv.tm
T0 = time.perf_counter()

# Sizes. GPU: ~4.6 B parameters (4.3 B in 7 MoE blocks of 64 experts, top-2), 32 768 tokens a step.
GPU_MODEL = dict(
    vocab_size=32768, dim=2048, n_layers=8, n_dense_layers=1, n_heads=16, inter_dim=8192,
    moe_inter_dim=1536, n_routed_experts=64, n_shared_experts=1, top_k=2, seq_len=4096,
)  # fmt: skip
SMOKE_MODEL = dict(
    vocab_size=128, dim=32, n_layers=2, n_dense_layers=1, n_heads=2, inter_dim=64,
    moe_inter_dim=16, n_routed_experts=4, n_shared_experts=1, top_k=2, seq_len=16,
)  # fmt: skip
GPU_RUN = dict(batch=8, steps=10, warmup=3, backend="inductor", dtype="bfloat16", device="cuda", max_timed_s=10.0, peak_tflops=989.0)  # fmt: skip
SMOKE_RUN = dict(batch=2, steps=2, warmup=3, backend="aot_eager", dtype="float32", device="cpu", max_timed_s=5.0, peak_tflops=None)  # fmt: skip
ALIGN = 16  # rows: each expert's group starts and ends on a multiple, as torchtitan pads them for the kernel
EXPERTS_GEMM = "auto"  # --experts-gemm

LABELS = {
    "eager": "eager: AC + FSDP2, no compile (the loss and memory reference)",
    "compile_ac": "torch.compile(AC(block)), autoweave off: the AC fallback",
    "hand_weave": "hand weave, torchtitan PR #1895: eager AC, each child compiled, experts' GEMMs compiled",
    "autoweave": "autoweave default: the fallback's code with autoweave on",
    "upper_bound": "upper bound: experts in the block's FSDP unit, so no graph break",
    "ac_compile": "AC(torch.compile(block)), autoweave off",
    "nofsdp_compile_ac": "control without FSDP: experts behind a compiler.disable'd hook, plain compile(AC)",
    "nofsdp_autoweave": "control without FSDP: the same with autoweave",
    "autoweave:hoist": "autoweave, strategy hoist (eager AC around a split compile)",
    "autoweave:pieces": "autoweave, strategy pieces (each compiled piece checkpointed)",
    "autoweave+nested": "autoweave default, dynamo's nested graph breaks on (not autoweave's default yet)",
}
# Run order: the important variants first, both AC modes, then the rest (a spent budget skips the tail).
TIERS = (
    ("eager", "compile_ac", "hand_weave", "autoweave", "upper_bound"),
    ("ac_compile",),
    ("nofsdp_compile_ac", "nofsdp_autoweave"),
    ("autoweave:hoist", "autoweave:pieces", "autoweave+nested"),
)
HAND = ("hand_weave", "ac_compile")
WOVEN = tuple(name for name in LABELS if "autoweave" in name)
AC_MODES = ("full", "selective")
# The CPU proxy (--variants census): the bound against autoweave under each strategy.
CENSUS_VARIANTS = ("upper_bound", "autoweave", "autoweave:hoist", "autoweave:pieces", "autoweave+nested")
# A break inside a function the block calls (the experts' unit, in the MoE's forward) resumes
# there with dynamo's nested graph breaks on: the MoE block is 3 graphs, not 5, and the glue
# crossing the extra boundaries (a replayed view, its backward, a summed gradient) goes back
# into the graphs. Set process-wide for the variant (``nested_variant``).
NESTED = "+nested"
# A torchtitan-style selective AC: save the GEMMs' and attention's outputs, recompute the rest.
SAVE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "max",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    if hasattr(torch.ops.aten, name)
)


def _adjust_torch_for_one_rank() -> None:
    """Two process-wide adjustments, made by main(), not at import.

    torch 2.13 at world size 1: inside a checkpoint, FSDP2's recompute of a nested unit opens more
    profiler ranges (``record_function`` ops) than its forward did (at world size 1 the forward has no
    all-gather ranges), so eager selective AC fails in backward ("profiler._record_function_enter_new.
    default invocation index 2 ... not found in storage"; the example fails so on one rank, not on two).
    Those ops only mark profiler ranges: selective AC is told to skip them (SAC_IGNORED_OPS).
    And the experts' grouped GEMMs are aten::_grouped_mm, which measure.GEMM_OPS predates.
    """
    profiler = torch.ops.profiler
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", set())
    ignored.update(
        {profiler._record_function_enter_new.default, profiler._record_function_exit._RecordFunction}
    )
    if "aten::_grouped_mm" not in measure.GEMM_OPS:
        measure.GEMM_OPS = (*measure.GEMM_OPS, "aten::_grouped_mm")


def save_list_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- #
# The MoE: tokens sorted by expert, grouped GEMMs
# --------------------------------------------------------------------------- #


def grouped_mm_for(t: torch.Tensor) -> bool:
    """``torch._grouped_mm`` for bf16 on CUDA (``--experts-gemm auto``), ``torch.bmm`` otherwise."""
    if EXPERTS_GEMM != "auto":
        return EXPERTS_GEMM == "grouped_mm"
    return hasattr(torch, "_grouped_mm") and t.is_cuda and t.dtype == torch.bfloat16


def dispatch_layout(chosen: torch.Tensor, n_experts: int, grouped: bool) -> tuple[torch.Tensor, ...]:
    """Where each (token, choice) of ``chosen`` (T, k) goes in the experts' input, sorted by expert.

    Returns ``(order, dest, offsets, rows)``: the i-th row in expert order is flat choice
    ``order[i]`` (token * k + j) and sits at row ``dest[i]`` of a ``rows``-row input; ``offsets``
    (int32) ends each expert's group. Grouped: groups start and end on multiples of ALIGN (zero rows
    pad them), the last one absorbs the slack, so every shape is static. bmm: one slot of T rows per expert
    (a token picks an expert at most once). No host sync, nothing data-dependent in a shape.
    """
    flat = chosen.reshape(-1)
    n, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.zeros(n_experts, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[expert]
    if grouped:
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        rows = (n + ALIGN - 1) // ALIGN * ALIGN + n_experts * ALIGN
        ends = torch.where(torch.arange(n_experts, device=device) == n_experts - 1, rows, ends)
    else:
        slot = chosen.shape[0]
        starts = torch.arange(n_experts, device=device) * slot
        ends = starts + slot
        rows = n_experts * slot
    return order, starts[expert] + rank, ends.to(torch.int32), rows


def _gmm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)


class SortedExperts(tm.GroupedExperts):
    """The experts' own computation on rows sorted by expert: ``(rows, D), offsets -> (rows, D)``."""

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if grouped_mm_for(x):
            return _gmm(F.silu(_gmm(x, self.w1, offsets)) * _gmm(x, self.w3, offsets), self.w2, offsets)
        xe = x.view(self.num_experts, -1, x.shape[-1])
        h = F.silu(torch.bmm(xe, self.w1.transpose(1, 2))) * torch.bmm(xe, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2)).reshape(x.shape[0], -1)


class DispatchMoE(tm.MoE):
    """Token-choice top-k MoE as trainers write it: route, sort tokens by expert, run the experts on
    their own tokens, combine. Dispatch and combine are the MoE's glue, around the experts' unit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, chosen = self.router(tokens)
        k = chosen.shape[1]
        order, dest, offsets, rows = dispatch_layout(chosen, self.n_routed_experts, grouped_mm_for(tokens))
        routed_in = tokens.new_zeros(rows, dim).index_copy(0, dest, tokens[order // k])
        routed_out = self.experts(routed_in, offsets)[dest]
        # Back to (token, choice) order: ``order`` is a permutation, so every row is written.
        per_choice = torch.empty_like(routed_out).index_copy(0, order, routed_out).view(-1, k, dim)
        routed = (per_choice * scores.unsqueeze(-1).to(per_choice.dtype)).sum(dim=1)
        return (routed + self.shared_experts(tokens)).reshape(bsz, seqlen, dim)


def param_count(a: Any) -> int:
    d, n_moe = a.dim, a.n_layers - a.n_dense_layers
    moe = d * a.n_routed_experts + 3 * d * a.moe_inter_dim * (a.n_routed_experts + a.n_shared_experts)
    blocks = a.n_layers * (2 * d + 4 * d * d) + a.n_dense_layers * 3 * d * a.inter_dim + n_moe * moe
    return 2 * a.vocab_size * d + d + blocks


def flops_per_step(a: Any, batch: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward; AC's recompute not counted)."""
    d, n_moe = a.dim, a.n_layers - a.n_dense_layers
    attention = 8 * d * d + 2 * a.seq_len * d  # q, k, v, o projections; causal QK^T and AV (half of 4·S·D)
    moe = 2 * d * a.n_routed_experts + (a.top_k + a.n_shared_experts) * 6 * d * a.moe_inter_dim
    per_token = (
        a.n_layers * attention + a.n_dense_layers * 6 * d * a.inter_dim + n_moe * moe + 2 * d * a.vocab_size
    )
    return 3.0 * per_token * batch * a.seq_len


def memory_estimate(a: Any, batch: int, elem: int) -> dict[str, float]:
    """A rough peak in GiB: weights, grads and AdamW's moments in the model dtype, plus activations."""
    t, d, n_moe = batch * a.seq_len, a.dim, a.n_layers - a.n_dense_layers
    rows, h, hs = (
        t * a.top_k + a.n_routed_experts * ALIGN,
        a.moe_inter_dim,
        a.moe_inter_dim * a.n_shared_experts,
    )
    state = 4 * elem * param_count(a)
    loss = t * a.vocab_size * (2 * elem + 12)  # logits, their fp32 copy, log-softmax, grads (fp32, dtype)
    kept = a.n_layers * t * d * elem  # each block's input, kept by any AC
    work = elem * (10 * t * d + 3 * rows * h + 2 * rows * d)  # one block recomputed for its backward
    saved = elem * (
        n_moe * (6 * t * d + 2 * rows * h + rows * d + 2 * t * hs)
        + a.n_dense_layers * (6 * t * d + 2 * t * a.inter_dim)
    )
    gib = float(2**30)
    return {
        "params_b": param_count(a) / 1e9,
        "weights_grads_adam_gib": state / gib,
        "full_ac_peak_gib": (state + loss + kept + work) / gib,
        "selective_ac_peak_gib": (state + loss + kept + work + saved) / gib,
    }


def _estimate_text() -> str:
    a, run = tm.ModelArgs(**GPU_MODEL), GPU_RUN
    est = memory_estimate(a, run["batch"], 2)
    return (
        f"GPU defaults: {est['params_b']:.2f} B parameters (bf16; weights + grads + AdamW "
        f"{est['weights_grads_adam_gib']:.0f} GiB), {run['batch']} x {a.seq_len} tokens a step, "
        f"{flops_per_step(a, run['batch']) / 1e12:.0f} TFLOP a step (model FLOPs); estimated peak "
        f"{est['full_ac_peak_gib']:.0f} GiB under full AC, {est['selective_ac_peak_gib']:.0f} GiB under "
        "selective AC, of an H200's 139 GiB. Expected: ~0.2-0.5 s a step, 10-60 s of compile a variant; "
        "the default --budget-s keeps the whole run under 8 minutes (what does not fit is skipped and "
        "recorded; a rerun with the same --cache-dir compiles warm)."
    )


# --------------------------------------------------------------------------- #
# Building a variant
# --------------------------------------------------------------------------- #


@torch.no_grad()
def init_params(model: nn.Module, seed: int, std: float) -> None:
    """Deterministic weights drawn on the parameters' device (the example's CPU draw is slow at this size)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=torch.Generator(p.device).manual_seed(seed + i))


def fresh_model(margs: Any, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    with torch.device("meta"):
        model = tm.Transformer(margs)
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.__class__ = DispatchMoE
            block.moe.experts.__class__ = SortedExperts
    model = model.to(dtype).to_empty(device=device)  # allocated once, in the model dtype
    init_params(model, seed, margs.init_std)
    return model


def build(name: str, ac: str, backend: Any, cfg: Config) -> nn.Module:
    """The model as variant ``name`` parallelizes it (AC, then compile, then FSDP, as torchtitan orders it)."""
    wrap = mv._ckpt_wrapper()  # looked up now: autoweave's patch when it is on
    ckw: dict[str, Any] = {"preserve_rng_state": False}
    if ac == "selective":
        ckw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_list_policy)
    if isinstance(cfg.margs, qwen3_client.Qwen3Args):
        fresh = functools.partial(
            qwen3_client.fresh_model, cfg.margs, cfg.device, cfg.dtype, cfg.seed, init_params
        )
        return qwen3_client.build(name, ckw, wrap, backend, cfg, fresh)
    model = fresh_model(cfg.margs, cfg.device, cfg.dtype, cfg.seed)
    base, _, strategy = name.partition(":")
    for key, block in model.layers.items():
        if base == "eager":
            model.layers[key] = wrap(block, **ckw)
        elif base == "hand_weave" and block.moe_enabled:
            mv._sibling_weave(block, backend)  # children compiled, experts' forward compiled
            model.layers[key] = wrap(block, **ckw)
        elif base == "ac_compile":
            model.layers[key] = wrap(torch.compile(block, backend=backend), **ckw)
        else:  # torch.compile(AC(block)): the fallback, autoweave, the upper bound, the controls, dense blocks
            if base.startswith("nofsdp") and block.moe_enabled:
                fsdp_like(block.moe.experts)
            wrapped = wrap(block, **ckw)
            if strategy:
                autoweave.set_mode(wrapped, strategy=strategy)
            model.layers[key] = torch.compile(wrapped, backend=backend)
    if not base.startswith("nofsdp"):
        tm.apply_fsdp(model, cfg.mesh, cfg.expert_mesh, "shared" if base == "upper_bound" else "separate")
    return model


# --------------------------------------------------------------------------- #
# Running a variant
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Config:
    args: argparse.Namespace
    margs: Any
    device: torch.device
    dtype: torch.dtype
    seed: int
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    mesh: Any = None
    expert_mesh: Any = None
    cache_root: Path | None = None
    autoweave_problem: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else measure.heap_in_use()


def _train_step(
    model: nn.Module, opt: Any, batch: tuple[torch.Tensor, torch.Tensor], logits: Any = None
) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs) if logits is None else logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _timed(cfg: Config, fn: Any, n: int) -> list[float]:
    """Seconds of each of ``n`` calls: CUDA events on a GPU (no sync between steps), perf_counter on CPU."""
    if not cfg.cuda:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(cfg.device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _use_cache(cfg: Config, key: str) -> bool:
    """Point inductor's and triton's caches at this variant's own folder; was it warm already?"""
    if cfg.cache_root is None:
        return False
    folder = (
        cfg.cache_root if cfg.args.shared_cache else cfg.cache_root / re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    )
    warm = folder.is_dir() and any(folder.iterdir())
    folder.mkdir(parents=True, exist_ok=True)
    if not cfg.args.shared_cache:  # nor in memory: what inductor's own fresh_cache() clears
        from torch._inductor import utils as inductor_utils

        getattr(inductor_utils, "clear_caches", lambda: None)()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return warm


def _switch_autoweave(on: bool, cfg: Config) -> str | None:
    """Turn autoweave on or off in this process; the reason it cannot be on, if it cannot."""
    if not on:
        autoweave.disable()
        return None
    if cfg.autoweave_problem:
        return cfg.autoweave_problem
    try:
        if autoweave.enable():
            return None
        reason = autoweave.startup.off_reason() or "autoweave.enable() returned False"
    except Exception as exc:  # noqa: BLE001 - recorded, the other variants still run
        reason = f"autoweave.enable() raised {type(exc).__name__}: {exc}"
    cfg.autoweave_problem = reason
    return reason


def nested_variant(name: str) -> Any:
    """The variant's dynamo config: nested graph breaks on for a ``+nested`` one (torch 2.11+ has the switch)."""
    if not name.endswith(NESTED):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(nested_graph_breaks=True)


def run_variant(name: str, ac: str, cfg: Config, deadline: float) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "key": f"{ac}/{name}",
        "variant": name,
        "ac": ac,
        "label": LABELS[name],
        "status": "ok",
    }
    weave = name in WOVEN
    problem = _switch_autoweave(weave, cfg)
    if problem:
        return {**rec, "status": "skipped", "reason": f"autoweave unavailable: {problem}"}
    rec["autoweave_on"] = autoweave.is_enabled()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rec["cache_warm"] = _use_cache(cfg, rec["key"])
    a = cfg.args
    cap = counting.Capture()
    backend = cap.backend(a.backend)
    if a.census:  # graphs without a backward (a resume frame that only routes) run inside a range too
        backend = measure.graphs_in_range(backend)
    fallbacks = counting.FallbackCounter().install()
    rss_scope = mv._reset_peak_rss()
    if cfg.cuda:
        torch.cuda.reset_peak_memory_stats(cfg.device)
    started = time.perf_counter()
    model = opt = None
    losses: list[torch.Tensor] = []
    try:
        model = build(name, ac, backend, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        batch = cfg.batches

        def step(i: int, logits: Any = None) -> None:
            losses.append(_train_step(model, opt, batch[i % len(batch)], logits))

        start = time.perf_counter()
        step(0)  # compiles
        cfg.sync()
        rec["first_step_s"] = time.perf_counter() - start
        start = time.perf_counter()
        before = cfg.allocated()  # activations held for backward: what an AC strategy changes
        logits = model(batch[1 % len(batch)][0])
        after = cfg.allocated()
        step(1, logits)
        cfg.sync()
        estimate = time.perf_counter() - start
        del logits
        rec["held_for_backward_mib"] = (
            (after - before) / 2**20 if before is not None and after is not None else None
        )
        # One profiled forward, after every compile, its output dropped (a backward through an eager
        # selective checkpoint would meet the profiler's own ops): GEMMs run outside compiled graphs.
        rec["eager_fwd_gemms"] = measure.forward_gemms_outside_graphs(model, batch[2 % len(batch)][0])
        step(2)
        for i in range(3, a.warmup):
            step(i)
        cfg.sync()
        if a.census:  # one more step, profiled: what runs outside compiled graphs (issue 42)
            inputs, targets = batch[0]
            prof = measure.profiled_step(
                lambda: model(inputs),
                lambda logits: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward(),
            )
            opt.zero_grad(set_to_none=True)
            rec["census"] = measure.step_census(prof)
            rec["breakdown"] = measure.step_breakdown(prof)
        rec["warmup_peak_mem_gib"] = torch.cuda.max_memory_allocated(cfg.device) / 2**30 if cfg.cuda else None
        if cfg.cuda:
            torch.cuda.reset_peak_memory_stats(cfg.device)
        n = min(a.steps, max(1, int(a.max_timed_s / max(estimate, 1e-9))))
        if time.perf_counter() > deadline:
            n = min(n, 2)
            rec["note"] = "timed steps cut to 2: the budget is spent"
        rec["timed_steps"] = n
        counter = iter(range(a.warmup, a.warmup + n))
        times = _timed(cfg, lambda: step(next(counter)), n)
        rec["step_s_all"] = times
        rec["step_s"] = statistics.median(times)
        rec["tokens_per_s"] = a.batch * cfg.margs.seq_len / rec["step_s"]
        if a.peak_tflops:
            rec["mfu"] = (
                _fns(cfg.margs).flops_per_step(cfg.margs, a.batch) / rec["step_s"] / (a.peak_tflops * 1e12)
            )
        if cfg.cuda:
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(cfg.device) / 2**30
            rec["peak_mem_kind"] = "torch.cuda.max_memory_allocated, timed steps"
        else:  # no peak counter for the C heap: its use at the top of a step, the forward done
            rec["peak_mem_gib"] = after / 2**30 if after is not None else None
            rec["peak_mem_kind"] = "C heap in use after a forward, before its backward (mallinfo2)"
            rec["peak_rss_mib"], rec["peak_rss_scope"] = mv._peak_rss_mb(), rss_scope
    except Exception as exc:  # noqa: BLE001 - one variant's failure is a row, not the end of the run
        rec["status"] = "error"
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        fallbacks.uninstall()
        breaks = torch._dynamo.utils.counters["graph_break"]
        rec["graph_breaks"] = sum(breaks.values())
        rec["graph_break_reasons"] = {reason[:200]: count for reason, count in list(breaks.items())[:4]}
        rec["ac_fallbacks"] = fallbacks.count
        rec["ac_fallback_messages"] = [m[:300] for m in fallbacks.messages[:2]]
        rec["graphs"], rec["ops"] = cap.graph_count, cap.ops
        rec["losses"] = [float(x) for x in losses]
        rec["final_loss"] = rec["losses"][-1] if rec["losses"] else None
        rec["wall_s"] = time.perf_counter() - started
        # The step closure holds them too: drop the last references before the next variant.
        model = opt = None
        losses.clear()
        torch._dynamo.reset()  # compiled code, and what its guards hold
        gc.collect()
        if cfg.cuda:
            torch.cuda.empty_cache()
    return rec


# --------------------------------------------------------------------------- #
# Summaries: ratios, checks, targets, table, chart
# --------------------------------------------------------------------------- #


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Ratios into each record (in place); the graph-break checks and the issue's targets per AC mode."""
    by = {r["key"]: r for r in records if r["status"] == "ok"}
    checks, targets = {}, {}
    for ac in AC_MODES:
        eager = by.get(f"{ac}/eager") or next((r for r in by.values() if r["variant"] == "eager"), None)
        plain, weave, hand_weave = (by.get(f"{ac}/{n}") for n in ("compile_ac", "autoweave", "hand_weave"))
        hands = [r for r in (by.get(f"{ac}/{n}") for n in HAND) if r and r.get("step_s")]
        best = min(hands, key=lambda r: r["step_s"]) if hands else None
        for rec in (r for r in by.values() if r["ac"] == ac):
            rec["ratio_vs_best_hand"] = _ratio(rec.get("step_s"), best and best["step_s"])
            rec["best_hand"] = best and best["variant"]
            rec["ratio_vs_plain_compile_ac"] = _ratio(rec.get("step_s"), plain and plain.get("step_s"))
            rec["peak_mem_vs_eager"] = _ratio(rec.get("peak_mem_gib"), eager and eager.get("peak_mem_gib"))
            upper = by.get(f"{ac}/upper_bound")
            rec["ratio_vs_bound"] = _ratio(rec.get("step_s"), upper and upper.get("step_s"))
            held, peak = rec.get("held_for_backward_mib"), rec.get("peak_mem_gib")
            rec["held_share_of_peak"] = held / (peak * 1024) if held is not None and peak else None
            ref = eager["losses"] if eager else []
            n = min(len(ref), len(rec["losses"]), cfg.args.warmup)
            diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(rec["losses"][:n], ref[:n], strict=True)]
            rec["max_rel_loss_diff"] = max(diffs) if diffs else None
            rec["loss_match"] = None if not diffs else rec["max_rel_loss_diff"] <= cfg.args.loss_rtol
        if plain:
            checks[ac] = {
                "plain_compile_ac_graph_breaks": plain["graph_breaks"],
                "plain_compile_ac_ac_fallbacks": plain["ac_fallbacks"],
                "graph_break_present": plain["graph_breaks"] > 0,
                "ac_fallback_present": plain["ac_fallbacks"] > 0,
                "world_size": 1,
            }
        if weave:
            targets[ac] = _targets(weave, plain, hand_weave, ac)
    return {"checks": checks, "targets": targets}


def _target(value: float | None, op: str, bound: float) -> dict[str, Any]:
    met = None if value is None else (value <= bound if op == "<=" else value >= bound)
    return {"value": value, "target": f"{op} {bound}", "met": met}


def _targets(weave: dict, plain: dict | None, hand: dict | None, ac: str) -> dict:
    """The targets for the autoweave default (issue 21's, then issue 42's), each with its value and whether it is met."""
    plain_vs_weave = _ratio(plain and plain.get("step_s"), weave.get("step_s"))
    return {
        # Issue 42: at the bound (the same code, the experts not nested), and well ahead of plain.
        "autoweave_step_vs_bound": _target(weave.get("ratio_vs_bound"), "<=", 1.02 if ac == "full" else 1.03),
        "plain_compile_ac_step_vs_autoweave_issue42": _target(plain_vs_weave, ">=", 1.5),
        "autoweave_step_vs_best_hand": _target(weave.get("ratio_vs_best_hand"), "<=", 1.02),
        "plain_compile_ac_step_vs_autoweave": _target(plain_vs_weave, ">=", 1.2),
        "autoweave_peak_mem_vs_eager": _target(weave.get("peak_mem_vs_eager"), "<=", 1.05),
        "autoweave_first_step_vs_hand_weave": _target(
            _ratio(weave.get("first_step_s"), hand and hand.get("first_step_s")), "<=", 1.0
        ),
    }


COLUMNS = (
    ("variant", "variant"), ("ac", "AC"), ("first_step_s", "first step s"), ("step_s", "median step ms"),
    ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("peak_mem_gib", "peak mem GiB"),
    ("held_for_backward_mib", "held for bwd MiB"), ("held_share_of_peak", "held ÷ peak"),
    ("eager_fwd_gemms", "eager fwd GEMMs"), ("graphs", "graphs"),
    ("graph_breaks", "graph breaks"), ("ac_fallbacks", "AC fallbacks"), ("max_rel_loss_diff", "max rel loss diff"),
    ("ratio_vs_best_hand", "step ÷ best hand"), ("ratio_vs_plain_compile_ac", "step ÷ plain compile(AC)"),
    ("ratio_vs_bound", "step ÷ bound"),
)  # fmt: skip


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "—"
    formats = {
        "first_step_s": "{:.1f}", "step_s": "{:.1f}", "tokens_per_s": "{:,.0f}", "mfu": "{:.1%}",
        "peak_mem_gib": "{:.2f}", "held_for_backward_mib": "{:.1f}", "max_rel_loss_diff": "{:.1e}",
        "ratio_vs_best_hand": "{:.2f}×", "ratio_vs_plain_compile_ac": "{:.2f}×", "ratio_vs_bound": "{:.3f}×",
        "held_share_of_peak": "{:.0%}",
    }  # fmt: skip
    if key == "step_s":
        value *= 1e3
    return formats[key].format(value) if key in formats else str(value)


def _shape_text(meta: dict[str, Any]) -> str:
    m = meta["model"]
    if "num_hidden_layers" in m:  # --model qwen3
        return (
            f"transformers Qwen3-MoE, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_experts']} experts top-{m['num_experts_per_tok']}, experts: {m['experts_impl']}"
        )
    return (
        f"the example MoE, {m['n_layers']} blocks, dim {m['dim']}, {m['n_routed_experts']} experts "
        f"top-{m['top_k']}, experts' GEMMs: {meta['experts_gemm']}"
    )


def markdown(records: list[dict[str, Any]], meta: dict[str, Any], summary: dict[str, Any]) -> str:
    a = meta["args"]
    title = "CPU smoke run (format check, not a result)" if a["smoke"] else f"{meta['device_name']}"
    lines = [
        f"### gpu_bench: {title}",
        "",
        f"{meta['params']:,} parameters ({_shape_text(meta)}), "
        f"{a['batch']} x {meta['model']['seq_len']} tokens, {a['dtype']}, backend {a['backend']}, FSDP2 on 1 rank "
        f"({meta['pg_backend']}); torch {meta['torch']}; {meta['date']}; {meta['wall_s']:.0f} s.",
        "",
        "| " + " | ".join(h for _, h in COLUMNS) + " |",
        "|" + "|".join(":--" if k in ("variant", "ac") else "--:" for k, _ in COLUMNS) + "|",
    ]
    for rec in records:
        if rec["status"] != "ok":
            what = rec.get("reason") or rec.get("error") or ""
            cells = [rec["variant"], rec["ac"], f"**{rec['status']}**: {what[:150]}"] + [""] * (
                len(COLUMNS) - 3
            )
        else:
            cells = [_fmt(k, rec.get(k)) for k, _ in COLUMNS]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    lines += ["", "Targets (autoweave default):", ""]
    for ac, found in summary["targets"].items():
        for name, t in found.items():
            value = "—" if t["value"] is None else f"{t['value']:.3f}"
            lines.append(f"- {ac} AC: {name} = {value} (target {t['target']}): {_met(t['met'])}")
    for ac, check in summary["checks"].items():
        lines.append(
            f"- {ac} AC, plain compile(AC(block)) at world size 1: {check['plain_compile_ac_graph_breaks']} graph "
            f"break(s), {check['plain_compile_ac_ac_fallbacks']} AC fallback(s)"
        )
    return "\n".join(lines) + "\n"


def _met(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


def chart(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["status"] == "ok" and r.get("step_s")]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.35 * len(ok) + 2))
    names = [f"{r['ac']}: {r['variant']}" for r in ok]
    colors = [
        "#d62728" if r["variant"] == "autoweave" else "#1f77b4" if r["ac"] == "full" else "#2ca02c"
        for r in ok
    ]
    for ax, key, title in (
        (axes[0], "step_s", "median step time, ms (lower is faster)"),
        (axes[1], "eager_fwd_gemms", "forward GEMMs outside compiled graphs"),
    ):
        values = [(r.get(key) or 0) * (1e3 if key == "step_s" else 1) for r in ok]
        ax.barh(range(len(ok)), values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.1f}" if key == "step_s" else f" {v:.0f}", va="center", fontsize=8)
        ax.set_yticks(range(len(ok)), names if key == "step_s" else [""] * len(ok), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.15)
    smoke = " (CPU smoke: not a result)" if meta["args"]["smoke"] else ""
    fig.suptitle(
        f"gpu_bench on {meta['device_name']}, {meta['args']['backend']}, torch {meta['torch']}{smoke}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=textwrap.fill(_estimate_text(), 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json, .md and .png")
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model, float32, aot_eager: the same code path"
    )
    p.add_argument("--ac", default="full,selective", help="comma list of AC modes (full, selective)")
    p.add_argument(
        "--variants", default=None, help=f"comma list of variants to run (default all: {', '.join(LABELS)})"
    )
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds for the run, after the imports (default 420)"
    )
    p.add_argument(
        "--max-timed-s", type=float, default=None, help="seconds of timed steps per variant at most"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="inductor/triton caches (one folder per variant): a rerun is warm",
    )
    p.add_argument(
        "--shared-cache",
        action="store_true",
        help="one cache folder for all variants (faster; first steps not comparable)",
    )
    p.add_argument("--backend", default=None, help="compile backend (GPU: inductor, smoke: aot_eager)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda, smoke cpu)")
    p.add_argument(
        "--dtype", default=None, choices=("bfloat16", "float32"), help="model dtype (GPU bf16, smoke fp32)"
    )
    p.add_argument("--experts-gemm", default="auto", choices=("auto", "grouped_mm", "bmm"))
    p.add_argument(
        "--model",
        dest="model_name",
        default="example",
        choices=("example", "qwen3"),
        help="the example MoE, or transformers' Qwen3-MoE at Qwen3-30B-A3B's layer shapes (qwen3_client.py)",
    )
    p.add_argument(
        "--experts-impl",
        default="grouped_mm",
        help="qwen3: transformers' experts_implementation (grouped_mm, batched_mm, eager)",
    )
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (GPU 10, smoke 2)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first, at least 3 (compile, memory, profile)"
    )
    p.add_argument("--layers", type=int, default=None, help="blocks, the first dense")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="routed experts per MoE block")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="peak for MFU (GPU default 989: H200 bf16 dense)"
    )
    p.add_argument(
        "--loss-rtol", type=float, default=None, help="losses match eager within (bf16 2e-2, fp32 1e-4)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--census",
        action="store_true",
        help="profile one step after warm-up: aten ops outside compiled graphs, graphs called (with "
        "--variants census: the bound and autoweave's strategies only, and the census table)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.batch_given = a.batch is not None  # else fitted to the device's memory (fit_batch)
    qwen3 = a.model_name == "qwen3"
    if qwen3:
        model = dict(qwen3_client.SMOKE_MODEL if a.smoke else qwen3_client.GPU_MODEL)
        keys = ("num_hidden_layers", "hidden_size", "seq_len", "num_experts")
        if not a.smoke and a.batch is None:
            a.batch = qwen3_client.GPU_RUN["batch"]
    else:
        model = dict(SMOKE_MODEL if a.smoke else GPU_MODEL)
        keys = ("n_layers", "dim", "seq_len", "n_routed_experts")
    for flag, key in zip(("layers", "dim", "seq_len", "experts"), keys, strict=True):
        if getattr(a, flag) is not None:
            model[key] = getattr(a, flag)
    a.model = model
    for key, value in (SMOKE_RUN if a.smoke else GPU_RUN).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.loss_rtol is None:
        a.loss_rtol = 2e-2 if a.dtype == "bfloat16" else 1e-4
    a.ac_modes = [m for m in a.ac.split(",") if m]
    if a.variants == "census":
        a.variants, a.census = ",".join(CENSUS_VARIANTS), True
    wanted = a.variants.split(",") if a.variants else list(LABELS)
    if qwen3:  # the hand weave and the controls without FSDP are the example's own
        wanted = [v for v in wanted if v in qwen3_client.VARIANTS]
    unknown = sorted(set(wanted) - set(LABELS)) + sorted(set(a.ac_modes) - set(AC_MODES))
    if unknown:
        p.error(f"unknown variant(s) or AC mode(s): {', '.join(unknown)}")
    a.plan = [(ac, v) for tier in TIERS for ac in a.ac_modes for v in tier if v in wanted]
    if a.warmup < 3 or a.steps < 1 or model["num_hidden_layers" if qwen3 else "n_layers"] < 2:
        p.error("--warmup must be at least 3, --steps at least 1, --layers at least 2")
    return a


def fit_batch(estimate: Any, batch: int, device_gib: float, share: float = 0.92) -> tuple[int, dict | None]:
    """The default batch, halved until the estimated peak (``estimate(batch)``, GiB, the larger of the
    AC modes) fits ``share`` of the device's memory: a lent machine may be an H100 (78 GiB) where
    the defaults were sized on an H200 (139 GiB), and an OOM would cost a variant's row. Returns
    the batch and, when it changed, what was fitted (recorded in the JSON's meta)."""

    def peak_at(b: int) -> float:
        return max(estimate(b).get(k, 0.0) for k in ("full_ac_peak_gib", "selective_ac_peak_gib"))

    first, peak = batch, peak_at(batch)
    while batch > 1 and peak > share * device_gib:
        batch //= 2
        peak = peak_at(batch)
    if batch == first:
        return batch, None
    return batch, {
        "from": first,
        "to": batch,
        "device_gib": round(device_gib, 1),
        "estimated_peak_gib": round(peak, 1),
    }


def _warmup_compiler(backend: str, device: torch.device) -> None:
    """Pay the process's one-time compiler start-up before the first variant."""
    t = torch.ones(16, device=device, requires_grad=True)
    torch.compile(lambda v: (v.cos() + 1).sum(), backend=backend)(t).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _built_params(margs: Any) -> int:
    if isinstance(margs, qwen3_client.Qwen3Args):
        return qwen3_client.built_params(margs)
    with torch.device("meta"):
        return sum(p.numel() for p in tm.Transformer(margs).parameters())


def _fns(margs: Any) -> Any:
    """The model's counting functions: the example's (this module) or the Qwen3 client's."""
    if isinstance(margs, qwen3_client.Qwen3Args):
        return qwen3_client
    return types.SimpleNamespace(
        param_count=param_count, flops_per_step=flops_per_step, memory_estimate=memory_estimate
    )


def _meta(a: argparse.Namespace, cfg: Config, est: dict[str, float]) -> dict[str, Any]:
    aw_env = {k: v for k, v in os.environ.items() if k.startswith("AUTOWEAVE")}
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device_name": torch.cuda.get_device_name(cfg.device)
        if cfg.cuda
        else f"CPU ({os.cpu_count()} cores)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "plan"},
        "model": dataclasses.asdict(cfg.margs),
        "params": _built_params(cfg.margs),
        "params_analytic": _fns(cfg.margs).param_count(cfg.margs),
        "params_b": _fns(cfg.margs).param_count(cfg.margs) / 1e9,
        "memory_estimate_gib": est,
        "flops_per_step": _fns(cfg.margs).flops_per_step(cfg.margs, a.batch),
        "tokens_per_step": a.batch * cfg.margs.seq_len,
        "experts_gemm": "torch._grouped_mm"
        if grouped_mm_for(torch.empty(0, device=cfg.device, dtype=cfg.dtype))
        else "torch.bmm",
        "pg_backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "autoweave": {"version": autoweave.__version__, "env": aw_env},
        "cache_root": str(cfg.cache_root) if cfg.cache_root else None,
        "plan": [f"{ac}/{v}" for ac, v in a.plan],
        "sac_ignores_record_function": True,  # see _adjust_torch_for_one_rank
        "note": "CPU smoke: a format check, not a result" if a.smoke else "",
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    _adjust_torch_for_one_rank()
    global EXPERTS_GEMM
    EXPERTS_GEMM = a.experts_gemm
    a.out.mkdir(parents=True, exist_ok=True)
    own_cache = a.cache_dir is None
    cache_root = Path(tempfile.mkdtemp(prefix="gpu_bench_cache_")) if own_cache else a.cache_dir
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_bench: no CUDA device here; --smoke runs on the CPU")
        device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{tm._free_port()}",
        rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}),
    )  # fmt: skip
    qwen3 = a.model_name == "qwen3"
    margs = qwen3_client.model_args(a.model, a.experts_impl) if qwen3 else tm.ModelArgs(**a.model)
    dtype = getattr(torch, a.dtype)
    a.batch_fitted = None
    if device.type == "cuda" and not a.batch_given:
        device_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        estimate = functools.partial(_fns(margs).memory_estimate, margs, elem=dtype.itemsize)
        a.batch, a.batch_fitted = fit_batch(estimate, a.batch, device_gib)
        if a.batch_fitted:
            log(f"batch {a.batch_fitted['from']} -> {a.batch}: the estimated peak fits {device_gib:.0f} GiB")
    batches = []
    for step in range(3):  # the same data for every variant; steps cycle through it
        inputs, targets = (qwen3_client if qwen3 else tm).make_batch(step, a.seed, a.batch, margs)
        batches.append((inputs.to(device), targets.to(device)))
    cfg = Config(a, margs, device, dtype, a.seed, batches, cache_root=cache_root)
    cfg.mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    cfg.expert_mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("ep_fsdp",))
    est = _fns(margs).memory_estimate(margs, a.batch, dtype.itemsize)
    meta = _meta(a, cfg, est)
    log(f"{meta['params_b']:.3f} B params on {meta['device_name']}; estimated peak {est['full_ac_peak_gib']:.1f} GiB "
        f"(full AC) / {est['selective_ac_peak_gib']:.1f} GiB (selective); {len(a.plan)} variants, budget {a.budget_s:.0f} s")  # fmt: skip
    _use_cache(cfg, "warmup")
    try:
        _warmup_compiler(a.backend, device)
    except Exception as exc:  # noqa: BLE001 - the variants still run (and say what fails)
        log(f"compiler warm-up failed: {type(exc).__name__}: {exc}")
    start = time.perf_counter()
    deadline = T0 + a.budget_s  # counted from the end of the imports: the compiler warm-up is in it
    records: list[dict[str, Any]] = []
    for ac, name in a.plan:
        now = time.perf_counter()
        done = [
            r["wall_s"]
            for r in records
            if r["status"] == "ok" and (r["variant"] == "eager") == (name == "eager")
        ]
        guess = max(done, default=0.0)  # the longest such variant so far: a late start rarely overruns
        if now >= deadline or now + guess > deadline:
            reason = f"budget: {deadline - now:.0f} s of --budget-s {a.budget_s:.0f} left, such a variant took ~{guess:.0f} s"
            records.append({"key": f"{ac}/{name}", "variant": name, "ac": ac, "label": LABELS[name], "status": "skipped", "reason": reason})  # fmt: skip
            log(f"skip {ac}/{name}: {reason}")
            continue
        log(f"run {ac}/{name}")
        with nested_variant(name):
            rec = run_variant(name, ac, cfg, deadline)
        records.append(rec)
        what = (
            f"step {rec['step_s'] * 1e3:.1f} ms"
            if rec.get("step_s")
            else rec.get("reason") or rec.get("error")
        )
        log(f"  {rec['status']} in {rec.get('wall_s', 0):.1f} s: {what}")
        _write(records, meta, cfg, start, with_chart=False)
    autoweave.disable()
    table = _write(records, meta, cfg, start, with_chart=True)
    sys.stdout.write(table)
    dist.destroy_process_group()
    if own_cache:
        shutil.rmtree(cache_root, ignore_errors=True)
    log(f"done in {time.perf_counter() - T0:.0f} s; {a.out / 'gpu_bench.json'}")
    return 0


def _write(
    records: list[dict[str, Any]], meta: dict[str, Any], cfg: Config, start: float, with_chart: bool
) -> str:
    """The JSON and the table so far (a run cut short still leaves them); the chart at the end."""
    summary = summarize(records, cfg)
    meta["wall_s"] = time.perf_counter() - T0
    meta["variants_wall_s"] = time.perf_counter() - start
    skipped = [{"key": r["key"], "reason": r["reason"]} for r in records if r["status"] == "skipped"]
    errors = [{"key": r["key"], "error": r["error"]} for r in records if r["status"] == "error"]
    data = {"meta": meta, "variants": records, "skipped": skipped, "errors": errors, **summary}
    out = cfg.args.out
    (out / "gpu_bench.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    table = markdown(records, meta, summary) + census_table(records) + breakdown_table(records)
    (out / "gpu_bench.md").write_text(table)
    if with_chart:
        try:
            chart(records, meta, out / "gpu_bench.png")
        except ImportError:
            log("matplotlib is not installed: no chart")
    return table


def census_table(records: list[dict[str, Any]]) -> str:
    """The census of each variant profiled (``--census``): ops outside graphs and graphs, per phase.

    "beyond the bound": the aten ops a variant ran outside compiled graphs and outside FSDP's hooks,
    forward and backward, more often than the bound of the same AC mode did (op: extra calls); each
    is a candidate to move into a graph. FSDP's ops are the units' own (the nested unit adds its
    hooks' copies and collectives: the bound has no such unit).
    """
    rows = [r for r in records if r.get("census")]
    if not rows:
        return ""
    lines = [
        "\n### Census: one training step after warm-up, ops outside compiled graphs\n",
        "| AC | variant | fwd eager ops | fwd FSDP ops | fwd graphs | bwd eager ops | bwd FSDP ops "
        "| recompute graphs | bwd graphs | eager ops beyond the bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fwd, bwd = r["census"]["forward"], r["census"]["backward"]
        bound = next((b for b in rows if b["ac"] == r["ac"] and b["variant"] == "upper_bound"), None)
        extra = "-"
        if bound is not None and bound is not r:
            ours: dict[str, int] = {}
            for phase in ("forward", "backward"):
                for op, n in r["census"][phase]["eager_by_op"].items():
                    ours[op] = ours.get(op, 0) + n - bound["census"][phase]["eager_by_op"].get(op, 0)
            extra = ", ".join(f"{op.removeprefix('aten::')} +{n}" for op, n in sorted(ours.items()) if n > 0)
            extra = extra or "none"
        lines.append(
            f"| {r['ac']} | {r['variant']} | {fwd['eager_ops']} | {fwd['fsdp_ops']} | {fwd['forward_graphs']} "
            f"| {bwd['eager_ops']} | {bwd['fsdp_ops']} | {bwd['forward_graphs']} | {bwd['backward_graphs']} | {extra} |"
        )
    return "\n".join(lines) + "\n"


def breakdown_table(records: list[dict[str, Any]]) -> str:
    """Where the profiled step's time went (``--census``), forward and backward summed, per category.

    On a GPU: kernel time charged to the CPU op that launched it, and the device's idle time within
    each phase; on the CPU proxy: each CPU event's self time (no idle column). "top eager" names the
    eager ops that took most of the eager time.
    """
    rows = [r for r in records if r.get("breakdown")]
    if not rows:
        return ""
    kind = rows[0]["breakdown"]["time_kind"]
    head = " | ".join(f"{c} ms" for c in measure.BREAKDOWN)
    lines = [
        f"\n### Breakdown of the profiled step ({kind})\n",
        f"| AC | variant | {head} | kernels | host syncs | top eager |",
        "|---|---|" + "---|" * (len(measure.BREAKDOWN) + 3),
    ]
    for r in rows:
        phases = [r["breakdown"][p] for p in ("forward", "backward")]
        cells = []
        for c in measure.BREAKDOWN:
            values = [p["ms"][c] for p in phases if p["ms"][c] is not None]
            cells.append(f"{sum(values):.2f}" if values else "—")
        counts = [sum(p["kernels"].values()) for p in phases if p["kernels"] is not None]
        eager: dict[str, float] = {}
        for p in phases:
            for op, t in p["eager_ms_by_op"].items():
                eager[op] = eager.get(op, 0.0) + t
        top = ", ".join(
            f"{op.removeprefix('aten::')} {t:.2f}"
            for op, t in sorted(eager.items(), key=lambda kv: -kv[1])[:3]
        )
        lines.append(
            f"| {r['ac']} | {r['variant']} | {' | '.join(cells)} | {sum(counts) if counts else '—'} "
            f"| {sum(p['host_syncs'] for p in phases)} | {top or '-'} |"
        )
    return "\n".join(lines) + "\n"


def log(message: str) -> None:
    print(f"[gpu_bench {time.perf_counter() - T0:6.1f}s] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
