"""benchmarks/clients.py's closing table: every client on one line, beside plain and the bound (issue 32)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _clients():
    spec = importlib.util.spec_from_file_location("clients_bench", ROOT / "benchmarks" / "clients.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(table, setting, cpu, frames, graphs, eager, compiled, ok=True):
    return {
        "table": table, "setting": setting, "ok": ok, "step1_cpu_s": cpu, "frames": frames,
        "graphs": graphs, "fwd_gemms_eager": eager, "fwd_gemms_compiled": compiled,
    }  # fmt: skip


def test_each_table_is_one_line_with_plain_bound_and_autoweave_and_both_ratios() -> None:
    clients = _clients()
    nested = [
        _row("nested", "eager", 0.3, 0, 0, 27, 0),
        _row("nested", "plain", 2.0, 1, 0, 27, 0),
        _row("nested", "bound", 6.0, 1, 1, 1, 26),
        _row("nested", "autoweave", 7.0, 7, 6, 1, 26),
    ]
    flat = [_row("flat", "plain", 5.0, 1, 1, 0, 27), _row("flat", "autoweave", 4.0, 1, 1, 0, 27, ok=True)]
    broken = [
        _row("broken", "plain", None, None, None, None, None, ok=False),
        _row("broken", "autoweave", 3.0, 2, 2, 0, 4),
    ]
    for table, worker in (("nested", "w"), ("flat", "trainer_worker"), ("broken", "w")):
        clients.add_ratios([r for r in nested + flat + broken if r["table"] == table], table, worker)
    lines = clients.summary(nested + flat + broken).splitlines()
    assert lines[0] == "| table | plain | bound | autoweave | vs plain | vs bound |"
    assert lines[2] == (
        "| nested | 2.0 (1 fr, 0 gr), 27 of 27 | 6.0 (1 fr, 1 gr), 1 of 27 | 7.0 (7 fr, 6 gr), 1 of 27 | 3.50x | 1.17x |"
    )
    assert lines[3] == "| flat | 5.0 (1 fr, 1 gr), 0 of 27 | - | 4.0 (1 fr, 1 gr), 0 of 27 | 0.80x | - |"
    assert lines[4] == "| broken | fails | - | 3.0 (2 fr, 2 gr), 0 of 4 | - | - |"
    assert len(lines) == 5
