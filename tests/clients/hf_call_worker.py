"""transformers <= 5.22 (its layers checkpoint around ``nn.Module.__call__``) with HF gradient
checkpointing and the experts in an FSDP2 unit of their own, per layer and whole model (issue 41).

Run under torchrun (2 gloo ranks on the CPU). A tiny random-init ``Qwen3MoeForCausalLM`` (seed 0,
``use_cache=False``, fp32), sharded by hand as the lane's other FSDP2 clients shard it: with
``--units moe`` (the default) each layer's ``mlp.experts`` is a unit inside its layer's unit, then
the root; with ``--units layer`` (the bound) the layers and the root only. Then
``gradient_checkpointing_enable(use_reentrant=False)``: on transformers 5.0-5.22 each
``GradientCheckpointingLayer`` checkpoints its whole ``__call__``, so the layer's FSDP hooks run
inside the checkpoint. ``--compile layer``: each layer ``.compile(backend="aot_eager")``;
``whole``: ``torch.compile(model, backend="aot_eager")``. ``--steps`` training steps (the last
``--steady`` of them after warm-up); ``--eager``: no compile.

Reported, besides ``_common``'s counts: ``frames_per_step`` (dynamo frames converted in each step, on
this rank), ``steady_frames`` (summed over the steady steps and over the ranks) and
``steady_cpu_s`` (user + system CPU seconds per steady step, summed over the ranks): what a run
costs once warm-up is over. Nothing in transformers is changed; the process group is gloo.

    torchrun --standalone --nproc-per-node 2 tests/clients/hf_call_worker.py --compile whole [--units layer]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--steady", type=int, default=3, help="the last steps, counted after warm-up")
    p.add_argument("--compile", choices=("layer", "whole"), default="layer")
    p.add_argument("--units", choices=("moe", "layer"), default="moe")
    p.add_argument("--eager", action="store_true", help="no compile")
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        import transformers
        from torch._dynamo.utils import counters
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen3MoeForCausalLM

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(_common.tiny_qwen3_moe_config(args.layers, use_cache=False))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            if args.units == "moe":
                fully_shard(layer.mlp.experts, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        run = model
        if args.eager:
            pass
        elif args.compile == "layer":
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
        else:
            run = torch.compile(model, backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        losses, frames, cpu = [], [], []
        for _ in range(args.steps):
            before, cpu0 = counters["frames"]["total"], _common.cpu_seconds()
            out = run(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.item()))
            frames.append(counters["frames"]["total"] - before)
            cpu.append(_common.cpu_seconds() - cpu0)
            metrics.end_step()
        steady = slice(len(frames) - args.steady, None)
        result = {
            "transformers": transformers.__version__,
            "losses": losses,
            "frames_per_step": frames,
            "steady_frames": int(_common.sum_over_ranks(float(sum(frames[steady])))),
            "steady_cpu_s": round(_common.sum_over_ranks(sum(cpu[steady]) / args.steady), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(cpu[0]), 2),
        }
        result.update(metrics.snapshot())
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
