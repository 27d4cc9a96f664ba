"""autoweave beside the fallback and the hand-written weaves, on the example MoE (FSDP2, 2 ranks, CPU).

Runs, side by side, in one torchrun call per repeat (benchmarks/moe_variants.py):

* ``eager``: AC + FSDP, no compile (the loss reference);
* ``compile_ac:off``: torch.compile(checkpoint_wrapper(block)) without autoweave: Dynamo gives
  up on the checkpointed MoE blocks (the fallback);
* ``hand_siblings:off``: the hand-written sibling weave (each child compiled, eager AC);
* ``hand_ac_compile:off``: the hand-written AC(Compile(block));
* ``compile_ac:on``: the same code as the fallback, with autoweave;
* ``upper_bound:off``: experts share their block's FSDP unit, so nothing needs weaving.

Repeats are interleaved: repeat ``i`` runs the variants rotated by ``i`` (A B C ..., then B C ... A,
...), so no variant always runs first in its process. Step and first-step times are medians over
repeats; counts (ops, graphs, breaks, fallbacks, GEMMs) come from the first repeat, since they are
deterministic. Each torchrun gets a fresh inductor cache directory with the FX-graph and
AOTAutograd caches off, and compiles a throw-away function before the variants (``--warmup``), so
no variant pays the process's compiler start-up or finds its graphs already cached.

    python benchmarks/weave_bench.py [--ac full|selective] [--backend inductor] [--repeats 3]
        [--json out.json] [--png out.png] [--markdown out.md] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "moe_variants.py"
NPROC = 2
REFERENCE = "eager"
AUTOWEAVE = "compile_ac:on"

# (worker variant, label), in table order.
VARIANTS: tuple[tuple[str, str], ...] = (
    ("eager", "eager (no compile)"),
    ("compile_ac:off", "AC + compile, no autoweave (fallback)"),
    ("hand_siblings:off", "hand-written sibling weave"),
    ("hand_ac_compile:off", "hand-written AC(Compile(block))"),
    ("compile_ac:on", "autoweave"),
    ("upper_bound:off", "upper bound (experts in the block's FSDP unit)"),
)

# --strategies: autoweave with each AC placement forced (the strategy issue).
STRATEGY_VARIANTS: tuple[tuple[str, str], ...] = (
    ("compile_ac:on:hoist", "autoweave, hoist (eager AC around a split compile)"),
    ("compile_ac:on:pieces", "autoweave, pieces (each compiled piece checkpointed)"),
)

# --fullgraph: checkpoint_wrapper(block).compile(fullgraph=True), with and without autoweave.
FULLGRAPH_VARIANTS: tuple[tuple[str, str], ...] = (
    ("inplace_fullgraph:off", "block.compile(fullgraph=True), no autoweave"),
    ("inplace_fullgraph:on", "block.compile(fullgraph=True), autoweave"),
)

# (JSON key, Markdown header): every row of the JSON has each key.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("variant", "variant"),
    ("ops", "ops captured"),
    ("graphs", "graphs"),
    ("graph_breaks", "graph breaks"),
    ("fallbacks", "AC fallbacks"),
    ("eager_gemms", "eager fwd GEMMs"),
    ("first_step_s", "first step s"),
    ("step_s", "median step s"),
    ("step_ratio", "step ÷ autoweave"),
    ("peak_rss_mb", "peak RSS MB"),
    ("activation_mb", "activations MB"),
    ("max_rel_loss_diff", "max rel loss diff"),
    ("policy_saved", "SAC: ops saved"),
    ("policy_out_ops", "SAC: .out ops seen"),
)
COLUMN_KEYS = tuple(key for key, _ in COLUMNS)

# Counts and memory are read in the last two checked steps, after every compile: a selective-AC
# block whose pieces were measured holding more than eager SAC is planned again (hoist) and
# compiles at the second step (autoweave.planning.learned), so the default checks four steps, quick three.
QUICK = {"layers": 2, "dim": 32, "steps": 3, "timing_steps": 2, "repeats": 1, "backend": "aot_eager"}
DEFAULTS = {"layers": 4, "dim": 64, "steps": 4, "timing_steps": 20, "repeats": 3, "backend": "inductor"}


def log(message: str) -> None:
    print(f"[weave_bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ac", choices=("full", "selective"), default="full")
    p.add_argument("--backend", default=None, help=f"inner compile backend (default {DEFAULTS['backend']})")
    p.add_argument(
        "--repeats", type=int, default=None, help=f"torchrun calls, rotated (default {DEFAULTS['repeats']})"
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"steps checked against eager (default {DEFAULTS['steps']})"
    )
    p.add_argument(
        "--timing-steps",
        type=int,
        default=None,
        help=f"timed steps after those (default {DEFAULTS['timing_steps']})",
    )
    p.add_argument(
        "--layers", type=int, default=None, help=f"blocks; the first is dense (default {DEFAULTS['layers']})"
    )
    p.add_argument("--dim", type=int, default=None, help=f"model width (default {DEFAULTS['dim']})")
    p.add_argument(
        "--json", type=Path, default=None, help="write every column per variant, plus run metadata"
    )
    p.add_argument("--png", type=Path, default=None, help="write a chart (needs matplotlib)")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown table (also printed)")
    p.add_argument(
        "--strategies", action="store_true", help="also run autoweave with each AC strategy forced"
    )
    p.add_argument("--fullgraph", action="store_true", help="also run block.compile(fullgraph=True)")
    p.add_argument(
        "--glue-gemm", action="store_true", help="MoE blocks combine with an einsum in their own forward"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny model, aot_eager, 1 repeat, few steps (a smoke test)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per torchrun call")
    a = p.parse_args(argv)
    base = QUICK if a.quick else DEFAULTS
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.repeats < 1 or a.steps < 1 or a.timing_steps < 1:
        p.error("--repeats, --steps and --timing-steps must be at least 1")
    if a.layers < 2:
        p.error("--layers must be at least 2 (the first block is dense, MoE blocks follow)")
    return a


def rotations(variants: list[str], repeats: int) -> list[list[str]]:
    """Repeat ``i`` runs the variants rotated left by ``i``."""
    n = len(variants)
    return [[variants[(i + j) % n] for j in range(n)] for i in range(repeats)]


def _child_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # A fresh, private inductor cache per torchrun, and no FX-graph / AOTAutograd cache hits:
    # first-step times are compiles, not cache loads of an earlier run's graphs.
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_repeat(
    order: list[str], a: argparse.Namespace, index: int
) -> tuple[dict[str, dict[str, Any]], float]:
    """One torchrun over ``order``; returns (records by variant, wall seconds). Never raises."""
    with tempfile.TemporaryDirectory(prefix="weave_bench_") as tmp:
        out = Path(tmp) / "records.json"
        logfile = Path(tmp) / "worker.log"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
            str(WORKER), "--warmup",
            "--variants", ",".join(order),
            "--ac", a.ac, "--backend", a.backend,
            "--steps", str(a.steps), "--timing-steps", str(a.timing_steps),
            "--layers", str(a.layers), "--dim", str(a.dim),
            "--out", str(out),
        ] + (["--glue-gemm"] if a.glue_gemm else [])  # fmt: skip
        start = time.perf_counter()
        problem = None
        try:
            with open(logfile, "w") as fh:
                proc = subprocess.run(
                    cmd, env=_child_env(str(Path(tmp) / "inductor")), stdout=fh, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, timeout=a.timeout, cwd=ROOT,
                )  # fmt: skip
            if proc.returncode != 0:
                problem = f"torchrun exited with code {proc.returncode}"
        except subprocess.TimeoutExpired:
            problem = f"torchrun timed out after {a.timeout:.0f} s"
        wall = time.perf_counter() - start
        records: dict[str, dict[str, Any]] = {}
        if out.exists():
            try:
                for rec in json.loads(out.read_text()):
                    key = (
                        REFERENCE
                        if rec["order"] == REFERENCE
                        else f"{rec['order']}:{'on' if rec['autoweave'] else 'off'}"
                    )
                    if rec.get("strategy", "auto") != "auto":
                        key += f":{rec['strategy']}"
                    records[key] = rec
            except (ValueError, KeyError, TypeError) as exc:
                problem = (problem + "; " if problem else "") + f"unreadable worker output ({exc})"
        elif problem is None:
            problem = "torchrun wrote no results"
        detail = "no record from the worker"
        if problem:
            text = logfile.read_text(errors="replace") if logfile.exists() else ""
            log(f"repeat {index + 1}: {problem}; last worker output:\n{text[-4000:]}")
            cause = _root_cause(text)
            detail = f"{problem}: {cause}" if cause else problem
        for variant in order:
            if variant not in records:
                records[variant] = {"error": detail}
        return records, wall


def _root_cause(log_text: str) -> str | None:
    """The last exception line a rank printed (``[rank0]: pkg.SomeError: message``), if any."""
    found = re.findall(r"^\[rank\d+\]: ?([A-Za-z_][\w.]*: .*)$", log_text, flags=re.MULTILINE)
    return found[-1].strip()[:300] if found else None


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _max_rel_loss_diff(losses: list[float], reference: list[float]) -> float | None:
    if not losses or len(losses) != len(reference):
        return None
    return max(abs(x - r) / max(abs(r), 1e-12) for x, r in zip(losses, reference, strict=True))


def aggregate(runs: list[dict[str, dict[str, Any]]], variants: list[str]) -> list[dict[str, Any]]:
    """One row per variant with every column of COLUMNS (None where not measured) and the raw repeats."""
    ref_losses = [
        run[REFERENCE].get("losses") for run in runs if REFERENCE in run and "error" not in run[REFERENCE]
    ]
    rows = []
    for variant in variants:
        recs = [run.get(variant, {"error": "missing"}) for run in runs]
        ok = [r for r in recs if "error" not in r]
        errors = [f"repeat {i + 1}: {r['error']}" for i, r in enumerate(recs) if "error" in r]
        row: dict[str, Any] = dict.fromkeys(COLUMN_KEYS)
        row["variant"] = variant
        row["label"] = dict(VARIANTS + STRATEGY_VARIANTS + FULLGRAPH_VARIANTS).get(variant, variant)
        row["error"] = None if ok else (recs[0]["error"] if recs else "not run")
        row["repeat_errors"] = errors
        row["repeats_ok"] = len(ok)
        if ok:
            first = ok[0]
            for key in ("ops", "graphs", "graph_breaks", "fallbacks", "eager_gemms", "compiled_gemms"):
                row[key] = first.get(key)
            row["first_step_s"] = _median([r.get("first_step_s") for r in ok])
            row["step_s"] = _median([r.get("step_s") for r in ok])
            row["peak_rss_mb"] = _median([r.get("peak_rss_mb") for r in ok])
            row["activation_mb"] = _median([r.get("activation_mb") for r in ok])
            row["peak_rss_scope"] = first.get("peak_rss_scope", "process")
            # Losses are deterministic; compare every repeat with its own eager run, keep the worst.
            diffs = []
            for run in runs:
                rec, ref = run.get(variant, {}), run.get(REFERENCE, {})
                if "error" not in rec and "error" not in ref and "losses" in rec and "losses" in ref:
                    diffs.append(_max_rel_loss_diff(rec["losses"], ref["losses"]))
            diffs = [d for d in diffs if d is not None]
            row["max_rel_loss_diff"] = max(diffs) if diffs else None
            row["losses"] = first.get("losses")
            # What a selective policy was asked: ops it saved, and inductor's extern `.out`
            # calls, which mean it decided on kernels instead of the ops it was written for.
            policy = first.get("policy") or []
            if policy:
                row["policy_saved"] = sorted({op for op, d in policy if d.startswith("MUST_SAVE")})
                row["policy_out_ops"] = sorted({op for op, _ in policy if op.endswith(".out")})
        row["repeats"] = {
            key: [r.get(key) if "error" not in r else None for r in recs]
            for key in ("first_step_s", "step_s", "peak_rss_mb")
        }
        rows.append(row)
    weave = next((r for r in rows if r["variant"] == AUTOWEAVE), None)
    base = weave["step_s"] if weave else None
    for row in rows:
        if row["step_s"] is not None and base:
            row["step_ratio"] = row["step_s"] / base
        # Paired per-repeat ratios (same process, same machine state): robust to drift between repeats.
        paired = []
        for run in runs:
            rec, ref = run.get(row["variant"], {}), run.get(AUTOWEAVE, {})
            if rec.get("step_s") and ref.get("step_s"):
                paired.append(rec["step_s"] / ref["step_s"])
        row["step_ratio_per_repeat"] = paired
    if not ref_losses:
        for row in rows:
            row["loss_reference_missing"] = True
    return rows


def _fmt(value: Any, key: str) -> str:
    if value is None:
        return "—"
    if key in ("first_step_s",):
        return f"{value:.1f}"
    if key == "step_s":
        return f"{value:.4f}"
    if key == "step_ratio":
        return f"{value:.2f}×"
    if key == "peak_rss_mb":
        return f"{value:.0f}"
    if key == "activation_mb":
        return f"{value:.2f}"
    if key == "max_rel_loss_diff":
        return "0" if value == 0 else f"{value:.1e}"
    if key in ("policy_saved", "policy_out_ops"):
        return ", ".join(op.removeprefix("aten.") for op in value) or "none"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    a = meta["args"]
    lines = [
        f"### autoweave benchmark: {a['ac']} AC, {a['backend']}, {a['repeats']} repeat(s)",
        "",
        f"Example MoE ({a['layers']} blocks, dim {a['dim']}), FSDP2 on {NPROC} CPU ranks (gloo); "
        f"{a['steps']} steps checked against eager, then {a['timing_steps']} timed; "
        f"torch {meta['torch']}, Python {meta['python']}, {meta['date']}.",
        "",
        "| " + " | ".join(header for _, header in COLUMNS) + " |",
        "|" + "|".join(":--" if key == "variant" else "--:" for key in COLUMN_KEYS) + "|",
    ]
    for row in rows:
        name = f"{row['label']} `{row['variant']}`"
        if row["error"]:
            cells = [name, f"**error**: {row['error'][:160]}"] + [""] * (len(COLUMNS) - 2)
        else:
            cells = [name] + [_fmt(row[key], key) for key in COLUMN_KEYS[1:]]
            if row["repeat_errors"]:
                cells[0] += f" ({len(row['repeat_errors'])} repeat(s) failed)"
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "ops/graphs: FX ops and graphs Dynamo captured; AC fallbacks: checkpointed regions Dynamo gave up on "
        "(run eager); eager fwd GEMMs: forward matmuls outside compiled graphs (profiler). Times are medians "
        "over repeats; first step includes compilation; step ÷ autoweave divides median step times. "
        "Loss diff: max over the checked steps of |loss − eager loss| / |eager loss|. "
        + (
            "Peak RSS: rank 0's peak while the variant ran."
            if all(r.get("peak_rss_scope") != "process" for r in rows)
            else "Peak RSS: rank 0's process peak so far (could not reset per variant)."
        ),
    ]
    failed = [r for r in rows if r["repeat_errors"]]
    if failed:
        lines += ["", "Errors:"]
        for row in failed:
            for err in row["repeat_errors"]:
                lines.append(f"- `{row['variant']}` {_cell(err[:400])}")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        r["label"].split(" (")[0] + ("\n(" + r["label"].split(" (", 1)[1] if " (" in r["label"] else "")
        for r in rows
    ]
    colors = [
        "#d62728" if r["variant"] == AUTOWEAVE else "#7f7f7f" if r["variant"] == REFERENCE else "#1f77b4"
        for r in rows
    ]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    panels = (
        ("eager_gemms", "forward GEMMs outside compiled graphs (lower is better)", "{:.0f}"),
        ("step_ratio", "median step time ÷ autoweave's (lower is faster)", "{:.2f}×"),
    )
    for ax, (key, title, fmt) in zip(axes, panels, strict=True):
        ys = [r[key] if r[key] is not None else 0 for r in rows]
        bars = ax.barh(range(len(rows)), ys, color=colors)
        for bar, row in zip(bars, rows, strict=True):
            text = "error" if row["error"] else ("—" if row[key] is None else fmt.format(row[key]))
            dots = row.get("step_ratio_per_repeat", []) if key == "step_ratio" else []
            for ratio in dots:
                ax.plot(ratio, bar.get_y() + bar.get_height() / 2, "k.", markersize=4)
            x = max([bar.get_width(), *dots])
            ax.text(x, bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=9)
        if key == "step_ratio":
            ax.axvline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.2)
    axes[1].tick_params(labelleft=False)
    a = meta["args"]
    fig.suptitle(
        f"autoweave on the example MoE: {a['ac']} AC, {a['backend']}, {a['layers']} blocks, dim {a['dim']}, "
        f"{a['repeats']} repeat(s), torch {meta['torch']} (dots: per-repeat ratios)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - metadata only
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    variants = [v for v, _ in VARIANTS]
    if a.strategies:
        variants += [v for v, _ in STRATEGY_VARIANTS]
    if a.fullgraph:
        variants += [v for v, _ in FULLGRAPH_VARIANTS]
    aw_env = {k: v for k, v in os.environ.items() if k.startswith("AUTOWEAVE")}
    if aw_env:
        log(f"note: running with {aw_env} set; they apply to the autoweave variant")
    orders = rotations(variants, a.repeats)
    started = time.perf_counter()
    runs, walls = [], []
    for i, order in enumerate(orders):
        log(f"repeat {i + 1}/{a.repeats}: {', '.join(order)}")
        records, wall = run_repeat(order, a, i)
        runs.append(records)
        walls.append(wall)
        log(f"repeat {i + 1}/{a.repeats} took {wall:.0f} s")
    rows = aggregate(runs, variants)
    meta = {
        "torch": _torch_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nproc_per_node": NPROC,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "worker": str(WORKER.relative_to(ROOT)),
        "variants": variants,
        "reference": REFERENCE,
        "autoweave_variant": AUTOWEAVE,
        "rotations": orders,
        "repeat_wall_s": walls,
        "total_wall_s": time.perf_counter() - started,
        "autoweave_env": aw_env,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    table = markdown(rows, meta)
    sys.stdout.write(table)
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps({"meta": meta, "columns": list(COLUMN_KEYS), "rows": rows}, indent=1) + "\n"
        )
    if a.png:
        try:
            chart(rows, meta, a.png)
        except ImportError:
            log("matplotlib is not installed: no chart (pip install matplotlib)")
    failed = [r["variant"] for r in rows if r["error"]]
    if failed:
        log(f"variants that errored in every repeat: {', '.join(failed)} (see the table)")
    log(f"done in {meta['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
