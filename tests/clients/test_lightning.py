"""Lightning 2.6 ``ModelParallelStrategy`` (FSDP2) through the Trainer and Fabric, 2 gloo ranks.

Worker: ``tests/clients/lightning_worker.py``: the user's ``configure_model`` / ``parallelize_fn``
shards each block's experts (a nested FSDP unit), checkpoints the block (``checkpoint_wrapper``)
and compiles each block in place or the whole model after sharding. Compared: plain torch
(``AUTOWEAVE`` unset), autoweave (``AUTOWEAVE=1``, with ``AUTOWEAVE_REPORT``) and eager
(``--eager``). The report's wording is checked on these runs too (issue 32's four defects;
``tests/test_report_wording.py`` has them in process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoweave import _compat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "lightning_worker"
FORMS = [("trainer", "block"), ("trainer", "whole"), ("fabric", "block"), ("fabric", "whole")]


@pytest.fixture(scope="module", autouse=True)
def _needs_lightning():
    _runner.require("lightning")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lightning")


def _woven(client_run, out_dir, api, form):
    """autoweave's run, with the report on; it saves a distributed checkpoint after training."""
    tag = f"{api}-{form}"
    return client_run(
        WORKER,
        "autoweave",
        "--api",
        api,
        "--compile",
        form,
        "--save",
        str(out_dir / tag),
        env={"AUTOWEAVE_REPORT": str(out_dir / f"{tag}.json")},
    )


def _plain(client_run, api, form):
    return client_run(WORKER, "plain", "--api", api, "--compile", form)


@pytest.mark.parametrize(("api", "form"), FORMS)
def test_autoweave_compiles_the_checkpointed_blocks_around_the_experts_unit(client_run, out_dir, api, form):
    plain = _plain(client_run, api, form)
    woven = _woven(client_run, out_dir, api, form)
    eager = client_run(WORKER, "plain", "--api", api, "--eager")
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active") and not plain.get("autoweave_active")
    # Plain torch: the experts' FSDP hooks break the graph under each block's checkpoint, and dynamo
    # runs the checkpointed block eager: every forward GEMM but none compiled.
    assert plain.get("fallbacks") >= 1
    assert plain.get("fwd_gemms_compiled") == 0 and plain.get("fwd_gemms_eager") == 25, plain.result
    assert woven.get("fallbacks") == 0, woven.describe()
    # Per block: only the head (outside the compiled blocks) runs eager; the whole model: none.
    assert woven.get("fwd_gemms_eager") == (1 if form == "block" else 0), woven.result
    assert woven.get("fwd_gemms_eager") < plain.get("fwd_gemms_eager")
    assert woven.get("recompile_limit_hits") == 0
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-5
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 1e-5
    report = "\n".join(woven.stderr_lines())
    assert "checkpointed regions that fell back to eager: 0" in report, report
    # (b) the modules are named as the user wrote them, not through Fabric's wrapper
    assert "_forward_module" not in report, report
    assert "layers.0" in report, report


@pytest.mark.parametrize("api", ["trainer", "fabric"])
def test_a_checkpoint_saved_with_autoweave_loads_without_it(client_run, out_dir, api):
    saved = _woven(client_run, out_dir, api, "block")
    assert saved.ok, saved.describe()
    loaded = client_run(
        WORKER, "plain", "--api", api, "--compile", "block", "--load", str(out_dir / f"{api}-block")
    )
    assert loaded.ok, loaded.describe()
    assert not loaded.get("autoweave_active")
    sums, again = saved.get("param_sums"), loaded.get("param_sums")
    assert sums and len(sums) == len(again)
    assert _runner.max_rel_diff(again, sums) < 1e-6, (again, sums)
    assert abs(loaded.get("next_loss") - saved.get("next_loss")) <= 1e-5 * abs(saved.get("next_loss"))


def test_the_exit_report_says_how_many_regions_it_left_out(client_run, out_dir):
    # (c) the whole model woven: embed, the blocks, norm, head, and where dynamo cannot resume a
    # break inside the experts' call (torch < 2.13), the experts too: 5 regions, 4 listed
    woven = _woven(client_run, out_dir, "fabric", "whole")
    assert woven.ok, woven.describe()
    report = "\n".join(woven.stderr_lines())
    if _compat.dynamo.nested_breaks_supported():  # the experts' forward traced with their block
        assert "regions: 4 woven" in report, report
        assert "more region(s)" not in report, report
        return
    assert "regions: 5 woven" in report, report
    assert "... and 1 more region(s): the 4 slowest to compile are listed" in report, report


def test_mode_off_is_named_as_why_nothing_wove(client_run, out_dir):
    # (a) AUTOWEAVE_MODE=off: no plan is printed, and the report says the user turned weaving off
    run = client_run(
        WORKER,
        "autoweave",
        "--api",
        "fabric",
        "--compile",
        "block",
        env={"AUTOWEAVE_MODE": "off", "AUTOWEAVE_REPORT": str(out_dir / "off.json")},
    )
    assert run.ok, run.describe()
    report = "\n".join(run.stderr_lines())
    assert run.get("fallbacks") >= 1
    assert "autoweave plan" not in report
    assert "AUTOWEAVE_MODE=off is set" in report, report
    assert "the plan above" not in report, report


def test_plan_summary_waits_for_the_memory_measure_after_the_sanity_check(client_run, out_dir):
    # (d) selective AC, pieces: Lightning's no-grad sanity check runs every block twice before
    # training; the summary waits for the first call with grad, which measures the pieces.
    run = client_run(
        WORKER,
        "autoweave",
        "--api",
        "trainer",
        "--compile",
        "block",
        "--ac",
        "selective",
        env={"AUTOWEAVE_REPORT": str(out_dir / "selective.json")},
    )
    assert run.ok, run.describe()
    report = "\n".join(run.stderr_lines())
    plan = report[report.index("autoweave plan") :]
    assert "measured: pieces hold" in plan, report
    assert "not measured yet" not in report, report
    assert run.get("fwd_gemms_eager") == 1 and run.get("fallbacks") == 0, run.result
