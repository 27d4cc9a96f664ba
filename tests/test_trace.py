"""TORCH_TRACE: the example's plans and woven regions reach tlparse's report, each region on its compile's page."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoweave import _compat
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_moe.py"


def _tlparse() -> str | None:
    beside = Path(sys.executable).with_name("tlparse")  # the venv's, when not on PATH
    return str(beside) if beside.exists() else shutil.which("tlparse")


@pytest.mark.slow
def test_example_trace_shows_autoweave_artifacts_in_tlparse(tmp_path: Path) -> None:
    tlparse = _tlparse()
    if tlparse is None:
        pytest.skip("tlparse is not installed (pip install tlparse)")
    trace = tmp_path / "trace"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AUTOWEAVE", "TORCH_LOGS", "TORCH_TRACE"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sitecustomize"), env.get("PYTHONPATH", "")])
    env.update(AUTOWEAVE="1", OMP_NUM_THREADS="1", TORCH_TRACE=str(trace))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(EXAMPLE), "--steps", "2", "--backend", "aot_eager", "--no-progress",
    ]  # fmt: skip
    run_ranks(cmd, env, timeout=600, cwd=tmp_path)  # once more on gloo's teardown abort

    [log] = [p for p in trace.iterdir() if "rank_0" in p.name]
    out = tmp_path / "tl_out"
    parsed = subprocess.run(
        [tlparse, str(log), "-o", str(out), "--no-browser", "--overwrite"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert parsed.returncode == 0, parsed.stderr[-2000:]

    index = (out / "index.html").read_text()
    assert "autoweave_plan" in index and "autoweave_region" in index
    directory = json.loads((out / "compile_directory.json").read_text())
    artifacts = {
        compile_id: [a["url"] for a in entry["artifacts"] if a["name"].startswith("autoweave_")]
        for compile_id, entry in directory.items()
    }
    # Plans are made before their regions compile: with the process-wide artifacts.
    plans = [out / url for url in artifacts.get("[-/-]", []) if "autoweave_plan" in url]
    assert len(plans) == 4  # 4 blocks compiled
    woven = [json.loads(p.read_text()) for p in plans]
    assert sorted(p["woven"] for p in woven) == [False, True, True, True]
    # Regions: on the pages of real compiles (a frame id), one of them the experts'.
    regions = [
        json.loads((out / url).read_text())
        for compile_id, urls in artifacts.items()
        if compile_id != "[-/-]"
        for url in urls
        if "autoweave_region" in url
    ]
    assert regions
    if _compat.dynamo.nested_breaks_supported():
        # The experts' forward is traced with its block (nested graph breaks): no region of their
        # own; their decision, with its source, is on the plan's page.
        found = [d for p in woven for d in p["decisions"] if d["path"].endswith("1.moe.experts")]
        assert found and not found[0]["region"], woven
        decision = found[0]
    else:
        experts = [r for r in regions if any(m.endswith("moe.experts") for m in r["modules"])]
        assert experts, regions
        [decision] = experts[0]["decisions"][:1]
        # Written at the region's first compile, during layers.1's first call (layers 2-3 share it later).
        assert experts[0]["modules"][0] == "layers.1.moe.experts"
    assert decision["action"] == "boundary"
    assert decision["source"]["call"].startswith(f"{EXAMPLE}:")


def test_region_label_sees_through_resume_functions() -> None:
    from autoweave import _state
    from autoweave.observe import trace

    _state.run.trace_regions["autoweave_Block_x_1"] = {
        "label": "autoweave_Block_x_1",
        "modules": [],
        "decisions": [],
    }
    try:
        assert trace.region_label("autoweave_Block_x_1") == "autoweave_Block_x_1"
        resume = "torch_dynamo_resume_in_torch_dynamo_resume_in_autoweave_Block_x_1_at_190_at_193"
        assert trace.region_label(resume) == "autoweave_Block_x_1"
        assert trace.region_label("autoweave_Block_x_12") is None  # another region, not a prefix match
        assert trace.region_label("forward") is None
    finally:
        _state.reset()
