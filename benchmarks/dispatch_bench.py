"""What autoweave adds to every forward: per-forward time with autoweave vs plain torch, in one process.

autoweave is turned on in-process with ``autoweave.enable()``; each "plain" model is built and
compiled inside ``with autoweave.disabled():`` (those compiles go to plain torch). Both models of a
case are built from the same seed, warmed up (the first calls compile), then timed interleaved:
``--rounds`` rounds, each running ``--per-round`` forwards of one then of the other, the order
alternating per round, so drift hits both alike. Forward only, under ``torch.no_grad()``, with a
cheap backend (``eager`` by default) so what is left is dispatch, not kernels. The table reports
the calling thread's CPU time per forward (torch runs single-threaded here), which a machine
shared with other jobs disturbs far less than the wall clock; the JSON has wall-clock medians too.

Cases:

* ``many_submodules``: nothing to weave. ``--layers`` AC-wrapped layers compiled one by one
  (``torch.compile(checkpoint_wrapper(layer))``), each holding N small expert modules (as HF MoE
  layers hold one module per expert) of which the forward uses two: N is ``--submodules``, to show
  whether autoweave's cost is flat in the number of submodules.
* ``whole_model``: ``--dense-layers`` dense layers, ``torch.compile(model)`` on the whole model.
* ``outer_ac``: ``checkpoint_wrapper(torch.compile(block))`` per layer (AC outside the compile).
* ``woven``: MoE blocks whose experts are FSDP2 units on a fake process group (world size 2),
  ``torch.compile(checkpoint_wrapper(block))`` then ``fully_shard``: autoweave weaves them; plain
  torch falls back to eager for every checkpointed block. This row compares a woven model with the
  fallback, so it is a cost of weaving, not of dispatch alone.

The target (issue 10): autoweave adds at most 2% of plain's per-forward time, flat in the number
of submodules.

    python benchmarks/dispatch_bench.py [--quick] [--json out.json] [--backend eager]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw  # noqa: E402

import autoweave  # noqa: E402
from autoweave import _compat
from autoweave.dispatch import dispatchers

TARGET_RATIO = 1.02
DIM = 8


# -- models --------------------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class ExpertLayer(nn.Module):
    """A layer holding many expert modules and using two of them, so the work is flat in their number."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts[0](h) + self.experts[1](h)


class DenseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ffn = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.ffn(self.norm(x)))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, DIM)
        self.experts = Expert()  # its own FSDP unit in the woven case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts(h) * torch.sigmoid(self.router(h))


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# -- builders: each returns a ready model; called once outside and once inside autoweave.disabled()


def build_many_submodules(layers: int, submodules: int, backend: str) -> nn.Module:
    return Stack(
        [
            torch.compile(cw.checkpoint_wrapper(ExpertLayer(submodules)), backend=backend)
            for _ in range(layers)
        ]
    )


def build_whole_model(layers: int, backend: str) -> nn.Module:
    return torch.compile(Stack([DenseLayer() for _ in range(layers)]), backend=backend)


def build_outer_ac(layers: int, backend: str) -> nn.Module:
    return Stack([cw.checkpoint_wrapper(torch.compile(DenseLayer(), backend=backend)) for _ in range(layers)])


_mesh: Any = None


def _fake_mesh() -> Any:
    """A 2-rank CPU mesh on torch's fake process group: FSDP2's structure, hooks and collectives, no peers."""
    global _mesh
    if _mesh is None:
        import torch.distributed as dist
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        _mesh = init_device_mesh("cpu", (2,))
    return _mesh


