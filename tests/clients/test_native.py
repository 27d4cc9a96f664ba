"""transformers 5.24's native FSDP2 (``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``), 2 gloo ranks.

Worker: ``tests/clients/native_worker.py`` (tiny Qwen3-MoE, bf16, transformers' FSDP plan plus the
router and the experts as units inside each layer's unit; ``gradient_checkpointing_enable``, so each
layer checkpoints in its own forward inside its unit). Per compile form (each layer ``.compile()``,
``torch.compile(model)``, the ``Trainer`` with ``torch_compile=True``) plain torch (``AUTOWEAVE``
unset) against autoweave (``AUTOWEAVE=1``, with a report per rank) and the same form eager.

The capture limit, per form: the forward GEMMs no compiled module holds. Per-layer compile: the
``lm_head``'s one GEMM (outside every layer); whole-model compile and the Trainer: none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "native_worker"
FORMS = ("layer", "whole", "trainer")
LIMIT = {"layer": 1, "whole": 0, "trainer": 0}  # forward GEMMs outside every compiled module
# bf16: compiled (aot_eager's decompositions) against eager differ by a rounding or two; autoweave
# against plain compile must agree to 1e-5 (they run the same aten ops).
BF16_REL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    _runner.require("transformers")
    _runner.require("accelerate")


@pytest.fixture(scope="session")
def report_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("native-reports")


def _runs(client_run, form, report_dir):
    report = str(report_dir / f"{form}-r{{rank}}.json")
    return (
        client_run(WORKER, "plain", "--compile", form),
        client_run(WORKER, "autoweave", "--compile", form, env={"AUTOWEAVE_REPORT": report}),
        client_run(WORKER, "plain", "--compile", form, "--eager"),
        report,
    )


@pytest.mark.parametrize("form", FORMS)
def test_native_fsdp2_compile_keeps_the_layers_compiled(client_run, report_dir, form):
    plain, woven, eager, report = _runs(client_run, form, report_dir)
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active") and not plain.get("autoweave_active")
    # the layout transformers made: the router and the experts are units inside each layer's unit
    units = set(woven.get("units"))
    for i in (0, 1):
        assert {f"model.layers.{i}", f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.experts"} <= units
    assert woven.get("gate_dtype") == "torch.bfloat16"
    # plain: dynamo falls back to eager for the checkpointed layers, every forward GEMM eager
    assert plain.get("fallbacks") >= 1
    assert plain.get("fwd_gemms_eager") > LIMIT[form], plain.result
    # autoweave: no fallback, every GEMM a compiled module holds runs compiled (steady state)
    assert woven.get("fallbacks") == 0, woven.describe()
    assert woven.get("recompile_limit_hits") == 0
    assert woven.get("fwd_gemms_eager") == LIMIT[form], woven.result
    assert woven.get("fwd_gemms_eager") < plain.get("fwd_gemms_eager")
    assert woven.get("fwd_gemms_eager") + woven.get("fwd_gemms_compiled") == plain.get("fwd_gemms_eager")
    assert len(woven.get("losses")) == 3
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) <= 1e-5
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) <= BF16_REL
    # both ranks planned the same
    plans = [json.loads(Path(report.format(rank=r)).read_text())["plans"] for r in (0, 1)]
    assert plans[0] and plans[0] == plans[1]
