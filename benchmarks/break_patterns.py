"""Capture per graph-break pattern: plain torch against autoweave, in one process, one rank.

Each pattern is a block (or layer, or model) from ``tests/break_models.py`` that breaks dynamo's
graph the way real MoE code does, or checkpoints where autoweave must read code to see it.
Experts marked ``fsdp`` carry a ``torch.compiler.disable``d pre-hook, which breaks the graph
exactly as FSDP2's hooks do (a stand-in: this script runs in one process). For each pattern and
AC mode, both variants train ``--steps`` steps with a counting backend around ``--backend``;
printed (and written with ``--json``): graphs and ops captured, forward GEMMs run outside
compiled graphs in the last step, AC fallbacks per step, and the largest relative difference of
the outputs from eager.

    python benchmarks/break_patterns.py --backend inductor --json out.json

Run it from another checkout's ``PYTHONPATH`` to measure that autoweave instead (the models are
loaded from this file's checkout by path).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from measure import eager_gemms  # benchmarks/measure.py, beside this script
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave.sense import counting

HERE = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bm = _load("break_models")


_fsdp_like = bm.fsdp_like


_ac = bm.with_ac
_policy = bm.save_matmuls


def _stack(blocks: list[nn.Module]) -> nn.Module:
    return bm.Stack(blocks)


# name -> (builder(ac) returning an eager model, how it is compiled)
def _patterns() -> dict[str, Any]:
    def per_block(make: Any, fsdp: bool = False) -> Any:
        def build(ac: str) -> nn.Module:
            blocks = []
            for _ in range(3):
                block = make()
                if fsdp:
                    _fsdp_like(block.experts)
                blocks.append(_ac(block, ac))
            return _stack(blocks)

        return build

    def code_ckpt(make: Any) -> Any:
        def build(ac: str) -> nn.Module:
            blocks = [make() for _ in range(3)]
            for b in blocks:
                _fsdp_like(b.experts)
            return _stack(blocks)

        return build

    def call_layer(ac: str) -> nn.Module:
        blocks = []
        for _ in range(3):
            layer = bm.CallCheckpointLayer()
            _fsdp_like(layer.experts)
            if ac == "selective":
                layer.enable_checkpointing(
                    use_reentrant=False,
                    context_fn=functools.partial(create_selective_checkpoint_contexts, _policy),
                )
            else:
                layer.enable_checkpointing(use_reentrant=False)
            blocks.append(layer)
        return _stack(blocks)

    def whole(ac: str) -> nn.Module:
        blocks = []
        for _ in range(3):
            block = bm.PlainMoE()
            _fsdp_like(block.experts)
            wrapped = _ac(block, ac)
            _fsdp_like(wrapped)  # the block's own FSDP unit (AC, then fully_shard per block)
            blocks.append(wrapped)
        return _stack(blocks)

    return {
        "graph_break() in experts": (per_block(bm.BreakBlock), "blocks"),
        "per-expert loop (.tolist())": (per_block(bm.LoopBlock), "blocks"),
        ".item() in router + loop": (per_block(bm.ItemRouterBlock), "blocks"),
        "graph_break() in experts + FSDP unit": (per_block(bm.BreakBlock, fsdp=True), "blocks"),
        # The block's own glue holds GEMMs (an einsum combine); its experts are an FSDP unit.
        "einsum combine in the glue + FSDP unit": (per_block(bm.GlueGemmBlock), "blocks"),
        "checkpoint in __call__ (HF layer)": (call_layer, "blocks"),
        # These checkpoint in code (full AC as written): one AC mode.
        "aliased checkpoint in forward": (code_ckpt(bm.AliasCheckpointBlock), "blocks:full"),
        "checkpoint via self._ckpt": (code_ckpt(bm.AttributeCheckpointBlock), "blocks:full"),
        "checkpoint in a helper method": (code_ckpt(bm.HelperCheckpointBlock), "blocks:full"),
        "whole-model compile": (whole, "model"),
    }


def _compile(model: nn.Module, how: str, backend: Any) -> nn.Module:
    if how == "model":
        return torch.compile(model, backend=backend)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend=backend)
    return model


def _run(
    build: Any, how: str, ac: str, on: bool, backend: str, steps: int, fresh: bool = False
) -> dict[str, Any]:
    torch._dynamo.reset()
    # Each row on its own: forget breaks an earlier row taught (in autoweave builds that learn).
    try:
        from autoweave import _state

        _state.reset()
    except ImportError:  # an older build, measured from its checkout
        try:
            from autoweave.planning import learned_breaks

            learned_breaks.forget()
        except (ImportError, AttributeError):
            pass
    torch.manual_seed(0)
    eager = build(ac)
    model = copy.deepcopy(eager)
    x = torch.randn(6, bm.DIM)
    cap = counting.Capture()
    counted = cap.backend(backend)
    if on:
        model = _compile(model, how, counted)
    else:
        with autoweave.disabled():
            model = _compile(model, how, counted)
    fallbacks, diffs, compiled, times = [], [], [], []
    gemms = -1
    inputs = torch.Generator().manual_seed(1)
    for step in range(steps):
        if fresh:  # new tokens each step: data-dependent routing changes, as in training
            x = torch.randn(6, bm.DIM, generator=inputs)
        before = cap.graph_count
        start = time.perf_counter()
        with counting.FallbackCounter() as watch:
            if step == steps - 1:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = model(x)
                gemms = eager_gemms(prof)[0]
            else:
                out = model(x)
            out.square().mean().backward()
        times.append(round(time.perf_counter() - start, 3))
        compiled.append(cap.graph_count - before)
        ref = eager(x)
        ref.square().mean().backward()
        diffs.append(float(((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()))
        fallbacks.append(watch.count)
    return {
        "graphs": cap.graph_count,
        "ops": cap.ops,
        "eager_fwd_gemms": gemms,
        "fallbacks_per_step": fallbacks,
        # Graphs compiled in each step, and each step's time: the cost of learning a break
        # (and of a data-dependent loop's recompiles) until the steady state.
        "graphs_per_step": compiled,
        "step_s": times,
        "steady_from_step": next((i for i in range(len(compiled)) if not any(compiled[i:])), len(compiled)),
        "max_rel_diff": max(diffs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", default="aot_eager", help="inner backend (inductor for the README table)"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--fresh-inputs", action="store_true", help="new inputs each step (routing changes; loops recompile)"
    )
    parser.add_argument("--ac", default="full,selective")
    parser.add_argument("--only", default="", help="comma list of pattern names (substring match)")
    parser.add_argument("--label", default="now", help="name of the autoweave build measured (column)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autoweave.enable()
    rows = []
    for name, (build, how) in _patterns().items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        how, _, only_ac = how.partition(":")
        for ac in args.ac.split(","):
            if only_ac and ac != only_ac:
                continue
            for on in (False, True):
                try:
                    result = _run(build, how, ac, on, args.backend, args.steps, args.fresh_inputs)
                except Exception as exc:  # a variant that fails is a result too
                    result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
                row = {"pattern": name, "ac": ac, "autoweave": args.label if on else "off", **result}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        "| pattern | AC | autoweave | graphs | ops | eager fwd GEMMs | fallbacks per step "
        "| graphs compiled per step | step s | steady from step | max rel diff |"
    )
    print("|:--|:--|:--|--:|--:|--:|:--|:--|:--|--:|--:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['pattern']} | {r['ac']} | {r['autoweave']} | error: {r['error']} | | | | | | | |")
            continue
        print(
            f"| {r['pattern']} | {r['ac']} | {r['autoweave']} | {r['graphs']} | {r['ops']} | "
            f"{r['eager_fwd_gemms']} | {r['fallbacks_per_step']} | {r['graphs_per_step']} | "
            f"{r['step_s']} | {r['steady_from_step']} | {r['max_rel_diff']:.1e} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
