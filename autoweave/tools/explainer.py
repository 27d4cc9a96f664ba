"""``autoweave explain``: the plan for a model, before any GPU is asked for.

The model is built on the meta device, a sharding recipe is simulated (AC per
block, FSDP units marked with ``autoweave.boundary``) or a user function applies
one, and each block is planned as ``torch.compile(block)`` would plan it at its
first forward. Nothing is compiled and no process group is created.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autoweave import _compat
from autoweave.dispatch import plan_inputs
from autoweave.observe import summary
from autoweave.planning import boundaries
from autoweave.sense import names as sense_names

SIMULATED = "FSDP unit (fully_shard, simulated)"
DEFAULT_SHARD = ("experts",)


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
    return functools.reduce(getattr, name.split("."), module)


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


class BadInput(ValueError):
    """The command line names something the model does not have (exit status 2)."""


def private_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to plan on: the same modules, hooks and marks, its tensors on meta.

    ``copy.deepcopy`` with every parameter and buffer given beforehand as an
    empty meta tensor of its shape: the module tree is copied, no data is (a
    model on a GPU costs no memory to explain). A model that cannot be copied
    (FSDP1's wrappers refuse ``deepcopy``) raises ``BadInput`` naming the fix.
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = empty
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise BadInput(
            f"explain plans a copy of the model, and {type(model).__name__} cannot be copied "
            f"({type(exc).__name__}: {exc}); pass a factory instead (explain(lambda: {type(model).__name__}(...)), "
            "built on the meta device), which leaves nothing of yours to copy"
        ) from exc


def _describe(name: str, container: nn.Module) -> str:
    kinds = sorted({type(child).__name__ for child in container.children()})
    count = len(_compat.modules.children_of(container))
    what = f"{count} × {kinds[0]}" if len(kinds) == 1 else f"{count} blocks: {', '.join(kinds[:3])}"
    return f"{name or '<root>'} ({type(container).__name__}, {what})"


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)) and len(module)
    ]


def blocks_of(model: nn.Module, path: str | None = None) -> tuple[str, nn.Module]:
    """The container of the repeated blocks: ``path`` if given, else the likeliest one.

    Not simply the first ModuleList/ModuleDict: models often hold embeddings or
    heads in one before the layers. The blocks are where the parameters are;
    among equals, a container of one repeated class, then the outermost, wins.
    """
    if path is not None:
        try:
            container = model.get_submodule(path) if path else model
        except AttributeError:
            found = ", ".join(name for name, _ in _candidates(model)[:6]) or "none"
            raise BadInput(
                f"--blocks {path!r}: {type(model).__name__} has no submodule by that name "
                f"(ModuleList/ModuleDict found: {found})"
            ) from None
        if not _compat.modules.children_of(container):
            raise BadInput(f"--blocks {path!r}: {type(container).__name__} has no child modules to plan")
        return path, container
    candidates = _candidates(model)
    if not candidates:
        raise BadInput(
            f"{type(model).__name__} has no nn.ModuleDict / nn.ModuleList of blocks; "
            "name the container with --blocks PATH (blocks=...), or pass a recipe that returns the targets"
        )

    def score(item: tuple[str, nn.Module]) -> tuple[int, bool, int]:
        name, container = item
        repeated = len(container) > 1 and len({type(c) for c in container.children()}) == 1
        # numel() works on the meta device: nothing is allocated.
        return (sum(p.numel() for p in container.parameters()), repeated, -name.count(".") - bool(name))

    return max(candidates, key=score)  # max keeps the first of equals: model order


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    save = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def simulate(
    model: nn.Module,
    *,
    ac: str = "full",
    shard: Sequence[str] | None = None,
    blocks: str | None = None,
) -> list[tuple[str, nn.Module]]:
    """The default recipe: FSDP units marked inside each block, then AC around each block.

    ``shard``: names of the submodules treated as FSDP units. When given, every
    name must match a submodule (a typo raises ``BadInput``); by default
    ``experts`` is tried, and a model without experts simply has no units.
    Returns ``(qualified name, compile target)`` for every block.
    """
    cw = _compat.modules.checkpoint_wrapper_module()

    if ac not in ("full", "selective", "none"):
        raise ValueError(f"ac={ac!r} not understood (accepted: full, selective, none)")
    prefix, container = blocks_of(model, blocks)
    names = set(DEFAULT_SHARD if shard is None else shard)
    # Distinct last segments of the names inside the blocks, in model order ("" for a block itself).
    found = dict.fromkeys(n.rsplit(".", 1)[-1] for b in container.children() for n, _ in b.named_modules())
    unmatched = names - found.keys()
    if shard is not None and unmatched:
        raise BadInput(
            f"--shard: no submodule of the blocks in {_describe(prefix, container)} is named "
            f"{', '.join(sorted(unmatched))}; names found in the blocks: "
            f"{', '.join([n for n in found if n][:8]) or 'none'}. Nothing was planned; pass names from "
            "that list (--shard '' for no FSDP units)"
        )
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
            setattr(container, key, target)  # registers under the same key, in any container
        out.append((f"{prefix}.{key}" if prefix else key, target))
    return out


def explain(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    *,
    ac: str = "full",
    shard: Sequence[str] | None = None,
    blocks: str | None = None,
    recipe: Callable[[nn.Module], Any] | None = None,
    mode: str = "auto",
    strategy: str = "auto",
    fullgraph: bool = False,
) -> str:
    """The plan ``torch.compile`` of each block would get, as the plan log prints it.

    ``model_or_factory``: a model (ideally on the meta device) or a zero-argument
    factory, called under ``torch.device("meta")``. ``blocks``: the dotted name
    of the container whose children are the blocks (default: the ModuleList /
    ModuleDict holding the most parameters; the header line names it).
    ``recipe(model)`` applies your own AC / FSDP marking and may return the
    compile targets as ``(name, module)`` pairs; without a recipe, every block is
    wrapped in ``ac`` AC and every submodule named in ``shard`` (default:
    ``experts``, where present) is treated as an FSDP unit. Raises ``BadInput``
    when ``blocks`` or a ``shard`` name matches nothing.

    A model passed in is left exactly as it was: the recipe, the AC wrapping
    and the FSDP marks go on a copy of it on the meta device (``private_copy``).
    """
    if isinstance(model_or_factory, nn.Module):
        model = private_copy(model_or_factory)  # the recipe and the simulation change it: never the user's
    else:
        model = build(model_or_factory)
    if recipe is not None:
        returned = recipe(model)
        if isinstance(returned, nn.Module):
            model = returned
        targets = list(returned) if isinstance(returned, (list, tuple)) else None
        where = "blocks returned by the recipe"
        if targets is None:
            prefix, container = blocks_of(model, blocks)
            targets = [(f"{prefix}.{k}" if prefix else k, m) for k, m in container.named_children()]
            where = f"blocks: {_describe(prefix, container)}"
        how = f"{where}; recipe {getattr(recipe, '__qualname__', recipe)}"
    else:
        prefix, container = blocks_of(model, blocks)
        where = f"blocks: {_describe(prefix, container)}"
        targets = simulate(model, ac=ac, shard=shard, blocks=prefix)
        names = DEFAULT_SHARD if shard is None else tuple(shard)
        found = any(getattr(m, boundaries.MARK, None) == SIMULATED for _, t in targets for m in t.modules())
        units = ", ".join(names) or "none"
        if names and not found:
            units += " (none found in the blocks)"
        how = f"{where}; {ac} AC per block, FSDP units (simulated): {units}"
    entries = []
    for name, target in targets:
        plan = plan_inputs.plan(
            plan_inputs.Request(target, fullgraph=fullgraph), mode=mode, strategy=strategy
        )
        entries.append(summary.Entry(name=name, type_name=sense_names.inner_type(target), plan=plan))
    head = f"autoweave explain: {type(model).__name__} on meta; {how}; torch.compile(block) per block"
    return head + "\n" + summary.format_summary(entries)
