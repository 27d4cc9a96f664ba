"""AC placement per woven block (hoist / pieces) on real gloo FSDP2, full and
selective AC, and ``fullgraph=True``.

The ``full`` and ``selective`` runs use a block layout of their own (``--glue-gemm``: the MoE
combines its experts' outputs with an einsum in its own forward), so the block's glue holds a GEMM
that only a strategy compiling the glue captures. Selective-AC policy checks against kernels run
with inductor on the example: with aot_eager a policy sees `.default` ops even around compiled
code, so only inductor shows whether the policy still decides on the ops it was written for (FACTS:
an eager SAC wrapper around inductor code sees only extern `.out` kernels).
"""

from __future__ import annotations

import pytest

from tests.distributed.test_weave_fsdp import _assert_matches_eager, _run

STRATEGIES = ("hoist", "pieces")
# Ops a woven block's own forward (glue, run eager) and FSDP's hooks show to an eager SAC
# policy but no compiled region does: the MoE combine's zeros/scatter, and FSDP's all-gather.
GLUE = {"aten.zeros.default", "aten.scatter.src", "aten.as_strided.default", "aten.empty.memory_format"}
HOOK_PREFIXES = ("c10d.", "fsdp.", "profiler.")
# What FSDP's unshard allocates (its all-gather output views) while an eager SAC policy listens.
FSDP_ALLOCATIONS = {"aten.as_strided.default", "aten.empty.memory_format"}
VARIANTS = [
    "eager",
    "upper_bound:off",
    "hand_siblings:off",
    "compile_ac:on",
    "inplace_fullgraph:on",
    "fullgraph_glue_break:off",
    "fullgraph_glue_break:on",
] + [f"compile_ac:on:{s}" for s in STRATEGIES]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("strat_full"), "full", VARIANTS, "--glue-gemm")


@pytest.fixture(scope="module")
def selective(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("strat_sac"), "selective", VARIANTS, "--glue-gemm")


@pytest.fixture(scope="module")
def selective_inductor(tmp_path_factory: pytest.TempPathFactory) -> dict:
    variants = ["eager", "compile_ac:on", "compile_ac:on:pieces", "hand_siblings:off", "ac_compile:on"]
    return _run(
        tmp_path_factory.mktemp("strat_ind"),
        "selective",
        variants,
        "--backend",
        "inductor",
        "--layers",
        "2",
        "--steps",
        "2",
    )


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_under_each_ac_mode(request: pytest.FixtureRequest, ac: str, strategy: str) -> None:
    results = request.getfixturevalue(ac)
    rec = results[("compile_ac", True, strategy)]
    _assert_matches_eager(rec, results[("eager", True)])
    assert rec["fallbacks"] == 0
    assert rec["eager_gemms"] <= results[("hand_siblings", False)]["eager_gemms"]
    limit = results[("upper_bound", False)]["eager_gemms"]  # no nested FSDP unit: all but the head
    if strategy == "pieces" or (ac == "full" and strategy == "hoist"):
        # The block's glue compiled too (the einsum combine): the capture limit.
        assert rec["eager_gemms"] == limit
    # The hand-written sibling weave runs the glue's einsum eager in every MoE block.
    assert results[("hand_siblings", False)]["eager_gemms"] > limit


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_auto_reaches_the_capture_limit(request: pytest.FixtureRequest, ac: str) -> None:
    results = request.getfixturevalue(ac)
    rec = results[("compile_ac", True)]
    _assert_matches_eager(rec, results[("eager", True)])
    assert rec["fallbacks"] == 0
    assert rec["eager_gemms"] == results[("upper_bound", False)]["eager_gemms"]


