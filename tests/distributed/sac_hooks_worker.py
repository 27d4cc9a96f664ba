"""torchrun worker: the example MoE under selective AC and FSDP2, lengths varying up to the recompile
limit, then steps whose forward runs under the user's saved-tensor hooks; plain torch and autoweave.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/sac_hooks_worker.py OUT

Rank 0 writes {"<hooks>:<on|off>": {"losses": [...], "error": str | None}} to OUT.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import create_selective_checkpoint_contexts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import autoweave  # noqa: E402
from benchmarks.moe_variants import load_example  # noqa: E402

tm = load_example()
LENGTHS = (16, 12, 8, 14, 10, 6)  # a recompile limit of 2 is reached by the fifth step
HOOKED = ((6, True), (16, True), (12, False))  # then a forward under the hooks, two, and one without
HOOKS = {
    "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
}


def run(hooks: str, on: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()
    args = tm.ModelArgs(n_layers=3, dim=32, vocab_size=128, seq_len=16, moe_inter_dim=16, inter_dim=64)
    context_fn = functools.partial(create_selective_checkpoint_contexts, tm._selective_policy)
    with contextlib.nullcontext() if on else autoweave.disabled():
        model = tm.Transformer(args)
        model.init_weights(0)
        for key, block in model.layers.items():
            wrapped = cw.checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
            model.layers[key] = torch.compile(wrapped, backend="aot_eager")
        for block in model.layers.values():
            inner = tm._unwrap(block)
            if inner.moe_enabled:
                fully_shard(inner.moe.experts, mesh=mesh)  # experts: a unit of their own in the block
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    steps = [(length, False) for length in LENGTHS] + list(HOOKED)
    with torch._dynamo.config.patch(recompile_limit=2):
        for step, (length, hooked) in enumerate(steps):
            inputs, targets = tm.make_batch(step, 0, 4, args)
            shard = slice(rank * 2, rank * 2 + 2)
            try:
                with HOOKS[hooks]() if hooked else contextlib.nullcontext():
                    logits = model(inputs[shard, :length])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[shard, :length].flatten())
                loss.backward()
            except Exception as exc:
                return {"losses": losses, "error": f"step {step}: {type(exc).__name__}: {str(exc)[:300]}"}
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    return {"losses": losses, "error": None}


def main() -> None:
    dist.init_process_group("gloo")
    autoweave.enable()
    results = {f"{hooks}:{'on' if on else 'off'}": run(hooks, on) for hooks in HOOKS for on in (False, True)}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
