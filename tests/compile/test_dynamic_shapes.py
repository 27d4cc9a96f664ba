"""Dynamic shapes as plain dynamo: autoweave's own inspections add no guard, specialize no size.

A selective-AC block with a reshape that depends on the sequence length and a boundary inside,
trained at 12 distinct lengths. The ``pieces`` strategy replays each piece's graph on fake copies
of its inputs (which inputs it changes in place); that replay once met dynamo's SymInts with
static fake tensors and added guards such as ``Eq(128*s27, 12288)`` to dynamo's shape env: the
frame after the break recompiled at every new length up to the recompile limit (8).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat
from autoweave.dispatch import dispatchers
from autoweave.planning.plans import Action
from tests import break_models as bm
from tests.models import RecompileLimitHits, recompiles

DIM, HEADS = 16, 4
LENGTHS = (64, 96, 80, 128, 72, 112, 88, 120, 104, 56, 136, 48)

pytestmark = pytest.mark.usefixtures("weave_on")


class SeqBlock(nn.Module):
    """Attention-like glue (reshapes by the sequence length) around experts that break as an FSDP unit."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.experts = bm.fsdp_like(bm.SimpleExperts(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.reshape(b, t, HEADS, d // HEADS).transpose(1, 2)
            for z in self.qkv(self.norm(x)).chunk(3, dim=-1)
        )
        h = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        # After the break: a reshape by b * t, where a guard like Eq(128*s, 12288) came from.
        return h + self.experts(h.reshape(b * t, d)).reshape(b, t, d)


