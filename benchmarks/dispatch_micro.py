"""Per-call cost autoweave adds to one compiled module, by the number of submodules it holds.

A companion to ``dispatch_bench.py`` that isolates the dispatcher: one AC-wrapped layer with N
child modules and a trivial forward, compiled with ``backend="eager"`` once inside
``autoweave.disabled()`` (plain torch) and once with autoweave on; nothing to weave. ``--compile``
picks ``torch.compile(layer)`` (``wrap``, the default) or ``layer.compile()`` (``inplace``). Calls are
timed interleaved, in blocks of ``--calls``, by the calling thread's CPU time, forward only under
``no_grad``. Prints a table (and ``--json``); run it with another checkout on ``PYTHONPATH`` to
measure that build.

    python benchmarks/dispatch_micro.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave


class Layer(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(2, 2) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _compiled(n: int, style: str) -> nn.Module:
    layer = cw.checkpoint_wrapper(Layer(n))
    if style == "wrap":
        return torch.compile(layer, backend="eager")
    layer.compile(backend="eager")
    return layer


def measure(n: int, rounds: int, calls: int, style: str = "wrap") -> dict[str, float]:
    with autoweave.disabled():
        plain = _compiled(n, style)
    ours = _compiled(n, style)
    x = torch.randn(2, 2)
    times: dict[str, list[float]] = {"plain": [], "autoweave": []}
    with torch.no_grad():
        for _ in range(5):
            plain(x)
            ours(x)
        for r in range(rounds):
            order = [("plain", plain), ("autoweave", ours)]
            for name, model in order if r % 2 else reversed(order):
                start = time.thread_time_ns()
                for _ in range(calls):
                    model(x)
                times[name].append((time.thread_time_ns() - start) / calls / 1000)
    plain_us, ours_us = statistics.median(times["plain"]), statistics.median(times["autoweave"])
    return {"submodules": n, "plain_us": plain_us, "autoweave_us": ours_us, "added_us": ours_us - plain_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submodules", default="8,128,1024")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--compile", choices=("wrap", "inplace"), default="wrap")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    autoweave.enable()
    rows = [measure(int(n), args.rounds, args.calls, args.compile) for n in args.submodules.split(",")]
    print(
        f"autoweave {autoweave.__version__}, torch {torch.__version__}, {args.compile} compile: "
        "per call, median thread CPU time"
    )
    print("| submodules | plain µs/call | autoweave µs/call | added µs/call | ratio |")
    print("|--:|--:|--:|--:|--:|")
    for r in rows:
        ratio = r["autoweave_us"] / r["plain_us"]
        print(
            f"| {r['submodules']} | {r['plain_us']:.1f} | {r['autoweave_us']:.1f} | {r['added_us']:+.1f} | {ratio:.3f}× |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
