"""Lightning 2.6: a small MoE model through ``ModelParallelStrategy`` (Lightning's FSDP2 path), 2 gloo ranks.

Run under torchrun: Lightning reads torchrun's environment (``TorchElasticEnvironment``, processes
created outside it) and launches nothing itself. The user's code does what Lightning's FSDP2 docs do:
in ``configure_model`` (``--api trainer``) or the strategy's ``parallelize_fn`` (``--api fabric``),
per block ``fully_shard`` on the experts (the nested unit), ``checkpoint_wrapper`` on the block,
``fully_shard`` on the wrapped block, then ``fully_shard`` on the root; ``--compile block``
compiles each checkpointed block in place (``.compile()``), ``--compile whole`` compiles the whole
model after sharding (``torch.compile(model)``, as Lightning's docs do); ``--eager`` compiles
nothing. Every compile uses ``backend="aot_eager"``. ``--units layer`` (``benchmarks/clients.py``'s
"bound") leaves out the experts' ``fully_shard``: they stay in their block's unit, nothing is nested,
and plain compile captures what it can when nothing breaks the checkpoint.

Plain torch: each checkpointed block holds the experts' FSDP unit, whose hooks break the graph
inside the checkpoint, so dynamo runs the whole block eager (an AC fallback per block).

What is changed around Lightning to run it on a CPU: ``accelerator="cpu"`` (the process group
backend is then gloo, Lightning's default for a CPU device, and the strategy's device mesh
``init_device_mesh("cpu", (2, 1))``); ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1)`` so both ranks shard (its default puts the ranks on the tensor-parallel
dimension); Trainer: no logger, no checkpoint callback, no progress bar (no files besides
``--save``'s). The Trainer run keeps Lightning's validation sanity check (2 no-grad batches before
training; ``--no-sanity`` drops it).

``--save DIR`` writes a distributed checkpoint after training (Trainer: ``trainer.save_checkpoint``;
Fabric: ``fabric.save``) and reports the next loss (one forward on the next batch) and every
parameter's full sum; ``--load DIR`` restores it instead of training (Trainer:
``trainer.fit(ckpt_path=DIR)`` for one more step, whose loss is the next loss; Fabric:
``fabric.load``) and reports the same.

    torchrun --standalone --nproc-per-node 2 tests/clients/lightning_worker.py --api trainer|fabric [--compile block|whole] [--eager] [--units moe|layer] [--save DIR | --load DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

DIM, VOCAB, SEQ, BATCH = 32, 64, 16, 2


def build_model(layers: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Experts(nn.Module):
        """Dense experts: every token through every expert, weighted by the router (2 bmm)."""

        def __init__(self, n: int = 4, hidden: int = 16) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(n, DIM, hidden) / DIM**0.5)
            self.w2 = nn.Parameter(torch.randn(n, hidden, DIM) / hidden**0.5)

        def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
            n = self.w1.shape[0]
            t = x.reshape(1, -1, DIM).expand(n, -1, -1)
            y = torch.bmm(F.silu(torch.bmm(t, self.w1)), self.w2).reshape(n, *x.shape)
            # summed over the experts: a new tensor, not a view (FSDP warns of a unit returning a view)
            return (y * gates.permute(2, 0, 1).unsqueeze(-1)).sum(0)

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(DIM, 4, bias=False)
            self.experts = Experts()
            self.shared = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts(x, torch.softmax(self.router(x), -1)) + self.shared(x)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.out = nn.Linear(DIM, DIM)
            self.moe = MoE()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
            att = (q @ k.transpose(-1, -2) / DIM**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + self.out(att @ v)
            return x + self.moe(self.norm2(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Model()


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective AC's policy: keep the GEMMs' outputs, recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def parallelize(model, mesh, compile_form: str | None, ac: str = "full", units: str = "moe"):
    """The user's code: FSDP2 units (the experts nested in each block unless ``units="layer"``), AC, then compile."""
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    dp = mesh["data_parallel"]
    ac_kwargs = {}
    if ac == "selective":
        ac_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    for i, block in enumerate(model.layers):
        if units == "moe":
            fully_shard(block.moe.experts, mesh=dp)
        wrapped = checkpoint_wrapper(block, **ac_kwargs)
        fully_shard(wrapped, mesh=dp)
        if compile_form == "block":
            wrapped.compile(backend="aot_eager")
        model.layers[i] = wrapped
    fully_shard(model, mesh=dp)
    if compile_form == "whole":
        model = torch.compile(model, backend="aot_eager")
    return model


