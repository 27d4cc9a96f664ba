"""Small models drawn from a grammar of what users write, for the differential fuzzer (issue 31).

A ``Case`` is plain data, drawn from a seed: the blocks (a per-layer value and
where it lives, a graph break and where it sits, AC, a decorator on
``forward``), how they are compiled, and a schedule of steps (lengths, eval
steps, hooks added and removed, resets, stances). ``build`` turns a case into a
model; the same case and seed build the same parameters every time, so plain
torch and autoweave train equal models.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import random

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tests.models import make_break

DIM = 8

VALUE_TYPES = ("none", "float", "int", "bool", "str", "enum", "tensor")
VALUE_PLACES = ("public", "private", "argument")
BREAKS = ("fsdp-unit", "disabled-call", "item", "print")
BREAK_AT = ("first", "middle", "last")
ACS = ("none", "full", "selective-matmuls", "selective-nothing", "checkpoint-in-forward")
FORMS = ("torch.compile(block)", "block.compile()", "torch.compile(model)", "model.compile()")
STRATEGIES = ("auto", "hoist", "pieces")
DECORATORS = ("none", "pass-through", "computing")
LENGTHS = ("static", "varying", "dynamic=True", "mark_dynamic")
HOOK_KINDS = ("forward", "pre", "backward")
EVENTS = ("eval-step", "reset", "force-eager", "hook-add", "hook-remove")


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    layers: int
    value_type: str
    value_place: str
    values_differ: bool
    brk: str
    break_at: str
    ac: str
    form: str
    fullgraph: bool
    strategy: str
    decorator: str
    lengths: str
    recompile_limit: int | None
    steps: int
    # (step, event, layer, on_submodule, hook kind): what happens before that step
    events: tuple[tuple[int, str, int, bool, str], ...]

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        return ", ".join(f"{k}={v}" for k, v in fields.items())


def draw(seed: int) -> Case:
    """The case for ``seed``: every choice from one ``random.Random(seed)``."""
    rng = random.Random(seed)
    steps = rng.choice((3, 4))
    events: list[tuple[int, str, int, bool, str]] = []
    layers = rng.choice((2, 3))
    for _ in range(rng.choice((0, 0, 1, 2))):
        event = rng.choice(EVENTS)
        step = rng.randrange(1, steps)
        layer = rng.randrange(layers)
        if event == "hook-add":
            kind = rng.choice(HOOK_KINDS)
            on_sub = rng.random() < 0.5
            events.append((step, event, layer, on_sub, kind))
            if rng.random() < 0.5 and step + 1 < steps:
                events.append((rng.randrange(step + 1, steps), "hook-remove", layer, on_sub, kind))
        elif event != "hook-remove":
            events.append((step, event, layer, False, ""))
    form = rng.choice(FORMS)
    return Case(
        seed=seed,
        layers=layers,
        value_type=rng.choice(VALUE_TYPES),
        value_place=rng.choice(VALUE_PLACES),
        values_differ=rng.random() < 0.6,
        brk=rng.choice(BREAKS),
        break_at=rng.choice(BREAK_AT),
        ac=rng.choice(ACS),
        form=form,
        fullgraph=rng.random() < 0.1,
        strategy=rng.choice(STRATEGIES),
        decorator=rng.choice(DECORATORS),
        lengths=rng.choice(LENGTHS),
        recompile_limit=rng.choice((None, None, None, 2)),
        steps=steps,
        events=tuple(sorted(events)),
    )


# -- values ---------------------------------------------------------------------------------


def layer_value(case: Case, index: int) -> object:
    """Layer ``index``'s value (equal on every layer unless ``values_differ``)."""
    i = index if case.values_differ else 0
    kind = case.value_type
    if kind == "float":
        return 0.5 + 0.25 * i
    if kind == "int":
        return 1 + i
    if kind == "bool":
        return i % 2 == 0
    if kind == "str":
        return ("tanh", "relu", "sigmoid")[i % 3]
    if kind == "enum":
        return (Act.TANH, Act.RELU)[i % 2]
    if kind == "tensor":
        return torch.full((DIM,), 0.5 + 0.25 * i)
    return None


def _apply_value(h: torch.Tensor, value: object) -> torch.Tensor:
    if value is None:
        return h
    if isinstance(value, torch.Tensor) or isinstance(value, float):
        return h * value
    if isinstance(value, bool):
        return h.tanh() if value else torch.sigmoid(h)
    if isinstance(value, int):
        return h + value
    if isinstance(value, Act):
        return h.tanh() if value is Act.TANH else torch.relu(h)
    if value == "tanh":
        return h.tanh()
    if value == "relu":
        return torch.relu(h)
    return torch.sigmoid(h)