def build_woven(layers: int, backend: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = _fake_mesh()
    blocks = [MoEBlock() for _ in range(layers)]
    model = Stack([torch.compile(cw.checkpoint_wrapper(b), backend=backend) for b in blocks])
    # The common order: AC, then compile, then FSDP (experts in their own unit, then each block).
    for block in blocks:
        fully_shard(block.experts, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return model


# -- measuring -----------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    submodules: int  # many_submodules: expert modules per layer; else modules per compiled unit
    layers: int
    modules_per_unit: int = 0  # modules under one compiled layer (under the model for whole_model)
    plain_ms: float = 0.0  # median per-forward time, plain torch
    autoweave_ms: float = 0.0
    ratio: float = 0.0  # autoweave_ms / plain_ms
    added_us: float = 0.0  # (autoweave_ms - plain_ms) per forward, in µs
    paired_ratio: float = 0.0  # median of the per-round ratios (each round times both)
    meets: bool = False
    woven: int = 0  # autoweave-compiled modules whose plan weaves
    planned: int = 0  # autoweave-compiled modules (dispatchers) in the model
    recompile_limit_hits: int = 0
    plain_samples_ms: list[float] = field(default_factory=list)  # CPU ms per forward, per round
    autoweave_samples_ms: list[float] = field(default_factory=list)
    plain_wall_ms: float = 0.0  # the same rounds timed by the wall clock (medians)
    autoweave_wall_ms: float = 0.0
    plain_wall_samples_ms: list[float] = field(default_factory=list)
    autoweave_wall_samples_ms: list[float] = field(default_factory=list)
    error: str | None = None


def _dispatchers(model: nn.Module) -> list[Any]:
    found = []
    for module in model.modules():
        dispatcher = dispatchers.dispatcher_of(module)
        if dispatcher is not None:
            found.append(dispatcher)
    return found


def _submodule_count(model: nn.Module) -> int:
    return sum(1 for _ in model.modules())


class _LimitHits(logging.Handler):
    """Counts dynamo's recompile-limit warnings: a frame past the limit runs eager and skews timing."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if _compat.log_strings.RECOMPILE_LIMIT_NEEDLE in record.getMessage():
            self.count += 1


def _time(model: nn.Module, x: torch.Tensor, n: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per forward over ``n`` forwards.

    CPU time of this thread is the primary measure: dispatch is Python work on the calling
    thread (torch runs single-threaded here), and on a machine shared with other jobs wall
    time mostly measures the scheduler.
    """
    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        model(x)
    return (time.thread_time_ns() - cpu) / n / 1e6, (time.perf_counter_ns() - wall) / n / 1e6


def measure(
    case: str,
    layers: int,
    build: Callable[[], nn.Module],
    *,
    rounds: int,
    per_round: int,
    warmup: int,
    submodules: int | None = None,
) -> Row:
    torch._dynamo.reset()  # cases never share dynamo caches (nor recompile budgets)
    hits = _LimitHits()
    limit_logger = logging.getLogger(_compat.log_strings.RECOMPILE_LIMIT_LOGGER)
    limit_logger.addHandler(hits)
    row = Row(case, 0, layers)
    try:
        torch.manual_seed(0)
        woven_model = build()
        with autoweave.disabled():
            torch.manual_seed(0)
            plain_model = build()
        x = torch.randn(4, DIM)
        with torch.no_grad():
            for _ in range(warmup):
                woven_model(x)
                plain_model(x)
            dispatchers = _dispatchers(woven_model)
            row.planned = len(dispatchers)
            row.woven = sum(1 for d in dispatchers if d.plan is not None and d.plan.woven)
            row.modules_per_unit = _modules_per_unit(case, woven_model)
            row.submodules = row.modules_per_unit if submodules is None else submodules
            sides = [
                (plain_model, row.plain_samples_ms, row.plain_wall_samples_ms),
                (woven_model, row.autoweave_samples_ms, row.autoweave_wall_samples_ms),
            ]
            for r in range(rounds):
                for model, cpu_samples, wall_samples in sides if r % 2 == 0 else sides[::-1]:
                    cpu_ms, wall_ms = _time(model, x, per_round)
                    cpu_samples.append(cpu_ms)
                    wall_samples.append(wall_ms)
        row.plain_wall_ms = statistics.median(row.plain_wall_samples_ms)
        row.autoweave_wall_ms = statistics.median(row.autoweave_wall_samples_ms)
        row.plain_ms = statistics.median(row.plain_samples_ms)
        row.autoweave_ms = statistics.median(row.autoweave_samples_ms)
        row.ratio = row.autoweave_ms / row.plain_ms
        row.added_us = (row.autoweave_ms - row.plain_ms) * 1e3
        row.paired_ratio = statistics.median(
            a / p for a, p in zip(row.autoweave_samples_ms, row.plain_samples_ms, strict=True)
        )
        row.meets = row.ratio <= TARGET_RATIO
    except Exception as exc:  # one broken case must not hide the others
        row.error = f"{type(exc).__name__}: {exc}"
    finally:
        limit_logger.removeHandler(hits)
        row.recompile_limit_hits = hits.count
    return row


def _modules_per_unit(case: str, model: nn.Module) -> int:
    """Modules under one compiled layer (for whole_model: under the compiled model)."""
    if case == "whole_model":
        return _submodule_count(model)
    first = model.layers[0]
    return _submodule_count(first) if isinstance(first, nn.Module) else 0


# -- output --------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| case | submodules | layers | plain ms/fwd | autoweave ms/fwd | ratio | added µs/fwd | woven | target ≤ 1.02× |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|:-:|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.case} | {r.submodules} | {r.layers} | error: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {r.case} | {r.submodules} | {r.layers} | {r.plain_ms:.3f} | {r.autoweave_ms:.3f} | "
            f"{r.ratio:.3f}× | {r.added_us:+.1f} | {r.woven}/{r.planned} | {'yes' if r.meets else '**no**'} |"
        )
    return "\n".join(lines)


def flatness(rows: list[Row]) -> dict[str, Any] | None:
    """Is the added time flat in the number of submodules (many_submodules rows)?

    Flat: the added µs at the most submodules exceed those at the fewest by no more than 2% of
    plain's per-forward time at the fewest (the same budget as the per-row target).
    """
    sweep = sorted(
        (r for r in rows if r.case == "many_submodules" and not r.error), key=lambda r: r.submodules
    )
    if len(sweep) < 2:
        return None
    low, high = sweep[0], sweep[-1]
    growth = high.added_us - low.added_us
    per_submodule = growth / (high.submodules - low.submodules)
    budget = (TARGET_RATIO - 1) * low.plain_ms * 1e3
    return {
        "from_submodules": low.submodules,
        "to_submodules": high.submodules,
        "added_us_growth": growth,
        "added_us_per_submodule": per_submodule,
        "budget_us": budget,
        "flat": growth <= budget,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (CI smoke test)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--backend", default="eager", help="dynamo backend for every compile (default: eager)"
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--submodules", default="8,32,128", help="expert modules per layer, comma list")
    parser.add_argument("--dense-layers", type=int, default=64)
    parser.add_argument("--woven-layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.submodules, args.dense_layers, args.woven_layers = 3, "8,32", 4, 2
        args.rounds, args.per_round, args.warmup = 3, 2, 2

    if not autoweave.enable():
        print("autoweave could not be enabled in this process", file=sys.stderr)
        return 1
    # Many same-class layers with different expert counts share code objects across cases; a
    # frame past the recompile limit would run eager and time something else.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch.set_num_threads(1)

    timing = {"rounds": args.rounds, "per_round": args.per_round, "warmup": args.warmup}
    rows: list[Row] = []
    for n in [int(s) for s in args.submodules.split(",") if s.strip()]:
        rows.append(
            measure(
                "many_submodules",
                args.layers,
                lambda n=n: build_many_submodules(args.layers, n, args.backend),
                submodules=n,
                **timing,
            )
        )
    rows.append(
        measure(
            "whole_model",
            args.dense_layers,
            lambda: build_whole_model(args.dense_layers, args.backend),
            **timing,
        )
    )
    rows.append(measure("outer_ac", args.layers, lambda: build_outer_ac(args.layers, args.backend), **timing))
    rows.append(
        measure("woven", args.woven_layers, lambda: build_woven(args.woven_layers, args.backend), **timing)
    )

    flat = flatness(rows)
    print(
        f"autoweave dispatch overhead: torch {torch.__version__}, backend {args.backend}, forward only under "
        f"no_grad, {args.rounds} interleaved rounds x {args.per_round} forwards, median CPU time (this "
        f"thread) per forward; wall-clock medians in the JSON\n"
    )
    print(table(rows))
    if flat is not None:
        print(
            f"\nflat in submodules: {'yes' if flat['flat'] else '**no**'} (added time grows "
            f"{flat['added_us_growth']:+.1f} µs from {flat['from_submodules']} to {flat['to_submodules']} "
            f"submodules per layer, {flat['added_us_per_submodule']:+.3f} µs per submodule summed over "
            f"the {args.layers} layers of a forward; budget "
            f"{flat['budget_us']:.1f} µs)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "meta": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "autoweave": autoweave.__version__,
                "target_ratio": TARGET_RATIO,
                "measure": "forward only, torch.no_grad(), median CPU ms (calling thread) per forward over "
                "interleaved rounds; *_wall_* fields: the same rounds by the wall clock",
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            },
            "rows": [asdict(r) for r in rows],
            "flatness": flat,
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
