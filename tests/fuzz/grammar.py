"""Small models drawn from a grammar of what users write, for the differential fuzzer (issue 31).

A ``Case`` is plain data, drawn from a seed: the blocks (a per-layer value and
where it lives, a graph break and where it sits, AC, a decorator on
``forward``), how they are compiled, and a schedule of steps (lengths, eval
steps, hooks added and removed, resets, stances). ``build`` turns a case into a
model; the same case and seed build the same parameters every time, so plain
torch and autoweave train equal models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import random
from collections.abc import Iterator
from typing import Any

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
# Grown from what trainers write (issue 41); drawn after the fields above, so each seed's
# earlier choices stay what they were.
HOOK_STYLES = ("disabled-count", "traced-list", "activation-stats")
CALL_PATHS = ("forward", "helper", "container")
TRAINER_EVENTS = ("freeze", "unfreeze", "fail-on-recompile")
# How the model is sharded: not at all, or as torchtitan and NeMo shard an MoE, with real FSDP2
# units and a mixed-precision policy (bf16 parameters, fp32 gradient reduction), the experts in
# a unit of their own where the break is ``fsdp-unit``. One rank (gloo, in this process): the
# hooks, casts and DTensor parameters of a real run; 2-rank numerics are the distributed tests'.
PARALLEL = ("none", "none", "none", "fsdp-mp")


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
    # How a hook counts its calls: under ``torch.compiler.disable`` (the first grammar's), or
    # traced, as users write it: appended to a list, or an activation statistic kept.
    hook_style: str = "disabled-count"
    # Where the block reaches ``out`` (a hook's target on a submodule): from ``forward``, from a
    # helper method, or inside a nested container.
    call_path: str = "forward"
    counter: bool = False  # ``self.calls += 1`` in forward
    stat_gate: bool = False  # a gate whose output only feeds ``.item()`` (its grad stays None)
    autocast: bool = False  # every forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``
    parallel: str = "none"  # ``PARALLEL``
    # transformers' ``DynamicCache`` as a training forward meets it (``use_cache`` on): made per
    # call, each layer fills its slot, guarded on the slot being empty; a recompute finds it
    # filled (CI on 3cc1360: accelerate 1.15, Qwen3-MoE).
    cache: bool = False

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
    case = Case(
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
    return _grown(case, rng)


def _grown(case: Case, rng: random.Random) -> Case:
    """What trainers write that the first grammar did not draw (issue 41), drawn after the rest."""
    events = list(case.events)
    ac = case.ac
    if ac in ("full", "checkpoint-in-forward") and rng.random() < 0.25:
        ac = "checkpoint-in-call"  # transformers <= 5.22's layers: the checkpoint around ``__call__``
    for _ in range(rng.choice((0, 0, 1))):
        event = rng.choice(TRAINER_EVENTS)
        step = rng.randrange(1, case.steps)
        layer = rng.randrange(case.layers)
        if event == "unfreeze":
            if step + 1 >= case.steps:
                continue
            events.append((step, "freeze", layer, False, ""))
            step = rng.randrange(step + 1, case.steps)
        events.append((step, event, layer, False, ""))
    return dataclasses.replace(
        case,
        ac=ac,
        events=tuple(sorted(events)),
        hook_style=rng.choice(HOOK_STYLES),
        call_path=rng.choice(CALL_PATHS),
        counter=rng.random() < 0.25,
        stat_gate=rng.random() < 0.3,
        autocast=rng.random() < 0.2,
        parallel=rng.choice(PARALLEL),
        # Drawn last: every earlier choice of a seed is unchanged. Not under selective AC: its
        # recompute meets the slot filled, runs a ``cat`` its forward did not, and plain torch
        # raises (a case that compares nothing).
        cache=rng.random() < 0.25 and not ac.startswith("selective"),
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


class _Slot:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None


class LayerCache:
    """transformers' ``DynamicCache`` in a training forward: one slot per layer, filled on its first update."""

    def __init__(self, layers: int) -> None:
        self.layers = [_Slot() for _ in range(layers)]

    def update(self, index: int, keys: torch.Tensor) -> None:
        slot = self.layers[index]
        slot.keys = keys if slot.keys is None else torch.cat([slot.keys, keys])


