"""The planner is pure: module trees in, plans out, nothing compiled."""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoweave.planning import boundaries, planner, plans
from autoweave.planning.learned import Learned
from autoweave.planning.plans import Action


class Node(nn.Module):
    def forward(self, x):
        for child in self.children():
            x = child(x)
        return x


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _sac(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(
        module, context_fn=functools.partial(create_selective_checkpoint_contexts, _policy)
    )


# A tree spec: ("leaf",) | ("node", boundary, ac, [children])
trees = st.recursive(
    st.just(("leaf",)),
    lambda kids: st.tuples(
        st.just("node"),
        st.booleans(),
        st.sampled_from(["none", "full", "selective"]),
        st.lists(kids, min_size=1, max_size=3),
    ),
    max_leaves=12,
)


def build(spec, depth=0) -> nn.Module:
    if spec[0] == "leaf":
        return nn.Linear(2, 2)
    _, is_boundary, ac, kids = spec
    node = Node()
    for i, kid in enumerate(kids):
        node.add_module(f"c{i}", build(kid, depth + 1))
    if is_boundary and depth > 0:
        boundaries.boundary(node)
    if ac == "full":
        return checkpoint_wrapper(node)
    if ac == "selective":
        return _sac(node)
    return node


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def _separate_frame(path: str, modules: dict[str, nn.Module], by_path: dict[str, planner.Decision]) -> bool:
    """Does a region that traces down to ``path`` stop there (dynamo runs it as a frame of its own)?

    A boundary's call always breaks the enclosing trace (its hooks are not traceable), so
    what runs inside it is compiled by its own BOUNDARY region, never the enclosing split
    region's graph. An opaque decision is kept out of the enclosing trace on purpose. Any
    other module, a region or not, is traced inline by a region above it.
    """
    decision = by_path.get(path)
    return boundaries.classify(modules[path]) is not None or (decision is not None and decision.opaque)


def _owning_regions(
    path: str, modules: dict[str, nn.Module], by_path: dict[str, planner.Decision]
) -> list[str]:
    """The regions whose compiled graph holds the parameters of the module at ``path``.

    A region owns the parameters of every module its trace reaches: its own, and those of
    descendants down to (not into) a separate frame. Exactly one owner is right; none means a
    parameter left eager under a woven plan, two mean a region traced inline inside another.
    """
    chain = _ancestors(path) + [path]
    owners = []
    for i, above in enumerate(chain):
        decision = by_path.get(above)
        if decision is None or not decision.region:
            continue
        if not any(_separate_frame(below, modules, by_path) for below in chain[i + 1 :]):
            owners.append(above)
    return owners


@settings(max_examples=150, deadline=None)
@given(
    trees, st.sampled_from(planner.MODES), st.sampled_from(planner.STRATEGIES), st.booleans(), st.booleans()
)
def test_plan_invariants(spec, mode, strategy, fullgraph, one_by_one):
    root = build(spec)
    plan = planner.plan(
        root, mode=mode, strategy=strategy, fullgraph=fullgraph, children_one_by_one=one_by_one
    )
    modules = dict(root.named_modules())
    boundary_paths = [n for n, m in modules.items() if m is not root and boundaries.classify(m)]
    assert [p for p, _ in plan.boundaries] == boundary_paths
    # Whether plain torch.compile would trace a checkpoint with a boundary inside (and lose
    # the checkpointed region): some AC wrapper, the root included, holds a boundary.
    ac_over_boundary = any(
        isinstance(m, CheckpointWrapper) and any(boundaries.classify(x) for x in m.modules() if x is not m)
        for m in modules.values()
    )
    if not boundary_paths:
        expected = "no boundary inside: compiled as plain torch.compile would"
    elif mode == "off":
        expected = "weaving is off (mode=off): compiled as plain torch.compile would"
    elif mode == "auto" and not fullgraph and not ac_over_boundary:
        expected = "boundaries inside but no checkpoint around them: plain torch.compile splits the graph"
    else:
        expected = None  # woven: always weaves at a boundary; fullgraph would fail; auto saves the region
    if expected is not None:
        # Unwoven: one decision, the root compiled as plain torch.compile would, saying why.
        assert not plan.woven and not plan.regions()
        (decision,) = plan.decisions
        assert (decision.path, decision.action, decision.module_type) == (
            "",
            Action.PLAIN,
            type(root).__name__,
        )
        assert decision.reason.startswith(expected) and plan.headline() == decision.reason
        return
    assert plan.woven and plan.regions(), plan.decisions
    assert Action.PLAIN not in {d.action for d in plan.decisions}
    by_path = {d.path: d for d in plan.decisions}
    assert len(by_path) == len(plan.decisions), "one decision per module"
    for d in plan.decisions:
        module = modules[d.path] if d.path else root
        # A region compiled whole has no boundary inside and nothing planned below it.
        if d.action is Action.COMPILE:
            assert not any(boundaries.classify(m) for n, m in module.named_modules() if m is not module)
            assert not any(p.startswith(d.path + ".") for p in by_path if d.path)
        if d.action is Action.SPLIT:
            assert d.splits
            assert not one_by_one  # the dispatcher's last resort splits nothing
            assert d.checkpoint is None or d.pieces  # no break inside a traced checkpoint
        if d.checkpoint is not None:
            assert d.action in (Action.COMPILE, Action.BOUNDARY) or d.pieces
    for path in boundary_paths:
        # Every boundary's hooks stay out of compiled regions: the nearest region above it may
        # only be a split region (dynamo breaks the graph at the boundary's call).
        regions_above = [by_path[a] for a in _ancestors(path) if a in by_path and by_path[a].region]
        if regions_above:
            assert regions_above[-1].action in (Action.SPLIT, Action.BOUNDARY)
            assert regions_above[-1].splits and not one_by_one
    # Every parameter is captured by exactly one compiled region (see _owning_regions).
    for path, module in modules.items():
        for name, _ in module.named_parameters(recurse=False):
            owners = _owning_regions(path, modules, by_path)
            where = f"{path or '<root>'}.{name}"
            assert len(owners) == 1, f"{where} is captured by regions {owners}, not exactly one"
    # No traced checkpoint contains a boundary: each AC wrapper over a boundary is decided.
    for name, m in modules.items():
        if isinstance(m, CheckpointWrapper) and any(
            boundaries.classify(x) for x in m.modules() if x is not m
        ):
            if name and not any(a in by_path and by_path[a].action is Action.EAGER for a in _ancestors(name)):
                inside_boundary = any(boundaries.classify(modules[a]) for a in _ancestors(name) if a)
                assert name in by_path or inside_boundary


def _moe_block(ac: str = "full"):
    block = Node()
    block.add_module("norm", nn.LayerNorm(2))
    moe = Node()
    moe.add_module("router", nn.Linear(2, 2))
    moe.add_module("experts", boundaries.boundary(nn.Linear(2, 2), "FSDP unit (fully_shard)"))
    block.add_module("moe", moe)
    return checkpoint_wrapper(block) if ac == "full" else _sac(block)


def _unshielded_block():
    """A boundary with no checkpoint anywhere: plain torch.compile splits there and loses nothing."""
    block = Node()
    block.add_module("norm", nn.LayerNorm(2))
    block.add_module("experts", boundaries.boundary(nn.Linear(2, 2), "FSDP unit (fully_shard)"))
    return block


_UNWOVEN = "boundaries inside but no checkpoint around them: plain torch.compile splits the graph there"


@pytest.mark.parametrize(
    "make, mode, fullgraph, reason",
    [
        (lambda: nn.Linear(2, 2), "auto", False, "no boundary inside: compiled as plain torch.compile would"),
        (lambda: checkpoint_wrapper(nn.Linear(2, 2)), "always", True, "no boundary inside"),
        (lambda: _moe_block("full"), "off", False, "weaving is off (mode=off)"),
        (lambda: _moe_block("selective"), "off", True, "weaving is off (mode=off)"),
        (_unshielded_block, "auto", False, _UNWOVEN),
        (_unshielded_block, "always", False, None),  # always: woven at any boundary
        (_unshielded_block, "auto", True, None),  # fullgraph: plain would raise at the boundary
        (lambda: _moe_block("full"), "auto", False, None),  # the checkpointed region is saved
    ],
    ids=[
        "no-boundary",
        "ac-no-boundary",
        "off",
        "off-fullgraph",
        "no-ac",
        "no-ac-always",
        "no-ac-fullgraph",
        "ac",
    ],
)
def test_each_plan_is_woven_or_plain_with_its_reason(make, mode, fullgraph, reason):
    module = make()
    plan = planner.plan(module, mode=mode, fullgraph=fullgraph)
    if reason is None:
        assert plan.woven and plan.regions() and plan.decision("").action is not Action.PLAIN
        assert plan.headline().startswith(f"woven into {len(plan.regions())} compiled regions (mode={mode},")
        return
    (decision,) = plan.decisions
    assert not plan.woven and decision.action is Action.PLAIN and decision.path == ""
    assert decision.reason.startswith(reason) and plan.headline() == decision.reason


def test_full_ac_hoists_and_compiles_the_boundary_inner_forward():
    plan = planner.plan(_moe_block("full"))
    assert plan.decision("").action is Action.HOIST
    inner = plan.decision("_checkpoint_wrapped_module")
    assert inner.action is Action.SPLIT and inner.region
    experts = plan.decision("_checkpoint_wrapped_module.moe.experts")
    assert experts.action is Action.BOUNDARY and experts.region and "FSDP unit" in experts.reason


def test_selective_ac_is_moved_into_each_compiled_piece():
    plan = planner.plan(_moe_block("selective"))
    root = plan.decision("")
    assert root.action is Action.PIECES and root.ac.selective
    inner = plan.decision("_checkpoint_wrapped_module")
    assert inner.action is Action.SPLIT and inner.pieces and inner.checkpoint.selective
    # Every region (the split block, the boundary's own forward) checkpoints each of its pieces.
    assert all(r.pieces and r.checkpoint.selective for r in plan.regions())
    assert {r.path.rsplit(".", 1)[-1] for r in plan.regions()} == {"_checkpoint_wrapped_module", "experts"}


@pytest.mark.parametrize("strategy, action", [("hoist", Action.HOIST), ("pieces", Action.PIECES)])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_every_strategy_can_be_chosen(ac, strategy, action):
    plan = planner.plan(_moe_block(ac), strategy=strategy)
    assert plan.decision("").action is action
    # The plan records the strategy that runs, which is the one asked here.
    assert (plan.asked, plan.strategy) == (strategy, strategy)
    assert f"strategy={strategy})" in plan.headline()


@pytest.mark.parametrize("removed", ["push-down", "siblings"])
def test_a_removed_strategy_is_refused_naming_the_accepted_ones(removed):
    with pytest.raises(ValueError, match="auto, hoist, pieces"):
        planner.plan(_moe_block("full"), strategy=removed)


def test_auto_picks_hoist_for_full_pieces_for_selective_hoist_for_a_custom_checkpoint():
    full = planner.plan(_moe_block("full"))
    assert full.decision("").action is Action.HOIST
    # The plan records what auto resolved to, and its headline says both.
    assert (full.asked, full.strategy) == ("auto", "hoist") and "strategy=auto -> hoist)" in full.headline()
    selective = planner.plan(_moe_block("selective"))
    assert selective.decision("").action is Action.PIECES and selective.strategy == "pieces"
    block = _moe_block("full")._checkpoint_wrapped_module
    custom = checkpoint_wrapper(block, checkpoint_fn=lambda fn, *a, **k: fn(*a, **k))
    for strategy in ("auto", "pieces"):
        # A custom checkpoint_fn is called as written, by its wrapper, around a compile that splits.
        plan = planner.plan(custom, strategy=strategy)
        root = plan.decision("")
        assert root.action is Action.HOIST and "custom checkpoint_fn" in root.reason, root.reason
        assert plan.decision("_checkpoint_wrapped_module").action is Action.SPLIT
        assert plan.strategy == "hoist" and all(r.checkpoint is None for r in plan.regions())


def test_children_one_by_one_is_the_dispatchers_last_resort_only():
    plan = planner.plan(_moe_block("selective"), mode="always", children_one_by_one=True)
    root = plan.decision("")
    assert root.action is Action.CHILDREN_ONE_BY_ONE and root.ac.selective
    assert plan.decision("_checkpoint_wrapped_module").action is Action.WEAVE
    assert plan.strategy == "children-one-by-one" and plan.asked == "auto"


def test_a_block_measured_holding_more_as_pieces_is_hoisted_under_auto_only():
    block = _moe_block("selective")
    why = "pieces hold 0.61 MB for backward, eager selective AC 0.15 MB (its input and its policy's saves)"
    plan = planner.plan(block, learned=Learned(measured={id(block): why}))
    root = plan.decision("")
    assert root.action is Action.HOIST and why in root.reason and root.ac.selective
    assert plan.decision("_checkpoint_wrapped_module").action is Action.SPLIT
    # A strategy the user chose is kept, measured or not; another block is not affected.
    assert (
        planner.plan(block, strategy="pieces", learned=Learned(measured={id(block): why})).decision("").action
        is Action.PIECES
    )
    assert (
        planner.plan(block, learned=Learned(measured={id(nn.Linear(2, 2)): why})).decision("").action
        is Action.PIECES
    )


def test_fullgraph_full_ac_hoists_and_splits_only_at_the_boundary():
    plan = planner.plan(_moe_block("full"), fullgraph=True)
    assert plan.decision("").action is Action.HOIST
    inner = plan.decision("_checkpoint_wrapped_module")
    assert inner.action is Action.SPLIT and inner.splits
    # The boundary's own forward is a region that may not split: fullgraph applies there.
    assert not plan.decision("_checkpoint_wrapped_module.moe.experts").splits


def test_fullgraph_full_ac_children_one_by_one_splits_nothing():
    plan = planner.plan(_moe_block("full"), fullgraph=True, children_one_by_one=True)
    assert plan.decision("").action is Action.CHILDREN_ONE_BY_ONE
    assert plan.decision("_checkpoint_wrapped_module").action is Action.WEAVE
    assert all(d.action is not Action.SPLIT for d in plan.decisions)


def test_nested_boundary_inside_boundary():
    outer = boundaries.boundary(Node(), "FSDP unit (fully_shard)")
    outer.add_module("a", nn.Linear(2, 2))
    outer.add_module("inner", boundaries.boundary(nn.Linear(2, 2), "FSDP unit (fully_shard)"))
    block = Node()
    block.add_module("outer", outer)
    plan = planner.plan(checkpoint_wrapper(block), fullgraph=True, children_one_by_one=True)
    assert plan.decision("_checkpoint_wrapped_module.outer").action is Action.BOUNDARY
    assert plan.decision("_checkpoint_wrapped_module.outer.inner").action is Action.BOUNDARY
    assert plan.decision("_checkpoint_wrapped_module.outer.a").action is Action.COMPILE


def test_checkpoint_call_in_forward_is_seen():
    class CkptBlock(Node):
        def forward(self, x):
            import torch.utils.checkpoint

            return torch.utils.checkpoint.checkpoint(self.moe, x, use_reentrant=False)

    block = CkptBlock()
    block.add_module("moe", _moe_block("full")._checkpoint_wrapped_module.moe)
    assert planner.calls_checkpoint(block) and not planner.calls_checkpoint(block.moe)
    plan = planner.plan(block)
    assert plan.woven and plan.decision("").action is Action.WEAVE


def test_registered_predicate_and_disabled_forward_are_boundaries(monkeypatch: pytest.MonkeyPatch):
    import torch

    special = nn.Linear(2, 2)
    # Registered on a copy of the registry: undoing the patch unregisters it.
    monkeypatch.setattr(boundaries, "_predicates", list(boundaries._predicates))
    boundaries.register_boundary(lambda m: "special" if m is special else None)
    assert boundaries.classify(special) == "special"
    monkeypatch.undo()
    assert boundaries.classify(special) is None
    disabled = nn.Linear(2, 2)
    disabled.forward = torch.compiler.disable(disabled.forward)
    assert "disable" in boundaries.classify(disabled)
    block = Node()
    block.add_module("d", disabled)
    plan = planner.plan(checkpoint_wrapper(block))
    assert plan.decision("_checkpoint_wrapped_module.d").action is Action.EAGER


def test_unknown_mode_names_accepted_values():
    import pytest

    with pytest.raises(ValueError, match="auto, always, off"):
        planner.plan(nn.Linear(2, 2), mode="sometimes")


def test_planning_reads_the_users_forward_under_autoweaves_installs():
    # A re-plan (e.g. after fully_shard changed the tree) sees a module whose forward
    # autoweave replaced; decisions must still come from the user's code beneath it.
    class CkptBlock(Node):
        def forward(self, x):
            import torch.utils.checkpoint

            return torch.utils.checkpoint.checkpoint(self.moe, x, use_reentrant=False)

    block = CkptBlock()
    block.add_module("moe", _moe_block("full")._checkpoint_wrapped_module.moe)
    installed = functools.partial(print)  # stands in for a compiled region
    setattr(installed, boundaries.PRIOR, None)  # it replaced the class forward
    block.__dict__["forward"] = installed
    assert planner.calls_checkpoint(block)
    assert boundaries.user_forward(block).__func__ is CkptBlock.forward
    assert boundaries.own_forward(block) is None


_FULL = planner.CheckpointSpec(selective=False, reentrant=False, options=())
_SELECTIVE = planner.CheckpointSpec(selective=True, reentrant=False, options=())
_CUSTOM = planner.CheckpointSpec(selective=False, reentrant=False, options=(), known=False)
_REENTRANT_SAC = planner.CheckpointSpec(selective=True, reentrant=True, options=())
_LOOPS = "its forward loops over blocks holding boundaries"


@pytest.mark.parametrize(
    "spec, asked, context, expected, why",
    [
        (_FULL, "auto", {}, "hoist", ""),
        (_FULL, "pieces", {}, "pieces", ""),
        (_SELECTIVE, "auto", {}, "pieces", ""),
        (_SELECTIVE, "hoist", {}, "hoist", ""),
        (_SELECTIVE, "auto", {"measured": "0.6 MB"}, "hoist", "measured: 0.6 MB"),
        (_SELECTIVE, "pieces", {"measured": "0.6 MB"}, "pieces", ""),  # what was asked is kept
        # A torch that cannot size eager SAC: hoist without trying pieces, unless asked for them.
        (_SELECTIVE, "auto", {"unmeasurable": "no op_output"}, "hoist", "no op_output"),
        (_SELECTIVE, "pieces", {"unmeasurable": "no op_output"}, "pieces", ""),
        (_FULL, "auto", {"unmeasurable": "no op_output"}, "hoist", ""),
        (_SELECTIVE, "pieces", {"untraceable": "not two modes"}, "hoist", "not two modes"),
        (_CUSTOM, "auto", {}, "hoist", "custom checkpoint_fn"),
        (_CUSTOM, "pieces", {}, "hoist", "custom checkpoint_fn"),
        (_REENTRANT_SAC, "auto", {}, "children-one-by-one", "reentrant"),
        (_REENTRANT_SAC, "hoist", {}, "hoist", ""),
        (_FULL, "hoist", {"nested": True}, "children-one-by-one", "nested"),
        (_SELECTIVE, "pieces", {"children_one_by_one": True}, "children-one-by-one", "re-planned"),
        # A block that cannot be one split region: the same rule under every strategy.
        (_SELECTIVE, "auto", {"shape": _LOOPS}, "children-one-by-one", _LOOPS),
        (_SELECTIVE, "pieces", {"shape": _LOOPS}, "children-one-by-one", _LOOPS),
        (
            _FULL,
            "hoist",
            {"shape": "its forward calls checkpoint"},
            "children-one-by-one",
            "calls checkpoint",
        ),
    ],
)
def test_the_resolver_picks_one_strategy_with_its_reason(spec, asked, context, expected, why):
    context = dict(context)
    untraceable = context.pop("untraceable", None)
    resolved = plans.resolve(spec, asked=asked, untraceable=lambda: untraceable, **context)
    assert resolved.strategy.name == expected
    assert (why in resolved.why) if why else resolved.why == ""


def test_the_first_call_is_measured_when_auto_chose_pieces_for_a_kind_not_measured_yet():
    assert plans.resolve(_SELECTIVE, asked="auto").measure
    assert not plans.resolve(_SELECTIVE, asked="auto", measured="").measure  # measured: not heavier
    assert not plans.resolve(_SELECTIVE, asked="pieces").measure  # the user's choice is kept unmeasured
    assert not plans.resolve(_FULL, asked="auto").measure  # hoist: nothing to measure
    block = _moe_block("selective")
    assert planner.plan(block).decision("").measure
    measured = planner.plan(block, learned=Learned(measured={id(block): ""}))
    assert measured.decision("").action is Action.PIECES and not measured.decision("").measure


@pytest.mark.parametrize("strategy", ["auto", "hoist", "pieces"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_ac_around_a_forward_that_loops_over_boundaries_stays_eager_around_its_children(ac, strategy):
    # dynamo cannot resume a looping forward after a break: compiled whole (hoist) it runs the
    # head after the loop eager; its glue under pieces runs eager and unchecked.
    stack = Node()
    stack.layers = nn.ModuleList([_unshielded_block() for _ in range(2)])
    stack.head = nn.Linear(2, 2)
    plan = planner.plan(_sac(stack) if ac == "selective" else checkpoint_wrapper(stack), strategy=strategy)
    root = plan.decision("")
    assert root.action is Action.CHILDREN_ONE_BY_ONE and _LOOPS in root.reason, root.reason
    assert plan.decision("_checkpoint_wrapped_module").action is Action.WEAVE
    head = plan.decision("_checkpoint_wrapped_module.head")
    assert head.region and head.action is Action.COMPILE
    assert not any(r.pieces for r in plan.regions())  # the AC runs as written, around the children


def test_the_resolver_asks_about_the_context_fn_only_where_it_matters():
    asked = []

    def untraceable():
        asked.append(1)

    for spec, strategy in ((_FULL, "auto"), (_SELECTIVE, "hoist"), (_CUSTOM, "pieces")):
        plans.resolve(spec, asked=strategy, untraceable=untraceable)
    assert asked == []  # a probe calls the user's context_fn: not for a strategy that never traces it
    plans.resolve(_SELECTIVE, asked="auto", untraceable=untraceable)
    assert asked == [1]


@pytest.mark.parametrize(
    "spec, asked, expected",
    [
        (_SELECTIVE, "auto", "pieces"),
        (_SELECTIVE, "hoist", "pieces"),  # an eager policy would see inductor's kernels
        (_FULL, "auto", "hoist"),  # stays outside, as plain torch runs it
        (_FULL, "pieces", "pieces"),
        (_CUSTOM, "pieces", "hoist"),  # its checkpoint_fn is called as written, outside
    ],
)
def test_an_ac_outside_the_compile_moves_in_or_stays_outside(spec, asked, expected):
    assert plans.resolve_outer(spec, asked=asked).strategy.name == expected


def _hook_unit_block(ac: str, *, own_break: bool = False, instance_forward: bool = False) -> nn.Module:
    """``_moe_block`` with experts that break only in a ``disable``d hook, as ``fully_shard``'s do."""
    import torch

    wrapper = _moe_block(ac)
    block = wrapper._checkpoint_wrapped_module
    experts = nn.Linear(2, 2)
    experts.register_forward_pre_hook(torch.compiler.disable(lambda module, args: None))
    block.moe.experts = experts
    if instance_forward:
        block.forward = functools.partial(Node.forward, block)
    return wrapper, (Learned(breaks={id(block.moe): "a .item() call"}) if own_break else None)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_region_whose_only_breaks_are_unit_hooks_resumes_inside_the_units(ac):
    # Dynamo resumes each break inside the unit's call (nested graph breaks): the unit's forward is
    # traced in the block's region, which keeps the glue around it in its graphs (issue 42).
    model, learned = _hook_unit_block(ac)
    plan = planner.plan(model, nested_breaks=True, learned=learned)
    block, experts = (
        plan.decision("_checkpoint_wrapped_module"),
        plan.decision("_checkpoint_wrapped_module.moe.experts"),
    )
    assert block.region and block.splits and block.nested, block
    assert experts.action is Action.BOUNDARY and not experts.region, experts
    assert "nested graph breaks" in block.reason and "traced in the enclosing region" in experts.reason
    # Not where this torch cannot (nested_breaks off), nor past a break of another kind (its values
    # would be guarded as constants), nor in a block whose forward is the instance's own.
    for model, learned, nested_breaks in (
        (_hook_unit_block(ac)[0], None, False),
        (*_hook_unit_block(ac, own_break=True), True),
        (_hook_unit_block(ac, instance_forward=True)[0], None, True),
    ):
        plan = planner.plan(model, nested_breaks=nested_breaks, learned=learned)
        assert not any(d.nested for d in plan.decisions), plan.decisions
        assert plan.decision("_checkpoint_wrapped_module.moe.experts").region
