"""torchrun worker: a hand-written FSDP2 training loop as trainers write it, plain torch against autoweave.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/trainer_loop_worker.py OUT

The model is torchtitan's order on an MoE: each block ``checkpoint_wrapper``ed, compiled in place
(``.compile(backend="aot_eager")``), then ``fully_shard`` on its ``experts`` (a unit inside the
block's), on the block and on the root. The loop does what trainers do around the step and what no
other test puts together:

- gradient accumulation over two micro-batches of different lengths, with FSDP2's gradient sync
  off for all but the last (``set_requires_gradient_sync``, as torchtitan, accelerate and Lightning
  do for FSDP2): the first backward keeps unsharded gradients, the second reduce-scatters;
- gradient clipping (``clip_grad_norm_`` over the DTensor parameters), its total norm recorded;
- an evaluation pass every other step: ``model.eval()``, ``torch.no_grad()``, then ``model.train()``;
- the model's state at the end read with ``get_model_state_dict`` (full tensors), as a checkpoint
  would save it; in ``resume``, half-way through, a fresh model and optimizer built the same way and
  loaded from the running ones' ``get_state_dict`` (a job resumed from its checkpoint).

Each variant runs with autoweave off and on (``VARIANTS``: full AC; selective AC saving the matmuls;
the evaluation under ``inference_mode``; the embedding and routers frozen; bf16 parameters under
FSDP2's ``MixedPrecisionPolicy``; ``whole``: no per-block compile, the sharded model
``torch.compile``d whole, as accelerate and the HF Trainer do; ``resume``; ``autocast``: the
forward under bf16 autocast; ``hooks``: a forward and a full backward hook on each block's ``mix``
logging norms with ``.item()``; ``no-reshard``: every unit ``reshard_after_forward=False``;
``prefetch``: each unit prefetches the next in forward and the previous in backward;
``dropout``: each block drops 10% of its mix's output, the masks drawn again in recompute;
``zero-grads``: ``zero_grad(set_to_none=False)``; ``rl``: each micro-batch first run through the same
model under ``no_grad`` in train mode, its output part of the loss, as RL's old policy; ``accum``: 1,
3 or 2 micro-batches a step, of lengths seen and new; ``unfreeze``: the routers frozen, in the
optimizer all along, and trained from step ``UNFREEZE_AT`` on), and
``bf16-bound`` and ``autocast-bound`` run those blocks compiled without AC, the reference a
compile's bf16 numerics are compared with. Rank 0 writes, per run: each micro-batch's loss, each
step's gradient norm, ``grad is None`` per parameter after each step's backward, each evaluation's
loss, the frames dynamo converted in each step (all ranks), dynamo's unique graphs, what the hooks
recorded, and the final state dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import autoweave  # noqa: E402

DIM, EXPERTS, LAYERS, STEPS = 16, 4, 3, 6
VARIANTS = (
    "full",
    "sac",
    "bf16",
    "inference",
    "frozen",
    "whole",
    "resume",
    "autocast",
    "hooks",
    "no-reshard",
    "prefetch",
    "dropout",
    "zero-grads",
    "rl",
    "accum",
    "unfreeze",
)
LENGTHS = (6, 4)  # the micro-batches' sequence lengths: the second is shorter
# ``accum``: 1, 3 or 2 micro-batches a step (a token budget per step, as packing trainers fill it).
LENGTHS_BY_STEP = ((6,), (6, 4, 5), (4, 6), (5,), (6, 4, 5), (4, 6))
UNFREEZE_AT = 3  # ``unfreeze``: the routers trained from this step on (progressive unfreezing)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * 0.2)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            out = out + weights[:, e : e + 1] * (torch.relu(x @ self.w1[e]) @ self.w2[e])
        return out


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout) if dropout else None
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixed = self.mix(self.norm(h))
        h = h + (mixed if self.drop is None else self.drop(mixed))
        flat = h.reshape(-1, DIM)
        weights = self.router(flat).softmax(-1)
        return h + self.experts(flat, weights).reshape(h.shape)


class Model(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block(dropout) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _batch(step: int, micro: int, rank: int, length: int) -> torch.Tensor:
    return torch.randn(
        2, length, DIM, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    )


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    saved = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _watch(block: Block, seen: list[float]) -> None:
    """Activation and gradient statistics, as a trainer's logging callback records them."""

    def forward_hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen.append(round(out.detach().norm().item(), 4))

    def backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        seen.append(round(-grad_out[0].detach().norm().item(), 4))

    block.mix.register_forward_hook(forward_hook)
    block.mix.register_full_backward_hook(backward_hook)


def _wrap(block: nn.Module, variant: str) -> nn.Module:
    if variant.endswith("-bound"):  # the reference for bf16: compiled blocks without AC (nothing falls back)
        return block
    if variant == "sac":  # torchtitan's op-level selective AC: the matmuls saved
        return cw.checkpoint_wrapper(
            block, context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls)
        )
    return cw.checkpoint_wrapper(block)


