"""A woven module's first call runs its forward once, whatever fails (issue 19).

The woven regions compile at the first call. Whatever fails there, the forward
is never run a second time on another path: its side effects (a counter, a
buffer update), its RNG draws and, under FSDP, its collectives would happen
twice. A failure of autoweave's own degrades where it happened, in that call
(a graph the backend fails on, a frame dynamo cannot convert, runs eager); the
model's own error is raised once, as plain torch raises it. Each behaviour is
checked against eager or against the same code compiled inside
``autoweave.disabled()``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat
from autoweave._failopen import AutoweaveError
from autoweave.dispatch import dispatchers
from tests.models import MoE

# Every entry into Counted.forward (dynamo replays the append once per compiled call).
ENTRIES: list[int] = []


class Counted(nn.Module):
    """A block with side effects in its forward; its experts are a boundary (a graph break)."""

    def __init__(self, dim: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(p)
        self.ffn = MoE(dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("steps", torch.zeros(()))

    def forward(
        self, x: torch.Tensor, reject: bool = False, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        ENTRIES.append(1)
        self.steps.add_(1)
        if reject:
            raise ValueError("batch rejected by the model")
        h = self.ffn(self.drop(self.norm(x)))  # the experts' hook breaks the graph here
        out = x + self.out(torch.cos(h))  # cos: the marker `picky` rejects, after the break
        if bias is not None:
            out = out + bias  # a wrong-shaped bias: the model's own shape error, after the break
        return out


def _has_cos(gm: torch.fx.GraphModule) -> bool:
    return any(node.target in (torch.cos, torch.ops.aten.cos.default) for node in gm.graph.nodes)


def picky(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """aot_eager, except that it fails on every graph holding a cosine."""
    if _has_cos(gm):
        raise RuntimeError("picky backend rejects cos")
    return lookup_backend("aot_eager")(gm, example_inputs)


COMPILED_COS: list[int] = []


def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """aot_eager, noting each compiled graph that holds the cosine."""
    if _has_cos(gm):
        COMPILED_COS.append(1)
    return lookup_backend("aot_eager")(gm, example_inputs)


pytestmark = pytest.mark.usefixtures("weave_on")


@pytest.fixture(autouse=True)
def counters():
    ENTRIES.clear()
    COMPILED_COS.clear()


def _compiled(block: nn.Module, backend: object, *, on: bool = True, how: str = "wrap") -> nn.Module:
    model = cw.checkpoint_wrapper(block)
    with contextlib.nullcontext() if on else autoweave.disabled():
        if how == "wrap":
            return torch.compile(model, backend=backend)
        model.compile(backend=backend)
        return model


def _forward(model: nn.Module, x: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, int]:
    """The output and how many times the block's forward ran for it (its recompute not counted)."""
    ENTRIES.clear()
    out = model(x, **kwargs)
    return out, len(ENTRIES)


def _no_autoweave_warning(err: str) -> None:
    for slug in ("[internal-error]", "[weave-failed]", "[piece-eager]", "[graph-eager]", "[region-eager]"):
        assert slug not in err, err