class GlueSeqBlock(bm.GlueGemmBlock):
    """``bm.GlueGemmBlock`` (auto keeps it as pieces under a policy that saves its matmuls), its
    combine reshaped by the token count read before the break."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        h = x + torch.tanh(self.attn(self.norm1(x)))
        hn = self.norm2(h)
        gates = torch.softmax(self.router(hn), dim=-1)
        routed = self.experts(hn)
        return h + torch.einsum("etd,te->td", routed, gates).reshape(tokens, -1)


def _train(
    strategy: str | None, ac: str = "selective", mark: bool = False, glue: bool = False, **kwargs
) -> dict:
    """Per step: recompiles and graphs compiled; per frame: recompiles; recompile-limit hits.

    ``glue``: ``GlueSeqBlock`` under a policy that saves its matmuls (auto keeps it as pieces),
    its token count varying, in place of ``SeqBlock``.
    """
    torch.manual_seed(0)
    if glue:
        block = cw.checkpoint_wrapper(GlueSeqBlock(DIM), context_fn=bm.POLICIES["save-matmuls"])
    else:
        block = bm.with_ac(SeqBlock(), ac)
    if strategy is not None:
        block = autoweave.set_mode(block, strategy=strategy)
    graphs = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs[0] += 1
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    with autoweave.disabled() if strategy is None else contextlib.nullcontext():
        model = torch.compile(block, backend=backend, **kwargs)
    per_step, graphs_per_step = [], []
    with recompiles() as again, RecompileLimitHits() as hits:
        for length in LENGTHS:
            before, graphs_before = len(again), graphs[0]
            x = (
                torch.randn(length, DIM, requires_grad=True)
                if glue
                else torch.randn(2, length, DIM, requires_grad=True)
            )
            if mark:
                torch._dynamo.mark_dynamic(x, 1)
            model(x).sum().backward()
            per_step.append(len(again) - before)
            graphs_per_step.append(graphs[0] - graphs_before)
    frames = Counter(compile_id.split("/")[0] for compile_id in again)
    dispatcher = dispatchers.dispatcher_of(model)
    plan = None if dispatcher is None or dispatcher.plan is None else dispatcher.plan.decision("").action
    return {
        "steps": per_step,
        "graphs": graphs_per_step,
        "frames": frames,
        "hits": hits.messages,
        "plan": plan,
    }


def _once_per_frame(run: dict) -> None:
    assert run["hits"] == [], run["hits"]
    assert all(n <= 1 for n in run["frames"].values()), run


def test_pieces_recompile_each_frame_once_then_stay_dynamic():
    run = _train("pieces")
    _once_per_frame(run)
    # Compiled at the first length, made dynamic at the second, never again.
    assert sum(run["steps"][2:]) == 0 and sum(run["graphs"][2:]) == 0, run


def test_auto_recompiles_each_woven_frame_once():
    run = _train("auto")
    _once_per_frame(run)
    # Auto measures the block's first step as pieces and moves it to hoist at step 2 (pieces hold
    # more than eager SAC here): its frames are new code there, and learn that the length is dynamic
    # at their second length, step 3, as plain dynamo's would.
    assert sum(run["steps"][3:]) == 0 and sum(run["graphs"][3:]) == 0, run


def test_auto_that_keeps_pieces_recompiles_each_frame_once_then_stays_dynamic():
    run = _train("auto", glue=True)
    _once_per_frame(run)
    assert run["plan"] is Action.PIECES
    assert sum(run["steps"][2:]) == 0 and sum(run["graphs"][2:]) == 0, run


@pytest.mark.parametrize("strategy", ["pieces", "auto"])
def test_dynamic_true_compiles_nothing_after_step_1(strategy):
    run = _train(strategy, dynamic=True)
    _once_per_frame(run)
    first_woven = 1 if strategy == "auto" else 0  # auto's hoist frames are compiled at step 2
    # At auto's switch the experts' forward (the class's code, traced with the block under nested
    # graph breaks) compiles once under the hoisted region's backend (BACKEND_MATCH), as a new frame.
    assert sum(run["steps"][first_woven + 1 :]) == 0 and sum(run["graphs"][first_woven + 1 :]) == 0, run
    assert sum(run["steps"]) <= (
        1 if strategy == "auto" and _compat.dynamo.nested_breaks_supported() else 0
    ), run


def test_mark_dynamic_is_honoured_as_by_plain_dynamo():
    plain = _train(None, mark=True)
    torch._dynamo.reset()
    woven = _train("pieces", mark=True)
    _once_per_frame(woven)
    # The marked frame never recompiles; the frame after the break learns once, as plain's would.
    assert sum(woven["steps"][2:]) == 0 and sum(woven["graphs"][2:]) == 0, woven
    assert sum(plain["steps"]) == 0, plain


def test_full_ac_recompiles_as_plain_dynamo():
    plain = _train(None, ac="full")
    torch._dynamo.reset()
    hoist = _train("hoist", ac="full")
    _once_per_frame(hoist)
    assert sum(hoist["steps"][2:]) == 0 and sum(plain["steps"][2:]) == 0, (hoist, plain)


# -- at the recompile limit the user's AC stays ------------------------------------------------


@pytest.mark.fail_open  # the limit's warning is the point
def test_a_pieces_block_at_the_recompile_limit_runs_under_its_checkpoint(capfd):
    from autoweave.observe import report
    from benchmarks.measure import forward_gemms_outside_graphs
    from tests.models import saved_bytes

    torch.manual_seed(0)
    block = SeqBlock()
    reference = bm.with_ac(copy.deepcopy(block), "selective")  # eager selective AC, as plain torch runs it
    no_ac = copy.deepcopy(block)
    model = torch.compile(
        autoweave.set_mode(bm.with_ac(block, "selective"), strategy="pieces"), backend="aot_eager"
    )
    report.start(None)
    try:
        # Static shapes and a limit of 1: the second length meets it. autoweave keeps the limit at
        # the region's entry (dynamo never reaches its own there, nor warns): a call that fits
        # none of its graphs runs eager under the user's checkpoint, that one and every later.
        with torch._dynamo.config.patch(recompile_limit=1), RecompileLimitHits() as hits:
            for length in (64, 64, 96, 96, 80):
                x = torch.randn(2, length, DIM, requires_grad=True)
                model(x).sum().backward()
            assert not hits.messages, hits.messages
            said = [line for line in capfd.readouterr().err.splitlines() if "[recompile-limit]" in line]
            # Once per region at its limit: the block's, and its experts' (a region of their own).
            assert any("autoweave_SeqBlock" in line for line in said), said
            assert all("runs eager under its checkpoint" in line for line in said), said
            x = torch.randn(2, 72, DIM, requires_grad=True)
            woven, eager_sac = saved_bytes(model, x), saved_bytes(reference, x)
            gemms = forward_gemms_outside_graphs(model, x)
            no_ac = saved_bytes(no_ac, x)
            model(x).sum().backward()  # a steady call after the switch: the report measures it
    finally:
        data = report.stop()
    assert woven == eager_sac < no_ac, (woven, eager_sac, no_ac)
    # The block's GEMMs (qkv, proj, the experts' linear) run eager now, and the headline says so.
    assert gemms == 3, gemms
    assert data["measured"]["eager_gemms"] == gemms, data["measured"]
