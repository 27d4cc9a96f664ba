"""The plan summary names what it covers: which model, what changed at a re-plan, which rank's modules."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

from autoweave import _compat
from autoweave.observe import summary
from autoweave.planning import planner
from tests.models import Block

pytestmark = pytest.mark.usefixtures("weave_on", "_one_rank")


@pytest.fixture
def _one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process group another test of this worker made (and ``_log`` remembers) must not
    # make these summaries a multi-rank job's; the rank test sets its own world.
    monkeypatch.setattr(summary, "world_size", lambda: 1)
    monkeypatch.setattr(summary, "rank", lambda: 0)


class Layers(nn.Module):
    """A model: compiled layers in a container, called in order (its class names it in the summary)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({n: torch.compile(nn.Linear(8, 8), backend="eager") for n in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class Policy(Layers):
    pass


class Reference(Layers):
    pass


def _summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("autoweave plan")]


def _two_steps(*models: nn.Module) -> None:
    x = torch.randn(2, 8)
    for _ in range(2):  # the second step logs the summary
        for model in models:
            model(x)


def test_two_models_in_one_process_are_told_apart_by_class(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="autoweave"):
        _two_steps(Policy(["0", "1"]), Reference(["0", "1"]))
    (text,) = _summaries(caplog)
    assert "  Policy.layers.0-1, Reference.layers.0-1 (4 × Linear): " in text, text


def test_two_models_of_one_class_are_told_apart_by_an_index(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="autoweave"):
        _two_steps(Policy(["0"]), Policy(["0"]))
    (text,) = _summaries(caplog)
    assert "  Policy#0.layers.0, Policy#1.layers.0 (2 × Linear): " in text, text


def test_one_model_is_named_as_before(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="autoweave"):
        _two_steps(Policy(["0", "1"]))
    (text,) = _summaries(caplog)
    assert "  layers.0-1 (2 × Linear):" in text and "Policy" not in text, text


def test_each_rank_says_which_modules_its_summary_covers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipeline stage on rank 0 of 2: the first two layers of the model (torchtitan keeps the names).
    monkeypatch.setattr(summary, "world_size", lambda: 2, raising=False)
    with caplog.at_level(logging.INFO, logger="autoweave"):
        _two_steps(Layers(["0", "1"]))
    (text,) = _summaries(caplog)
    assert (
        text.splitlines()[0] == "autoweave plan: 2 compiled modules, 0 woven; rank 0 of 2 covers layers.0-1"
    )


def test_a_re_plan_after_the_summary_is_one_line_saying_what_changed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Three blocks planned with pieces, summarised; then measured and planned again with hoist.
    blocks = [cw.checkpoint_wrapper(Block(), context_fn=_selective) for _ in range(3)]
    dispatchers = [SimpleNamespace(target=b, _applied=None) for b in blocks]
    model = nn.ModuleDict({"layers": nn.ModuleList(blocks)})

    def record(strategy: str) -> None:
        for dispatcher in dispatchers:
            plan = planner.plan(dispatcher.target, mode="always", strategy=strategy)
            _call_as(model, dispatcher, plan)

    with caplog.at_level(logging.INFO, logger="autoweave"):
        record("pieces")
        summary.flush()
        record("hoist")
        summary.flush()
        record("hoist")  # planned again, the same plan: nothing to say
        summary.flush()
    first, second = _summaries(caplog)
    assert first.splitlines()[0] == "autoweave plan: 3 compiled modules, 3 woven"
    assert second.startswith("autoweave plan: layers.0-2 (3 × Block): re-planned: pieces -> hoist: ")
    assert len(second.splitlines()) == 1, second


def _call_as(model: nn.Module, dispatcher: SimpleNamespace, plan: planner.Plan) -> None:
    # The summary names a target by the modules whose forwards are calling it: be one.
    self = model  # noqa: F841 - read from this frame by sense.names.locate (a plan recorded from here)
    summary.record_plan(dispatcher, plan)


def _selective():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)


# -- what ran, not only what was planned ----------------------------------------------------


def _eager_body(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + layer.out(layer.experts(layer.norm(x)))


class DisabledBodyLayer(nn.Module):
    """A checkpointed layer whose whole body runs in a ``torch.compiler.disable``d helper.

    Nothing in its module tree says so: it is planned as any layer holding a nested unit,
    and dynamo, breaking at the helper's call, hands its region no graph.
    """

    def __init__(self) -> None:
        super().__init__()
        from tests import break_models as bm
        from tests.models import make_break

        self.norm = nn.LayerNorm(bm.DIM)
        self.experts = make_break(bm.SimpleExperts(bm.DIM))
        self.out = nn.Linear(bm.DIM, bm.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.compiler.disable(_eager_body)(self, x)


def test_a_region_that_compiled_no_graph_is_not_said_to_be_compiled(caplog: pytest.LogCaptureFixture) -> None:
    # The plan says the layers' inner forward is "compiled, split at boundaries"; it ran eager.
    from autoweave.sense import counting
    from tests import break_models as bm

    torch.manual_seed(0)
    layers = [cw.checkpoint_wrapper(DisabledBodyLayer()) for _ in range(2)]
    model = torch.compile(bm.Stack(layers), backend="aot_eager")
    x = torch.randn(6, bm.DIM)
    with caplog.at_level(logging.INFO, logger="autoweave"):
        for _ in range(3):
            model(x).sum().backward()
    since = counting.autograd_mark()
    ran = counting.autograd_gemms(model(x), since)
    assert ran is not None and ran.eager >= 2  # each layer's own GEMM ran outside compiled graphs
    (text,) = _summaries(caplog)
    inner = [line.strip() for line in text.splitlines() if "[DisabledBodyLayer]" in line]
    assert [line.split(" [")[0] for line in inner] == ["layers.0", "layers.1"], text
    assert all("] ran eager (0 graphs); planned compiled, split at boundaries" in line for line in inner), (
        text
    )
    # The experts' region compiled its graph: its line is the plan's, as before.
    assert "layers.0.experts [SimpleExperts] boundary: a hook" in text, text
    assert "; 2 of them ran eager (0 graphs)" in text.splitlines()[1], text


def test_a_region_whose_module_has_not_run_its_plan_says_not_run_yet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrapper = cw.checkpoint_wrapper(Block())

    def fail_once(module: nn.Module, args: tuple) -> None:
        handle.remove()
        raise ValueError("the model's own error")

    handle = wrapper._checkpoint_wrapped_module.register_forward_pre_hook(fail_once)
    model = torch.compile(wrapper, backend="aot_eager")
    with pytest.raises(ValueError):
        model(torch.randn(4, 8))
    with caplog.at_level(logging.INFO, logger="autoweave"):
        summary.flush()  # what exit logs: the plan was made, its regions never ran
        model(torch.randn(4, 8)).sum().backward()
        model(torch.randn(4, 8)).sum().backward()
        summary.flush()
    first, *rest = _summaries(caplog)
    # The block's region, and the experts' unless their forward is traced with it (nested breaks).
    regions = 1 if _compat.dynamo.nested_breaks_supported() else 2
    assert first.splitlines()[1].endswith(f"; {regions} of them not run yet"), first
    names = ("[Block]", "[Experts]")[:regions]
    region_lines = [line for line in first.splitlines()[2:] if any(name in line for name in names)]
    assert region_lines and all("not run yet; planned " in line for line in region_lines), first
    assert not rest  # ran since: the same plan, nothing to say again
