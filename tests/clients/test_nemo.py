"""NeMo Automodel 0.7: DeepSeek-V3 MoE through ``_parallelize_moe`` (experts as their own FSDP unit on
the expert mesh), ``apply_ac`` and ``compile_parallelized_model``, 2 gloo ranks, aot_eager.

Worker: ``tests/clients/nemo_worker.py`` (it says what is changed around NeMo to run on the CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "nemo_worker"


@pytest.fixture(scope="module", autouse=True)
def _needs_nemo():
    _runner.require("nemo_automodel")


def _experts_are_units(run):
    units = run.get("structure", {}).get("fsdp_units", [])
    return [u for u in units if u.endswith("mlp.experts")]


def _report(tmp_path):
    return {"AUTOWEAVE_REPORT": str(tmp_path / "report{rank}.json")}


def _measured(tmp_path) -> dict:
    return json.loads((tmp_path / "report0.json").read_text())["measured"]


def test_selective_ac_bf16_autoweave_trains_without_fallbacks(client_run, tmp_path):
    plain = client_run(WORKER, "plain", "--measure")
    woven = client_run(WORKER, "autoweave", "--measure", env=_report(tmp_path))
    eager = client_run(WORKER, "plain", "--no-compile", "--measure")
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    # NeMo's own parallelizer made the experts FSDP units of their own (the graph break).
    assert len(_experts_are_units(plain)) == 2, plain.result
    assert plain.get("structure") == woven.get("structure")
    # Plain torch: the block's checkpoint falls back to eager; autoweave compiles around it.
    assert plain.get("fallbacks") >= 1
    assert woven.get("fallbacks") == 0, woven.describe()
    # bf16 compute: compiled and eager round differently.
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 2e-3
    assert _runner.max_rel_diff(plain.get("losses"), eager.get("losses")) < 2e-3
    # Never more eager forward GEMMs than plain torch. NeMo's CPU default runs its experts as a
    # loop with a data-dependent ``nonzero`` per expert: those GEMMs stay eager (2 MoE layers x 4
    # experts x 2) beside the lm_head.
    assert woven.get("fwd_gemms_eager") <= plain.get("fwd_gemms_eager")
    assert woven.get("fwd_gemms_eager") == 1 + 16, woven.describe()
    # NeMo's context_fn wraps torch's SAC contexts: the MoE blocks are planned with hoist, which
    # holds no more than eager selective AC and recomputes no more matmuls.
    assert woven.get("act_bytes") <= 1.05 * eager.get("act_bytes"), (
        woven.get("act_bytes"),
        eager.get("act_bytes"),
    )
    assert woven.get("bwd_gemms") <= eager.get("bwd_gemms")
    assert woven.get("recompiles") <= plain.get("recompiles")
    # The report's headline (autograd's record of one call per compiled layer) against the
    # profiler's count, which also counts the lm_head, outside every compiled module.
    assert _measured(tmp_path)["eager_gemms"] == woven.get("fwd_gemms_eager") - 1, _measured(tmp_path)
    # Nothing of autoweave's failed open (before, every piece of the MoE blocks ran eager).
    assert not [
        line for line in woven.stderr_lines() if "autoweave" in line and "[" in line and "-eager]" in line
    ]


def test_selective_ac_grouped_mm_reaches_the_capture_limit(client_run, tmp_path):
    """NeMo's CUDA default for the experts (``torch._grouped_mm``), bf16: only the lm_head runs eager."""
    plain = client_run(WORKER, "plain", "--experts", "torch_mm", "--measure")
    woven = client_run(WORKER, "autoweave", "--experts", "torch_mm", "--measure", env=_report(tmp_path))
    eager = client_run(WORKER, "plain", "--experts", "torch_mm", "--no-compile", "--measure")
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert plain.get("fallbacks") >= 1 and plain.get("fwd_gemms_eager") > 1
    assert woven.get("fallbacks") == 0, woven.describe()
    assert woven.get("fwd_gemms_eager") == 1, woven.describe()  # the lm_head, outside every block
    # Every module measured at a step that ran compiled: none left unmeasured by a stance.
    assert _measured(tmp_path) == {"modules": 3, "fully_compiled": 3, "eager_gemms": 0, "not_measured": {}}
    assert woven.get("act_bytes") <= 1.05 * eager.get("act_bytes")
    assert woven.get("bwd_gemms") <= eager.get("bwd_gemms")
    assert woven.get("recompiles") <= plain.get("recompiles")
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 2e-3


