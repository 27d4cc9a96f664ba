"""``autoweave.explain(model)`` plans a copy: the user's model is exactly as it was afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import autoweave
from autoweave.planning import boundaries
from tests.models import Block


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([Block(moe=False)] + [Block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What explain must not change: the tree, the state_dict, every module's attributes and marks."""
    return {
        "tree": [(name, type(m)) for name, m in model.named_modules()],
        "state_dict": list(model.state_dict()),
        "tensors": [(name, id(t)) for name, t in [*model.named_parameters(), *model.named_buffers()]],
        "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "children": {name: dict(m._modules) for name, m in model.named_modules()},
        "marks": {name: getattr(m, boundaries.MARK, None) for name, m in model.named_modules()},
    }


def _recipe(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    for i, block in enumerate(model.layers):
        model.layers[i] = cw.checkpoint_wrapper(block)
        if hasattr(block.ffn, "experts"):
            autoweave.boundary(block.ffn.experts, "my FSDP unit")


@pytest.mark.parametrize(
    "options",
    [{}, {"ac": "selective"}, {"ac": "none", "shard": ["experts"]}, {"recipe": _recipe}],
    ids=["full", "selective", "none", "recipe"],
)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_explain_leaves_the_users_model_unchanged(options: dict[str, Any], device: str) -> None:
    with torch.device(device):
        model = Stack()
    before = fingerprint(model)
    text = autoweave.explain(model, **options)
    assert "layers.1" in text and "boundary" in text  # it did plan the blocks
    assert fingerprint(model) == before
    assert text == autoweave.explain(Stack, **options)  # the plan of the copy is the model's plan


def test_explain_of_a_model_it_cannot_copy_says_to_pass_a_factory() -> None:
    class Uncopyable(Stack):
        def __deepcopy__(self, memo: dict) -> Any:
            raise RuntimeError("no copies of me")

    model = Uncopyable()
    before = fingerprint(model)
    with pytest.raises(ValueError, match="factory"):
        autoweave.explain(model)
    assert fingerprint(model) == before
