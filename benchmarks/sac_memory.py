"""Selective AC around a graph break: activation memory and backward GEMMs, per policy and strategy.

A stack of blocks from ``tests/break_models.py``, each ``checkpoint_wrapper(block, context_fn=policy)``
with its experts behind a ``torch.compiler.disable``d pre-hook (the graph break FSDP2's hooks make;
one process, one rank). For each selective-AC policy (save nothing, save the matmuls, torchtitan's op
list) and each way to run it (eager SAC; plain ``torch.compile`` per block, which runs the blocks
eager; autoweave's default; each strategy forced), the model trains ``--steps`` steps from the same
weights and the last step measures:

- activation memory held after the forward: the C heap in use after it minus before it (glibc
  ``mallinfo2``: every CPU tensor, whoever holds it: autograd's saved tensors, a checkpoint's inputs,
  selective AC's cache), and its ratio to eager SAC's;
- backward GEMMs: matmuls run while ``loss.backward()`` runs (recomputed and gradient ones), counted
  by a dispatch mode, so a matmul selective AC serves from its cache is not counted;
- eager forward GEMMs: matmuls of one forward run outside compiled graphs (capture);
- the largest relative difference of a step's loss from eager SAC's.

    python benchmarks/sac_memory.py [--block glue|reduce|dense] [--backend aot_eager|inductor] [--json out.json]

Prints a Markdown table; ``--json`` writes every row with the run's settings.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from break_patterns import bm  # tests/break_models, loaded beside this script
from measure import backward_gemms, forward_gemms_outside_graphs, heap_in_use  # beside this script
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers

BLOCKS = {
    "glue": bm.GlueGemmBlock,  # an einsum combine (a bmm) after the experts
    "reduce": bm.ReduceCombineBlock,  # a weighted sum after the experts: no GEMM after the break
    "dense": bm.DenseTailBlock,  # a dense MLP after the experts: its down projection ends the block
}
# (key, label): how each row runs the model.
STRATEGIES = (
    ("eager", "eager SAC (no compile)"),
    ("plain", "torch.compile per block, no autoweave"),
    ("auto", "autoweave default"),
    ("hoist", "autoweave, hoist"),
    ("pieces", "autoweave, pieces"),
)


def build(block: str, policy: str, layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        cw.checkpoint_wrapper(BLOCKS[block](dim), context_fn=bm.POLICIES[policy]) for _ in range(layers)
    ]
    return bm.Stack(blocks, dim)


def prepare(model: nn.Module, how: str, backend: str) -> nn.Module:
    if how == "eager":
        return model
    for i, layer in enumerate(model.layers):
        if how == "plain":
            with autoweave.disabled():
                model.layers[i] = torch.compile(layer, backend=backend)
            continue
        if how != "auto":
            autoweave.set_mode(layer, strategy=how)
        model.layers[i] = torch.compile(layer, backend=backend)
    return model


def picked(model: nn.Module) -> str | None:
    """The AC strategy autoweave's plan holds for the first block now (after the measuring call)."""
    dispatcher = dispatchers.dispatcher_of(model.layers[0])
    plan = dispatcher.plan if dispatcher is not None else None
    if plan is None or not plan.woven:
        return None
    decision = plan.decision("")
    return decision.action.value if decision is not None else None


def measure(block: str, policy: str, how: str, args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.reset()
    _state.reset()
    model = prepare(build(block, policy, args.layers, args.dim), how, args.backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.dim)
    losses: list[float] = []
    held = gemms = None
    for step in range(args.steps):
        last = step == args.steps - 1
        if last:
            gc.collect()
            before = heap_in_use()
        loss = model(x).square().mean()
        if last:
            after = heap_in_use()
            held = None if before is None or after is None else after - before
            gemms = backward_gemms(loss)
        else:
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "activation_bytes": held,
        "backward_gemms": gemms,
        "eager_fwd_gemms": forward_gemms_outside_graphs(model, x),
        "picked": picked(model) if how not in ("eager", "plain") else None,
    }


def rows_for(block: str, policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, reference = [], None
    for how, label in STRATEGIES:
        row: dict[str, Any] = {"block": block, "policy": policy, "strategy": how, "label": label}
        try:
            row.update(measure(block, policy, how, args))
            row["runs"] = True
        except Exception as exc:  # a strategy that fails is a result too
            row.update(runs=False, error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}")
        if how == "eager" and row["runs"]:
            reference = row
        if row["runs"] and reference is not None:
            ref_held = reference["activation_bytes"]
            row["activation_ratio"] = (
                row["activation_bytes"] / ref_held
                if ref_held and row["activation_bytes"] is not None
                else None
            )
            row["backward_gemms_vs_eager"] = row["backward_gemms"] - reference["backward_gemms"]
            row["max_rel_loss_diff"] = max(
                abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(row["losses"], reference["losses"], strict=True)
            )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| policy | strategy | runs | activations MB | ÷ eager SAC | backward GEMMs (Δ eager SAC) "
        "| eager fwd GEMMs | max rel loss diff |",
        "|:--|:--|:--|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        if not r["runs"]:
            lines.append(f"| {r['policy']} | {r['label']} | no: {r['error']} | | | | | |")
            continue
        label = r["label"] + (f" (→ {r['picked']})" if r["strategy"] == "auto" and r.get("picked") else "")
        held = r["activation_bytes"]
        ratio = r.get("activation_ratio")
        lines.append(
            f"| {r['policy']} | {label} | yes | {'—' if held is None else f'{held / 2**20:.3f}'} | "
            f"{'—' if ratio is None else f'{ratio:.2f}×'} | {r['backward_gemms']} ({r['backward_gemms_vs_eager']:+d}) | "
            f"{r['eager_fwd_gemms']} | {r['max_rel_loss_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", choices=sorted(BLOCKS), default="glue")
    parser.add_argument("--backend", default="aot_eager", help="inner backend (inductor: what users run)")
    parser.add_argument("--policies", default=",".join(bm.POLICIES), help="comma list of policy names")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="steps; the last one is measured")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autoweave.enable()
    rows = []
    for policy in args.policies.split(","):
        rows.extend(rows_for(args.block, policy, args))
    print(table(rows))
    if args.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            **{k: getattr(args, k) for k in ("block", "backend", "layers", "dim", "tokens", "steps")},
        }
        Path(args.json).write_text(json.dumps({"settings": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
