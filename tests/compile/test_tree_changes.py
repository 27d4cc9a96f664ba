"""The tree-change signal (``_changes``): what moves it, and what must not.

A ``ModuleList`` slice (``for layer in self.layers[: n]``, in every transformers
decoder) builds a new container and registers modules into it at every call,
inside the traced frame when the whole model is compiled. Neither is a change to
a compiled module's tree: with autoweave on, such a model compiles the graphs
plain torch compiles, recompiles as often (never), and its forwards read no
module tree. Real changes (``parent.child = new``, ``fully_shard`` after a first
forward, see ``test_parity``) still re-plan.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.sense import counting
from tests.models import Block, RecompileLimitHits, recompiles

pytestmark = pytest.mark.usefixtures("weave_on")


class Layer(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Sliced(nn.Module):
    """A decoder the transformers way: the layers run through a slice of the ModuleList."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.n = len(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.n]:
            x = layer(x)
        return x


def _compile_and_run(on: bool, calls: int = 20) -> tuple[int, list[str], list[str]]:
    """(graphs compiled, recompiles, recompile-limit hits) over ``calls`` forwards of a sliced model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cap = counting.Capture()
    with contextlib.nullcontext() if on else autoweave.disabled():
        model = torch.compile(Sliced([Layer() for _ in range(4)]), backend=cap.backend("eager"))
    x = torch.randn(2, 8)
    with recompiles() as again, RecompileLimitHits() as hits:
        for _ in range(calls):
            model(x)
    return cap.graph_count, again, hits.messages


def test_a_compiled_model_that_slices_its_layers_compiles_as_plain_torch_does() -> None:
    plain = _compile_and_run(on=False)
    ours = _compile_and_run(on=True)
    assert plain == (1, [], [])
    assert ours == plain


def test_registering_into_a_fresh_container_while_tracing_leaves_the_signal_alone() -> None:
    model = torch.compile(Sliced([Layer() for _ in range(2)]), backend="eager")
    x = torch.randn(2, 8)
    model(x)
    before = _state.run.generation
    torch._dynamo.reset()
    model(x)  # traced again: the slice registers both layers inside dynamo's frame
    assert _state.run.generation == before


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    walks: list[nn.Module] = []
    real = dispatchers._fingerprint
    monkeypatch.setattr(dispatchers, "_fingerprint", lambda target: walks.append(target) or real(target))
    return walks


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


@pytest.mark.parametrize("layout", ["compiled-layers", "woven-model"])
def test_a_forward_that_slices_reads_no_module_tree(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # compiled-layers: an eager decoder over per-layer torch.compile (each layer a
    # dispatcher, the slice registers them at every forward, eagerly).
    # woven-model: torch.compile(decoder) over AC blocks holding a boundary; the
    # decoder's own forward runs eager around the woven blocks, slice included.
    walks = _count_walks(monkeypatch)
    torch.manual_seed(0)
    if layout == "compiled-layers":
        model = Sliced([torch.compile(Layer(), backend="aot_eager") for _ in range(4)])
    else:
        model = torch.compile(Sliced([cw.checkpoint_wrapper(Block()) for _ in range(3)]), backend="aot_eager")
    x = torch.randn(4, 8)
    for _ in range(2):
        _step(model, x)
    if layout == "woven-model":
        assert dispatchers.dispatcher_of(model).plan.woven
    warm, generation = len(walks), _state.run.generation
    assert warm >= 1
    for _ in range(10):
        _step(model, x)
    assert _state.run.generation == generation
    assert len(walks) == warm


def test_a_real_change_between_forwards_still_replans(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = _count_walks(monkeypatch)
    block = Block(moe=False)
    model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    x = torch.randn(4, 8)
    _step(model, x)
    dispatcher = dispatchers.dispatcher_of(model)
    assert not dispatcher.plan.woven
    # Built outside the tree, then registered into it: the signal moves once.
    moe = Block().ffn
    before, warm = _state.run.generation, len(walks)
    block.ffn = moe
    assert _state.run.generation > before
    _step(model, x)
    assert len(walks) == warm + 1
    assert dispatcher.plan.woven
    assert dispatcher.plan.decision("_checkpoint_wrapped_module.ffn.experts").action.value == "boundary"
    # The same child assigned again changes nothing: no signal, no walk.
    before, warm = _state.run.generation, len(walks)
    block.ffn = moe
    _step(model, x)
    assert (_state.run.generation, len(walks)) == (before, warm)
    # Registered deeper, into a child the last walk read: seen too.
    moe.extra = nn.Identity()
    assert _state.run.generation > before
    _step(model, x)
    assert len(walks) == warm + 1


class HooksInForward(nn.Module):
    """Registers a hook in its first forward, as transformers' output capturing does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.hooked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            self.lin.register_forward_hook(lambda module, args, out: None).remove()
            self.hooked = True
        return torch.relu(self.lin(x)) + 1


def test_a_hook_registered_while_compiling_converts_the_frames_plain_torch_does() -> None:
    # Dynamo breaks inside torch's register_forward_hook and runs it eager; the frames of
    # autoweave's hook watch that it then calls are not converted, nor traced.
    def frames(on: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        with contextlib.nullcontext() if on else autoweave.disabled():
            model = torch.compile(HooksInForward(), backend="eager")
        for _ in range(2):
            model(torch.randn(2, 8))
        return counters["frames"]["total"]

    assert frames(on=True) == frames(on=False)
