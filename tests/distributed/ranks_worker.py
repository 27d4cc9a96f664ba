"""Worker for tests/distributed/test_rank_decisions.py: ranks that see different sequence lengths.

``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/ranks_worker.py OUT``

Gloo FSDP2 (``init_device_mesh("cpu", (2,))``) over a stack of selective-AC blocks, each
``torch.compile(checkpoint_wrapper(block))`` then ``fully_shard``, trained a few steps where
rank 0 sees short sequences and rank 1 long ones, once inside ``autoweave.disabled()`` (plain
torch) and once woven. Two decisions there depend on the length a rank saw:

- ``SquareBlock``: what ``pieces`` keeps across its break grows with the square of the length,
  eager selective AC's with the length: the first-call memory verdict (pieces or hoist);
- ``LongBreakBlock``: only a long sequence takes the branch that breaks dynamo's graph, so only
  rank 1 sees dynamo fall back and learns the break.

Rank r writes ``OUT/rank{r}.json``: its losses (plain and woven) and, after each woven step,
every block's dispatcher state and the action of each decision of its plan.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave.dispatch.dispatchers import dispatcher_of

DIM = 64
# Per rank, per step: rank 0 short, rank 1 long (and each rank's length changes between steps).
LENGTHS = ((8, 12, 8, 12), (128, 96, 128, 96))


class SquareBlock(nn.Module):
    """A (T, T) tensor crosses the break: pieces keep it, eager selective AC recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = h[..., :1] - h[..., :1].transpose(1, 2)  # no GEMM: the policy does not save it
        torch._dynamo.graph_break()
        return x + self.out(torch.softmax(scores, -1) @ h)


class LongBreakBlock(nn.Module):
    """A path only long sequences take breaks dynamo's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        if x.shape[1] > 32:
            torch._dynamo.graph_break()
        return x + self.out(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SquareBlock(), SquareBlock(), LongBreakBlock(), LongBreakBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


POLICY = functools.partial(
    create_selective_checkpoint_contexts,
    [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default],
)


def build(mesh: object) -> nn.Module:
    torch.manual_seed(0)
    model = Model()
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(
            checkpoint_wrapper(block, context_fn=POLICY, preserve_rng_state=False), backend="aot_eager"
        )
        fully_shard(model.layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def decisions(model: nn.Module) -> list:
    out = []
    for layer in model.layers:
        d = dispatcher_of(layer)
        plan = d.plan
        actions = [] if plan is None else [(x.path, x.action.value) for x in plan.decisions]
        out.append([d.state.value, actions])
    return out


def train(model: nn.Module, rank: int, record: list | None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, length in enumerate(LENGTHS[rank]):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(2, length, DIM, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if record is not None:
            record.append(decisions(model))
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert autoweave.enable()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with autoweave.disabled():
        plain = train(build(mesh), rank, None)
    torch._dynamo.reset()
    record: list = []
    woven = train(build(mesh), rank, record)
    (out / f"rank{rank}.json").write_text(json.dumps({"plain": plain, "woven": woven, "decisions": record}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
