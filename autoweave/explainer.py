"""``autoweave explain``: the plan for a model, before any GPU is asked for.

The model is built on the meta device, a sharding recipe is simulated (AC per
block, FSDP units marked with ``autoweave.boundary``) or a user function applies
one, and each block is planned as ``torch.compile(block)`` would plan it at its
first forward. Nothing is compiled and no process group is created.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoweave import boundaries, plan_log, planner

SIMULATED = "FSDP unit (fully_shard, simulated)"


def load_object(spec: str) -> Any:
    """``MODULE:NAME`` -> the object. MODULE is an importable name or a ``.py`` path.

    NAME may be an attribute path (``pkg.mod:Outer.build``) or an expression
    evaluated in the module's namespace (``train_moe.py:Transformer(ModelArgs())``).
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise ValueError(f"expected MODULE:NAME, got {spec!r}")
    module = _load_module(module_part)
    if any(c in name for c in "()[] "):
        return eval(name, vars(module))  # noqa: S307 - the user's own expression, like python -c
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _load_module(name: str) -> Any:
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such file: {name}")
        module_name = os.path.splitext(os.path.basename(path))[0]
        existing = sys.modules.get(module_name)
        if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == path:
            return existing
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {name}")
        module = importlib.util.module_from_spec(spec)
        # Registered before running it: dataclasses and pickling look it up by name.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        return module
    return importlib.import_module(name)


def build(factory: Callable[[], nn.Module]) -> nn.Module:
    """Call ``factory`` with the meta device as default: no memory is allocated."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the factory returned {type(model).__name__}, not an nn.Module")
    return model


def blocks_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The first ModuleDict / ModuleList in the model: the repeated blocks."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)) and len(module):
            return name, module
    raise ValueError(
        f"{type(model).__name__} has no nn.ModuleDict / nn.ModuleList of blocks; "
        "pass recipe= to say which modules are compiled"
    )


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    save = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def simulate(
    model: nn.Module, *, ac: str = "full", shard: Sequence[str] = ("experts",)
) -> list[tuple[str, nn.Module]]:
    """The default recipe: FSDP units marked inside each block, then AC around each block.

    Returns ``(qualified name, compile target)`` for every block.
    """
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    if ac not in ("full", "selective", "none"):
        raise ValueError(f"ac={ac!r} not understood (accepted: full, selective, none)")
    prefix, container = blocks_of(model)
    names = set(shard)
    kwargs: dict[str, Any] = {}
    if ac == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    out = []
    for key, block in list(container.named_children()):
        for name, sub in block.named_modules():
            if name and name.rsplit(".", 1)[-1] in names:
                boundaries.boundary(sub, SIMULATED)
        target = block if ac == "none" else cw.checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
        if target is not block:
            container[int(key) if isinstance(container, nn.ModuleList) else key] = target
        out.append((f"{prefix}.{key}" if prefix else key, target))
    return out


def explain(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    *,
    ac: str = "full",
    shard: Sequence[str] = ("experts",),
    recipe: Callable[[nn.Module], Any] | None = None,
    mode: str = "auto",
    strategy: str = "auto",
    fullgraph: bool = False,
) -> str:
    """The plan ``torch.compile`` of each block would get, as the plan log prints it.

    ``model_or_factory``: a model (ideally on the meta device) or a zero-argument
    factory, called under ``torch.device("meta")``. ``recipe(model)`` applies your
    own AC / FSDP marking and may return the compile targets as ``(name, module)``
    pairs (default: the blocks of the first ModuleDict/ModuleList); without a
    recipe, every block is wrapped in ``ac`` AC and every submodule named in
    ``shard`` is treated as an FSDP unit.
    """
    model = model_or_factory if isinstance(model_or_factory, nn.Module) else build(model_or_factory)
    if recipe is not None:
        returned = recipe(model)
        if isinstance(returned, nn.Module):
            model = returned
        targets = list(returned) if isinstance(returned, (list, tuple)) else None
        if targets is None:
            prefix, container = blocks_of(model)
            targets = [(f"{prefix}.{k}" if prefix else k, m) for k, m in container.named_children()]
        how = f"recipe {getattr(recipe, '__qualname__', recipe)}"
    else:
        targets = simulate(model, ac=ac, shard=shard)
        how = f"{ac} AC per block, FSDP units (simulated): {', '.join(shard) or 'none'}"
    entries = []
    for name, target in targets:
        plan = planner.plan(target, mode=mode, strategy=strategy, fullgraph=fullgraph)
        entries.append(plan_log.Entry(name=name, type_name=plan_log.inner_type(target), plan=plan))
    head = f"autoweave explain: {type(model).__name__} on meta; {how}; torch.compile(block) per block"
    return head + "\n" + plan_log.format_summary(entries)
