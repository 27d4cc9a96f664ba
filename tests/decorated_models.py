"""Modules whose forward is torch 2.15's decorated checkpoint, importable without autoweave.

A process that loads a pickled model must import its classes: these import torch only,
so a test can load them where ``autoweave`` cannot be imported.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DIM = 16


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(DIM, DIM)

    # A boundary under the checkpoint, as an FSDP unit's hooks are (and picklable, unlike a hook).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.experts = Experts()
        self.out = nn.Linear(DIM, DIM)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(x))
        return h + self.out(self.experts(h))


try:
    _decorator = checkpoint(use_reentrant=False)
except TypeError:  # torch before 2.15: checkpoint takes the function first
    _decorator = None

if _decorator is not None:

    class DecoratedBlock(Block):
        forward = _decorator(Block.body)
