"""gpu_bench's second model: transformers' Qwen3-MoE, as a new user trains it (issue 42, item 5).

``python benchmarks/gpu_bench.py --model qwen3 ...``: the same variants, measures and table as the
example MoE, on ``Qwen3MoeForCausalLM`` at Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts
top-8, expert width 768, 32 query and 4 key/value heads of 128; 8 layers, batch 4 x 4096 on a GPU;
tiny on ``--smoke``). Each decoder layer is ``torch.compile(checkpoint_wrapper(layer))`` (AC, then
compile, then FSDP2, torchtitan's order), the experts (``mlp.experts``) an FSDP2 unit of their own
inside the layer's; the bound keeps them in the layer's unit. transformers' own gradient
checkpointing is off: the checkpoint is the wrapper's, as in torchtitan-style loops.

The experts run transformers' ``experts_implementation`` (``--experts-impl``; on the device
``grouped_mm``, the default of transformers 5.17 there is eager). Nothing in transformers is changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

# Qwen3-30B-A3B's shapes, 8 layers: ~5.5 B parameters (4.8 B in the experts).
GPU_MODEL = dict(
    vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=8, seq_len=4096,
)  # fmt: skip
SMOKE_MODEL = dict(
    vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2, seq_len=16,
)  # fmt: skip
GPU_RUN = dict(batch=4)
# What the variants mean here (the example's hand weave and its controls without FSDP do not apply).
VARIANTS = (
    "eager",
    "compile_ac",
    "autoweave",
    "upper_bound",
    "ac_compile",
    "autoweave:hoist",
    "autoweave:pieces",
    "autoweave+nested",
)


@dataclasses.dataclass
class Qwen3Args:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    seq_len: int
    experts_impl: str = "grouped_mm"


class CausalLM(nn.Module):
    """The model's logits for ``input_ids``: what gpu_bench's step takes the loss of."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def model_args(sizes: dict[str, int], experts_impl: str) -> Qwen3Args:
    return Qwen3Args(**sizes, experts_impl=experts_impl)


def _config(a: Qwen3Args) -> Any:
    from transformers import Qwen3MoeConfig

    fields = {k: v for k, v in dataclasses.asdict(a).items() if k not in ("seq_len", "experts_impl")}
    cfg = Qwen3MoeConfig(
        **fields,
        intermediate_size=4 * a.hidden_size,  # dense MLP width: unused, every layer is MoE
        max_position_embeddings=max(a.seq_len, 64),
        use_cache=False,
        tie_word_embeddings=False,
    )
    cfg._experts_implementation = a.experts_impl  # transformers 5.x reads it when it builds the experts
    return cfg


def fresh_model(a: Qwen3Args, device: torch.device, dtype: torch.dtype, seed: int, init: Any) -> CausalLM:
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(_config(a))
    model = CausalLM(hf).to(dtype).to_empty(device=device)  # allocated once, in the model dtype
    init(model, seed, 0.02)
    # to_empty leaves non-persistent buffers unset: the rotary frequencies, built again (in fp32,
    # as from_pretrained keeps them) by a rotary module made off the meta device.
    rotary = hf.model.rotary_emb
    fresh = type(rotary)(rotary.config)
    for name, buffer in fresh.named_buffers():
        setattr(rotary, name, buffer.to(device))
    return model


def build(name: str, ckw: dict[str, Any], wrap: Any, backend: Any, cfg: Any, fresh: Any) -> nn.Module:
    """Variant ``name`` of the Qwen3 model: AC, then compile, then FSDP2 (experts nested but in the bound)."""
    from torch.distributed.fsdp import fully_shard

    import autoweave

    model = fresh()
    layers = model.hf.model.layers
    base, _, strategy = name.partition(":")
    for i, layer in enumerate(list(layers)):
        if base == "eager":
            layers[i] = wrap(layer, **ckw)
        elif base == "ac_compile":
            layers[i] = wrap(torch.compile(layer, backend=backend), **ckw)
        else:  # torch.compile(AC(layer)): the fallback, autoweave, the bound
            wrapped = wrap(layer, **ckw)
            if strategy:
                autoweave.set_mode(wrapped, strategy=strategy)
            layers[i] = torch.compile(wrapped, backend=backend)
        if base != "upper_bound":
            fully_shard(layer.mlp.experts, mesh=cfg.expert_mesh)
        fully_shard(layers[i], mesh=cfg.mesh)
    fully_shard(model, mesh=cfg.mesh)
    return model


def built_params(a: Qwen3Args) -> int:
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3MoeForCausalLM(_config(a)).parameters())


def make_batch(step: int, seed: int, batch: int, a: Qwen3Args) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, the same for every variant."""
    gen = torch.Generator().manual_seed(seed + step)
    seq = torch.randint(a.vocab_size, (batch, a.seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def param_count(a: Qwen3Args) -> int:
    d, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attention = d * q + 2 * d * kv + q * d + 2 * a.head_dim
    moe = d * a.num_experts + 3 * d * a.moe_intermediate_size * a.num_experts
    return 2 * a.vocab_size * d + d + a.num_hidden_layers * (attention + moe + 2 * d)


def flops_per_step(a: Qwen3Args, batch: int) -> float:
    """Model FLOPs of one training step (3 x forward; AC's recompute not counted)."""
    d, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attention = 2 * (2 * d * q + 2 * d * kv) + 2 * a.seq_len * q  # projections; causal QK^T and AV
    moe = 2 * d * a.num_experts + a.num_experts_per_tok * 6 * d * a.moe_intermediate_size
    per_token = a.num_hidden_layers * (attention + moe) + 2 * d * a.vocab_size
    return 3.0 * per_token * batch * a.seq_len


def memory_estimate(a: Qwen3Args, batch: int, elem: int) -> dict[str, float]:
    """A rough peak in GiB: weights, grads and AdamW's moments in the model dtype, plus the loss's tensors."""
    t, d = batch * a.seq_len, a.hidden_size
    state = 4 * elem * param_count(a)
    loss = t * a.vocab_size * (2 * elem + 12)
    kept = a.num_hidden_layers * t * d * elem
    rows = t * a.num_experts_per_tok
    work = elem * (10 * t * d + 3 * rows * a.moe_intermediate_size + 2 * rows * d)
    saved = elem * a.num_hidden_layers * (6 * t * d + 2 * rows * a.moe_intermediate_size + rows * d)
    gib = float(2**30)
    return {
        "params_b": param_count(a) / 1e9,
        "weights_grads_adam_gib": state / gib,
        "full_ac_peak_gib": (state + loss + kept + work) / gib,
        "selective_ac_peak_gib": (state + loss + kept + work + saved) / gib,
    }
