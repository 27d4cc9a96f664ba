"""Compile cost: what plain torch, an upper bound, a same-code hand weave and autoweave compile, and when.

Each run is a worker of the real-clients lane in its own ``torchrun`` (2 gloo ranks, aot_eager),
launched by ``tests/clients/_runner.py`` with a clean ``AUTOWEAVE*`` environment, all in this one
invocation so that the ratios compare runs made side by side. Counted the way every client worker
counts (``tests/clients/_common.py``, whose ``Metrics`` these numbers come from):

- frames: distinct frames dynamo compiled, the ``f`` of the compile ids ``f/n`` its compile-start
  callback reports (a frame counts once however often it recompiles). The one definition used in
  every table and in the client lane's tests;
- compiles / recompiles: every compile-start callback / those with ``n > 0``;
- graphs: graphs the backend was handed (a counting backend installed under ``aot_eager``'s name);
- limit hits: dynamo's recompile-limit warnings;
- step-1 CPU s: user + system CPU seconds of the first training step (planning, tracing and
  compiling included), of each rank's process and its waited-for children (compiler
  subprocesses), summed over both ranks. The CPU is shared with other jobs, so these are upper
  bounds and only their ratios, taken in one run, mean much; nothing here asserts a time;
- eager fwd GEMMs: GEMMs of one forward run outside compiled graphs (the profiler,
  ``benchmarks/measure.py``), of all the forward's GEMMs.

Tables:

a) transformers' Qwen3-MoE through accelerate 1.15 (``tests/clients/accelerate_worker.py``: FSDP2
   plugin, the experts their own unit, AC, regional compile) at 2, 8 and 16 layers, with
   ``use_cache=False`` (as training code passes) and ``use_cache=True`` (the config's default, which
   accelerate leaves on under AC). Variants: ``plain`` (accelerate's path, ``AUTOWEAVE`` unset);
   ``layers eager`` (no FSDP unit nor AC of their own for the experts, plain compile; accelerate
   shards the decoder layer *inside* its checkpoint wrapper, whose hooks break the checkpoint, so
   every layer runs eager: what compiling none of the layers costs, a floor, not a capture bound);
   ``upper bound`` (the same, with each layer's FSDP unit moved *around* its checkpoint wrapper,
   torchtitan's order: nothing breaks a checkpoint, plain compile takes every layer whole, all its
   forward GEMMs in one graph: the capture limit, and what compiling this model costs when nothing
   breaks it);
   ``hand weave`` (the code autoweave compiles, written by hand: each decoder layer's inner module
   and each experts' inner module compiled in place, one code object shared by every layer, under
   their eager checkpoint wrappers; see the worker's docstring); ``autoweave`` (``AUTOWEAVE=1``).
b) the example MoE (``tests/clients/example_worker.py`` over ``examples/train_moe.py``: full AC,
   ``torch.compile`` per block, the routed experts their own FSDP unit; one dense block first) at 2, 8
   and 16 layers, for the same four (the upper bound: the experts in their block's unit, every block
   compiled whole; the hand weave: ``checkpoint_wrapper(torch.compile(block))`` for MoE blocks,
   sharing ``TransformerBlock.forward``).
c) variable lengths: the example MoE, 2 layers, a new sequence length at each of 12 steps (64, 96,
   80, 128, 72, 112, 88, 120, 104, 56, 136, 48), selective and full AC, automatic dynamic and
   ``dynamic=True``, plain against autoweave: compiles per step, recompiles, limit hits and the last
   step that compiled anything.

    python benchmarks/compile_cost.py [--quick] [--tables a,b,c] [--json out.json] [--md out.md]

Table a needs accelerate and transformers (the client lane's venv, ``.ci/clients``); without them
it is skipped. ``--quick``: 2 layers, ``use_cache=False`` only, 3 lengths, selective AC with
automatic dynamic only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "clients"))
import _runner  # noqa: E402  tests/clients/_runner.py

LENGTHS = (64, 96, 80, 128, 72, 112, 88, 120, 104, 56, 136, 48)
# variant name -> (setting for _runner, the worker's --variant)
ACCELERATE_VARIANTS = {
    "plain": ("plain", "accelerate"),
    "layers eager": ("plain", "eager_layers"),
    "upper bound": ("plain", "upper_bound"),
    "hand weave": ("plain", "hand_weave"),
    "autoweave": ("autoweave", "accelerate"),
}
EXAMPLE_VARIANTS = {
    "plain": ("plain", "compile"),
    "upper bound": ("plain", "upper_bound"),
    "hand weave": ("plain", "hand_weave"),
    "autoweave": ("autoweave", "compile"),
}
FIELDS = (
    "frames", "compiles", "recompiles", "graphs", "recompile_limit_hits", "step1_cpu_s",
    "fwd_gemms_eager", "fwd_gemms_compiled", "fallbacks", "compiles_per_step", "last_compiling_step",
    "losses", "ok", "error",
)  # fmt: skip


def _run(table: str, worker: str, setting: str, args: list[str], **labels: Any) -> dict[str, Any]:
    start = time.perf_counter()
    run = _runner.run_worker(worker, setting, args, nproc=2, timeout=1800)
    row: dict[str, Any] = {"table": table, **labels, "setting": setting, "worker": worker, "args": args}
    row.update({k: (run.result or {}).get(k) for k in FIELDS})
    row["ok"] = run.ok
    if not run.ok:
        row["error"] = (run.result or {}).get("error") or f"rc={run.rc}: {run.stderr.strip()[-300:]}"
    row["wall_s"] = round(time.perf_counter() - start, 1)
    print(
        f"  {table} {labels} {setting}: frames={row['frames']} recompiles={row['recompiles']} "
        f"cpu={row['step1_cpu_s']} ok={row['ok']} ({row['wall_s']} s)",
        file=sys.stderr,
        flush=True,
    )
    return row


def depth_rows(
    table: str, worker: str, variants: dict, layers: list[int], extra: list[str], **labels
) -> list:
    rows = []
    for n in layers:
        for name, (setting, variant) in variants.items():
            args = ["--layers", str(n), "--steps", "2", "--gemms", "--variant", variant, *extra]
            rows.append(_run(table, worker, setting, args, variant=name, layers=n, **labels))
    return rows


def lengths_rows(lengths: list[int], acs: list[str], dynamics: list[str]) -> list:
    rows = []
    for ac in acs:
        for dynamic in dynamics:
            for setting in ("plain", "autoweave"):
                args = ["--layers", "2", "--steps", str(len(lengths)), "--ac", ac, "--dynamic", dynamic]
                args += ["--lengths", ",".join(map(str, lengths))]
                rows.append(_run("c", "example_worker", setting, args, ac=ac, dynamic=dynamic))
    return rows


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def depth_table(rows: list[dict[str, Any]]) -> list[str]:
    floor = any(r["variant"] == "layers eager" for r in rows)
    columns = [
        "variant", "layers", "frames", "compiles", "recompiles", "graphs", "limit hits", "step-1 CPU s",
        "CPU vs upper bound", *(["CPU vs layers eager"] if floor else []), "frames vs hand weave",
        "eager fwd GEMMs", "runs?",
    ]  # fmt: skip
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    by = {(r["variant"], r["layers"]): r for r in rows}
    for r in rows:
        bound, hand = by.get(("upper bound", r["layers"]), {}), by.get(("hand weave", r["layers"]), {})
        eager = by.get(("layers eager", r["layers"]), {})
        gemms = (
            "-"
            if r["fwd_gemms_eager"] is None
            else f"{r['fwd_gemms_eager']} of {r['fwd_gemms_eager'] + (r['fwd_gemms_compiled'] or 0)}"
        )
        cells = [
            r["variant"], r["layers"], r["frames"], r["compiles"], r["recompiles"], r["graphs"],
            r["recompile_limit_hits"], r["step1_cpu_s"], _ratio(r["step1_cpu_s"], bound.get("step1_cpu_s")),
            *([_ratio(r["step1_cpu_s"], eager.get("step1_cpu_s"))] if floor else []),
            _ratio(r["frames"], hand.get("frames")), gemms, "yes" if r["ok"] else f"no: {r['error']}"[:160],
        ]  # fmt: skip
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return out


def lengths_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| AC | dynamic | setting | compiles per step | frames | recompiles | limit hits "
        "| last step that compiled | step-1 CPU s | runs? |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_step = ",".join(map(str, r["compiles_per_step"] or [])) or "-"
        cells = [
            r["ac"], "automatic" if r["dynamic"] == "auto" else "`dynamic=True`", r["setting"], per_step,
            r["frames"], r["recompiles"], r["recompile_limit_hits"], r["last_compiling_step"],
            r["step1_cpu_s"], "yes" if r["ok"] else f"no: {r['error']}"[:160],
        ]  # fmt: skip
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers, use_cache=False, 3 lengths, selective AC")
    p.add_argument("--tables", default="a,b,c")
    p.add_argument("--layers", default=None, help="comma list of depths for tables a and b (default 2,8,16)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    tables = set(a.tables.split(","))
    layers = [int(n) for n in a.layers.split(",")] if a.layers else [2] if a.quick else [2, 8, 16]
    caches = ["false"] if a.quick else ["false", "true"]
    lengths = list(LENGTHS[:3] if a.quick else LENGTHS)
    rows: list[dict[str, Any]] = []
    md = [
        "# Compile cost (`benchmarks/compile_cost.py`)",
        "",
        f"torch {_torch_version()}, Python {platform.python_version()}, 2 gloo ranks on the CPU, aot_eager. "
        "CPU seconds are upper bounds (a shared machine); frames, compiles and GEMMs are counts.",
    ]
    accelerate = _runner.importable("accelerate") and _runner.importable("transformers")
    if "a" in tables:
        if not accelerate:
            md += [
                "",
                "a) skipped: accelerate or transformers is not installed (the client lane's venv has them)",
            ]
        for cache in caches if accelerate else []:
            sub = depth_rows(
                "a", "accelerate_worker", ACCELERATE_VARIANTS, layers, ["--use-cache", cache], use_cache=cache
            )
            rows += sub
            md += [
                "",
                f"## a) transformers Qwen3-MoE through accelerate 1.15, `use_cache={cache.title()}`",
                "",
            ]
            md += depth_table(sub)
    if "b" in tables:
        sub = depth_rows("b", "example_worker", EXAMPLE_VARIANTS, layers, [])
        rows += sub
        md += ["", "## b) the example MoE (full AC), 2 steps", ""] + depth_table(sub)
    if "c" in tables:
        acs = ["selective"] if a.quick else ["selective", "full"]
        dynamics = ["auto"] if a.quick else ["auto", "true"]
        sub = lengths_rows(lengths, acs, dynamics)
        rows += sub
        md += [
            "",
            f"## c) variable lengths: the example MoE, 2 layers, lengths {', '.join(map(str, lengths))}",
            "",
        ]
        md += lengths_table(sub)
    text = "\n".join(md) + "\n"
    print(text)
    if a.md:
        Path(a.md).write_text(text)
    if a.json:
        meta = {"torch": _torch_version(), "python": platform.python_version(), "args": vars(a)}
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "?"


if __name__ == "__main__":
    main()
