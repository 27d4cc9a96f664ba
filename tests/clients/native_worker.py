"""transformers 5.24's native FSDP2: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``.

Run under torchrun (2 gloo ranks on the CPU). Rank 0 builds a tiny random-init
``Qwen3MoeForCausalLM`` (seed 0, ``use_cache=False``) and ``save_pretrained``s it into a temporary
directory; after a barrier both ranks load it with ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=2, ...), dtype=...)``, which shards it with
transformers' own FSDP plan (``distributed/fsdp.py``: ``fully_shard`` per plan entry, deepest
first, then on the root). Then ``gradient_checkpointing_enable(use_reentrant=False)`` (each
``Qwen3MoeDecoderLayer`` is a ``GradientCheckpointingLayer``: it checkpoints in its own forward,
*inside* its FSDP unit), 3 training steps, and one of ``--compile``:

- ``layer``: each decoder layer ``.compile(backend="aot_eager")`` in place;
- ``whole``: ``torch.compile(model, backend="aot_eager")``;
- ``trainer``: transformers' ``Trainer`` with ``TrainingArguments(torch_compile=True,
  torch_compile_backend="aot_eager", gradient_checkpointing=True, use_cpu=True, max_steps=3)`` on
  the natively sharded model (the Trainer accepts it: ``is_distributed_loading_by_transformers``);
- ``none`` (or ``--eager``): eager; ``--compile trainer --eager``: the Trainer without ``torch_compile``.

Which modules become FSDP units (transformers 5.24.0, read from ``distributed/mixin.py``
``_resolve_parallel_plans`` and checked here, ``units`` in the result):

- ``--units plan`` (transformers' default plan): ``model.embed_tokens``, each ``model.layers.<i>``,
  ``model.norm`` + ``lm_head`` as one group (``keep_full_weight``), the root. Qwen3-MoE declares no
  ``_keep_in_fp32_modules_strict``, so in bf16 the router ``mlp.gate`` stays bf16 and is no unit of
  its own. Declaring one (``Qwen3MoePreTrainedModel._keep_in_fp32_modules_strict =
  ["mlp.gate.weight"]``, as hy_v3/dots3/kimi_linear declare ``gate.weight``) does make each gate a
  unit in fp32, but then ``Qwen3MoeTopKRouter.forward`` fails: ``F.linear`` of bf16 hidden states
  and an fp32 weight ("expected m1 and m2 to have the same dtype"): its router does not upcast.
- ``--units moe`` (the default): the same plan plus ``fsdp_plan={"model.layers.*.mlp.gate":
  "free_full_weight", "model.layers.*.mlp.experts": "free_full_weight"}`` (``DistributedConfig``'s
  own override): the gate and the experts are units inside each layer's unit, the layout the
  strict-fp32 router models get (the gate) and the hand-written ``fully_shard`` of issue 32
  (gate, experts, layer, model).

What is changed around transformers to run it on a CPU: nothing in its code. The process group is
initialised here (gloo) before ``from_pretrained`` so that rank 0 can save first and both ranks can
barrier; transformers' ``initialize_distributed_mesh`` then builds its CPU mesh itself
(``torch._C._get_accelerator()`` is ``cpu``). bf16 on the CPU and gloo work (a layer is
milliseconds); ``--dtype fp32`` is there to compare.

Measured (``_common``): dynamo's counts, AC fallbacks, and the steady-state forward GEMMs outside
compiled graphs (``gemms_of_forward``: one unprofiled forward without labels, which compiles for the
new arguments, then the profiled one).

    torchrun --standalone --nproc-per-node 2 tests/clients/native_worker.py --compile layer [--units moe] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MOE_UNITS = {"model.layers.*.mlp.gate": "free_full_weight", "model.layers.*.mlp.experts": "free_full_weight"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", choices=("layer", "whole", "trainer", "none"), default="layer")
    p.add_argument(
        "--eager",
        action="store_true",
        help="no compile: the loop eager, or the Trainer without torch_compile",
    )
    p.add_argument("--units", choices=("plan", "moe"), default="moe")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args()
    if args.eager and args.compile != "trainer":
        args.compile = "none"
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
        from transformers import Qwen3MoeForCausalLM
        from transformers.distributed import DistributedConfig

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        where = [tempfile.mkdtemp(prefix="aw-native-") if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        path = where[0]
        try:
            if rank == 0:
                torch.manual_seed(0)
                cfg = _common.tiny_qwen3_moe_config(args.layers, use_cache=False)
                Qwen3MoeForCausalLM(cfg).save_pretrained(path)
            dist.barrier()
            dconf = DistributedConfig(fsdp_size=2, fsdp_plan=dict(MOE_UNITS) if args.units == "moe" else None)
            dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
            model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=dconf, dtype=dtype)
        finally:
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        gate_dtype = str(model.model.layers[0].mlp.gate.weight.dtype)
        model.train()
        g = torch.Generator().manual_seed(1)
        if args.compile == "trainer":
            return {"units": units, "gate_dtype": gate_dtype, **_train_with_trainer(model, args, metrics, g)}

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        run = model
        if args.compile == "layer":
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
        elif args.compile == "whole":
            run = torch.compile(model, backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 64, (2, 16), generator=g)
        losses, times = [], []
        step1_cpu = 0.0
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), _common.cpu_seconds()
            out = run(input_ids=ids, labels=ids)
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
            "gate_dtype": gate_dtype,
            "compiled": type(run).__name__,
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(step1_cpu), 2),
        }
        result.update(metrics.snapshot())
        result.update(
            _common.measurements(
                lambda: run(input_ids=ids),
                lambda: run(input_ids=ids, labels=ids),
                lambda: run(input_ids=ids, labels=ids).loss,
            )
        )
        opt.zero_grad()
        result["recompiles_after_measure"] = metrics.snapshot()["recompiles"]
        return result

    _common.run_main(body)


def _train_with_trainer(model, args, metrics, g) -> dict:
    """The Trainer's path: it turns gradient checkpointing on and compiles the whole model (accelerate's plugin)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16), generator=g)]
    times: list[float] = []
    cpu: list[float] = []  # CPU seconds of each step on this rank

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.cpu0 = time.perf_counter(), _common.cpu_seconds()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            cpu.append(_common.cpu_seconds() - self.cpu0)
            metrics.end_step()

    with tempfile.TemporaryDirectory() as out:
        compile_args = {} if args.eager else {"torch_compile": True, "torch_compile_backend": "aot_eager"}
        targs = TrainingArguments(
            **compile_args,
            output_dir=out,
            use_cpu=True,
            max_steps=args.steps,
            per_device_train_batch_size=2,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            learning_rate=1e-3,
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timer()])
        trainer.train()
    result = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "first_step_s": round(times[0], 2),
        "step_s": round(min(times[1:] or times), 3),
        "step1_cpu_s": round(_common.sum_over_ranks(cpu[0]), 2),
    }
    result.update(metrics.snapshot())
    wrapped = trainer.model_wrapped
    result["compiled"] = type(wrapped).__name__
    ids = torch.stack([data[0]["input_ids"], data[1]["input_ids"]])
    wrapped.train()
    result.update(
        _common.measurements(
            lambda: wrapped(input_ids=ids),
            lambda: wrapped(input_ids=ids, labels=ids),
            lambda: wrapped(input_ids=ids, labels=ids).loss,
        )
    )
    result["recompiles_after_measure"] = metrics.snapshot()["recompiles"]
    return result


if __name__ == "__main__":
    main()
