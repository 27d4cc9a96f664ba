"""transformers 5.24's ``Trainer`` with ``torch_compile=True`` and gradient checkpointing, one CPU process.

``TrainingArguments(torch_compile=True, torch_compile_backend="aot_eager",
gradient_checkpointing=True, use_cpu=True, max_steps=3)`` on a tiny random-init
``Qwen3MoeForCausalLM``: the Trainer turns gradient checkpointing on in the layers
(``GradientCheckpointingLayer``, which 5.23+ checkpoints in ``forward``) and hands
accelerate a ``TorchDynamoPlugin``, which wraps the whole model in ``torch.compile``.
Nothing is changed around the Trainer. ``--eager`` drops ``torch_compile`` and the
backend (``torch_compile_backend`` alone compiles too).

    python tests/clients/trainer_worker.py [--eager] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eager", action="store_true")
    args = p.parse_args()
    metrics = _common.Metrics().install()

    def body() -> dict:
        import torch
        from transformers import (
            Qwen3MoeForCausalLM,
            Trainer,
            TrainerCallback,
            TrainingArguments,
        )

        torch.manual_seed(0)
        cfg = _common.tiny_qwen3_moe_config(args.layers)
        model = Qwen3MoeForCausalLM(cfg)
        g = torch.Generator().manual_seed(1)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16), generator=g)]

        times: list[float] = []
        cpu: list[float] = []  # CPU seconds of each step (this one process: no process group)

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t0, self.cpu0 = time.perf_counter(), _common.cpu_seconds()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.t0)
                cpu.append(_common.cpu_seconds() - self.cpu0)

        with tempfile.TemporaryDirectory() as out:
            targs = dict(
                output_dir=out,
                use_cpu=True,
                max_steps=args.steps,
                per_device_train_batch_size=2,
                gradient_checkpointing=True,
                logging_steps=1,
                report_to=[],
                save_strategy="no",
                learning_rate=1e-3,
                seed=0,
                dataloader_num_workers=0,
            )
            if not args.eager:
                targs.update(torch_compile=True, torch_compile_backend="aot_eager")
            trainer = Trainer(
                model=model, args=TrainingArguments(**targs), train_dataset=data, callbacks=[Timer()]
            )
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {
            "losses": losses,
            "first_step_s": round(times[0], 2),
            "step_s": round(min(times[1:] or times), 3),
            "step1_cpu_s": round(_common.sum_over_ranks(cpu[0]), 2),
        }
        result.update(metrics.snapshot())
        wrapped = trainer.model_wrapped
        result["compiled"] = type(wrapped).__name__
        ids = torch.stack([data[0]["input_ids"], data[1]["input_ids"]])  # the training batch's shape
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

    _common.run_main(body)


if __name__ == "__main__":
    main()
