"""The weave on real FSDP2 (gloo, world size 2, torchrun), for every order users apply AC, compile and FSDP.

One torchrun per AC mode runs every variant (benchmarks/moe_variants.py, the same worker the
benchmark uses) with a counting backend around aot_eager; these tests read its JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed import torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "moe_variants.py"

WOVEN_ORDERS = (
    "compile_ac",
    "inplace_fullgraph",
    "fsdp_then_compile",
    "no_block_fsdp",
    "ckpt_in_forward",
    "compile_twice",
    "whole_model",
)
BREAK_ORDERS = ("break_compile_ac", "break_ac_compile")  # a graph break that is no FSDP unit
COPING_ORDERS = ("ac_compile",)  # plain torch already copes: autoweave must not capture less
HAND = ("hand_siblings", "hand_ac_compile", "upper_bound")


def _run(tmp: Path, ac: str, variants: list[str], *extra: str) -> dict[tuple[str, bool], dict]:
    out = tmp / f"{ac}.json"
    torchrun(
        WORKER,
        "--ac",
        ac,
        "--steps",
        "3",
        "--variants",
        ",".join(variants),
        "--out",
        str(out),
        *extra,
        timeout=900,
    )
    records = json.loads(out.read_text())
    # Keyed by (order, autoweave); variants that force a strategy get their own keys too.
    out_map: dict = {}
    for r in records:
        key = (r["order"], r["autoweave"])
        if r.get("strategy", "auto") != "auto":
            key = (r["order"], r["autoweave"], r["strategy"])
        out_map[key] = r
    return out_map


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict:
    variants = ["eager"] + [f"{o}:{s}" for o in WOVEN_ORDERS + COPING_ORDERS for s in ("off", "on")]
    variants += [f"{o}:off" for o in HAND]
    variants += ["break_compile_ac:off", "break_compile_ac:on", "break_ac_compile:off"]
    return _run(tmp_path_factory.mktemp("full"), "full", variants)


@pytest.fixture(scope="module")
def selective(tmp_path_factory: pytest.TempPathFactory) -> dict:
    variants = ["eager", "compile_ac:off", "compile_ac:on", "inplace_fullgraph:on", "fsdp_then_compile:on"]
    return _run(tmp_path_factory.mktemp("sac"), "selective", variants)


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _assert_matches_eager(record: dict, eager: dict) -> None:
    assert "error" not in record, record.get("error")
    # zip over empty lists would compare nothing: the reference must hold every step and gradient.
    assert eager["losses"] and all(math.isfinite(x) for x in eager["losses"]), eager["losses"]
    assert eager["grad_norms"], "the eager reference recorded no gradients"
    for got, want in zip(record["losses"], eager["losses"], strict=True):
        assert _close(got, want), (record["order"], record["losses"], eager["losses"])
    assert set(record["grad_norms"]) == set(eager["grad_norms"])
    for name, want in eager["grad_norms"].items():
        assert _close(record["grad_norms"][name], want), (record["order"], name)


@pytest.mark.slow
@pytest.mark.parametrize("order", WOVEN_ORDERS)
def test_woven_orders_never_fall_back_and_match_eager(full: dict, order: str) -> None:
    on, off, eager = full[(order, True)], full[(order, False)], full[("eager", True)]
    _assert_matches_eager(on, eager)
    assert on["fallbacks"] == 0
    # Without autoweave this order loses the checkpointed MoE blocks (or fails under fullgraph).
    assert "error" in off or off["fallbacks"] > 0
    # Forward GEMMs outside compiled graphs: no more than the best hand-written weave, which is
    # only the root's output projection here (nothing else of the model runs eager).
    best_hand = min(full[(h, False)]["eager_gemms"] for h in HAND)
    assert on["eager_gemms"] <= best_hand
    # The upper bound's count, or fewer: a whole-model compile also compiles the root's output
    # projection (its forward loops over the blocks, so it is woven and the head is a region).
    assert on["eager_gemms"] <= full[("upper_bound", False)]["eager_gemms"]
    if order != "whole_model":
        assert on["eager_gemms"] == full[("upper_bound", False)]["eager_gemms"]
    if "error" not in off:
        assert on["eager_gemms"] < off["eager_gemms"]
        assert on["ops"] > off["ops"]


@pytest.mark.slow
@pytest.mark.parametrize("order", WOVEN_ORDERS + COPING_ORDERS)
def test_state_dict_keys_identical_on_and_off(full: dict, order: str) -> None:
    on, off = full[(order, True)], full[(order, False)]
    if "error" in off:  # plain fullgraph raised before a step; compare to the same tree in place
        off = full[("compile_twice", False)]
    assert on["state_dict_keys"] and on["state_dict_keys"] == off["state_dict_keys"]


@pytest.mark.slow
def test_a_break_that_is_no_boundary_is_compiled_around_after_the_first_call(full: dict) -> None:
    on, off, outer = (
        full[("break_compile_ac", True)],
        full[("break_compile_ac", False)],
        full[("break_ac_compile", False)],
    )
    _assert_matches_eager(on, full[("eager", True)])
    assert off["fallbacks"] > 0 and off["eager_gemms"] > on["eager_gemms"]
    # One fallback, at the first MoE block's first call: every block running the same code is
    # re-planned from what it taught; then the capture of AC outside the compile.
    assert on["fallbacks"] == 1
    assert on["eager_gemms"] == outer["eager_gemms"]
    assert on["ops"] >= outer["ops"]


@pytest.mark.slow
def test_where_plain_torch_copes_autoweave_captures_no_less(full: dict) -> None:
    for order in COPING_ORDERS:
        on, off = full[(order, True)], full[(order, False)]
        _assert_matches_eager(on, full[("eager", True)])
        assert off["fallbacks"] == 0 and on["fallbacks"] == 0
        assert on["ops"] >= off["ops"]
        assert on["eager_gemms"] <= off["eager_gemms"]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_ac", "inplace_fullgraph", "fsdp_then_compile"])
def test_selective_ac_woven_without_fallback(selective: dict, order: str) -> None:
    on = selective[(order, True)]
    _assert_matches_eager(on, selective[("eager", True)])
    assert on["fallbacks"] == 0
    assert selective[("compile_ac", False)]["fallbacks"] > 0
    assert on["eager_gemms"] < selective[("compile_ac", False)]["eager_gemms"]
