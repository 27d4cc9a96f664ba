"""Train a tiny DeepSeek-V3-style MoE language model with FSDP2, AC and torch.compile.

This script stands in for a user's existing training codebase: it is written the
way large trainers (e.g. torchtitan) structure things and depends only on
PyTorch (+ tqdm). It runs on CPU (gloo) and unchanged on GPUs (NCCL):

    torchrun --standalone --nproc_per_node=2 examples/train_moe.py
    python examples/train_moe.py --steps 3 --backend aot_eager   # single process

It is also importable (tests and benchmarks load it by path); all work happens
under ``main()``.
"""

import argparse
import functools
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from tqdm import tqdm

# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #


@dataclass
class ModelArgs:
    """Hyper-parameters; defaults are tiny so that CPU training takes seconds."""

    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 4
    n_dense_layers: int = 1  # the first layers use a dense MLP, like DeepSeek-V3
    n_heads: int = 4
    inter_dim: int = 128  # hidden size of the dense MLP
    moe_inter_dim: int = 32  # hidden size of each expert
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    top_k: int = 2
    seq_len: int = 64
    norm_eps: float = 1e-6
    init_std: float = 0.02


class Attention(nn.Module):
    """Multi-head causal self-attention (no rotary embeddings, for brevity)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.dim % args.n_heads == 0, "dim must be divisible by n_heads"
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        # (B, S, D) -> (B, H, S, Dh), the layout SDPA expects.
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Token-choice top-k router with softmax scores."""

    def __init__(self, dim: int, n_routed_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_routed_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, D) -> (top_scores (T, K), selected_experts_indices (T, K))."""
        # Routing in fp32 keeps the top-k choice stable under low-precision training.
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=-1)
        return top_scores, selected_experts_indices


class GroupedExperts(nn.Module):
    """All routed experts as stacked weights, one SwiGLU per expert.

    Real trainers sort tokens by expert and run a grouped GEMM over variable-size
    token slices. That needs data-dependent shapes, which torch.compile handles
    poorly; at this size it is cheaper and fully traceable to run every expert on
    every token with ``bmm`` and zero out the unselected ones via the routing
    weight matrix. The numerics match a dispatching implementation.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """x: (T, D), expert_weights: (T, E), zero for unselected experts -> (T, D)."""
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)  # (E, T, D)
        h = F.silu(torch.bmm(xe, self.w1.transpose(1, 2))) * torch.bmm(
            xe, self.w3.transpose(1, 2)
        )  # (E, T, H)
        out = torch.bmm(h, self.w2.transpose(1, 2))  # (E, T, D)
        # Weighted sum over experts. A reduction (not einsum, which returns a view
        # of a reshaped bmm) so the output is a fresh tensor, as FSDP2 prefers.
        weights = expert_weights.to(out.dtype).t().unsqueeze(-1)  # (E, T, 1)
        return (out * weights).sum(dim=0)


class MoE(nn.Module):
    """Routed experts plus always-on shared experts (DeepSeek-V3 style)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_routed_experts = args.n_routed_experts
        self.router = Router(args.dim, args.n_routed_experts, args.top_k)
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.n_routed_experts)
        # The shared experts are fused into one wider MLP, as in DeepSeek-V3.
        self.shared_experts = MLP(args.dim, args.moe_inter_dim * args.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        top_scores, selected_experts_indices = self.router(tokens)
        # Dense (T, E) combine matrix: the top-k scores at the chosen experts.
        expert_weights = torch.zeros(
            tokens.shape[0],
            self.n_routed_experts,
            dtype=top_scores.dtype,
            device=tokens.device,
        ).scatter(1, selected_experts_indices, top_scores)
        routed = self.experts(tokens, expert_weights)
        out = routed + self.shared_experts(tokens)
        return out.reshape(bsz, seqlen, dim)


class TransformerBlock(nn.Module):
    """Pre-norm block; the same class serves dense and MoE layers."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = MLP(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index (torchtitan style) keeps FQNs stable
        # when blocks are replaced by wrappers or dropped for pipelining.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, S) int64 -> logits (B, S, vocab_size)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministically initialise every parameter from ``seed``.

        Values are drawn on CPU from a private generator in parameter order, so
        the same seed gives bit-identical weights on every rank, device and run,
        independent of the global RNG state. Call before ``parallelize``.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                value = torch.ones(param.shape)
            else:
                value = torch.randn(param.shape, generator=gen) * self.args.init_std
            param.copy_(value.to(device=param.device, dtype=param.dtype))


