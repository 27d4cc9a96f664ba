"""Worker for tests/test_report.py: the example MoE under real gloo FSDP2, 2 steps.

``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/report_worker.py OUT {on,off}``
compiles each block with a counting backend (``counting.Capture``), autoweave on or
(``off``) with every compile made inside ``autoweave.disabled()``; the report
itself comes from ``AUTOWEAVE_REPORT`` in the environment. Rank r writes
``OUT/capture{r}.json`` with the counting backend's numbers.

``python tests/report_worker.py OUT on --spawn`` starts the two ranks with
``torch.multiprocessing.spawn`` instead: no ``RANK`` in any environment, the
rank is known only to ``torch.distributed``. Each rank destroys its process
group before exit, so the report must remember the rank it saw.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autoweave  # noqa: E402
from autoweave.sense import counting  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("train_moe", ROOT / "examples" / "train_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module  # before exec: dynamo and dataclasses look it up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    out, weave = Path(sys.argv[1]), sys.argv[2] == "on"
    if "--spawn" in sys.argv[3:]:
        _spawn(out, weave)
        return
    assert autoweave.enable()
    ex = _example()
    rank, world, _ = ex.init_distributed()
    _train(ex, out, weave, rank, world)


def _spawned(rank: int, out: Path, weave: bool, port: int) -> None:
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    assert autoweave.enable()
    _train(_example(), out, weave, rank, 2)


def _spawn(out: Path, weave: bool) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(out, weave, port), nprocs=2, join=True)


def _train(ex, out: Path, weave: bool, rank: int, world: int) -> None:
    args = ex.ModelArgs()
    model = ex.Transformer(args)
    model.init_weights(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    expert_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep_fsdp",))
    cap = counting.Capture()
    backend = cap.backend("aot_eager")
    ex.apply_ac(model, "full")
    with contextlib.nullcontext() if weave else autoweave.disabled():
        for key, block in model.layers.items():
            model.layers[key] = torch.compile(block, backend=backend)
    ex.apply_fsdp(model, mesh, expert_mesh, "separate")
    for step in range(2):
        inputs, targets = ex.make_batch(step, 0, 2 * world, args)
        shard = slice(rank * 2, rank * 2 + 2)
        logits = model(inputs[shard])
        F.cross_entropy(logits.flatten(0, 1), targets[shard].flatten()).backward()
    (out / f"capture{rank}.json").write_text(json.dumps({"graphs": cap.graph_count, "ops": cap.ops}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
