"""accelerate 1.15 + transformers 5.24: a tiny Qwen3-MoE through ``Accelerator.prepare`` with FSDP2.

Run under torchrun (2 gloo ranks on the CPU). accelerate's own code applies everything:
``fsdp2_prepare_model`` -> its auto-wrap policy over the decoder layer and the experts class,
``fsdp2_apply_ac`` (``checkpoint_wrapper`` on each matched module: the experts get nested AC),
then ``compile_regions_fsdp2`` (in-place ``.compile()`` per repeated block, regional) or
``torch.compile(model)`` (whole model), then ``fully_shard`` per unit.

What is changed around accelerate to run it on a CPU: ``Accelerator(cpu=True)`` picks
multi-CPU DDP, so its state is set to FSDP with the plugin after construction
(``acc.state.distributed_type = DistributedType.FSDP``, the same on ``PartialState()``, and
``acc.state.fsdp_plugin = plugin``).
Nothing else.

    torchrun --standalone --nproc-per-node 2 tests/clients/accelerate_worker.py --layers 3 [--compile regional|whole|none] [--nograd] [--save DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", choices=("regional", "whole", "none"), default="regional")
    p.add_argument("--nograd", action="store_true", help="one no_grad forward before training")
    p.add_argument(
        "--use-cache",
        choices=("config", "true", "false"),
        default="config",
        help="the model config's use_cache (default: left as Qwen3MoeConfig sets it, True)",
    )
    p.add_argument("--save", default=None, help="save the trained model here (accelerate's save_model)")
    p.add_argument(
        "--measure", action="store_true", help="profile GEMMs, backward GEMMs and activation memory"
    )
    args = p.parse_args()

    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        from accelerate import Accelerator, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
        if args.use_cache != "config":
            cfg.use_cache = args.use_cache == "true"
        model = Qwen3MoeForCausalLM(cfg)
        experts_cls = type(model.model.layers[0].mlp.experts).__name__
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            activation_checkpointing=True,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Qwen3MoeDecoderLayer", experts_cls],
        )
        kwargs = {}
        if args.compile != "none":
            kwargs["dynamo_plugin"] = TorchDynamoPlugin(
                backend="aot_eager", use_regional_compilation=args.compile == "regional"
            )
        acc = Accelerator(cpu=True, **kwargs)
        # On a CPU accelerate picks multi-CPU DDP; make it take its FSDP2 path with the plugin.
        # AcceleratorState re-reads PartialState's fields (prepare builds AcceleratorState() again),
        # so set both: with only acc.state set, prepare still shards (FSDP2) but leaves the state at
        # MULTI_CPU, and get_state_dict then skips its FSDP2 branch and returns sharded DTensors.
        acc.state.distributed_type = DistributedType.FSDP
        PartialState().distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = fsdp
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        if args.nograd:
            with torch.no_grad():
                model(input_ids=ids)
        losses, times = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = model(input_ids=ids, labels=ids)
            acc.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.item()))
            times.append(time.perf_counter() - t0)
        result = {
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
        }
        result.update(metrics.snapshot())
        if args.save:
            acc.wait_for_everyone()
            result["distributed_type"] = str(acc.distributed_type)
            state = acc.get_state_dict(
                model
            )  # FSDP2: get_model_state_dict(full_state_dict=True, cpu_offload=True)
            if acc.is_main_process:
                os.makedirs(args.save, exist_ok=True)
                torch.save(
                    {k: v.detach().clone() for k, v in state.items()}, os.path.join(args.save, "model.pt")
                )
            result["saved_keys"] = len(state) if state else 0
        if args.measure:
            result.update(
                _common.measurements(
                    lambda: model(input_ids=ids),
                    lambda: model(input_ids=ids, labels=ids),
                    lambda: model(input_ids=ids, labels=ids).loss,
                )
            )
            opt.zero_grad()
            # after the measuring calls: did they compile anything new?
            after = metrics.snapshot()
            result["recompiles_after_measure"] = after["recompiles"]
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
