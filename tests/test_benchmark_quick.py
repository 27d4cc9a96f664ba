"""benchmarks/weave_bench.py --quick end to end: it runs, and its JSON and chart say what they should."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "weave_bench.py"

COLUMNS = (
    "variant", "ops", "graphs", "graph_breaks", "fallbacks", "eager_gemms",
    "first_step_s", "step_s", "step_ratio", "peak_rss_mb", "activation_mb", "max_rel_loss_diff",
    "policy_saved", "policy_out_ops",
)  # fmt: skip
VARIANTS = (
    "eager", "compile_ac:off", "hand_siblings:off", "hand_ac_compile:off", "compile_ac:on", "upper_bound:off",
    "compile_ac:on:hoist", "compile_ac:on:pieces",
)  # fmt: skip


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    out_json, out_png = tmp / "bench.json", tmp / "bench.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--ac", "selective", "--strategies", "--json", str(out_json), "--png", str(out_png)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    return proc, out_json, out_png


@pytest.mark.slow
def test_quick_benchmark_json(quick: tuple[subprocess.CompletedProcess, Path, Path]) -> None:
    proc, out_json, _ = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out_json.read_text())
    assert data["meta"]["torch"] and data["meta"]["args"]["quick"] is True
    assert tuple(data["columns"]) == COLUMNS
    assert [row["variant"] for row in data["rows"]] == list(VARIANTS)  # one row per variant, in order
    rows = {row["variant"]: row for row in data["rows"]}
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"], proc.stderr[-3000:])
        for column in COLUMNS:
            assert row.get(column) is not None, (name, column)
    weave, fallback = rows["compile_ac:on"], rows["compile_ac:off"]
    # The quick model has one MoE block: plain torch loses exactly that checkpointed region,
    # autoweave loses none and captures more, in more graphs, around the FSDP unit.
    assert weave["fallbacks"] == 0
    assert fallback["fallbacks"] == 1
    assert weave["ops"] > fallback["ops"] and weave["graphs"] > fallback["graphs"]
    assert weave["eager_gemms"] < fallback["eager_gemms"]
    # ... as many forward GEMMs left outside compiled graphs as the model with no nested FSDP unit.
    assert weave["eager_gemms"] == rows["upper_bound:off"]["eager_gemms"]
    # Numerics: every variant is compared with the eager run's losses (eager's own row is 0 by
    # construction, so the reference itself is checked instead).
    reference = rows["eager"]["losses"]
    assert len(reference) == data["meta"]["args"]["steps"] and all(math.isfinite(x) for x in reference)
    for name, row in rows.items():
        assert row["max_rel_loss_diff"] <= 1e-5, (name, row["max_rel_loss_diff"])
    assert "| autoweave `compile_ac:on` |" in proc.stdout  # the Markdown table went to stdout
    # Selective AC: the policy decided on the GEMMs inside autoweave's compiled regions. (The quick
    # run uses aot_eager, where no variant shows `.out` kernels to the policy, so policy_out_ops
    # only tells strategies apart under inductor: tests/distributed/test_strategies.py.)
    assert "aten.mm.default" in weave["policy_saved"] and weave["policy_out_ops"] == []
    for variant in ("hand_siblings:off", "hand_ac_compile:off", "upper_bound:off"):
        assert rows[variant]["fallbacks"] == 0, variant
    for strategy in ("hoist", "pieces"):
        forced = rows[f"compile_ac:on:{strategy}"]
        assert forced["fallbacks"] == 0, strategy
        assert forced["eager_gemms"] < fallback["eager_gemms"], strategy


@pytest.mark.slow
def test_quick_benchmark_png(quick: tuple[subprocess.CompletedProcess, Path, Path]) -> None:
    pytest.importorskip("matplotlib")
    proc, _, out_png = quick
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert out_png.exists(), proc.stderr[-3000:]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


COMPILE_COST = ROOT / "benchmarks" / "compile_cost.py"


@pytest.mark.slow
def test_compile_cost_quick(tmp_path: Path) -> None:
    """benchmarks/compile_cost.py --quick, the variable-length table: one row per run, each trained, counted.

    Table c only: the depth tables run four variants per depth (minutes in CI); they share
    the worker, its counting and the table code with this one.
    """
    out_json = tmp_path / "cost.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    proc = subprocess.run(
        [sys.executable, str(COMPILE_COST), "--quick", "--tables", "c", "--json", str(out_json)],
        env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = json.loads(out_json.read_text())["rows"]
    lengths = {row["setting"]: row for row in rows if row["table"] == "c"}
    assert sorted(lengths) == ["autoweave", "plain"]
    for row in rows:
        assert row["ok"], row
        assert row["frames"] >= 1 and row["compiles"] >= row["frames"] and row["step1_cpu_s"] > 0, row
        assert sum(row["compiles_per_step"]) == row["compiles"], row
    for row in lengths.values():
        assert len(row["compiles_per_step"]) == 3, row  # one count per step, one length per step
    assert "## c) variable lengths" in proc.stdout
