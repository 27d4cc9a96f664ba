"""The weave in one process, with a counting backend and a dynamo-disabled hook standing in for FSDP."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave.dispatch import dispatchers
from autoweave.planning.plans import Action
from autoweave.sense import counting
from benchmarks.measure import forward_gemms_outside_graphs
from tests.models import Block, RecompileLimitHits, make_break, train_chain


@pytest.fixture(autouse=True)
def weave_on():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert autoweave.enable()
    yield
    autoweave.disable()
    torch._dynamo.reset()


def _train(
    model: nn.Module, x: torch.Tensor, steps: int = 2
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs, grads = [], []
    for _ in range(steps):
        out = model(x)
        out.square().mean().backward()
        outs.append(out.detach().clone())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        model.zero_grad()
    return outs, grads


def _reference(block: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import copy

    return _train(copy.deepcopy(block), x)


def test_compile_of_ac_block_with_boundary_is_woven_not_eager():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    ref = _reference(block, x)
    cap, fallbacks = counting.Capture(), counting.FallbackCounter()
    model = torch.compile(cw.checkpoint_wrapper(block), backend=cap.backend())
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert model._orig_mod._checkpoint_wrapped_module is block
    with fallbacks:
        got = _train(model, x)
    assert fallbacks.count == 0
    assert cap.graph_count >= 2 and cap.ops > 0
    for a, b in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    plan = dispatchers.dispatcher_of(model).plan
    assert plan.woven and plan.decision("_checkpoint_wrapped_module.ffn.experts").action.value == "boundary"


def test_without_autoweave_the_same_block_falls_back():
    torch.manual_seed(0)
    cap, fallbacks = counting.Capture(), counting.FallbackCounter()
    with autoweave.disabled():
        model = torch.compile(cw.checkpoint_wrapper(Block()), backend=cap.backend())
    with fallbacks:
        _train(model, torch.randn(4, 8))
    assert fallbacks.count >= 1
    assert dispatchers.dispatcher_of(model) is None


def test_inplace_fullgraph_splits_only_at_the_boundary_instead_of_raising():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    ref = _reference(block, x)
    model = cw.checkpoint_wrapper(block)
    model.compile(backend="aot_eager", fullgraph=True)
    got = _train(model, x)
    torch.testing.assert_close(got[1][-1], ref[1][-1], rtol=1e-5, atol=1e-6)
    plan = dispatchers.dispatcher_of(model).plan
    assert plan.decision("").action.value == "hoist"
    inner = plan.decision("_checkpoint_wrapped_module")
    assert inner.action.value == "split" and inner.splits
    # Every break dynamo met is the boundary's (its disabled hook), none elsewhere.
    reasons = torch._dynamo.utils.counters["graph_break"]
    assert reasons and all("disable" in reason for reason in reasons), dict(reasons)


def test_plain_fullgraph_really_raises_here():
    with autoweave.disabled():
        model = cw.checkpoint_wrapper(Block())
        model.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        model(torch.randn(4, 8))


def test_module_without_boundary_compiles_exactly_as_plain_torch():
    torch.manual_seed(0)
    cap = counting.Capture()
    model = torch.compile(cw.checkpoint_wrapper(Block(moe=False)), backend=cap.backend())
    model(torch.randn(4, 8)).sum().backward()
    plan = dispatchers.dispatcher_of(model).plan
    assert not plan.woven and plan.decisions[0].action.value == "plain"
    assert cap.graph_count == 1  # one graph holding the checkpoint, as plain torch.compile gives


def test_function_compile_is_untouched():
    def f(x):
        return torch.sin(x) + 1

    cap = counting.Capture()
    compiled = torch.compile(f, backend=cap.backend("eager"))
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), f(x))
    # dynamo's own wrapper directly around f, with nothing of autoweave's on it, and dynamo
    # compiled it: one graph, nothing run eager.
    assert compiled._torchdynamo_orig_callable is f
    assert dispatchers.dispatcher_of(compiled) is None and not hasattr(compiled, "__autoweave_prior__")
    assert cap.graph_count == 1


def test_mode_off_and_per_module_override():
    model = torch.compile(autoweave.set_mode(cw.checkpoint_wrapper(Block()), "off"), backend="aot_eager")
    with counting.FallbackCounter() as fallbacks:
        model(torch.randn(4, 8)).sum().backward()
    assert not dispatchers.dispatcher_of(model).plan.woven
    assert fallbacks.count >= 1


def test_no_ac_inside_means_plain_split_in_auto_and_weave_in_always():
    block = Block()
    assert not autoweave.plan(block).woven  # plain torch splits the graph and keeps the rest
    always = autoweave.plan(block, mode="always")
    assert always.woven and always.decision("").action.value == "split"


def test_state_dict_keys_and_parameters_unchanged():
    torch.manual_seed(0)
    with autoweave.disabled():
        plain = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    block = Block()
    params = dict(block.named_parameters())
    woven = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    woven(torch.randn(4, 8))
    assert list(woven.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in woven.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for name, p in block.named_parameters():
        assert params[name] is p
    # A checkpoint saved with autoweave on loads with it off, and back.
    plain.load_state_dict(woven.state_dict())
    woven.load_state_dict(plain.state_dict())


def test_replans_when_a_boundary_appears_after_the_first_forward():
    block = Block()
    block.ffn = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    model(torch.randn(4, 8))
    assert not dispatchers.dispatcher_of(model).plan.woven
    make_break(block.ffn[0])
    autoweave.boundary(block.ffn[0])  # the fingerprint sees the mark
    with counting.FallbackCounter() as fallbacks:
        model(torch.randn(4, 8)).sum().backward()
    assert dispatchers.dispatcher_of(model).plan.woven
    assert fallbacks.count == 0


# 10 leaves or layers are past dynamo's recompile limit (8) already; 32 (a real model's depth) is slow.
@pytest.mark.parametrize("n", [10, pytest.param(32, marks=pytest.mark.slow)])
def test_same_class_leaf_regions_with_different_shapes_never_hit_recompile_limit(caplog, n):
    # Hand-compiling many same-class leaves in place shares one code object and hits the
    # recompile limit (8); each autoweave region has its own code object.
    dims = [4 + i for i in range(n)]

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(d, d + 1) for d in dims)
            self.layers.append(make_break(nn.Linear(8, 8)))

        def forward(self, xs):
            return [layer(x) for layer, x in zip(self.layers, [*xs, xs[4]], strict=True)]

    cap = counting.Capture()
    # A break called from the loop over the leaves: a region per leaf, fullgraph each.
    stack = Stack()
    stack.compile(backend=cap.backend(), fullgraph=True)
    xs = [torch.randn(2, d) for d in dims]
    with caplog.at_level(logging.WARNING), RecompileLimitHits() as hits:
        stack(xs)
    assert cap.graph_count == n + 1  # every leaf captured on its own frame, none fell back
    assert hits.messages == []  # dynamo's own warning (caplog cannot hear torch's loggers)
    assert "recompile" not in caplog.text.lower()  # nor autoweave's


def test_recompile_limit_listener_hears_plain_torch_hit():
    # The listener the recompile-limit checks rely on does hear dynamo: plain torch compiling
    # same-class leaves of different shapes shares one code object and hits the limit.
    torch._dynamo.reset()
    with autoweave.disabled():
        leaves = [torch.compile(nn.Linear(d, d), backend="eager", dynamic=False) for d in (2, 3, 4)]
    with torch._dynamo.config.patch(recompile_limit=1), RecompileLimitHits() as hits:
        for d, leaf in zip((2, 3, 4), leaves, strict=True):
            leaf(torch.randn(1, d))
    assert hits.messages, "no recompile-limit warning heard"


@pytest.mark.fail_open
def test_failure_inside_planning_falls_back_with_one_warning(monkeypatch, capsys):
    from autoweave import _state
    from autoweave.planning import planner

    monkeypatch.setattr(_state.run, "warned_keys", set())

    def boom(*a, **k):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(planner, "plan", boom)
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    out = model(torch.randn(4, 8))  # runs as plain torch would
    model(torch.randn(4, 8))
    assert out.shape == (4, 8)
    err = capsys.readouterr().err
    assert err.count("[internal-error]") == 1 and "planner exploded" in err


def test_strict_mode_raises(monkeypatch):
    from autoweave import _settings
    from autoweave._failopen import AutoweaveError
    from autoweave._settings import Settings
    from autoweave.planning import planner

    monkeypatch.setattr(_settings, "_current", Settings(enabled=True, strict=True))
    monkeypatch.setattr(planner, "plan", lambda *a, **k: 1 / 0)
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    with pytest.raises(AutoweaveError):
        model(torch.randn(4, 8))


def test_checkpoints_cross_load_with_torch_save_and_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    woven = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    woven(torch.randn(4, 8)).sum().backward()  # woven at the first forward
    assert dispatchers.dispatcher_of(woven).plan.woven
    with autoweave.disabled():
        plain = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    # torch.save: woven -> plain
    torch.save(woven.state_dict(), tmp_path / "w.pt")
    plain.load_state_dict(torch.load(tmp_path / "w.pt"))
    for (n1, t1), (n2, t2) in zip(woven.state_dict().items(), plain.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2)
    # torch.distributed.checkpoint: plain -> a fresh woven model
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    dcp.save(plain.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    fresh = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    fresh(torch.randn(4, 8))
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    fresh.load_state_dict(state)
    for t1, t2 in zip(fresh.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(t1, t2)


def test_recompile_limit_hit_in_a_woven_region_is_reported(capfd):
    torch.manual_seed(0)
    model = cw.checkpoint_wrapper(Block())
    model.compile(backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        for batch in (2, 3, 4):
            model(torch.randn(batch, 8))
    # On stderr with its slug, once per region (the logger is silent by default). Under their
    # eager checkpoint the regions do not reach dynamo's limit: autoweave runs the calls no
    # graph fits eager itself, forward and recompute, and says so (``lookups_in_order``).
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "[recompile-limit] woven region" in line]
    assert said and len(said) == len(set(said)), err  # each region told once (three batches, two hits each)


def test_per_module_strategy_override_and_env_strategy(monkeypatch):
    from autoweave import _settings
    from autoweave._settings import Settings

    block = cw.checkpoint_wrapper(Block())
    assert autoweave.plan(block).decision("").action.value == "hoist"
    assert autoweave.plan(block).decision("_checkpoint_wrapped_module").action.value == "split"
    autoweave.set_mode(block, strategy="pieces")
    plan = autoweave.plan(block)
    assert plan.decision("").action.value == "pieces"
    assert all(d.checkpoint is not None for d in plan.regions())
    for refused in ("sideways", "push-down", "siblings"):
        with pytest.raises(ValueError, match="auto, hoist, pieces\\)"):
            autoweave.set_mode(block, strategy=refused)
    monkeypatch.setattr(_settings, "_current", Settings(enabled=True, strategy="pieces"))
    other = cw.checkpoint_wrapper(Block())
    assert autoweave.plan(other).decision("").action.value == "pieces"
    # The woven model trains like eager under the forced strategy.
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ref = _reference(other, x)
    got = _train(torch.compile(other, backend="aot_eager"), x)
    torch.testing.assert_close(got[1][-1], ref[1][-1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [10, pytest.param(32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("compile_style", ["wrap", "inplace"])
def test_layer_mixed_dense_and_moe_stack_no_fallback_no_recompile_limit(compile_style, caplog, n):
    # One block class for dense and MoE layers (as real models do); every MoE layer's
    # experts is a boundary. Plain torch here either falls back per checkpointed block or,
    # hand-woven as AC(Compile(layer)), mixes up layers that share the wrapper's frame.
    torch.manual_seed(0)
    blocks = [Block(moe=i % 2 == 1) for i in range(n)]
    ref_stack = nn.Sequential(*[cw.checkpoint_wrapper(b) for b in blocks])
    import copy

    ref_stack = copy.deepcopy(ref_stack)
    cap = counting.Capture()
    backend = cap.backend()
    layers = []
    for b in blocks:
        wrapped = cw.checkpoint_wrapper(b)
        if compile_style == "wrap":
            wrapped = torch.compile(wrapped, backend=backend)
        else:
            wrapped.compile(backend=backend)
        layers.append(wrapped)
    stack = nn.Sequential(*layers)
    x = torch.randn(4, 8)
    listeners = counting.FallbackCounter(), RecompileLimitHits()
    with listeners[0] as fallbacks, listeners[1] as hits, caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = stack(x)
            out.square().mean().backward()
            ref = ref_stack(x)
            ref.square().mean().backward()
    assert fallbacks.count == 0
    assert hits.messages == []  # dynamo's own warning (caplog cannot hear torch's loggers)
    assert "recompile_limit" not in caplog.text and "recompile limit" not in caplog.text  # nor autoweave's
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(stack.parameters(), ref_stack.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    # Identical layers share their graphs: far fewer graphs than layers.
    assert cap.graph_count <= 12, cap.graph_count


def _sac_kwargs():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


def test_selective_ac_outside_the_compile_is_moved_inside():
    # checkpoint_wrapper(torch.compile(block), context_fn=policy): plain torch splits the graph
    # at the boundary, but the eager policy would see inductor's kernels; autoweave moves the
    # checkpoint into each compiled region and the wrapper stops checkpointing.
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    eager = cw.checkpoint_wrapper(__import__("copy").deepcopy(block), **_sac_kwargs())
    ref = _train(eager, x)
    compiled = torch.compile(block, backend="aot_eager")
    model = cw.checkpoint_wrapper(compiled, **_sac_kwargs())
    with counting.FallbackCounter() as fallbacks:
        got = _train(model, x)
    plan = dispatchers.dispatcher_of(compiled).plan
    assert plan.woven and plan.outer_push_down is not None and plan.outer_push_down.selective
    assert plan.regions() and all(d.checkpoint is not None for d in plan.regions())
    assert "forward" in model.__dict__  # the wrapper no longer checkpoints itself
    assert fallbacks.count == 0
    for a, b in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Full AC outside the compile stays outside, eager, as in plain torch; the block is split at
    # the boundary as plain torch splits it, on code of its own per kind of block.
    full = torch.compile(Block(), backend="aot_eager")
    cw.checkpoint_wrapper(full)(x)
    root = dispatchers.dispatcher_of(full).plan.decision("")
    assert root.action is Action.SPLIT and "stays eager, outside the compile (full AC)" in root.reason


def test_full_ac_around_an_in_place_compile_stays_outside_and_captures_what_plain_does():
    """checkpoint_wrapper(block), then block.compile() (NeMo Automodel's per-layer compile)."""

    def build():
        torch.manual_seed(0)
        return nn.ModuleList(cw.checkpoint_wrapper(Block(moe=i > 0)) for i in range(3))

    def train(layers):
        return train_chain(layers, 8, 2)

    eager = train(build())
    runs = {}
    for on in (False, True):
        torch._dynamo.reset()
        cap = counting.Capture()
        layers = build()
        with contextlib.nullcontext() if on else autoweave.disabled():
            for wrapper in layers:
                wrapper._checkpoint_wrapped_module.compile(backend=cap.backend("aot_eager"))
        losses = train(layers)
        outside = forward_gemms_outside_graphs(nn.Sequential(*layers), torch.randn(4, 8))
        runs[on] = (losses, cap.graph_count, outside, layers)
    for on in (False, True):
        torch.testing.assert_close(runs[on][0], eager, rtol=1e-5, atol=1e-6)
    # The same capture as plain torch: graphs split at the boundary, no GEMM left eager. (The MoE
    # layers, whose backends are equal closures, share their graphs: plain compiles them twice.)
    assert runs[True][2] == runs[False][2] == 0, (runs[True][1:3], runs[False][1:3])
    assert runs[True][1] <= runs[False][1]
    plan = dispatchers.dispatcher_of(runs[True][3][1]._checkpoint_wrapped_module).plan
    assert plan.woven and plan.decision("").action is Action.SPLIT, plan
    assert "stays eager, outside the compile (full AC)" in plan.decision("").reason
