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

``--use-cache false`` sets ``use_cache=False`` on the model's config and passes it to the model, as
training code does (the config's default, ``True``, is what runs without it: accelerate's AC does not
turn the cache off).
``--variant`` (benchmarks/compile_cost.py) builds three references beside accelerate's own path.
``upper_bound``: what plain torch compiles when nothing breaks a checkpoint, the capture limit. Only
the decoder layers are wrapped (FSDP and AC), so the experts have no unit of their own, and each
layer's FSDP unit goes *around* its checkpoint wrapper (torchtitan's order: ``fully_shard`` on the
wrapper; accelerate's call on the layer is redirected there): every layer compiles whole, all its
forward GEMMs in one graph. ``eager_layers``: the experts have no unit either, and the layer's unit
stays where accelerate puts it. accelerate 1.15 puts it *inside* the checkpoint wrapper, whose
FSDP hooks break the checkpoint: plain dynamo runs every layer eager (what plain compile costs when
it compiles none of the layers: a floor, not a capture bound). accelerate 1.16 shards the wrapper
instead ("to keep FSDP hooks outside compiled code"): nothing nests, and plain compiles every layer. ``hand_weave`` is accelerate's regional compile with one change
(``hand_weave_regions`` in place of its ``compile_regions_fsdp2``): each repeated block's
*inner* module is compiled in place instead of its checkpoint wrapper, and so is the inner module of
the experts' nested checkpoint wrapper: both checkpoints run eager, around a compile of
``Qwen3MoeDecoderLayer.forward`` and of the experts' ``forward``, one code object (one dynamo
cache) each for every layer. Dynamo splits the layer at the experts' call (their FSDP unit, under
a checkpoint it cannot trace: one AC fallback message, the experts' checkpoint then runs eager
around their compiled forward). That is the code autoweave compiles for these layers (its plan:
"AC eager ... around a compile of the inner block", for the layer and for the experts), without
autoweave's code copies.

    torchrun --standalone --nproc-per-node 2 tests/clients/accelerate_worker.py --layers 3 [--compile regional|whole|none] [--nograd] [--save DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


@contextlib.contextmanager
def units_around_checkpoints(layers):
    """``fully_shard`` on a checkpointed layer shards its checkpoint wrapper instead, while open.

    accelerate imports ``fully_shard`` from ``torch.distributed.fsdp`` when it prepares the model,
    so the redirect is put there, and taken away again on leaving. On a clean exit no layer may
    hold a unit inside its checkpoint: the bound means nothing otherwise.
    """
    import torch.distributed.fsdp as fsdp

    shard = fsdp.fully_shard

    def around_the_checkpoint(module, *args, **kwargs):
        for wrapper in layers:
            if getattr(wrapper, "_checkpoint_wrapped_module", None) is module:
                shard(wrapper, *args, **kwargs)
                return module
        return shard(module, *args, **kwargs)

    fsdp.fully_shard = around_the_checkpoint
    try:
        yield
    finally:
        fsdp.fully_shard = shard
    # accelerate also shards the wrapper itself (its policy looks through it): what the redirect
    # changes is that the layer inside holds no unit, so no FSDP hook runs under the checkpoint
    inner = [getattr(wrapper, "_checkpoint_wrapped_module", None) for wrapper in layers]
    assert all(isinstance(wrapper, fsdp.FSDPModule) for wrapper in layers), "a layer's wrapper has no unit"
    assert not any(isinstance(layer, fsdp.FSDPModule) for layer in inner), "a layer kept its unit inside"


def hand_weave_regions(module, **compile_kwargs):
    """accelerate's ``compile_regions_fsdp2``, compiling a repeated block's inner module under its AC wrapper."""
    from accelerate.utils.other import has_repeated_blocks, is_repeated_blocks

    if is_repeated_blocks(module):
        for block in module:
            # the block's AC wrapper and the experts' nested one (accelerate's AC) stay eager
            for sub in block.modules():
                inner = getattr(sub, "_checkpoint_wrapped_module", None)
                if inner is not None:
                    inner.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            hand_weave_regions(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)
    return module


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
        help="use_cache for the model's config and call (default: as Qwen3MoeConfig sets it, True)",
    )
    p.add_argument("--save", default=None, help="save the trained model here (accelerate's save_model)")
    p.add_argument(
        "--measure", action="store_true", help="profile GEMMs, backward GEMMs and activation memory"
    )
    p.add_argument("--gemms", action="store_true", help="profile the forward's GEMMs only (no other measure)")
    p.add_argument(
        "--variant", choices=("accelerate", "upper_bound", "eager_layers", "hand_weave"), default="accelerate"
    )
    args = p.parse_args()

    metrics = _common.Metrics().install()

    def body() -> dict:
        import accelerate
        import torch
        from accelerate import Accelerator, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
        from transformers import Qwen3MoeForCausalLM

        torch.manual_seed(0)
        cfg = _common.tiny_qwen3_moe_config(args.layers)
        if args.use_cache != "config":
            cfg.use_cache = args.use_cache == "true"
        model = Qwen3MoeForCausalLM(cfg)
        experts_cls = type(model.model.layers[0].mlp.experts).__name__
        wrapped = (
            ["Qwen3MoeDecoderLayer"]
            if args.variant in ("upper_bound", "eager_layers")
            else ["Qwen3MoeDecoderLayer", experts_cls]
        )
        fsdp = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            activation_checkpointing=True,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=wrapped,
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
        if args.variant == "hand_weave":
            import accelerate.accelerator

            accelerate.accelerator.compile_regions_fsdp2 = hand_weave_regions
        with (
            units_around_checkpoints(model.model.layers)
            if args.variant == "upper_bound"
            else contextlib.nullcontext()
        ):
            model, opt = acc.prepare(model, opt)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        call = {} if args.use_cache == "config" else {"use_cache": args.use_cache == "true"}
        if args.nograd:
            with torch.no_grad():
                model(input_ids=ids, **call)
        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            out = model(input_ids=ids, labels=ids, **call)
            acc.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.item()))
            times.append(time.perf_counter() - t0)
            if step == 0:
                step1_cpu = _common.cpu_seconds() - cpu0
            metrics.end_step()
        result = {
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
            "variant": args.variant,
            "accelerate": accelerate.__version__,
        }
        result.update(metrics.snapshot())
        if args.gemms:
            eager, compiled = _common.gemms_of_forward(lambda: model(input_ids=ids, labels=ids, **call))
            result.update(fwd_gemms_eager=eager, fwd_gemms_compiled=compiled)
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
                    lambda: model(input_ids=ids, **call),
                    lambda: model(input_ids=ids, labels=ids, **call),
                    lambda: model(input_ids=ids, labels=ids, **call).loss,
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
