"""Small module trees for in-process tests; a dynamo-disabled pre-hook stands in for FSDP's."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import torch
import torch.nn as nn

from autoweave import _compat
from tests.break_models import fsdp_like

# A torch.compiler.disable'd pre-hook, as fully_shard gives a unit: a real graph break.
make_break = fsdp_like


class Experts(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


class MoE(nn.Module):
    def __init__(self, dim: int, boundary: bool = True) -> None:
        super().__init__()
        self.router = nn.Linear(dim, dim)
        self.experts = Experts(dim)
        self.shared = nn.Linear(dim, dim)
        if boundary:
            make_break(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.sigmoid(self.router(x))) * 0.5 + self.shared(x)


class Block(nn.Module):
    def __init__(self, dim: int = 8, moe: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ffn = MoE(dim) if moe else nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.ffn(self.norm(x)))


class RecompileLimitHits(logging.Handler):
    """Dynamo's recompile-limit warnings, heard on dynamo's own logger while installed.

    torch's loggers do not propagate to the root logger (``torch`` has ``propagate=False``),
    so pytest's ``caplog`` never sees dynamo's warning: listen where dynamo logs it.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._logger = logging.getLogger(_compat.log_strings.RECOMPILE_LIMIT_LOGGER)

    def emit(self, record: logging.LogRecord) -> None:
        if _compat.log_strings.RECOMPILE_LIMIT_NEEDLE in record.getMessage():
            self.messages.append(record.getMessage())

    def __enter__(self) -> RecompileLimitHits:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


@contextlib.contextmanager
def recompiles() -> Iterator[list[str]]:
    """The compile ids of dynamo's recompiles (a frame compiled once more) made while inside.

    Heard through dynamo's compile-start callbacks, as the report hears them,
    but on a list of the test's own.
    """
    seen: list[str] = []
    callbacks = _compat.dynamo.compile_callbacks()

    def on_start(args: object = None, *_: object) -> None:
        if getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO") != "DYNAMO":
            return  # a lazy backward compile of a graph already counted
        compile_id = str(getattr(args, "compile_id", ""))  # "frame/attempt", e.g. "0/1"
        match = re.search(r"(\d+)/(\d+)", compile_id)
        if match and int(match.group(2)) > 0:
            seen.append(compile_id)

    callbacks.register_start_callback(on_start)
    try:
        yield seen
    finally:
        callbacks.remove_start_callback(on_start)


def saved_bytes(model: nn.Module, *args: torch.Tensor) -> int:
    """Bytes autograd keeps for backward of one step of ``model`` (then runs that backward).

    Counted by saved-tensor hooks around the forward: a checkpoint's own hooks win
    inside it, so what an eager checkpoint recomputes is not counted, and a compiled
    graph's saved activations are.
    """
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args)
    out.sum().backward()
    return saved[0]


def train_steps(model: nn.Module, x: torch.Tensor, steps: int) -> list[float]:
    """Train ``model`` on ``x`` for ``steps`` steps (mean square loss); the losses."""
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def train_chain(layers: nn.Module, dim: int, steps: int) -> list[float]:
    """Train ``layers`` called one after the other (no parent module), seeded input; the losses."""
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        y = x
        for layer in layers:
            y = layer(y)
        loss = y.square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses
