"""Never worse than plain torch: saving, copying, torch's own errors, and a weave that fails.

Each behaviour is checked against the same code compiled inside
``autoweave.disabled()`` (plain torch), in this process.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.sense import counting
from tests.models import Block


@pytest.fixture(autouse=True)
def weave_on():
    torch._dynamo.reset()
    assert autoweave.enable()
    yield
    autoweave.disable()
    torch._dynamo.reset()


class Experts(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w(x))


class MarkedBlock(nn.Module):
    """A block whose experts are a boundary by autoweave's mark: picklable, unlike a disabled hook."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = autoweave.boundary(Experts(dim))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.experts(self.norm(x)))


class Model(nn.Module):
    def __init__(self, how: str, n: int = 2) -> None:
        super().__init__()
        layers = []
        for _ in range(n):
            block = cw.checkpoint_wrapper(MarkedBlock())
            if how == "wrap":
                block = torch.compile(block, backend="aot_eager")
            else:
                block.compile(backend="aot_eager")
            layers.append(block)
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build(how: str, on: bool) -> Model:
    torch.manual_seed(0)
    if on:
        return Model(how)
    with autoweave.disabled():
        return Model(how)


class _Recording(pickle.Unpickler):
    """Loads a pickle and records every module its classes and functions come from."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str):
        self.modules.add(module)
        return super().find_class(module, name)


def _torch_save_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _round_trip(op: str, model: nn.Module) -> nn.Module:
    if op == "pickle":
        return pickle.loads(pickle.dumps(model))
    if op == "torch.save":
        return _torch_save_load(model)
    return copy.deepcopy(model)


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.square().mean().backward()
    return out.detach()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["wrap", "inplace"])
@pytest.mark.parametrize("called", [False, True], ids=["fresh", "after-forward"])
@pytest.mark.parametrize("op", ["pickle", "torch.save", "deepcopy"])
def test_save_and_copy_behave_as_plain_torch(how, called, op):
    x = torch.randn(4, 8)
    results = {}
    for on in (False, True):
        model = _build(how, on)
        if called:
            _step(model, x)
        duplicate = _round_trip(op, model)
        # The copy computes what the original computes.
        torch.testing.assert_close(_step(duplicate, x), model(x).detach())
        results[on] = (type(duplicate.layers[0]).__name__, sorted(duplicate.state_dict()))
        if on and called:
            assert dispatchers.dispatcher_of(model.layers[0]).plan.woven  # the original was woven
    assert results[True] == results[False]


@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_pickle_of_a_woven_model_names_no_autoweave_code(how):
    model = _build(how, True)
    _step(model, torch.randn(4, 8))
    assert dispatchers.dispatcher_of(model.layers[0]).woven
    data = pickle.dumps(model)
    loader = _Recording(data)
    loader.load()
    assert loader.modules, "the recorder saw no classes"
    assert not [m for m in loader.modules if m.split(".")[0] == "autoweave"], loader.modules
    # The user's own, never compiled module carries the weave's forwards: it pickles too.
    inner = model.layers[0]._orig_mod if how == "wrap" else model.layers[0]
    block = inner._checkpoint_wrapped_module
    assert "forward" in block.__dict__  # woven in place
    assert "forward" not in pickle.loads(pickle.dumps(block)).__dict__


def test_deepcopy_of_a_compiled_module_runs_woven():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    _step(model, x)
    assert dispatchers.dispatcher_of(model).woven
    for when in ("after", "before"):
        source = (
            model if when == "after" else torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
        )
        duplicate = copy.deepcopy(source)
        assert dispatchers.dispatcher_of(duplicate) is not dispatchers.dispatcher_of(source)
        with counting.FallbackCounter() as fallbacks:
            _step(duplicate, x)
        assert fallbacks.count == 0
        assert dispatchers.dispatcher_of(duplicate).woven
        # The copy's parameters are its own; the original's are untouched by it.
        assert all(a is not b for a, b in zip(duplicate.parameters(), source.parameters(), strict=True))
    # Plain torch's copy of the same compile falls back (the reason the copy must be woven).
    with autoweave.disabled():
        plain = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    with counting.FallbackCounter() as fallbacks:
        _step(copy.deepcopy(plain), x)
    assert fallbacks.count >= 1


@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_bad_backend_raises_at_compile_time_with_torchs_error(how):
    def compile_with(backend):
        block = cw.checkpoint_wrapper(MarkedBlock())
        if how == "wrap":
            return torch.compile(block, backend=backend)
        block.compile(backend=backend)
        return block

    with autoweave.disabled(), pytest.raises(Exception) as plain:
        compile_with("no-such-backend")
    with pytest.raises(Exception) as ours:
        compile_with("no-such-backend")
    assert type(ours.value) is type(plain.value)
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_disable_true_is_passed_through_quietly_even_in_strict_mode(how, capfd, monkeypatch):
    from autoweave import _settings

    monkeypatch.setattr(_settings, "_current", _strict_settings())
    x = torch.randn(4, 8)
    block = cw.checkpoint_wrapper(MarkedBlock())
    if how == "wrap":
        model = torch.compile(block, disable=True)
    else:
        block.compile(disable=True)
        model = block
    torch.testing.assert_close(model(x), block(x))
    assert dispatchers.dispatcher_of(model) is None
    err = capfd.readouterr().err
    assert "autoweave" not in err


def _strict_settings():
    import os

    from autoweave._settings import Settings

    return Settings.from_environ({**os.environ, "AUTOWEAVE": "1", "AUTOWEAVE_STRICT": "1"})


@pytest.mark.parametrize("called", [False, True], ids=["fresh", "after-forward"])
@pytest.mark.parametrize("make", [nn.Tanh, lambda: nn.Linear(2, 2)], ids=["tanh", "linear"])
def test_torch_jit_script_after_an_in_place_compile_scripts_as_plain_torch(make, called):
    x = torch.randn(3, 2)
    scripted = {}
    for on in (False, True):
        torch.manual_seed(0)
        module = make()
        if on:
            module.compile()
        else:
            with autoweave.disabled():
                module.compile()
        if called:
            module(x)
        scripted[on] = torch.jit.script(module)
    assert dispatchers.dispatcher_of(module) is not None  # the module scripted was autoweave's
    torch.testing.assert_close(scripted[True](x), scripted[False](x))


class Picky(MarkedBlock):
    """Raises the user's own error on a batch it rejects, woven or not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError("batch of 3 rejected")
        return super().forward(x)


def test_the_users_own_error_is_raised_as_plain_torch_raises_it_and_the_weave_stays(capfd):
    model = torch.compile(cw.checkpoint_wrapper(Picky()), backend="aot_eager")
    with pytest.raises(ValueError, match="batch of 3 rejected"):
        model(torch.randn(3, 8))
    dispatcher = dispatchers.dispatcher_of(model)
    # Still woven, its first woven call still to come: the user's error was not autoweave's failure.
    assert dispatcher.woven and dispatcher.state is dispatchers.State.TRIAL
    _step(model, torch.randn(4, 8))
    assert dispatcher.state is dispatchers.State.WOVEN
    assert "autoweave[" not in capfd.readouterr().err


def test_a_forward_does_not_walk_the_module_tree(monkeypatch):
    walks = []
    real = dispatchers._fingerprint
    monkeypatch.setattr(dispatchers, "_fingerprint", lambda target: walks.append(target) or real(target))
    model = torch.compile(cw.checkpoint_wrapper(MarkedBlock()), backend="aot_eager")
    x = torch.randn(4, 8)
    for _ in range(2):  # compiling may register modules (graph modules): a walk or two
        _step(model, x)
    warm = len(walks)
    assert 1 <= warm <= 3
    for _ in range(5):
        _step(model, x)
    assert len(walks) == warm  # steady state: no walk per call (recompute included)
    dispatcher = dispatchers.dispatcher_of(model)
    # A change to the tree is still seen: a new child, then a new boundary, re-plan.
    block = model._orig_mod._checkpoint_wrapped_module
    block.extra = nn.Identity()
    _step(model, x)
    assert len(walks) > warm
    assert dispatcher.plan.decision("_checkpoint_wrapped_module.norm") is None  # traced in the split region
    autoweave.boundary(block.norm)
    _step(model, x)
    assert dispatcher.plan.decision("_checkpoint_wrapped_module.norm").action.value == "boundary"


COMPILED_FORMS = {
    "torch.compile(AC(block))": lambda: torch.compile(
        cw.checkpoint_wrapper(Block(8, moe=False)), backend="eager"
    ),
    "AC(torch.compile(block))": lambda: cw.checkpoint_wrapper(
        torch.compile(Block(8, moe=False), backend="eager")
    ),
}


@pytest.mark.parametrize("form", COMPILED_FORMS)
def test_a_call_from_eager_code_swaps_the_eval_frame_as_often_as_plain_torch(monkeypatch, form):
    """autoweave's own frames under a compiled module's call are kept from dynamo only when a
    compile runs them: called from eager code, nothing is turned off (``torch._dynamo.disable``
    around them cost two eval-frame swaps per wrapper per call, 2% of a small layer's forward)."""
    import torch._dynamo.eval_frame as eval_frame

    swaps = []
    real = eval_frame.set_eval_frame
    monkeypatch.setattr(eval_frame, "set_eval_frame", lambda callback: swaps.append(1) or real(callback))
    x = torch.randn(4, 8)

    def per_call(model: nn.Module) -> int:
        with torch.no_grad():
            for _ in range(2):  # compile, then settle
                model(x)
            before = len(swaps)
            model(x)
        return len(swaps) - before

    with autoweave.disabled():
        plain = per_call(COMPILED_FORMS[form]())
    woven = COMPILED_FORMS[form]()
    assert per_call(woven) == plain, "eval-frame swaps per call, autoweave against plain torch"
    compiled = (
        woven
        if isinstance(woven, torch._dynamo.eval_frame.OptimizedModule)
        else woven._checkpoint_wrapped_module
    )
    assert dispatchers.dispatcher_of(compiled) is not None  # it went through autoweave's dispatcher


def test_fully_shard_after_the_first_forward_replans(monkeypatch):
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        block = Block(moe=True)
        block.ffn.experts._forward_pre_hooks.clear()  # no stand-in break: FSDP will be the boundary
        model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
        x = torch.randn(4, 8)
        model(x)
        assert not dispatchers.dispatcher_of(model).plan.boundaries
        before = _state.run.generation
        fully_shard(block.ffn.experts, mesh=init_device_mesh("cpu", (2,)))
        assert _state.run.generation > before
        model(x)
        plan = dispatchers.dispatcher_of(model).plan
        assert plan.woven
        assert plan.decision("_checkpoint_wrapped_module.ffn.experts").reason.startswith("FSDP unit")
    finally:
        dist.destroy_process_group()