class FuzzBlock(nn.Module):
    """``q``, the break, ``experts``, ``out``; the per-layer value is read between ``q`` and the rest."""

    def __init__(self, case: Case, index: int) -> None:
        super().__init__()
        self.brk = case.brk
        self.break_at = case.break_at
        self.place = case.value_place
        self.call_path = case.call_path
        self.counter = case.counter
        self.calls = 0
        self.layer_idx = index
        self.q = nn.Linear(DIM, DIM)
        self.experts = Experts()
        if case.call_path == "container":
            self.post = nn.ModuleDict({"proj": nn.Sequential(nn.Linear(DIM, DIM))})
        else:
            self.out = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, 4) if case.stat_gate else None
        self.load = 0.0
        value = layer_value(case, index)
        if case.brk == "fsdp-unit" and not real_unit(case):
            make_break(self.experts)  # else a real unit (``build``)
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

    @property
    def out_module(self) -> nn.Module:
        """The module ``out`` is, wherever the block keeps it."""
        return self.post["proj"][0] if self.call_path == "container" else self.out

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        # A helper method the forward calls (``call_path="helper"``), as blocks write ``self.ffn(h)``.
        return self.out(h)

    def forward(self, x: torch.Tensor, value: object = None, cache: LayerCache | None = None) -> torch.Tensor:
        if self.counter:
            self.calls += 1
        if self.place == "public":
            value = getattr(self, "value", None)
        elif self.place == "private":
            value = getattr(self, "_value", None)
        h = self._at("first", x)
        if self.gate is not None:  # a router statistic read on the host: a break; the gate reaches only it
            self.load = self.gate(h).softmax(-1).max().item()
        h = _apply_value(self.q(h), value)
        if cache is not None:
            cache.update(self.layer_idx, h)
        h = self._at("middle", h)
        if self.call_path == "container":
            projected = self.post["proj"](h)
        elif self.call_path == "helper":
            projected = self._project(h)
        else:
            projected = self.out(h)
        return self._at("last", x + projected)


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

    def forward(self, x: torch.Tensor, value: object = None, **cache: Any) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self.inner, x, value, use_reentrant=False, **cache)


class CallCheckpointing(nn.Module):
    """transformers <= 5.22's ``GradientCheckpointingLayer``: the checkpoint around ``nn.Module.__call__``."""

    def __call__(self, *args, **kwargs):
        if self.training:
            return torch_checkpoint.checkpoint(
                functools.partial(super().__call__, **kwargs), *args, use_reentrant=False
            )
        return super().__call__(*args, **kwargs)


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
        cache = {"cache": LayerCache(len(self.layers))} if self.case.cache else {}
        for i, layer in enumerate(self.layers):
            if self.case.value_place == "argument":
                h = layer(h, layer_value(self.case, i), **cache)
            else:
                h = layer(h, **cache)
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


# The same classes, checkpointing around ``__call__`` (``ac="checkpoint-in-call"``).
_CALL_CLASSES = {
    decorator: type(f"Call{cls.__name__}", (CallCheckpointing, cls), {})
    for decorator, cls in _CLASSES.items()
}


def _block(case: Case, index: int) -> nn.Module:
    classes = _CALL_CLASSES if case.ac == "checkpoint-in-call" else _CLASSES
    return classes[case.decorator](case, index)


def build(case: Case) -> FuzzModel:
    """The model of ``case``, its parameters drawn from ``case.seed``."""
    torch.manual_seed(case.seed)
    model = FuzzModel(case)
    if case.parallel == "fsdp-mp":
        _shard(model, case)
    return model


def real_unit(case: Case) -> bool:
    """Are the experts (the ``fsdp-unit`` break) a real FSDP2 unit? Not under selective AC.

    Eager selective AC stores the ops its forward ran, the profiler's ``record_function``
    of the unit's post-forward among them, and its recompute fails to find them
    (``RuntimeError: ... encountered during backward but not found in storage``, torch
    2.13, CPU): a case plain torch raises on compares nothing. The fake unit stands in.
    """
    return case.brk == "fsdp-unit" and case.parallel == "fsdp-mp" and not case.ac.startswith("selective")


def _shard(model: FuzzModel, case: Case) -> None:
    """FSDP2 as torchtitan applies it: the experts' own unit, each (AC-wrapped) layer, the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))  # on ``one_rank``'s group
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if real_unit(case):
            fully_shard(block_of(model, i).experts, mesh=mesh, mp_policy=mp)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


@contextlib.contextmanager
def one_rank(case: Case) -> Iterator[None]:
    """A one-rank gloo process group while a ``parallel`` case runs; none is left behind.

    Torn down after: a process group left initialized would make the tests that run after
    in the same process rank-aware.
    """
    import torch.distributed as dist

    if case.parallel == "none" or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