def batch(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_of(model, ids):
    import torch.nn.functional as F

    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def param_sums(model) -> list[float]:
    """Every parameter's full sum (gathered from its shards), in ``named_parameters`` order."""
    out = []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(float(full.detach().double().sum()))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    p.add_argument("--compile", choices=("block", "whole"), default="block")
    p.add_argument("--eager", action="store_true", help="compile nothing")
    p.add_argument("--ac", choices=("full", "selective"), default="full", help="checkpoint_wrapper's AC")
    p.add_argument(
        "--units",
        choices=("moe", "layer"),
        default="moe",
        help="moe: the experts a unit inside each block's; layer: no unit inside a block",
    )
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-sanity", action="store_true", help="Trainer: no validation sanity check")
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    args = p.parse_args()
    compile_form = None if args.eager else args.compile
    metrics = _common.Metrics().install()

    def body() -> dict:
        if args.api == "fabric":
            return run_fabric(args, compile_form, metrics)
        return run_trainer(args, compile_form, metrics)

    _common.run_main(body)


def _strategy(**kwargs):
    from lightning.pytorch.strategies import ModelParallelStrategy as TrainerStrategy

    return TrainerStrategy(data_parallel_size=2, tensor_parallel_size=1, **kwargs)


def run_trainer(args, compile_form, metrics) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(args.layers)
            self.losses: list[float] = []
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.restored: list[float] | None = None

        def configure_model(self) -> None:
            self.model = parallelize(self.model, self.device_mesh, compile_form, args.ac, args.units)

        def training_step(self, ids, _):
            self._t0, self._cpu0 = time.perf_counter(), _common.cpu_seconds()
            loss = loss_of(self.model, ids)
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_batch_end(self, *_):
            self.times.append(time.perf_counter() - self._t0)
            self.cpu.append(_common.cpu_seconds() - self._cpu0)
            metrics.end_step()

        def validation_step(self, ids, _):
            return loss_of(self.model, ids)

        def on_train_start(self) -> None:
            if args.load:
                self.restored = param_sums(self.model)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = [batch(s) for s in range(args.steps + 1)]
    train = DataLoader(data[: args.steps], batch_size=None)
    module = Module()
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # both ranks see every batch, as in the Fabric loop
        num_sanity_val_steps=0 if args.no_sanity else 2,
        limit_val_batches=2,
        check_val_every_n_epoch=1000,
    )
    val = DataLoader([data[0], data[1]], batch_size=None)
    if args.load:
        # One more step from the checkpoint: its loss is the next loss of the run that saved it.
        next_train = DataLoader([data[args.steps]] * (args.steps + 1), batch_size=None)
        trainer = L.Trainer(max_steps=args.steps + 1, **trainer_kwargs)
        trainer.fit(module, next_train, val, ckpt_path=args.load)
        return {"next_loss": module.losses[-1], "param_sums": module.restored, "losses": module.losses}
    trainer = L.Trainer(max_steps=args.steps, **trainer_kwargs)
    trainer.fit(module, train, val)
    result = _results(module.model, module.losses, module.times, metrics, module.cpu[0])
    if args.save:
        trainer.save_checkpoint(args.save)
        result.update(_next(module.model, data[args.steps]))
    return result


def run_fabric(args, compile_form, metrics) -> dict:
    import lightning as L
    import torch
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=lambda m, mesh: parallelize(m, mesh, compile_form, args.ac, args.units),
        data_parallel_size=2,
        tensor_parallel_size=1,
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(build_model(args.layers))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = [batch(s) for s in range(args.steps + 1)]
    if args.load:
        fabric.load(args.load, {"model": model, "optimizer": opt})
        result = _next(model, data[args.steps])
        result["param_sums"] = param_sums(model)
        return result
    losses, times = [], []
    step1_cpu = 0.0
    for step in range(args.steps):
        t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
        loss = loss_of(model, data[step])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
        if step == 0:
            step1_cpu = _common.cpu_seconds() - cpu0
        metrics.end_step()
    result = _results(model, losses, times, metrics, step1_cpu)
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": opt})
        result.update(_next(model, data[args.steps]))
    return result


def _results(model, losses, times, metrics, step1_cpu: float) -> dict:
    result = {
        "losses": losses,
        "first_step_s": round(times[0], 2),
        "step_s": round(min(times[1:] or times), 3),
        # the first training step; the Trainer's sanity check (no-grad forwards) compiles before it
        "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
    }
    result.update(metrics.snapshot())
    ids = batch(0)
    eager, compiled = _common.gemms_of_forward(lambda: loss_of(model, ids))
    result.update(fwd_gemms_eager=eager, fwd_gemms_compiled=compiled)
    return result


def _next(model, ids) -> dict:
    """The loss of one forward on the next batch, and the parameters' sums."""
    import torch

    with torch.no_grad():
        loss = float(loss_of(model, ids))
    return {"next_loss": loss, "param_sums": param_sums(model)}


if __name__ == "__main__":
    main()
