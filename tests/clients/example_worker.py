"""The example MoE (``examples/train_moe.py``) as a worker: its own AC, compile and FSDP2, 2 gloo ranks.

Measured as every client worker measures (``_common.Metrics``), for the compile-cost benchmark
(``benchmarks/compile_cost.py``) and the client lane's compile-count tests. Built the example's way
(AC, then ``torch.compile`` per block, then FSDP with the routed experts in their own unit), with:

- ``--variant compile``: exactly that; plain or autoweave as the environment says (``AUTOWEAVE``);
- ``--variant upper_bound``: the experts share their block's FSDP unit (``experts_fsdp="shared"``):
  no unit inside a compiled block, nothing breaks the graph;
- ``--variant hand_weave`` (full AC only): the code autoweave compiles for this model, by hand. A
  dense block is ``torch.compile(checkpoint_wrapper(block))`` (no boundary inside, as autoweave
  leaves it); an MoE block is ``checkpoint_wrapper(torch.compile(block))``: the checkpoint stays eager
  around a compile of ``TransformerBlock.forward`` that every block shares (one code object, one
  dynamo cache), which dynamo splits at the experts' FSDP unit; the experts' forward is compiled as
  a frame of its own when the split runs it.

``--lengths 64,96,...`` gives step ``i`` the sequence length ``lengths[i % n]`` (packed or padded
SFT batches); ``--dynamic true`` passes ``dynamic=True`` to ``torch.compile`` (default: automatic
dynamic). ``--gemms`` profiles one forward's GEMMs outside and inside compiled graphs.

    torchrun --standalone --nproc-per-node 2 tests/clients/example_worker.py --layers 2 --steps 3 [--ac selective]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("train_moe", _common.ROOT / "examples" / "train_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ac", choices=("full", "selective"), default="full")
    p.add_argument("--variant", choices=("compile", "upper_bound", "hand_weave"), default="compile")
    p.add_argument("--lengths", default="64", help="comma list of sequence lengths, one per step, cycled")
    p.add_argument("--dynamic", choices=("auto", "true"), default="auto")
    p.add_argument("--gemms", action="store_true", help="profile the forward's GEMMs")
    args = p.parse_args()

    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh

        if args.variant == "hand_weave" and args.ac != "full":
            raise SystemExit("--variant hand_weave is defined for full AC only")
        tm = _example()
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        lengths = [int(n) for n in args.lengths.split(",")]
        margs = tm.ModelArgs(
            n_layers=args.layers, dim=32, vocab_size=128, seq_len=lengths[0], moe_inter_dim=16, inter_dim=64
        )
        model = tm.Transformer(margs)
        model.init_weights(0)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        expert_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep_fsdp",))
        compile_kwargs = {"backend": "aot_eager", "dynamic": True if args.dynamic == "true" else None}
        tm.apply_ac(model, args.ac)
        for key, block in model.layers.items():
            inner = tm._unwrap(block)
            if args.variant == "hand_weave" and inner.moe_enabled:
                model.layers[key] = checkpoint_wrapper(
                    torch.compile(inner, **compile_kwargs), preserve_rng_state=False
                )
            else:
                model.layers[key] = torch.compile(block, **compile_kwargs)
        tm.apply_fsdp(model, mesh, expert_mesh, "shared" if args.variant == "upper_bound" else "separate")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        local_bs = 4 // world
        shard = slice(rank * local_bs, (rank + 1) * local_bs)

        def batch(step: int):
            step_args = dataclasses.replace(margs, seq_len=lengths[step % len(lengths)])
            inputs, targets = tm.make_batch(step, 0, 4, step_args)
            return inputs[shard], targets[shard]

        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            inputs, targets = batch(step)
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            if step == 0:
                step1_cpu = _common.cpu_seconds() - cpu0
            metrics.end_step()
            g = loss.detach().clone()
            dist.all_reduce(g)
            losses.append(g.item() / world)
        result = {
            "losses": losses,
            "variant": args.variant,
            "lengths": lengths[: args.steps],
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
        }
        result.update(metrics.snapshot())
        if args.gemms:
            inputs, _ = batch(args.steps - 1)  # a length the run has compiled for
            eager, compiled = _common.gemms_of_forward(lambda: model(inputs))
            result.update(fwd_gemms_eager=eager, fwd_gemms_compiled=compiled)
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