# --------------------------------------------------------------------------- #
# Parallelisation
# --------------------------------------------------------------------------- #

# Matmul outputs are the expensive activations to recompute; save them under
# selective AC and recompute the cheap pointwise ops instead.
SAVE_OPS: set[Any] = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _unwrap(module: nn.Module) -> nn.Module:
    """Strip compile / checkpoint wrappers to reach the user's block."""
    while True:
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod
        elif isinstance(module, ptd_checkpoint_wrapper.CheckpointWrapper):
            module = module._checkpoint_wrapped_module
        else:
            return module


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap each block in activation checkpointing ("none", "full", "selective")."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown AC mode {mode!r}")
    kwargs: dict[str, Any] = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for key, block in model.layers.items():
        # The RNG state need not be preserved: the model has no dropout.
        model.layers[key] = ptd_checkpoint_wrapper.checkpoint_wrapper(
            block, preserve_rng_state=False, **kwargs
        )


def apply_compile(model: Transformer, backend: str, style: str, fullgraph: bool) -> None:
    """Compile each block separately: blocks share code, so graphs are reused."""
    for key, block in model.layers.items():
        if style == "wrap":
            model.layers[key] = torch.compile(block, backend=backend, fullgraph=fullgraph)
        elif style == "inplace":
            block.compile(backend=backend, fullgraph=fullgraph)
        else:
            raise ValueError(f"unknown compile style {style!r}")


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None = None,
    experts_fsdp: str = "separate",
) -> None:
    """Shard bottom-up with FSDP2: experts, then blocks, then the root.

    "separate" gives the routed experts their own FSDP unit (on their own mesh,
    as expert-parallel trainers do); "shared" keeps them in their block's unit.
    """
    if experts_fsdp not in ("separate", "shared"):
        raise ValueError(f"unknown experts_fsdp {experts_fsdp!r}")
    for block in model.layers.values():
        inner = _unwrap(block)
        if experts_fsdp == "separate" and getattr(inner, "moe_enabled", False):
            fully_shard(inner.moe.experts, mesh=expert_mesh or mesh)
        fully_shard(block, mesh=mesh)
    # The root unit holds embeddings, final norm and output projection.
    fully_shard(model, mesh=mesh)


def parallelize(
    model: Transformer,
    *,
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None = None,
    ac: str = "full",
    compile: bool = True,
    backend: str = "inductor",
    compile_style: str = "wrap",
    fullgraph: bool = False,
    experts_fsdp: str = "separate",
) -> Transformer:
    """Apply AC, then compile, then FSDP (the torchtitan order).

    - AC first, so the compiled region contains the checkpointed block and the
      compiler sees (and can optimise) recomputation.
    - Compile before FSDP, so each block's FSDP hooks sit outside its compiled
      graph: all-gathers and reduce-scatters run eagerly around the block. A
      nested unit (``experts_fsdp="separate"``) necessarily has its hooks inside
      the compiled, checkpointed block, which Dynamo cannot trace as one graph.
    - FSDP last, wrapping the finished blocks bottom-up.
    """
    apply_ac(model, ac)
    if compile:
        apply_compile(model, backend, compile_style, fullgraph)
    apply_fsdp(model, mesh, expert_mesh, experts_fsdp)
    return model


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Init the process group from torchrun's env, or as a 1-rank gloo group."""
    single_env: dict[str, str] = {}
    if "WORLD_SIZE" not in os.environ:
        # Plain `python train_moe.py` (or an in-process call): a world of one
        # still exercises FSDP. The env vars are removed again after init so a
        # later call in the same process picks a fresh port.
        single_env = {
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(_free_port()),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
        }
        os.environ.update(single_env)
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl")
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
    finally:
        for key in single_env:
            os.environ.pop(key, None)
    return dist.get_rank(), dist.get_world_size(), device


