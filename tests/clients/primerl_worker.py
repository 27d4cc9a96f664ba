"""prime-rl's order of wrapping, reproduced on transformers 5.24's tiny ``Qwen3MoeForCausalLM`` (no prime-rl package).

Run under torchrun (2 gloo ranks on the CPU). The order is prime-rl's trainer's (issue 32):

1. activation checkpointing per layer first: ``layers[i] = checkpoint_wrapper(layers[i])``;
2. then each layer compiled in place: ``layers[i].compile(backend="aot_eager")`` (the wrapper);
3. then ``fully_shard(layer.mlp.gate)`` (the router: prime-rl keeps it in fp32 and shards it on its
   own) and ``fully_shard(layer.mlp.experts)``, reached through the wrapper's attribute forwarding;
4. then ``fully_shard(layer)`` (the compiled wrapper), then ``fully_shard(model)``.

Then ``--steps`` AdamW steps on one batch. So the router's and the experts' FSDP hooks run inside
the checkpoint that is inside the compiled wrapper: the units sit under a checkpoint dynamo has to
trace.

What is changed from prime-rl: its own MoE model and router module (``mlp.router``) are
transformers' ``Qwen3MoeForCausalLM`` and ``mlp.gate`` here; the model is fp32 throughout (the
router is fp32 as in prime-rl; transformers' ``Qwen3MoeTopKRouter`` does not upcast bf16 hidden
states for an fp32 weight, so a bf16 model with an fp32 router fails in ``F.linear``); the mesh is
``init_device_mesh("cpu", (2,))`` with gloo. ``--no-compile`` skips step 2 (the eager reference).

``--units layer`` (``benchmarks/clients.py``'s "bound"): step 3 is left out, so the router and the
experts stay in their layer's unit and no FSDP hook runs under a checkpoint: the same model and
order with nothing nested, what plain compile captures when nothing breaks the checkpoint.

    torchrun --standalone --nproc-per-node 2 tests/clients/primerl_worker.py --layers 2 [--no-compile] [--units moe|layer]
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
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--units",
        choices=("moe", "layer"),
        default="moe",
        help="moe: prime-rl's router and experts units inside the layer's; layer: no unit inside a layer",
    )
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from transformers import Qwen3MoeForCausalLM

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        cfg = _common.tiny_qwen3_moe_config(args.layers, use_cache=False)
        model = Qwen3MoeForCausalLM(cfg)
        layers = model.model.layers
        for i, layer in enumerate(layers):  # 1. AC per layer
            layers.register_module(str(i), checkpoint_wrapper(layer))
        if not args.no_compile:  # 2. each (wrapped) layer compiled in place
            for layer in layers:
                layer.compile(backend="aot_eager")
        for layer in layers:  # 3. the fp32 router and the experts, 4. the layer
            if args.units == "moe":
                fully_shard(layer.mlp.gate, mesh=mesh)
                fully_shard(layer.mlp.experts, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.item()))
            times.append(time.perf_counter() - t0)
            if step == 0:
                step1_cpu = _common.cpu_seconds() - cpu0
            metrics.end_step()
        result = {
            "units": units,
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
        }
        result.update(metrics.snapshot())
        result.update(
            _common.measurements(
                lambda: model(input_ids=ids),
                lambda: model(input_ids=ids, labels=ids),
                lambda: model(input_ids=ids, labels=ids).loss,
            )
        )
        opt.zero_grad()
        result["recompiles_after_measure"] = metrics.snapshot()["recompiles"]
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
