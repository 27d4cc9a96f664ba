"""NeMo Automodel 0.7: its DeepSeek-V3 MoE through its own MoE parallelizer, AC and per-layer compile.

Tiny random-init ``DeepseekV3ForCausalLM`` (NeMo's own model class: 1 dense + 2 MoE layers,
4 routed experts, 1 shared expert), 2 gloo ranks. NeMo's code applies everything:
``_parallelize_moe`` -> ``moe.parallelizer.parallelize_model`` -> ``apply_ac`` (``--ac
selective``: its torchtitan-style per-op policy on a whole-block ``CheckpointWrapper``
tagged to be compiled *outer*; ``--ac full``: the router-saving policy, ``ignore_router=True``,
on a wrapper that ``_apply_per_layer_compile`` unwraps, compiling the block *inside* it in
place) -> ``apply_fsdp`` (the routed experts as their own FSDP unit on the ``ep_shard`` mesh,
each block a unit, the root) -> ``compile_parallelized_model`` (``.compile()`` per decoder
layer, after sharding).

What is changed around NeMo to run it on 2 CPU ranks:
- the process group is gloo; NeMo's mesh code then builds ``cpu`` meshes itself
  (``MeshContext.build`` -> ``_mesh_device_type``);
- the expert mesh: NeMo builds a ``moe_mesh`` (and dispatches to ``_parallelize_moe``) only
  for ``ep_size > 1``, and shards the experts on their own only when ``ep_shard > 1``, so
  at least 4 ranks. Here NeMo's own ``_create_moe_mesh(device_mesh, ep_shard_size=2,
  ep_size=1)`` builds it and ``_parallelize_moe`` is called directly with a ``MeshContext``
  holding both meshes;
- ``_apply_per_layer_compile`` calls ``.compile()`` with no arguments (inductor): for the
  duration of ``compile_parallelized_model`` only, ``nn.Module.compile`` (autoweave's
  wrapper, when it is on) gets ``backend="aot_eager"`` as its default (``--backend``).
- ``initialize_weights(buffer_device=cpu, dtype=float32)``: its default buffer device is
  ``cuda:<current>`` (and the constructor leaves the weights uninitialised);
- the loss is plain cross-entropy on the logits, with ``torch.optim.AdamW``.

    torchrun --standalone --nproc-per-node 2 tests/clients/nemo_worker.py [--ac selective|full|none] [--dtype bf16|fp32] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=3, help="--dense dense layers first, then MoE layers")
    p.add_argument(
        "--dense", type=int, default=1, help="dense layers before the MoE ones (first_k_dense_replace)"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", choices=("selective", "full", "none"), default="selective")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument(
        "--experts",
        choices=("torch", "torch_mm"),
        default="torch",
        help="NeMo's expert GEMMs: its CPU default, a loop per expert (torch), or its CUDA default, "
        "torch._grouped_mm (torch_mm)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallel size (the experts sharded on ep_shard = world / ep)",
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--measure", action="store_true")
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import DeepseekV3Config

        t_import = time.perf_counter()
        from nemo_automodel.components.distributed.config import FSDP2Config, MoEParallelizerConfig
        from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
        from nemo_automodel.components.distributed.mesh_utils import _create_moe_mesh
        from nemo_automodel.components.distributed.model_parallelizer import (
            _parallelize_moe,
            compile_parallelized_model,
            get_model_parallelizer,
        )
        from nemo_automodel.components.models.common.utils import BackendConfig
        from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM

        import_s = time.perf_counter() - t_import

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        cfg = DeepseekV3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=args.layers,
            first_k_dense_replace=args.dense,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            torch_dtype="bfloat16" if args.dtype == "bf16" else "float32",
        )
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(cfg, backend=BackendConfig(experts=args.experts))
        # Its constructor leaves the weights uninitialised; initialize_weights defaults to
        # buffer_device=cuda:<current>. fp32 master weights (cast to bf16 for compute by NeMo's
        # default MixedPrecisionPolicy with --dtype bf16).
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
        model = model.float()
        mp = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False
        )
        strategy = FSDP2Config(enable_compile=not args.no_compile, mp_policy=mp)
        ac = {"selective": "selective", "full": True, "none": False}[args.ac]
        ctx = MeshContext.build(strategy, ParallelismSizes(dp_size=world), activation_checkpointing=ac)
        moe_mesh = _create_moe_mesh(ctx.device_mesh, ep_shard_size=world // args.ep, ep_size=args.ep)
        ctx = MeshContext.from_meshes(
            ctx.device_mesh,
            moe_mesh,
            strategy_config=strategy,
            moe_parallel_config=MoEParallelizerConfig(mp_policy=mp),
            activation_checkpointing=ac,
        )
        model = _parallelize_moe(model, ctx, parallelizer=get_model_parallelizer(model))
        if not args.no_compile:
            import torch.nn as nn

            patched = nn.Module.compile

            def compile_with_backend(self, *a, **kw):
                kw.setdefault("backend", args.backend)
                return patched(self, *a, **kw)

            nn.Module.compile = compile_with_backend
            try:
                compile_parallelized_model(model, ctx)
            finally:
                nn.Module.compile = patched
        structure = _structure(model)

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        ids = torch.randint(0, 64, (2, 17), generator=g)
        inputs, labels = ids[:, :-1], ids[:, 1:]

        def forward():
            return model(inputs)

        def loss_of() -> torch.Tensor:
            out = forward()
            logits = out.logits if hasattr(out, "logits") else out
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            loss = loss_of()
            loss.backward()
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
            "import_s": round(import_s, 1),
            "structure": structure,
        }
        result.update(metrics.snapshot())
        if args.measure:
            result.update(_common.measurements(forward, loss_of, loss_of))
            opt.zero_grad()
            result["recompiles_after_measure"] = metrics.snapshot()["recompiles"]
        return result

    _common.run_main(body)


def _structure(model) -> dict:
    """What NeMo built: FSDP units, checkpoint wrappers, compiled modules (by type name)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    units, wrappers, compiled = [], [], []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            units.append(name or "<root>")
        if isinstance(module, CheckpointWrapper):
            wrappers.append(name)
        if module.__dict__.get("_compiled_call_impl") is not None:
            compiled.append(f"{name} [{type(module).__name__}]")
    return {"fsdp_units": units, "checkpoint_wrappers": wrappers, "compiled": compiled}


if __name__ == "__main__":
    main()
