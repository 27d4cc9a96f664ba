"""A policy and a frozen reference model of the same class in one process, as RL trainers hold them.

Both are the example MoE (``examples/train_moe.py``) built the example's way: full AC per block,
``torch.compile`` per block, FSDP2 with the routed experts in their own unit (a graph break inside
each checkpointed MoE block), 2 gloo ranks. Each block is compiled with
``isolate_recompiles=True`` (torch 2.13+), as upstream advises for several models in one process:
each ``torch.compile`` call keeps its own recompile count. The reference starts from the policy's
weights, is frozen (``requires_grad_(False)``, ``eval()``) and runs under ``no_grad``; each step
the policy trains on cross-entropy plus a KL term towards the reference's distribution.

Reported: the policy's losses, the reference's log-prob sums (it must not drift: frozen), the
compile counts (``_common.Metrics``), and the GEMMs of one forward of each model outside compiled
graphs (the reference's under ``no_grad``).

    torchrun --standalone --nproc-per-node 2 tests/clients/policy_ref_worker.py [--layers 2] [--no-isolate]
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from example_worker import _example  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-isolate", action="store_true", help="leave isolate_recompiles at its default")
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh

        tm = _example()
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        margs = tm.ModelArgs(
            n_layers=args.layers, dim=32, vocab_size=128, seq_len=32, moe_inter_dim=16, inter_dim=64
        )
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        expert_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep_fsdp",))
        kwargs: dict = {"backend": "aot_eager"}
        isolate = not args.no_isolate and "isolate_recompiles" in inspect.signature(torch.compile).parameters
        if isolate:
            kwargs["isolate_recompiles"] = True

        def build(frozen: bool):
            model = tm.Transformer(margs)
            model.init_weights(0)  # the reference starts from the policy's weights
            tm.apply_ac(model, "full")
            for key, block in model.layers.items():
                model.layers[key] = torch.compile(block, **kwargs)
            tm.apply_fsdp(model, mesh, expert_mesh, "separate")
            if frozen:
                model.requires_grad_(False)
                model.eval()
            return model

        policy, ref = build(False), build(True)
        opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
        local_bs = 4 // world
        shard = slice(rank * local_bs, (rank + 1) * local_bs)
        losses, ref_sums = [], []
        for step in range(args.steps):
            inputs, targets = tm.make_batch(step, 0, 4, margs)
            inputs, targets = inputs[shard], targets[shard]
            with torch.no_grad():
                ref_logp = F.log_softmax(ref(inputs).float(), dim=-1)
            logp = F.log_softmax(policy(inputs).float(), dim=-1)
            kl = F.kl_div(ref_logp, logp, log_target=True, reduction="batchmean")
            loss = F.nll_loss(logp.flatten(0, 1), targets.flatten()) + 0.1 * kl
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            metrics.end_step()
            g = torch.stack([loss.detach(), ref_logp.sum()])
            dist.all_reduce(g)
            losses.append(g[0].item() / world)
            ref_sums.append(g[1].item() / world)
        inputs, _ = tm.make_batch(0, 0, 4, margs)
        inputs = inputs[shard]
        policy_eager, policy_compiled = _common.gemms_of_forward(lambda: policy(inputs))
        with torch.no_grad():
            ref_eager, ref_compiled = _common.gemms_of_forward(lambda: ref(inputs))
        result = {
            "losses": losses,
            "ref_logp_sums": ref_sums,
            "isolate_recompiles": isolate,
            "fwd_gemms_eager": policy_eager,
            "fwd_gemms_compiled": policy_compiled,
            "ref_fwd_gemms_eager": ref_eager,
            "ref_fwd_gemms_compiled": ref_compiled,
        }
        result.update(metrics.snapshot())
        return result

    _common.run_main(body)


if __name__ == "__main__":
    main()