@pytest.mark.slow
def test_pieces_policy_decides_every_op_of_the_block_glue_included(selective: dict) -> None:
    eager = {tuple(p) for p in selective[("eager", True)]["policy"]}
    assert eager
    block_ops = {p for p in eager if not p[0].startswith(HOOK_PREFIXES) and p[0] not in FSDP_ALLOCATIONS}
    pieces = {tuple(p) for p in selective[("compile_ac", True, "pieces")]["policy"]}
    # Every op eager SAC decided on (FSDP's hooks and allocations aside), with the same decision,
    # and nothing else.
    assert pieces <= eager, sorted(pieces - eager)
    assert block_ops <= pieces, sorted(block_ops - pieces)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_fullgraph_splits_only_at_the_fsdp_unit(request: pytest.FixtureRequest, ac: str) -> None:
    results = request.getfixturevalue(ac)
    rec = results[("inplace_fullgraph", True)]
    _assert_matches_eager(rec, results[("eager", True)])
    assert rec["fallbacks"] == 0
    assert rec["eager_gemms"] == results[("upper_bound", False)]["eager_gemms"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_fullgraph_still_raises_on_a_break_in_the_glue(request: pytest.FixtureRequest, ac: str) -> None:
    results = request.getfixturevalue(ac)
    assert "Unsupported" in results[("fullgraph_glue_break", False)].get("error", "")
    error = results[("fullgraph_glue_break", True)].get("error", "")
    assert "Unsupported" in error or "FullgraphBreak" in error, error
    assert "graph break at" in error and "moe_variants.py" in error, error


@pytest.mark.slow
def test_selective_policy_decides_the_same_ops_as_eager_sac_with_inductor(selective_inductor: dict) -> None:
    eager = {tuple(p) for p in selective_inductor[("eager", True)]["policy"]}
    # The default: pieces, or hoist where pieces were measured holding more than eager SAC
    # (tests/compile/test_sac_memory.py); either way, eager SAC's numbers and no fallback.
    auto = selective_inductor[("compile_ac", True)]
    assert auto["strategy"] == "auto" and auto["fallbacks"] == 0
    _assert_matches_eager(auto, selective_inductor[("eager", True)])
    woven = selective_inductor[("compile_ac", True, "pieces")]
    assert woven["fallbacks"] == 0
    _assert_matches_eager(woven, selective_inductor[("eager", True)])
    seen = {tuple(p) for p in woven["policy"]}
    # The policy sees the ops it was written for, inside every compiled region ...
    assert ("aten.mm.default", "MUST_SAVE") in seen and ("aten.bmm.default", "MUST_SAVE") in seen
    assert not any(op.endswith(".out") for op, _ in seen), sorted(seen)
    # ... with the same decisions eager SAC made, and nothing is missing but the eager glue and FSDP's hooks.
    assert seen <= eager, sorted(seen - eager)
    missing = {op for op, _ in eager - seen}
    assert missing <= GLUE | {op for op in missing if op.startswith(HOOK_PREFIXES)}, sorted(missing)
    # The hand-written sibling weave (eager SAC around inductor code) hands the policy kernels instead.
    hand = {tuple(p) for p in selective_inductor[("hand_siblings", False)]["policy"]}
    assert any(op.endswith(".out") for op, _ in hand)


@pytest.mark.slow
def test_selective_ac_outside_the_compile_is_honoured_with_inductor(selective_inductor: dict) -> None:
    # checkpoint_wrapper(torch.compile(block), context_fn=policy): autoweave moves the checkpoint in.
    eager = {tuple(p) for p in selective_inductor[("eager", True)]["policy"]}
    rec = selective_inductor[("ac_compile", True)]
    _assert_matches_eager(rec, selective_inductor[("eager", True)])
    seen = {tuple(p) for p in rec["policy"]}
    # The dense first block has no boundary, so it compiles exactly as plain torch would (its
    # eager policy sees inductor's mm kernels, as without autoweave). The experts' bmm exist only
    # in woven MoE blocks: there the policy decides on the op itself, never on a kernel.
    assert ("aten.bmm.default", "MUST_SAVE") in seen
    assert ("aten.mm.default", "MUST_SAVE") in seen
    assert not any(op == "aten.bmm.out" for op, _ in seen), sorted(seen)
    assert {p for p in seen if not p[0].endswith(".out")} <= eager
    hand = {op for op, _ in selective_inductor[("hand_siblings", False)]["policy"]}
    assert "aten.bmm.out" in hand  # without autoweave the experts' policy sees kernels
