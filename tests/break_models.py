"""MoE blocks that break dynamo's graph in the ways real MoE code does, and layers that checkpoint
where autoweave has to read code to see it. For the tests of issue 11 and the capture benchmark.

Every block maps ``(batch, dim) -> (batch, dim)`` and holds its experts in ``self.experts``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as ckpt  # an alias, as codebases write it

DIM = 8
N_EXPERTS = 4


def save_matmuls(ctx, op, *args, **kwargs):
    """A selective-AC policy: keep matmul outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_nothing(ctx, op, *args, **kwargs):
    """A selective-AC policy that recomputes everything (full AC's memory, SAC's machinery)."""
    return CheckpointPolicy.PREFER_RECOMPUTE


# torchtitan's selective-AC op list (torchtitan/models/llama3/infra/parallelize.py): save the
# listed ops' outputs, except every second matmul. Its linears have no bias (``mm``); ours do
# (``addmm``), so both count as its matmuls.
_TITAN_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten.max.default,
}
_TITAN_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def titan_context_fn():
    """torchtitan-style selective AC: a ``context_fn`` whose policy counts matmuls per checkpoint."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op in _TITAN_MATMULS:
            counts[mode] += 1
        save = op in _TITAN_SAVE and not (op in _TITAN_MATMULS and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrapped_context_fn():
    """NeMo Automodel-style: torch's SAC contexts, the recompute one inside an ordinary context manager.

    NeMo's ``apply_ac`` wraps them so (its gate's expert-load buffer is swapped around the
    recompute). Eager checkpoints take it; a checkpoint traced inside a compiled graph cannot
    (it needs two ``TorchDispatchMode``s).
    """
    forward, recompute = create_selective_checkpoint_contexts(save_matmuls)
    wrapped_context_fn.calls += 1

    @contextlib.contextmanager
    def around_recompute():
        with recompute:
            yield

    return forward, around_recompute()


wrapped_context_fn.calls = 0


# name -> the context_fn of a selective-AC policy
POLICIES = {
    "save-nothing": functools.partial(create_selective_checkpoint_contexts, save_nothing),
    "save-matmuls": functools.partial(create_selective_checkpoint_contexts, save_matmuls),
    "torchtitan-style": titan_context_fn,
}


def with_ac(block: nn.Module, ac: str) -> nn.Module:
    """``checkpoint_wrapper(block)``, full AC or selective AC with ``save_matmuls``."""
    if ac == "selective":
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        )
    return cw.checkpoint_wrapper(block)


class LoopExperts(nn.Module):
    """Data-dependent routing: a Python loop over experts, each on the tokens routed to it."""

    def __init__(self, dim: int = DIM, n: int = N_EXPERTS) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        counts = torch.bincount(choice, minlength=self.w.shape[0]).tolist()  # a graph break
        order = torch.argsort(choice)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = order[start : start + n]
                out = out.index_add(0, idx, torch.relu(x[idx] @ self.w[e]))
            start += n
        return out


class ItemRouterBlock(nn.Module):
    """``.item()`` in the router (an aux-loss statistic read on the host)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, N_EXPERTS)
        self.experts = LoopExperts(dim)
        self.out = nn.Linear(dim, dim)
        self.balance = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        logits = self.router(h)
        self.balance = logits.softmax(-1).var().item()  # a graph break
        choice = logits.argmax(-1)
        return x + self.out(self.experts(h, choice))


class GraphBreakExperts(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()  # e.g. a kernel dynamo cannot trace
        return self.down(h)


class BreakBlock(nn.Module):
    """An explicit break inside the experts; glue (a gated combine) around them."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, dim)
        self.experts = GraphBreakExperts(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.out(self.experts(h) * torch.sigmoid(self.gate(h)))


class LoopBlock(nn.Module):
    """Top-1 routing into a per-expert loop (``.tolist()`` token counts)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, N_EXPERTS)
        self.experts = LoopExperts(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.out(self.experts(h, self.router(h).argmax(-1)))


class SimpleExperts(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w(x))


class PlainMoE(nn.Module):
    """No break of its own: its experts are the boundary (marked, or an FSDP unit)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = SimpleExperts(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.experts(self.norm(x)))


class CallCheckpointLayer(PlainMoE):
    """Checkpoints in an overridden ``__call__``, as transformers' GradientCheckpointingLayer does."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)

    def enable_checkpointing(self, **options) -> CallCheckpointLayer:
        # What model.gradient_checkpointing_enable() sets on each layer.
        self._gradient_checkpointing_func = functools.partial(torch_checkpoint.checkpoint, **options)
        self.gradient_checkpointing = True
        return self


class AliasCheckpointBlock(PlainMoE):
    """``checkpoint`` imported under another name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ckpt(super().forward, x, use_reentrant=False)


class AttributeCheckpointBlock(PlainMoE):
    """Checkpoint through an attribute: ``self._ckpt(...)``."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self._ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ckpt(super().forward, x)


class HelperCheckpointBlock(PlainMoE):
    """Checkpoint in a helper method the forward calls."""

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self._body, x, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x)


class FlagNamedCheckpoint(PlainMoE):
    """An attribute *named* ``checkpoint`` that is a flag: no checkpoint is called."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return x
        return super().forward(x)


class Stack(nn.Module):
    """A whole model: blocks in a ModuleList, then a head (compiled as one, as Trainer does)."""

    def __init__(self, blocks: list[nn.Module], dim: int = DIM) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _skip(module: nn.Module, args: tuple) -> None:
    return None


def fsdp_like(module: nn.Module) -> nn.Module:
    """A ``torch.compiler.disable``d pre-hook, as ``fully_shard`` gives a unit: a real graph break."""
    module.register_forward_pre_hook(torch.compiler.disable(_skip))
    return module


class StackedExperts(nn.Module):
    """Every expert on every token: ``(tokens, dim) -> (experts, tokens, dim)`` with two ``bmm``."""

    def __init__(self, dim: int = DIM, n: int = N_EXPERTS) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, 2 * dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n, 2 * dim, dim) / (2 * dim) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xe = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)
        return torch.bmm(torch.relu(torch.bmm(xe, self.w1)), self.w2)


class GlueGemmBlock(nn.Module):
    """A block whose own glue holds GEMMs: attention-like projection, router, and an einsum combine.

    The experts are the boundary (``fsdp=True``: a disabled pre-hook, as ``fully_shard`` makes);
    everything else in ``forward`` is the block's glue, run between its children.
    """

    def __init__(self, dim: int = DIM, n: int = N_EXPERTS, fsdp: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n)
        self.experts = StackedExperts(dim, n)
        if fsdp:
            fsdp_like(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(self.norm1(x)))
        hn = self.norm2(h)
        gates = torch.softmax(self.router(hn), dim=-1)
        routed = self.experts(hn)
        return h + torch.einsum("etd,te->td", routed, gates)  # the combine: a bmm in the glue


class ReduceCombineBlock(GlueGemmBlock):
    """``GlueGemmBlock`` whose combine is a weighted sum over experts (no GEMM after the experts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(self.norm1(x)))
        hn = self.norm2(h)
        gates = torch.softmax(self.router(hn), dim=-1)
        routed = self.experts(hn)
        return h + (routed * gates.t().unsqueeze(-1)).sum(0)


class DenseTailBlock(nn.Module):
    """Attention-like projection, experts (an FSDP-like unit), then a dense MLP into the residual.

    The MLP's down projection is the block's last GEMM: backward does not need its output.
    """

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.experts = fsdp_like(SimpleExperts(dim))
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        y = self.experts(self.norm2(h))
        return h + self.down(torch.relu(self.up(y)))
