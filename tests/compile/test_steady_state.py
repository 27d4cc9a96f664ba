"""After warm-up autoweave traces nothing plain torch does not (issue 41, item 4).

transformers 5.0-5.22 checkpoint a layer around ``nn.Module.__call__``
(``GradientCheckpointingLayer``), so under a whole-model compile the layer's checkpoint is
traced with its nested unit's hooks inside, and dynamo names the break at the line of the
decorator that wraps the model's forward. The woven plan compiles around every break it can
locate, yet that checkpoint still falls back; autoweave took the same fallback for a new break
at every call, planned the same regions again and dropped dynamo's cache for the model's code:
dynamo converted frames at every step forever (3 per step here; 5 on transformers' Qwen3-MoE),
where plain torch converts none after its first step.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import autoweave
from benchmarks.measure import forward_gemms_outside_graphs
from tests.break_models import SimpleExperts, fsdp_like

DIM = 8
pytestmark = pytest.mark.usefixtures("weave_on")


class CheckpointingLayer(nn.Module):
    """transformers <= 5.22's ``GradientCheckpointingLayer``: the checkpoint is around ``__call__``."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return checkpoint(functools.partial(super().__call__, **kwargs), *args, use_reentrant=False)
        return super().__call__(*args, **kwargs)


class Layer(CheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = fsdp_like(SimpleExperts(DIM))  # the experts' own unit: a graph break
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.experts(self.norm(x)))


def model_inputs(func):
    """A decorator that passes the call on, as transformers' ``check_model_inputs`` does."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        kwargs.pop("output_attentions", None)
        return func(self, *args, **kwargs)

    return wrapper


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    @model_inputs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(x))


def frames_and_losses(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[list[int], list[float]]:
    """Per step: the frames dynamo converted, and the loss."""
    frames, losses = [], []
    for _ in range(steps):
        before = counters["frames"]["total"]
        loss = model(x).square().mean()
        loss.backward()
        frames.append(counters["frames"]["total"] - before)
        losses.append(loss.item())
    return frames, losses


def _run(base: nn.Module, x: torch.Tensor, plain: bool) -> tuple[list[int], list[float]]:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    with autoweave.disabled() if plain else contextlib.nullcontext():
        compiled = torch.compile(model, backend="aot_eager")
    return frames_and_losses(compiled, x, steps=6)


def test_a_fallback_the_plan_cannot_remove_is_learned_once() -> None:
    torch.manual_seed(0)
    base = CausalLM()
    for layer in base.model.layers:
        layer.gradient_checkpointing = True
    x = torch.randn(4, DIM)
    plain_frames, plain_losses = _run(base, x, plain=True)
    woven_frames, woven_losses = _run(base, x, plain=False)
    assert woven_losses == pytest.approx(plain_losses, rel=1e-6)
    # Warm-up: the first call, and the call that applies what it learned.
    assert woven_frames[2:] == [0] * 4, woven_frames
    assert plain_frames[1:] == [0] * 5, plain_frames


# A warm-up is not a storm (CI on 3cc1360: accelerate 1.15's layer unit inside its checkpoint
# wrapper, transformers' Qwen3-MoE, whose DynamicCache slot, empty in each layer's forward, is
# filled in its recompute). Here each layer notes its index in a list made per forward (state
# the recompute cannot be presented as its forward saw it, unlike a slot: ``guarded_state``):
# each forward is guarded on the list's length, a new one per layer, and each recompute, finding
# it longer, makes an entry of its own, once. Counted per region and a recompute apart from its
# forward, three warm-up entries in a row looked like a storm and the layers ran eager from then
# on. The watchdog counts per block, a forward and its recompute as one call.
class NotingLayer(nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.layer_idx = idx
        self.inp = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, seen: list[int]) -> torch.Tensor:
        seen.append(self.layer_idx)
        return x + self.out(torch.relu(self.inp(x)))


class NotingModel(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(checkpoint_wrapper(NotingLayer(i)) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen: list[int] = []
        for layer in self.layers:
            x = layer(x, seen)
        return x


@pytest.fixture
def fake_mesh():
    """Two fake ranks: FSDP2's hooks and units as they are, no numerics (structure only)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_warm_up_entries_of_a_forward_and_its_recompute_are_not_a_storm(fake_mesh, capsys) -> None:
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = NotingModel(3), torch.randn(4, DIM)
    for layer in model.layers:  # accelerate 1.15's regional compile, then the layer's own unit
        layer.compile(backend="aot_eager")
        fully_shard(layer._checkpoint_wrapped_module, mesh=fake_mesh)
    fully_shard(model, mesh=fake_mesh)
    frames, _ = frames_and_losses(model, x, steps=4)
    assert "[steady-state]" not in capsys.readouterr().err
    assert frames[2:] == [0, 0], frames
    assert forward_gemms_outside_graphs(model, x) == 0  # every layer still runs its graphs