def _build(on: bool, variant: str, mesh: Any, seen: list[float] | None = None) -> nn.Module:
    torch.manual_seed(0)
    with contextlib.nullcontext() if on else autoweave.disabled():
        model = Model(dropout=0.1 if variant == "dropout" else 0.0)
        for i, block in enumerate(model.layers):
            if seen is not None:
                _watch(block, seen)
            wrapped = _wrap(block, variant)
            if variant != "whole":
                wrapped.compile(backend="aot_eager")
            model.layers[i] = wrapped
        if variant == "frozen":  # an adapter-style run: the embedding and the routers frozen
            for param in (*model.embed.parameters(), *(b.router.weight for b in model.layers)):
                param.requires_grad_(False)
        if variant == "unfreeze":  # frozen at first, in the optimizer all along
            for block in model.layers:
                block.router.requires_grad_(False)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard: dict[str, Any] = {"mesh": mesh, **({"mp_policy": mp} if variant.startswith("bf16") else {})}
        if variant == "no-reshard":  # torchtitan's reshard_after_forward_policy="never"
            shard["reshard_after_forward"] = False
        for wrapped in model.layers:
            fully_shard(getattr(wrapped, "_checkpoint_wrapped_module", wrapped).experts, **shard)
            fully_shard(wrapped, **shard)
        fully_shard(model, **shard)
        if variant == "prefetch":  # explicit prefetching of the next block's (and its experts') unit
            units = [m for w in model.layers for m in (w, w._checkpoint_wrapped_module.experts)]
            for i, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(units[i + 1 : i + 2])
                unit.set_modules_to_backward_prefetch(units[max(i - 1, 0) : i][::-1])
        if variant == "whole":  # accelerate's and the HF Trainer's order: the sharded model compiled whole
            model = torch.compile(model, backend="aot_eager")
    return model


def _optimizer(model: nn.Module, variant: str = "") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad or variant == "unfreeze"]
    return torch.optim.AdamW(params, lr=1e-2)


def _resumed(on: bool, model: nn.Module, opt: torch.optim.Optimizer, mesh: Any) -> tuple[Any, Any]:
    """A fresh model and optimizer loaded from ``model``'s and ``opt``'s state, as a resumed job starts."""
    model_state, opt_state = get_state_dict(model, opt)
    fresh = _build(on, "resume", mesh)
    fresh_opt = _optimizer(fresh)
    set_state_dict(fresh, fresh_opt, model_state_dict=model_state, optim_state_dict=opt_state)
    return fresh, fresh_opt


def run(on: bool, variant: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seen: list[float] = []  # what the hooks recorded, in order
    model = _build(on, variant, mesh, seen if variant == "hooks" else None)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant.startswith("autocast"))
    opt = _optimizer(model, variant)
    out: dict[str, Any] = {"losses": [], "norms": [], "none": [], "eval": [], "frames": [], "error": None}
    for step in range(STEPS):
        before = counters["frames"]["total"]
        try:
            if variant == "resume" and step == STEPS // 2:
                model, opt = _resumed(on, model, opt, mesh)
            if variant == "unfreeze" and step == UNFREEZE_AT:
                for name, param in model.named_parameters():
                    param.requires_grad_(param.requires_grad or ".router." in name)
            model.train()
            lengths = LENGTHS_BY_STEP[step] if variant == "accum" else LENGTHS
            for micro, length in enumerate(lengths):
                model.set_requires_gradient_sync(micro == len(lengths) - 1)
                x = _batch(step, micro, rank, length)
                with autocast:
                    if variant == "rl":  # the same model's output under no_grad first, as RL's old policy
                        with torch.no_grad():
                            old = model(x)
                        loss = (model(x) - 0.5 * old).float().square().mean() / len(lengths)
                    else:
                        loss = model(x).float().square().mean() / len(lengths)
                loss.backward()
                total = loss.detach().clone()
                dist.all_reduce(total)
                out["losses"].append(total.item())
            out["none"].append([p.grad is None for p in model.parameters()])
            trained = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(trained, max_norm=0.5)
            out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
            opt.zero_grad(set_to_none=variant != "zero-grads")
            if step % 2 == 1:
                model.eval()
                with torch.inference_mode() if variant == "inference" else torch.no_grad():
                    with autocast:
                        held_out = model(_batch(step, 9, rank, LENGTHS[0])).float().square().mean()
                dist.all_reduce(held_out)
                out["eval"].append(held_out.item())
                model.train()
        except Exception as exc:  # compared with plain torch's
            out["error"] = f"step {step}: {type(exc).__name__}: {str(exc)[:300]}"
            return out
        frames = torch.tensor([counters["frames"]["total"] - before])
        dist.all_reduce(frames)
        out["frames"].append(int(frames))
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["state"] = {name: t.flatten().tolist() for name, t in state.items()}
    out["unique_graphs"] = int(counters["stats"]["unique_graphs"])
    out["seen"] = seen
    return out


def main() -> None:
    dist.init_process_group("gloo")
    autoweave.enable()
    results = {
        f"{variant}:{'on' if on else 'off'}": run(on, variant) for variant in VARIANTS for on in (False, True)
    }
    results["bf16-bound:off"] = run(False, "bf16-bound")
    results["autocast-bound:off"] = run(False, "autocast-bound")
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
