"""benchmarks/dispatch_bench.py --quick end to end: every case ran, and its JSON says what it should.

No timing is asserted: a 2-core CI machine shared with other jobs cannot hold a 2% budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "dispatch_bench.py"

# (case, submodules) per row, in order; --quick sweeps 8 and 32 expert modules per layer.
QUICK_ROWS = [
    ("many_submodules", 8),
    ("many_submodules", 32),
    ("whole_model", None),
    ("outer_ac", None),
    ("woven", None),
]
ROW_KEYS = {
    "case", "submodules", "layers", "modules_per_unit", "plain_ms", "autoweave_ms", "ratio", "added_us",
    "paired_ratio", "meets", "woven", "planned", "recompile_limit_hits", "plain_samples_ms",
    "autoweave_samples_ms", "plain_wall_ms", "autoweave_wall_ms", "plain_wall_samples_ms",
    "autoweave_wall_samples_ms", "error",
}  # fmt: skip


@pytest.mark.slow
def test_quick_dispatch_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "dispatch.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["torch"] and meta["args"]["quick"] is True and meta["target_ratio"] == 1.02
    rounds = meta["args"]["rounds"]
    rows = data["rows"]
    assert [
        (r["case"], r["submodules"] if r["case"] == "many_submodules" else None) for r in rows
    ] == QUICK_ROWS
    for row in rows:
        case = row["case"]
        assert set(row) == ROW_KEYS, case
        assert row["error"] is None, (case, row["error"])
        # Both sides ran every round, interleaved, and produced numbers.
        for side in ("plain", "autoweave", "plain_wall", "autoweave_wall"):
            side = f"{side}_samples_ms"
            assert len(row[side]) == rounds, (case, side)
        assert row["plain_ms"] > 0 and row["autoweave_ms"] > 0, case
        assert row["ratio"] == pytest.approx(row["autoweave_ms"] / row["plain_ms"]), case
        assert row["meets"] == (row["ratio"] <= 1.02), case
        assert row["recompile_limit_hits"] == 0, case
        # autoweave routed the compiles of the autoweave side (one dispatcher per compile call).
        assert row["planned"] == (1 if case == "whole_model" else row["layers"]), case
        # ... and wove exactly where a boundary sits under a checkpoint.
        assert row["woven"] == (row["layers"] if case == "woven" else 0), case
    sweep = [r for r in rows if r["case"] == "many_submodules"]
    assert sweep[1]["modules_per_unit"] > sweep[0]["modules_per_unit"]  # the sweep changed the tree
    flat = data["flatness"]
    assert (flat["from_submodules"], flat["to_submodules"]) == (8, 32) and isinstance(flat["flat"], bool)
    # The Markdown table went to stdout, one line per row.
    assert (
        "| case | submodules | layers | plain ms/fwd | autoweave ms/fwd | ratio | added µs/fwd |"
        in proc.stdout
    )
    assert sum(
        line.startswith(("| many_submodules", "| whole_model", "| outer_ac", "| woven"))
        for line in proc.stdout.splitlines()
    ) == len(QUICK_ROWS)