@pytest.mark.fail_open
@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_a_backend_failure_at_the_first_call_runs_that_graph_eager_and_the_forward_once(how, capfd):
    torch.manual_seed(0)
    block, x = Counted(), torch.randn(4, 8)
    reference = cw.checkpoint_wrapper(copy.deepcopy(block))  # eager AC
    model = _compiled(block, picky, how=how)
    for _ in range(2):
        out, entries = _forward(model, x)
        assert entries == 1  # never run again on another path
        expected = reference(x)
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
    assert block.steps.item() == reference._checkpoint_wrapped_module.steps.item()
    for ours, theirs in zip(block.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    err = capfd.readouterr().err
    assert err.count("[graph-eager]") == 1 and "picky backend rejects cos" in err, err
    assert "[internal-error]" not in err and "[weave-failed]" not in err
    assert dispatchers.dispatcher_of(model).woven  # the rest of the weave stays compiled


@pytest.mark.parametrize("error", ["raise", "shape"])
def test_the_models_own_error_at_the_first_call_is_raised_once_as_plain_torch_raises_it(error, capfd):
    x = torch.randn(4, 8)
    # A ValueError raised by the forward before the break; a broadcast error after it.
    bad = {"reject": True} if error == "raise" else {"bias": torch.randn(5)}

    def first_call(on: bool) -> tuple[BaseException, int, nn.Module, nn.Module]:
        torch.manual_seed(0)
        block = Counted()
        model = _compiled(block, recording if on else "aot_eager", on=on)
        ENTRIES.clear()
        with pytest.raises(Exception) as info:
            model(x, **bad)
        return info.value, len(ENTRIES), block, model

    plain_error, plain_entries, _, _ = first_call(on=False)
    our_error, our_entries, block, model = first_call(on=True)
    assert our_entries == plain_entries == 1
    assert type(our_error) is type(plain_error)
    assert str(our_error) == str(plain_error)
    _no_autoweave_warning(capfd.readouterr().err)
    # The weave stays, and the next call runs as it should.
    assert dispatchers.dispatcher_of(model).woven
    reference = cw.checkpoint_wrapper(copy.deepcopy(block))
    out, entries = _forward(model, x)
    assert entries == 1
    torch.testing.assert_close(out, reference(x))
    if error == "shape":
        # The frame dynamo failed on ran eager to raise the error; it is compiled now, not left
        # eager. (A frame that raises while dynamo traces it is skipped by dynamo from then on,
        # with or without autoweave.)
        assert COMPILED_COS, "the graph after the break was left eager"
    _no_autoweave_warning(capfd.readouterr().err)


@pytest.mark.fail_open
def test_a_failure_at_the_first_call_draws_no_extra_random_numbers(capfd):
    x = torch.randn(4, 8)

    def first_call(on: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        torch.manual_seed(0)
        model = _compiled(Counted(p=0.5), picky, on=on)
        torch.manual_seed(1)
        out, entries = _forward(model, x)
        return out, torch.rand(4), entries  # what the generator gives next: its state after the call

    plain_out, plain_next, _ = first_call(on=False)
    out, after, entries = first_call(on=True)
    torch.testing.assert_close(out, plain_out)  # the same dropout mask
    torch.testing.assert_close(after, plain_next)  # and no draw more
    assert entries == 1
    assert capfd.readouterr().err.count("[graph-eager]") == 1


def _resume_of_a_region() -> bool:
    code = _compat.dynamo.code_being_compiled()
    return code is not None and "resume_in_autoweave_" in code.co_name


@pytest.fixture
def failing_conversion():
    """dynamo fails to convert every frame after a break in a woven region, as an internal error would."""
    callbacks = _compat.dynamo.compile_callbacks()

    def fail(*_: object) -> None:
        if _resume_of_a_region():
            raise RuntimeError("injected conversion failure")

    callbacks.register_start_callback(fail)
    yield
    if fail in callbacks.start_callbacks:  # torch._dynamo.reset() clears them
        callbacks.remove_start_callback(fail)


@pytest.mark.fail_open
def test_a_frame_dynamo_cannot_convert_at_the_first_call_runs_eager_and_the_forward_once(
    failing_conversion, capfd
):
    torch.manual_seed(0)
    block, x = Counted(), torch.randn(4, 8)
    reference = cw.checkpoint_wrapper(copy.deepcopy(block))
    model = _compiled(block, "aot_eager")
    for _ in range(2):
        out, entries = _forward(model, x)
        assert entries == 1
        expected = reference(x)
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()  # the recompute runs that frame eager too
        expected.square().mean().backward()
    for ours, theirs in zip(block.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    err = capfd.readouterr().err
    assert err.count("[region-eager]") == 1 and "injected conversion failure" in err, err
    assert "Counted" in err and "WON'T CONVERT" not in err  # autoweave's one warning, not dynamo's
    assert dispatchers.dispatcher_of(model).woven


def test_a_failure_at_the_first_call_raises_in_strict_mode(failing_conversion, monkeypatch):
    import os

    from autoweave import _settings
    from autoweave._settings import Settings

    strict = Settings.from_environ({**os.environ, "AUTOWEAVE": "1", "AUTOWEAVE_STRICT": "1"})
    monkeypatch.setattr(_settings, "_current", strict)
    model = _compiled(Counted(), "aot_eager")
    ENTRIES.clear()
    with pytest.raises(AutoweaveError, match="injected conversion failure") as info:
        model(torch.randn(4, 8))
    assert len(ENTRIES) == 1
    assert info.value.__cause__ is not None
    # A backend failure too: the graph is not left eager silently.
    torch._dynamo.reset()
    model = _compiled(Counted(), picky)
    with pytest.raises(AutoweaveError, match="picky backend rejects cos"):
        model(torch.randn(4, 8))