def test_selective_ac_fp32(client_run):
    woven = client_run(WORKER, "autoweave", "--dtype", "fp32")
    eager_bf16 = client_run(WORKER, "plain", "--no-compile", "--measure")
    assert woven.ok, woven.describe()
    assert woven.get("fallbacks") == 0
    # fp32 against the bf16 eager run (an fp32 eager run is in benchmarks/clients.py): the same
    # weights and data, only the compute dtype differs.
    assert _runner.max_rel_diff(woven.get("losses"), eager_bf16.get("losses")) < 2e-2


def test_full_ac_plain_raises_checkpoint_error(client_run):
    """NeMo's "full" AC: the router-saving selective policy on a wrapper whose block is compiled in place.

    Plain torch fails in the first backward. DeepSeek-V3's dense and MoE layers share one
    ``Block`` class: the MoE layers' compile breaks at the experts' FSDP unit inside
    ``Block._mlp``, and its cache entry for ``Block.forward`` does not guard on the MLP's type,
    so the dense layer's recompute runs the MoE layers' code (and compiles ``_mlp`` as a frame
    of its own) while its forward ran its own whole graph: different saved tensors.
    An all-dense or all-MoE stack trains (tests/clients/README.md).
    """
    plain = client_run(WORKER, "plain", "--ac", "full")
    assert not plain.ok
    assert plain.get("error_type") == "CheckpointError", plain.describe()


def test_full_ac_autoweave_trains(client_run, tmp_path):
    """Where plain torch fails: each kind of block compiled on code of its own, the AC left outside.

    NeMo's router-saving ``context_fn`` is wrapped in ordinary context managers, so the AC cannot
    move inside the compiled graphs; the plan says so and keeps it outside, as plain torch does,
    but the dense and the MoE layers no longer share one dynamo cache.
    """
    # With the report on: its measure runs inside NeMo's eager selective checkpoint, and must not
    # change what that checkpoint sees (it once ran an op there, and the recompute failed).
    woven = client_run(WORKER, "autoweave", "--ac", "full", "--measure", env=_report(tmp_path))
    eager = client_run(WORKER, "plain", "--ac", "full", "--no-compile", "--measure")
    assert woven.ok, woven.describe()
    assert eager.ok, eager.describe()
    assert woven.get("fallbacks") == 0
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 2e-3
    # All but the loop experts' GEMMs (2 MoE layers x 4 experts x 2) and the lm_head compiled.
    assert woven.get("fwd_gemms_eager") == 1 + 16, woven.describe()
    assert woven.get("act_bytes") <= 1.05 * eager.get("act_bytes")
    assert _measured(tmp_path)["eager_gemms"] == woven.get("fwd_gemms_eager") - 1, _measured(tmp_path)


def test_selective_ac_expert_parallel_learns_the_gate_break(client_run):
    """EP=2 (the experts split across the ranks, no FSDP unit of their own): the first break under
    NeMo's checkpoint is the gate's expert-load update, a side effect dynamo rejects there; autoweave
    learns it from step 0's fallback and compiles around it from step 1."""
    plain = client_run(WORKER, "plain", "--ep", "2", "--experts", "torch_mm", "--measure")
    woven = client_run(WORKER, "autoweave", "--ep", "2", "--experts", "torch_mm", "--measure")
    for run in (plain, woven):
        assert run.ok, run.describe()
    assert not _experts_are_units(woven)
    assert plain.get("fallbacks") >= 1 and plain.get("fwd_gemms_eager") > 1
    assert woven.get("fallbacks") <= 1, woven.describe()  # step 0 only
    assert woven.get("fwd_gemms_eager") == 1, woven.describe()  # the lm_head
    assert woven.get("act_bytes") <= plain.get("act_bytes")
    assert woven.get("bwd_gemms") <= plain.get("bwd_gemms")
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 2e-3