# -- breaks ---------------------------------------------------------------------------------


@torch.compiler.disable
def _untraceable(h: torch.Tensor) -> torch.Tensor:
    return h * 1.0


_SINK = io.StringIO()


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


class FuzzBlock(nn.Module):
    """``q``, the break, ``experts``, ``out``; the per-layer value is read between ``q`` and the rest."""

    def __init__(self, case: Case, index: int) -> None:
        super().__init__()
        self.brk = case.brk
        self.break_at = case.break_at
        self.place = case.value_place
        self.q = nn.Linear(DIM, DIM)
        self.experts = Experts()
        self.out = nn.Linear(DIM, DIM)
        value = layer_value(case, index)
        if case.brk == "fsdp-unit":
            make_break(self.experts)
        if case.value_place == "argument" or value is None:
            return
        name = "value" if case.value_place == "public" else "_value"
        if isinstance(value, torch.Tensor):
            self.register_buffer(name, value)
        else:
            setattr(self, name, value)

    def _at(self, where: str, h: torch.Tensor) -> torch.Tensor:
        """The experts, called once, at the break's place; the break just before them."""
        if self.break_at != where:
            return h
        if self.brk == "disabled-call":
            h = _untraceable(h)
        elif self.brk == "item":
            h = h * (1.0 if h.detach().abs().sum().item() >= 0 else 2.0)
        elif self.brk == "print":
            print("fuzz", file=_SINK)
        return self.experts(h)  # "fsdp-unit": its disabled pre-hook is the break

    def forward(self, x: torch.Tensor, value: object = None) -> torch.Tensor:
        if self.place == "public":
            value = getattr(self, "value", None)
        elif self.place == "private":
            value = getattr(self, "_value", None)
        h = self._at("first", x)
        h = self._at("middle", _apply_value(self.q(h), value))
        return self._at("last", x + self.out(h))


def _decorate(forward, decorator: str):
    if decorator == "pass-through":

        @functools.wraps(forward)
        def passing(self, *args, **kwargs):
            return forward(self, *args, **kwargs)

        return passing
    if decorator == "computing":

        @functools.wraps(forward)
        def computing(self, x, *args, **kwargs):
            return forward(self, x * 0.5, *args, **kwargs) * 2.0

        return computing
    return forward


class CheckpointingBlock(nn.Module):
    """A block that calls ``torch.utils.checkpoint.checkpoint`` on its inner block in ``forward``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, value: object = None) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self.inner, x, value, use_reentrant=False)


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_nothing(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _with_ac(block: nn.Module, ac: str) -> nn.Module:
    if ac == "full":
        return cw.checkpoint_wrapper(block)
    if ac == "selective-matmuls":
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        )
    if ac == "selective-nothing":
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_nothing)
        )
    if ac == "checkpoint-in-forward":
        return CheckpointingBlock(block)
    return block


class FuzzModel(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.embed = nn.Linear(DIM, DIM)  # every block's input requires grad
        self.layers = nn.ModuleList(_with_ac(_block(case, i), case.ac) for i in range(case.layers))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if self.case.value_place == "argument":
                h = layer(h, layer_value(self.case, i))
            else:
                h = layer(h)
        return self.head(h)


# One class per decorator, as a codebase has: blocks of one case share their class.
_CLASSES = {"none": FuzzBlock} | {
    decorator: type(
        f"FuzzBlock_{decorator.replace('-', '_')}",
        (FuzzBlock,),
        {"forward": _decorate(FuzzBlock.forward, decorator)},
    )
    for decorator in DECORATORS[1:]
}


def _block(case: Case, index: int) -> nn.Module:
    return _CLASSES[case.decorator](case, index)


def build(case: Case) -> FuzzModel:
    """The model of ``case``, its parameters drawn from ``case.seed``."""
    torch.manual_seed(case.seed)
    return FuzzModel(case)


def block_of(model: FuzzModel, index: int) -> FuzzBlock:
    """The ``FuzzBlock`` of layer ``index``, under whatever AC wraps it."""
    for module in model.layers[index].modules():
        if isinstance(module, FuzzBlock):
            return module
    raise LookupError(index)


def lengths_of(case: Case) -> list[int]:
    """The sequence length of each step."""
    if case.lengths == "static":
        return [6] * case.steps
    return [(6, 9, 7, 11, 5)[i % 5] for i in range(case.steps)]
