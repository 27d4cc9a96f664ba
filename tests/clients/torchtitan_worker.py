"""torchtitan 0.3: a tiny Qwen3-MoE through its own ``parallelize_qwen3`` on a CPU mesh, 2 gloo ranks.

torchtitan's code applies everything: its AC policy (``SelectiveAC`` by default here, or
``FullAC``) wraps each block, ``apply_compile`` compiles each block in place with
``fullgraph=True``, ``apply_fsdp_to_decoder`` shards each block (FSDP2). autoweave must be a
no-op here: torchtitan 0.3 shards routed experts with their block (no nested FSDP unit), so no
graph break sits under a checkpoint.

What is changed around torchtitan to run it on a CPU (nothing inside its parallelize path):
- ``torchtitan.distributed.parallel_dims.device_type = "cpu"``: torchtitan's
  ``tools.utils.device_type`` is ``"cuda"`` when no accelerator is found, and ``ParallelDims``
  builds its world mesh with it (``init_device_mesh(device_type, ...)``);
- ``spmd_backend="partial_dtensor"``: the default ``spmd_types`` backend wants a model-parallel
  mesh the CPU path does not build (``validate_config``);
- after ``parallelize_qwen3``, ``set_force_sum_reduction_for_comms(True)`` on every FSDP
  module: torchtitan's divide factor 1.0 makes FSDP2 reduce with ``PREMUL_SUM(1.0)``, which gloo
  lacks (a SUM is the same); the loss is divided by the world size before backward instead;
- the process group is gloo (``init_process_group("gloo")``);
- each block's inner attention is torchtitan's ``ScaledDotProductAttention`` (its
  ``get_attention_config`` offers only flex, which has no CPU backward, and CUDA-only varlen);
- the model is built on the CPU and seeded, not on the meta device with ``init_weights``, so
  every run starts from the same weights;
- training is plain cross-entropy with ``torch.optim.AdamW`` (torchtitan's trainer, data
  loader and tokenizer are not used).

    torchrun --standalone --nproc-per-node 2 tests/clients/torchtitan_worker.py [--layers 4] [--ac selective|full|none] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def tiny_config(layers: int):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    dim, head_dim, vocab = 32, 8, 64
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            moe_hidden_dim=16,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    # FlexAttention has no backward on the CPU (and varlen is CUDA-only): each block's inner
    # attention is torchtitan's own SDPA module instead, which get_attention_config no longer
    # hands out for language models (RoPE still gets the positions; no masks, is_causal).
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", choices=("selective", "full", "none"), default="selective")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--measure", action="store_true")
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        import torchtitan.distributed.parallel_dims as pd
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.models.qwen3 import parallelize_qwen3

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        pd.device_type = "cpu"  # torchtitan's device_type is "cuda" on a machine without accelerators
        parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend="partial_dtensor")
        parallel_dims = pd.ParallelDims.from_config(parallelism, world)
        parallel_dims.build_mesh()
        training = TrainingConfig(local_batch_size=2, seq_len=16, mixed_precision_param="float32")
        compile_config = CompileConfig(enable=not args.no_compile, components=["model"], backend="aot_eager")
        ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[args.ac]

        torch.manual_seed(0)
        model = tiny_config(args.layers).build()
        model.init_weights(buffer_device=torch.device("cpu"))
        model = parallelize_qwen3(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder="/tmp",
        )
        # torchtitan sets FSDP's gradient divide factor to 1.0 (disable_fsdp_gradient_division), which
        # FSDP2 turns into ReduceOp.PREMUL_SUM(1.0): gloo has no PREMUL_SUM. A plain SUM is the same.
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        ids = torch.randint(0, 64, (2, 17), generator=g)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        positions = torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)

        def forward() -> torch.Tensor:
            return model(inputs, positions=positions)

        def loss_of() -> torch.Tensor:
            logits = forward()
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            loss = loss_of()
            (
                loss / world
            ).backward()  # gradients summed over ranks: normalise as torchtitan does (global tokens)
            opt.step()
            opt.zero_grad()
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            losses.append(float(reduced.item()) / world)
            times.append(time.perf_counter() - t0)
            if step == 0:
                step1_cpu = _common.cpu_seconds() - cpu0
        result = {
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
        }
        result.update(metrics.snapshot())
        if args.measure:
            result.update(_common.measurements(forward, loss_of, loss_of))
            opt.zero_grad()
            result["recompiles_after_measure"] = metrics.snapshot()["recompiles"]
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