def make_batch(step: int, seed: int, batch_size: int, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic global batch (inputs, targets) for ``step``.

    Sequences follow a fixed random successor table with 10% noise, so there is
    something to learn and the loss visibly drops within a few steps.
    """
    # The table is fixed for the run; the offset keeps it apart from step seeds.
    table_gen = torch.Generator().manual_seed(seed + 1_000_003)
    successor = torch.randperm(args.vocab_size, generator=table_gen)
    gen = torch.Generator().manual_seed(seed + step)
    seq = torch.empty(batch_size, args.seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(args.vocab_size, (batch_size,), generator=gen)
    noise = torch.rand(batch_size, args.seq_len, generator=gen) < 0.1
    random_tokens = torch.randint(args.vocab_size, (batch_size, args.seq_len), generator=gen)
    for t in range(args.seq_len):
        seq[:, t + 1] = torch.where(noise[:, t], random_tokens[:, t], successor[seq[:, t]])
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = ModelArgs()
    p = argparse.ArgumentParser(
        description="Train a tiny MoE LM with FSDP2, activation checkpointing and torch.compile."
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=defaults.n_layers)
    p.add_argument("--dim", type=int, default=defaults.dim)
    p.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="global batch size, split evenly across ranks",
    )
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument(
        "--seq-lens",
        default=None,
        help="comma-separated sequence lengths, one per step in turn (packed or padded batches)",
    )
    p.add_argument("--ac", choices=("none", "full", "selective"), default="full")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--backend", default="inductor", help='e.g. "aot_eager" for fast tests')
    p.add_argument("--compile-style", choices=("wrap", "inplace"), default="wrap")
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--experts-fsdp", choices=("separate", "shared"), default="separate")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--losses-out", default=None, help="rank 0 writes losses as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[float]:
    args = parse_args(argv)
    rank, world, device = init_distributed()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} not divisible by {world} ranks")
    local_bs = args.batch_size // world

    model_args = ModelArgs(n_layers=args.layers, dim=args.dim, seq_len=args.seq_len)
    model = Transformer(model_args).to(device)
    model.init_weights(args.seed)

    # Experts get their own mesh object (as with expert parallelism), even
    # though here it spans the same ranks as the main FSDP mesh.
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    expert_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep_fsdp",))
    model = parallelize(
        model,
        mesh=mesh,
        expert_mesh=expert_mesh,
        ac=args.ac,
        compile=args.compile,
        backend=args.backend,
        compile_style=args.compile_style,
        fullgraph=args.fullgraph,
        experts_fsdp=args.experts_fsdp,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", disable=rank != 0 or args.no_progress)
    for step in bar:
        if args.seq_lens:
            lengths = [int(n) for n in args.seq_lens.split(",")]
            model_args.seq_len = lengths[step % len(lengths)]
        inputs, targets = make_batch(step, args.seed, args.batch_size, model_args)
        shard = slice(rank * local_bs, (rank + 1) * local_bs)
        inputs, targets = inputs[shard].to(device), targets[shard].to(device)

        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # Log the global mean loss (SUM then divide: gloo has no AVG).
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
        losses.append(global_loss.item() / world)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if rank == 0 and args.no_progress:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.6f}", flush=True)
    bar.close()

    if rank == 0:
        elapsed = time.perf_counter() - start
        print(f"trained {args.steps} steps on {world} rank(s) in {elapsed:.1f}s")
        print(f"final loss: {losses[-1]:.6f}" if losses else "final loss: nan")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(
                    {
                        "losses": losses,
                        "args": vars(args),
                        "model_args": asdict(model_args),
                        "world_size": world,
                    },
                    f,
                )
    # Tearing gloo down while a peer is still mid-collective can abort the
    # process ("terminate called without an active exception"); sync first.
    dist.barrier()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
