"""Real clients, their own code paths, on the CPU: plain torch against autoweave and each strategy.

Runs the drivers of the real-clients lane (``tests/clients/<client>_worker.py``: accelerate's
FSDP2 plugin with regional and whole-model compile, the transformers Trainer with
``torch_compile=True``, torchtitan's ``parallelize_qwen3``, NeMo Automodel's MoE parallelizer
with its AC and per-layer compile, transformers' native FSDP2 loading per compile form, prime-rl's
wrapping order, transformers 5.22's checkpoint around ``__call__``, Lightning's
``ModelParallelStrategy``), each in a subprocess (2 gloo ranks under torchrun where the client
supports it), once per setting: eager (no compile), plain
``torch.compile`` (``AUTOWEAVE`` unset), "bound" (plain ``torch.compile`` on the same layer without
the nested FSDP unit, where the worker can build it: ``BOUND``), autoweave's default
(``AUTOWEAVE=1``) and each strategy forced (``AUTOWEAVE_STRATEGY``).
For each run, printed as one Markdown table per client (and written with ``--json``):

- runs?: trained every step (or the error it raised);
- AC fallbacks: dynamo's "will fall back to eager-mode PyTorch" messages;
- compiles / recompiles: dynamo's compile callbacks (``f/n`` with ``n > 0`` is a recompile);
- frames: the distinct frames dynamo compiled (a frame once however often it recompiles);
- graphs / ops: graphs the (aot_eager) backend was handed and their ops;
- eager fwd GEMMs: GEMMs of one forward run outside compiled graphs (of all the forward's GEMMs);
- activation memory: the C heap grown across one forward with grad, as a ratio to eager's;
- bwd GEMMs: GEMMs run in one backward (a dispatch mode, or the profiler where the RNG-preserving
  checkpoint's higher-order ops defeat the mode; marked ``p``);
- max rel loss diff: the largest relative difference of a step's loss from eager's;
- first step: seconds (compile included);
- step-1 CPU: user + system CPU seconds of the first training step, summed over the ranks (compiler
  subprocesses included): the compile's cost, less sensitive than seconds to a shared machine;
- step-1 CPU vs plain / vs bound, on autoweave's rows: its step-1 CPU over plain's, and over the
  bound's. Plain often compiles none of the layers (it falls back to eager under the checkpoint), so
  "vs plain" compares against compiling nothing; "vs bound" compares against plain compiling the
  same layers whole when nothing nests (``docs/benchmarks.md``, "Step-1 CPU: vs plain, vs bound");
- frames after warm-up, CPU s per step after warm-up (workers that report them, ``hf_call_worker``):
  dynamo frames converted in the last steps, and user + system CPU seconds per such step, summed
  over the ranks, with autoweave's over plain's and over the bound's;
- report: with ``AUTOWEAVE_REPORT``, the report's headline (modules planned/woven, graphs, ops,
  recompiles, fallbacks, fail-open counts), beside the profiler's count.

    python benchmarks/clients.py [--clients accelerate,trainer,torchtitan,native,primerl,nemo,hf_call,lightning] [--json out.json]

Needs the lane's venv (``.ci/clients`` builds it in ``build/clients-venv``); a client whose
package is missing is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "clients"))
import _runner  # noqa: E402  tests/clients/_runner.py

STRATEGIES = ("plain", "autoweave", "hoist", "pieces")
# Where transformers 5.22.2 lies for the hf_call client (.ci/clients installs it there, --no-deps).
HF_CALL_PATH = Path(os.environ.get("HF_CALL_PATH", HERE.parent / "build" / "transformers-5.22"))

# The "bound" setting: plain torch.compile (AUTOWEAVE unset) with these worker args added, the same
# model with nothing nested inside a checkpointed layer (what plain compiles when nothing breaks it).
BOUND: dict[str, list[str]] = {
    # only the decoder layers wrapped, each layer's unit around its checkpoint wrapper
    "accelerate_worker": ["--variant", "upper_bound"],
    # transformers' default plan: a unit per layer, none inside it
    "native_worker": ["--units", "plan"],
    # prime-rl's order without the router's and the experts' units
    "primerl_worker": ["--units", "layer"],
    # the experts in their block's unit
    "lightning_worker": ["--units", "layer"],
    # the layers' units only
    "hf_call_worker": ["--units", "layer"],
}
# Why a worker (or one table, by its title) has no bound: printed under its tables, and in the JSON rows.
NO_BOUND: dict[str, str] = {
    "accelerate FSDP2 + whole-model compile, 3 layers": (
        "n/a: under whole-model compile accelerate's upper_bound variant compiles none of the layers "
        "either (40 of 40 forward GEMMs eager, measured 2026-12-03), so it bounds nothing"
    ),
    "trainer_worker": "n/a, nothing nests (no FSDP unit at all): autoweave has nothing to weave",
    "torchtitan_worker": "n/a, nothing nests (torchtitan shards the experts with their block): autoweave is a no-op",
    "nemo_worker": (
        "n/a: plain's trouble with NeMo's layers is not the experts' unit alone (selective AC: the gate's "
        "load-buffer update is a side effect dynamo rejects under the checkpoint; full AC: plain fails in "
        "backward with CheckpointError), and both remain without it, so such a run would bound nothing"
    ),
}

# client -> (package, [(table, worker, worker args, nproc, settings)])
CLIENTS: dict[str, tuple[str, list[tuple[str, str, list[str], int, tuple[str, ...]]]]] = {
    "accelerate": (
        "accelerate",
        [
            (
                "accelerate FSDP2 + regional compile, Qwen3-MoE 3 layers",
                "accelerate_worker",
                ["--layers", "3", "--measure"],
                2,
                ("plain", "bound", "autoweave", "hoist", "pieces"),
            ),
            (
                "accelerate FSDP2 + whole-model compile, 3 layers",
                "accelerate_worker",
                ["--layers", "3", "--compile", "whole", "--measure"],
                2,
                ("plain", "autoweave"),
            ),
            (
                "accelerate regional, 10 layers, 1 step",
                "accelerate_worker",
                ["--layers", "10", "--steps", "1"],
                2,
                ("plain", "bound", "autoweave"),
            ),
            (
                "accelerate regional, a no_grad forward first, 1 step",
                "accelerate_worker",
                ["--layers", "3", "--steps", "1", "--nograd"],
                2,
                ("plain", "bound", "autoweave"),
            ),
        ],
    ),
    "trainer": (
        "transformers",
        [
            (
                "Trainer torch_compile=True + gradient checkpointing, Qwen3-MoE 2 layers",
                "trainer_worker",
                [],
                1,
                ("plain", "autoweave"),
            )
        ],
    ),
    "torchtitan": (
        "torchtitan",
        [
            (
                "torchtitan parallelize_qwen3 (selective AC, fullgraph per block, FSDP2), 10 layers",
                "torchtitan_worker",
                ["--layers", "10", "--measure"],
                2,
                ("plain", "autoweave", "autoweave+report"),
            )
        ],
    ),
    "native": (
        "transformers",
        [
            (
                f"transformers native FSDP2 (from_pretrained distributed_config, gate + experts units), bf16, {form}",
                "native_worker",
                ["--compile", form],
                2,
                ("plain", "bound", "autoweave"),
            )
            for form in ("layer", "whole", "trainer")
        ],
    ),
    "primerl": (
        "transformers",
        [
            (
                f"prime-rl's order (AC, layer compile, FSDP2 router/experts/layer/model), Qwen3-MoE {n} layers",
                "primerl_worker",
                ["--layers", str(n)],
                2,
                ("plain", "bound", "autoweave"),
            )
            for n in (2, 8)
        ],
    ),
    "nemo": (
        "nemo_automodel",
        [
            (
                "NeMo DeepSeek-V3 (1 dense + 2 MoE), selective AC, bf16",
                "nemo_worker",
                ["--measure"],
                2,
                STRATEGIES,
            ),
            (
                "NeMo DeepSeek-V3, selective AC, bf16, experts on torch._grouped_mm (NeMo's CUDA default)",
                "nemo_worker",
                ["--experts", "torch_mm", "--measure"],
                2,
                STRATEGIES,
            ),
            (
                "NeMo DeepSeek-V3, selective AC, fp32, experts on torch._grouped_mm",
                "nemo_worker",
                ["--dtype", "fp32", "--experts", "torch_mm", "--measure"],
                2,
                ("plain", "autoweave"),
            ),
            (
                "NeMo DeepSeek-V3, selective AC, fp32",
                "nemo_worker",
                ["--dtype", "fp32", "--measure"],
                2,
                ("plain", "autoweave"),
            ),
            (
                "NeMo DeepSeek-V3, 'full' AC (router-saving policy, block compiled in place)",
                "nemo_worker",
                ["--ac", "full", "--measure"],
                2,
                STRATEGIES,
            ),
        ],
    ),
    # transformers <= 5.22: its layers checkpoint around ``__call__`` (issue 41, item 4). The lane
    # runs it with transformers 5.22.2 first on PYTHONPATH (``HF_CALL_PATH``).
    "hf_call": (
        "transformers",
        [
            (
                f"transformers 5.22 HF gradient checkpointing (around __call__), experts unit, FSDP2, fp32, {form}",
                "hf_call_worker",
                ["--compile", form],
                2,
                ("plain", "bound", "autoweave"),
            )
            for form in ("layer", "whole")
        ],
    ),
    "lightning": (
        "lightning",
        [
            (
                "Lightning Trainer ModelParallelStrategy (FSDP2, experts nested), AC, per-block compile, 3 layers",
                "lightning_worker",
                ["--api", "trainer", "--compile", "block"],
                2,
                ("plain", "bound", "autoweave"),
            ),
            (
                "Lightning Fabric ModelParallelStrategy, AC, whole-model compile after sharding, 3 layers",
                "lightning_worker",
                ["--api", "fabric", "--compile", "whole"],
                2,
                ("plain", "bound", "autoweave"),
            ),
        ],
    ),
}


def _eager_args(worker: str, args: list[str]) -> list[str]:
    if worker == "accelerate_worker":
        out, skip = [], False
        for a in args:  # drop any --compile <how>
            if skip:
                skip = False
                continue
            if a == "--compile":
                skip = True
                continue
            out.append(a)
        return out + ["--compile", "none"]
    if worker in ("trainer_worker", "lightning_worker", "native_worker", "hf_call_worker"):
        return args + ["--eager"]
    return args + ["--no-compile"]


def _report_headline(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return {
        "modules": data["totals"]["modules"],
        "woven": data["totals"]["woven"],
        "graphs": data["totals"]["graphs"],
        "ops": data["totals"]["ops"],
        "dynamo_graphs": data["dynamo"]["unique_graphs"],
        "recompiles": data["dynamo"]["recompiles"],
        "recompile_limit_hits": len(data["dynamo"]["recompile_limit_hits"]),
        "fallbacks": data["ac_fallbacks"]["count"],
        "woven_around": data["ac_fallbacks"]["woven_around"],
        "swallowed": data["swallowed"],
        # The headline: forward GEMMs outside compiled graphs, in the compiled modules (autograd's record).
        "measured": data.get("measured"),
    }


def measure(table: str, worker: str, args: list[str], nproc: int, setting: str, tmp: Path) -> dict[str, Any]:
    env: dict[str, str] = {}
    key, wargs = setting, list(args)
    if setting == "eager":
        key, wargs = "plain", _eager_args(worker, args)
    elif setting == "bound":
        key, wargs = "plain", wargs + BOUND[worker]
    elif setting == "autoweave+report":
        key = "autoweave"
    report = tmp / f"{worker}-{abs(hash((table, setting)))}-r{{rank}}.json"
    # Every autoweave run writes its report, but torchtitan's plain "autoweave" row: it checks
    # that autoweave prints nothing there ("autoweave+report" is the same run with the report).
    with_report = key != "plain" and not (worker == "torchtitan_worker" and setting == "autoweave")
    if with_report:
        env["AUTOWEAVE_REPORT"] = str(report)
    if worker == "hf_call_worker":  # transformers 5.22.2 first on the path, this client only
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HF_CALL_PATH), os.environ.get("PYTHONPATH")) if p)
    run = _runner.run_worker(worker, key, wargs, nproc=nproc, env=env, timeout=900)
    row: dict[str, Any] = dict(run.result or {})
    row.update(table=table, setting=setting, worker_setting=row.get("setting"), ok=run.ok, wall_s=run.wall_s)
    row["worker_wall_s"] = (run.result or {}).get("wall_s")
    row["command"] = run.command()
    if not run.ok:
        row.setdefault("error", (run.stderr.strip().splitlines() or ["no result"])[-1][:300])
    row["report"] = _report_headline(Path(str(report).format(rank=0))) if with_report else None
    row["autoweave_lines"] = sorted(
        {ln.split("]", 1)[-1][:160] for ln in run.stderr.splitlines() if "autoweave[" in ln}
    )
    return row


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b <= 0:
        return None
    return round(a / b, 2)


def add_ratios(table_rows: list[dict[str, Any]], table: str, worker: str) -> None:
    """autoweave's step-1 CPU over plain's and over the bound's, on each autoweave row of one table.

    Plain (``AUTOWEAVE`` unset) often compiles none of the layers, so the first ratio is against
    compiling little; the bound is plain compiling the same layers whole with nothing nested, so the
    second is against capturing as much. Rows other than autoweave's get ``None``.
    """
    by = {r["setting"]: r for r in table_rows if r.get("ok")}
    plain, bound = by.get("plain", {}), by.get("bound", {})
    for row in table_rows:
        woven = row.get("ok") and row["setting"] not in ("eager", "plain", "bound")
        cpu = row.get("step1_cpu_s")
        row["step1_cpu_vs_plain"] = _ratio(cpu, plain.get("step1_cpu_s")) if woven else None
        row["step1_cpu_vs_bound"] = _ratio(cpu, bound.get("step1_cpu_s")) if woven else None
        steady = row.get("steady_cpu_s")  # workers that report it: CPU per step after warm-up
        row["steady_cpu_vs_plain"] = _ratio(steady, plain.get("steady_cpu_s")) if woven else None
        row["steady_cpu_vs_bound"] = _ratio(steady, bound.get("steady_cpu_s")) if woven else None
        row["bound_note"] = NO_BOUND.get(table) or NO_BOUND.get(worker)


def _fmt_row(row: dict[str, Any], eager: dict[str, Any] | None) -> str:
    def g(k: str) -> Any:
        v = row.get(k)
        return "-" if v is None else v

    def x(k: str) -> str:
        v = row.get(k)
        return "-" if v is None else f"{v:.2f}x"

    if not row.get("ok"):
        err = str(row.get("error", "")).replace("|", "/")[:110]
        return f"| {row['setting']} | **no**: {err} |" + " |" * 14 + f" {g('wall_s')} | |"
    total = (row.get("fwd_gemms_eager") or 0) + (row.get("fwd_gemms_compiled") or 0)
    gemms = f"{row['fwd_gemms_eager']} of {total}" if row.get("fwd_gemms_eager") is not None else "-"
    mem = "-"
    if eager and eager.get("act_bytes") and row.get("act_bytes") is not None:
        mem = f"{row['act_bytes'] / eager['act_bytes']:.2f}x"
    bwd = (
        "-"
        if row.get("bwd_gemms") is None
        else f"{row['bwd_gemms']}{' p' if row.get('bwd_gemms_by') == 'profiler' else ''}"
    )
    diff = "-"
    if eager and eager.get("losses") and row.get("losses"):
        d = _runner.max_rel_diff(row["losses"], eager["losses"])
        diff = "-" if d is None else f"{d:.1e}"
    rep = row.get("report")
    rep_s = "-"
    if rep:
        sw = ",".join(f"{k} x{v}" for k, v in rep["swallowed"].items()) or "none"
        rep_s = (
            f"{rep['woven']}/{rep['modules']} woven, {rep['graphs']} graphs, {rep['ops']} ops, "
            f"{rep['recompiles']} recompiles, {rep['recompile_limit_hits']} limit hits, "
            f"{rep['fallbacks']} fallbacks ({rep['woven_around']} woven around), failed open: {sw}"
        )
        measured = rep.get("measured") or {}
        if measured.get("modules"):
            rep_s += (
                f"; measured: {measured['eager_gemms']} eager fwd GEMMs in compiled modules, "
                f"{measured['fully_compiled']}/{measured['modules']} fully compiled"
            )
    steady = "-"
    if row.get("steady_cpu_s") is not None:
        steady = f"{row['steady_cpu_s']} ({x('steady_cpu_vs_plain')} plain, {x('steady_cpu_vs_bound')} bound)"
    vs_bound = x("step1_cpu_vs_bound")
    if vs_bound == "-" and row.get("bound_note") and row["setting"] not in ("eager", "plain"):
        vs_bound = "n/a"
    return (
        f"| {row['setting']} | yes | {g('fallbacks')} | {g('compiles')} / {g('recompiles')} | {g('frames')} "
        f"| {g('graphs')} / {g('ops')} | {gemms} | {mem} | {bwd} | {diff} | {g('first_step_s')} "
        f"| {g('step1_cpu_s')} | {x('step1_cpu_vs_plain')} | {vs_bound} | {g('steady_frames')} | {steady} "
        f"| {g('wall_s')} | {rep_s} |"
    )


def summary(rows: list[dict[str, Any]]) -> str:
    """Every table on one line: plain, bound and autoweave's step-1 CPU, frames, graphs and eager GEMMs, and the ratios.

    A cell reads ``CPU s (frames fr, graphs gr), eager of all forward GEMMs``; ``-`` where a table has
    no such setting (its ``vs bound`` note says why), ``fails`` where the run raised.
    """

    def cell(row: dict[str, Any] | None) -> str:
        if row is None:
            return "-"
        if not row.get("ok"):
            return "fails"
        total = (row.get("fwd_gemms_eager") or 0) + (row.get("fwd_gemms_compiled") or 0)
        gemms = f", {row['fwd_gemms_eager']} of {total}" if row.get("fwd_gemms_eager") is not None else ""
        return f"{row.get('step1_cpu_s')} ({row.get('frames')} fr, {row.get('graphs')} gr){gemms}"

    def ratio(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}x"

    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        tables.setdefault(row["table"], {})[row["setting"]] = row
    lines = [
        "| table | plain | bound | autoweave | vs plain | vs bound |",
        "|---|---|---|---|---|---|",
    ]
    for table, by in tables.items():
        woven = by.get("autoweave")
        lines.append(
            f"| {table} | {cell(by.get('plain'))} | {cell(by.get('bound'))} | {cell(woven)} "
            f"| {ratio((woven or {}).get('step1_cpu_vs_plain'))} | {ratio((woven or {}).get('step1_cpu_vs_bound'))} |"
        )
    return "\n".join(lines)


HEADER = (
    "| setting | runs? | AC fallbacks | compiles / recompiles | frames | graphs / ops | eager fwd GEMMs "
    "| act. memory vs eager | bwd GEMMs | max rel loss diff | first step s | step-1 CPU s | step-1 CPU vs plain "
    "| vs bound | frames after warm-up | CPU s per step after warm-up | wall s | report |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="aw-clients-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for client in [c.strip() for c in args.clients.split(",") if c.strip()]:
            package, tables = CLIENTS[client]
            if client == "hf_call" and not (HF_CALL_PATH / "transformers").is_dir():
                print(f"\n{client}: no transformers 5.22 at {HF_CALL_PATH} (HF_CALL_PATH); skipped\n")
                continue
            if not _runner.importable(package):
                print(f"\n{client}: {package} is not installed; skipped (.ci/clients builds the venv)\n")
                continue
            for table, worker, wargs, nproc, settings in tables:
                eager = measure(table, worker, wargs, nproc, "eager", tmp)
                eager["client"] = client
                table_rows = [eager]
                print(
                    json.dumps({k: eager.get(k) for k in ("table", "setting", "ok", "wall_s")}),
                    file=sys.stderr,
                    flush=True,
                )
                for setting in settings:
                    row = measure(table, worker, wargs, nproc, setting, tmp)
                    row["client"] = client
                    table_rows.append(row)
                    print(
                        json.dumps({k: row.get(k) for k in ("table", "setting", "ok", "wall_s")}),
                        file=sys.stderr,
                        flush=True,
                    )
                add_ratios(table_rows, table, worker)
                rows.extend(table_rows)
                print(f"\n### {table}\n\n{HEADER}")
                for row in table_rows:
                    print(_fmt_row(row, eager if eager.get("ok") else None))
                if table_rows[-1].get("bound_note"):
                    print(f"\nvs bound: {table_rows[-1]['bound_note']}")
                for row in table_rows:
                    if row.get("autoweave_lines"):
                        print(f"\n{row['setting']} stderr (autoweave): " + " / ".join(row["autoweave_lines"]))
                sys.stdout.flush()
    if rows:
        print("\n### Every table: step-1 CPU s (frames, graphs), eager forward GEMMs\n")
        print(summary(rows))
    if args.json:
        import torch

        meta = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "clients": args.clients,
            "wall_s": round(time.time() - start, 1),
        }
        Path(args.json).write_text(json.dumps({"settings": meta, "rows": rows}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
