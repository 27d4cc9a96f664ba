"""The glue of a woven block, compiled and checkpointed: the ``pieces`` strategy and ``fullgraph=True``.

``bm.GlueGemmBlock`` holds GEMMs in its own forward (an attention-like projection, the router, an
einsum combine) around experts that break the graph as an FSDP unit does. Plain torch runs the
checkpointed block eager; ``pieces`` compiles the block split at the break and checkpoints each piece
with the user's policy. Real FSDP2 runs are in ``tests/distributed/test_strategies.py``.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.observe import summary
from autoweave.planning.plans import Action
from autoweave.sense import counting
from benchmarks.measure import forward_gemms_outside_graphs as _gemms_outside_graphs
from tests import break_models as bm

DIM, TOKENS = 16, 12
# Forward GEMMs of one GlueGemmBlock: attn, router, two expert bmm, the combine's bmm.
GEMMS = 5


@pytest.fixture(autouse=True)
def weave_on():
    assert autoweave.enable()
    _state.reset()
    torch._dynamo.reset()
    yield
    autoweave.disable()
    torch._dynamo.reset()


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> dict:
    fallbacks, outs = [], []
    for _ in range(steps):
        with counting.FallbackCounter() as watch:
            out = model(x)
            out.square().mean().backward()
        fallbacks.append(watch.count)
        outs.append(out.detach().clone())
    grads = [p.grad.clone() for p in model.parameters()]
    return {"fallbacks": fallbacks, "outs": outs, "grads": grads}


def _assert_same(got: dict, ref: dict) -> None:
    pairs = list(zip(got["outs"] + got["grads"], ref["outs"] + ref["grads"], strict=True))
    assert pairs
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _compiled(block: nn.Module, ac: str, strategy: str = "auto", **kwargs) -> nn.Module:
    wrapped = autoweave.set_mode(bm.with_ac(copy.deepcopy(block), ac), strategy=strategy)
    return torch.compile(wrapped, backend=kwargs.pop("backend", "aot_eager"), **kwargs)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_pieces_compile_every_forward_gemm_glue_included(ac):
    torch.manual_seed(0)
    block, x = bm.GlueGemmBlock(DIM), torch.randn(TOKENS, DIM)
    ref = _train(bm.with_ac(copy.deepcopy(block), ac), x)

    with autoweave.disabled():
        plain = torch.compile(bm.with_ac(copy.deepcopy(block), ac), backend="aot_eager")
    assert _train(plain, x)["fallbacks"][0] >= 1  # plain torch: the whole block runs eager
    assert _gemms_outside_graphs(plain, x) == GEMMS
    torch._dynamo.reset()

    pieces = _compiled(block, ac, "pieces")
    got = _train(pieces, x)
    assert got["fallbacks"] == [0, 0, 0]
    assert _gemms_outside_graphs(pieces, x) == 0
    _assert_same(got, ref)
    plan = dispatchers.dispatcher_of(pieces).plan
    assert plan.decision("").action is Action.PIECES
    assert plan.decision("_checkpoint_wrapped_module").pieces

    # Under full AC, hoist reaches the same limit; pieces equals it under either mode.
    hoist = _compiled(block, ac, "hoist")
    _assert_same(_train(hoist, x), ref)
    assert _gemms_outside_graphs(hoist, x) == 0


def test_auto_is_pieces_under_selective_ac_and_hoist_under_full_ac():
    block = bm.GlueGemmBlock(DIM)
    assert autoweave.plan(bm.with_ac(block, "selective")).decision("").action is Action.PIECES
    assert autoweave.plan(bm.with_ac(block, "full")).decision("").action is Action.HOIST


def test_pieces_keep_dropout_numerics_and_nested_checkpoints():
    torch.manual_seed(0)

    class Dropping(bm.GlueGemmBlock):
        def forward(self, x):
            inner = torch.utils.checkpoint.checkpoint(self.norm1, x, use_reentrant=False)
            return nn.functional.dropout(super().forward(x) + inner, 0.3, training=True)

    block, x = Dropping(DIM), torch.randn(TOKENS, DIM)
    torch.manual_seed(1)
    ref = _train(bm.with_ac(copy.deepcopy(block), "selective"), x)
    model = _compiled(block, "selective", "pieces")
    torch.manual_seed(1)
    got = _train(model, x)
    # The RNG stream and preserve_rng_state behave as in eager SAC: same masks, same numbers.
    _assert_same(got, ref)
    assert got["fallbacks"] == [0, 0, 0]


class _Recorder:
    """A selective policy that saves matmuls and records every forward decision it makes."""

    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str]] = Counter()

    def __call__(self, ctx, op, *args, **kwargs):
        gemm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        decision = CheckpointPolicy.MUST_SAVE if gemm else CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            self.decisions[(str(op), decision.name)] += 1
        return decision

    def wrap(self, block: nn.Module) -> nn.Module:
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, self)
        )


# inductor is slow (a C++ compile per graph); aot_eager traces the same ops for the policy.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_pieces_policy_decides_every_op_as_eager_sac(backend):
    torch.manual_seed(0)
    block, x = bm.GlueGemmBlock(DIM), torch.randn(TOKENS, DIM)
    eager = _Recorder()
    ref_model = eager.wrap(copy.deepcopy(block))
    ref = _train(ref_model, x, steps=1)
    traced = _Recorder()
    model = torch.compile(traced.wrap(copy.deepcopy(block)), backend=backend)
    got = _train(model, x, steps=2)
    assert dispatchers.dispatcher_of(model).plan.decision("").action is Action.PIECES
    torch.testing.assert_close(got["outs"][0], ref["outs"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["grads"], ref["grads"], strict=True):
        torch.testing.assert_close(a / 2, b, rtol=1e-5, atol=1e-6)  # two steps accumulated
    # The policy decides on the ops it was written for (never an inductor kernel) ...
    assert not any(op.endswith(".out") for op, _ in traced.decisions)
    # ... for every op eager SAC decides on, glue included (the combine's bmm), with the same
    # decision. AOTAutograd traces the block once per compile, not once per step: compare sets,
    # and the count of each op relative to the others.
    assert set(traced.decisions) == set(eager.decisions), set(traced.decisions) ^ set(eager.decisions)
    assert ("aten.bmm.default", "MUST_SAVE") in traced.decisions
    ratios = {traced.decisions[k] / eager.decisions[k] for k in eager.decisions}
    assert len(ratios) == 1, ratios


def test_fullgraph_splits_only_at_the_boundary():
    torch.manual_seed(0)
    block, x = bm.GlueGemmBlock(DIM), torch.randn(TOKENS, DIM)
    for ac in ("none", "full", "selective"):
        torch._dynamo.reset()
        model = copy.deepcopy(block) if ac == "none" else bm.with_ac(copy.deepcopy(block), ac)
        ref = _train(copy.deepcopy(model), x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        got = _train(compiled, x)
        _assert_same(got, ref)
        assert _gemms_outside_graphs(compiled, x) == 0, ac
        plan = dispatchers.dispatcher_of(compiled).plan
        assert plan.woven and any(d.splits for d in plan.decisions), ac


class _GlueBreak(bm.GlueGemmBlock):
    """A break in the block's own glue, not at a boundary: fullgraph=True must still refuse it."""

    def forward(self, x):
        y = super().forward(x)
        torch._dynamo.graph_break()
        return y * 2


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_fullgraph_still_raises_on_a_break_that_is_not_a_boundary(ac):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM)

    def build() -> nn.Module:
        block = _GlueBreak(DIM)
        return block if ac == "none" else bm.with_ac(block, ac)

    with autoweave.disabled():
        plain = torch.compile(build(), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        plain(x)
    torch._dynamo.reset()
    woven = torch.compile(build(), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph break at .*test_pieces.py"):
        woven(x)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        woven(x)  # and at every call after, as plain fullgraph=True does


def _checkpointed_graphs(fn, *args) -> list[bool]:
    """Compile ``fn`` through a pieces ``RegionBackend``: for each piece, did it reach the backend wrapped?"""
    from torch.utils.checkpoint import checkpoint

    from autoweave.weave.pieces import RegionBackend

    wrapped = []

    def inner(gm, example_inputs):
        wrapped.append(any("tag_activation_checkpoint" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    backend = RegionBackend(inner, "region", functools.partial(checkpoint, use_reentrant=False))
    torch.compile(fn, backend=backend)(*args)
    return wrapped


def _changes_input(t):
    t.mul_(2)  # recomputing this piece would change its input twice
    return t.sin()


def _changes_a_view(t):
    t.view(-1).add_(1.0)  # through a view: the base changes
    return t.sin()


def _relu_inplace(t):
    return F.relu(t, inplace=True).cos()


def _sets_an_item(t):
    t[0] = 0.0
    return t.sin()


def _copies_into(t):
    t.copy_(t.detach() * 2)
    return t.sin()


def _out_into_a_buffer_read_for_grad(t, buf):
    torch.mul(t.detach(), 2.0, out=buf)  # buf does not need grad, but t * buf saves it for backward
    return (t * buf).sin()


def _index_put_into_a_buffer_read_for_grad(t, buf):
    buf.index_put_((torch.tensor([0]),), torch.tensor(3.0))
    return (t * buf).sin()


def _counts_into_a_buffer(t, buf):
    buf.add_(1.0)  # changed, but nothing backward needs: the checkpoint stays
    return t.sin()


@pytest.mark.parametrize(
    "fn, wrapped",
    [
        (_changes_input, False),
        (_changes_a_view, False),
        (_relu_inplace, False),
        (_sets_an_item, False),
        (_copies_into, False),
        (_out_into_a_buffer_read_for_grad, False),
        (_index_put_into_a_buffer_read_for_grad, False),
        (_counts_into_a_buffer, True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_piece_that_changes_an_input_backward_needs_is_not_wrapped(fn, wrapped):
    x = torch.randn(4, requires_grad=True).clone()  # not a leaf, as a piece's inputs usually are not
    args = (x,) if fn.__code__.co_argcount == 1 else (x, torch.ones(4))
    assert _checkpointed_graphs(fn, *args) == [wrapped]


def test_each_piece_is_wrapped_in_the_checkpoint_operator_unless_that_would_be_wrong():
    x = torch.randn(4, requires_grad=True)

    def two_pieces(t):
        y = t.sin() * 2
        torch._dynamo.graph_break()
        return y.cos()

    assert _checkpointed_graphs(two_pieces, x) == [True, True]
    torch._dynamo.reset()
    assert _checkpointed_graphs(_changes_input, x.clone()) == [False]


class _ResidualExperts(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _ChangesExpertsOutput(nn.Module):
    """After the boundary, the experts' output is changed in place, as MoE code does."""

    def __init__(self, dim: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm = nn.LayerNorm(dim)
        self.experts = bm.fsdp_like(_ResidualExperts(dim))
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(self.norm(x))
        if self.how == "F.relu(inplace=True)":
            y = F.relu(y, inplace=True)
        elif self.how == "nn.ReLU(inplace=True)":
            y = self.act(y)
        else:
            y.view(-1).add_(1.0)
        return x + self.out(y)


@pytest.mark.parametrize("how", ["F.relu(inplace=True)", "nn.ReLU(inplace=True)", "y.view(-1).add_(1.0)"])
def test_pieces_train_through_an_in_place_change_after_a_boundary(how):
    torch.manual_seed(0)
    block, x = _ChangesExpertsOutput(DIM, how), torch.randn(TOKENS, DIM)
    # Marked, the experts stay a region of their own and the change lands on a piece's input. (A unit
    # breaking only in its hooks is traced with the block, nested graph breaks: the change then sits
    # inside the piece that made the output, and every piece keeps its checkpoint.)
    autoweave.boundary(block.experts)
    ref = _train(bm.with_ac(copy.deepcopy(block), "selective"), x)
    model = _compiled(block, "selective", "pieces")
    got = _train(model, x)
    _assert_same(got, ref)
    assert got["fallbacks"] == [0, 0, 0]
    # The plan log and the report say which piece runs without its checkpoint, and why.
    (entry,) = summary.entries()
    notes = [n for record in summary.decision_records(entry) for n in record["notes"]]
    assert any("compiled without its checkpoint" in n and "in place" in n for n in notes), notes
    assert "note: piece 2 compiled without its checkpoint" in summary.format_summary([entry])


def _refuses_addmm(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.addmm.default:
        raise ValueError("this policy refuses addmm")
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_a_policy_that_raises_raises_as_in_plain_torch(capfd):
    torch.manual_seed(0)
    block, x = bm.GlueGemmBlock(DIM), torch.randn(TOKENS, DIM)

    def build() -> nn.Module:
        policy = functools.partial(create_selective_checkpoint_contexts, _refuses_addmm)
        return cw.checkpoint_wrapper(copy.deepcopy(block), context_fn=policy)

    with autoweave.disabled():
        plain = torch.compile(build(), backend="aot_eager")
    with pytest.raises(ValueError, match="this policy refuses addmm"):
        plain(x)
    torch._dynamo.reset()
    capfd.readouterr()
    woven = torch.compile(autoweave.set_mode(build(), strategy="pieces"), backend="aot_eager")
    for _ in range(2):  # at every call, as plain torch does: the user's own error, unwrapped
        with pytest.raises(ValueError, match="this policy refuses addmm") as raised:
            woven(x)
        assert type(raised.value) is ValueError
    # Not reported as autoweave's: no [piece-eager], no [weave-failed], no warning at all.
    assert "autoweave[" not in capfd.readouterr().err
    assert dispatchers.dispatcher_of(woven).plan.decision("").action is Action.PIECES
