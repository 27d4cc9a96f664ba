"""torchrun worker: blocks with a ``.item()`` router and a counting forward hook, each
``torch.compile(checkpoint_wrapper(block))``, the model under DDP or ``replicate`` (issue 41, item 7).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/storm_worker.py OUT

The hook appends to a Python list: dynamo guards on the list's length, so a compiled frame that
runs it recompiles at every call. Plain torch runs each block eager (its checkpoint falls back at the
break) and compiles nothing after the first step. Rank 0 writes, for each wrapper and for plain torch
and autoweave, the losses of every step, the dynamo frames converted in each step (all ranks summed),
``grad is None`` per parameter and the last step's gradients.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import autoweave  # noqa: E402

DIM, STEPS = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.seen: list[int] = []  # what the counting hook appends to
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scores = self.router(h).softmax(-1)
        load = scores.detach().amax(-1).mean().item()  # router statistics: a graph break
        self.calls += 1
        return h + self.down(torch.relu(self.up(h))) * (1.0 + 0.0 * load) + scores[..., :1]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _counting(seen: list[int]) -> Any:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.append(len(seen))  # a list that counts (its length read: a guard on it)

    return hook


def run(wrap: str, on: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    with contextlib.nullcontext() if on else autoweave.disabled():
        model = Model()
        for i, block in enumerate(model.layers):
            block.up.register_forward_hook(_counting(block.seen))
            model.layers[i] = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed._composable import replicate

            replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "frames": [], "none": [], "error": None}
    for step in range(STEPS):
        x = torch.randn(4, 6, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
        before = counters["frames"]["total"]
        try:
            loss = model(x).square().mean()
            loss.backward()
        except Exception as exc:  # compared with plain torch's
            out["error"] = f"step {step}: {type(exc).__name__}: {str(exc)[:300]}"
            return out
        frames = torch.tensor([counters["frames"]["total"] - before])
        dist.all_reduce(frames)
        out["frames"].append(int(frames))
        out["none"].append([p.grad is None for p in model.parameters()])
        if step == STEPS - 1:
            out["grads"] = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item())
    return out


def main() -> None:
    dist.init_process_group("gloo")
    autoweave.enable()
    results = {
        f"{wrap}:{'on' if on else 'off'}": run(wrap, on)
        for wrap in ("ddp", "replicate")
        for on in (False, True)
    }
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
