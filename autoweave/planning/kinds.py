"""What makes two blocks one kind: the value every sharer of a block's facts is keyed by.

Blocks of one kind run the same code on same-shaped modules with the same hooks under the
same checkpoint: they share one compiled region (``weave/apply``), and what one of them
taught its kind (a memory verdict, ``learned``) holds for the others. One ``BlockKind`` is
the key of both; where a fact needs it coarser, it is derived from that value
(``BlockKind.memory``), so the two cannot disagree about what sets blocks apart.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave.planning import sources


@dataclass(frozen=True)
class BlockKind:
    """What a block runs: its code, its modules with their own hooks, its tensors, its checkpoint."""

    code: Any  # ``type(module).forward``
    structure: tuple  # (name, type, hooks_key) per module under it, itself first
    tensors: tuple  # (name, type name, shape, dtype) per parameter, then per buffer
    checkpoint: Any  # ``identity`` of its checkpoint function (None: none)

    def memory(self) -> tuple:
        """The kind a memory verdict is kept for: the same, less the tensors' types and dtypes.

        FSDP2 with a mixed-precision policy swaps its unit's parameters between sharded
        (fp32 DTensors: when a block is planned) and unsharded (bf16 tensors: during its
        forward, when its first call is measured). With the dtype in it the verdict was
        stored under a key the planner never read: the block was measured again at every
        plan and kept pieces that hold 1.6x plain torch's activations (fuzzer seed 11031).
        The verdict is a ratio of two byte counts of one forward, which a dtype scales alike.
        """
        shapes = tuple((name, shape) for name, _, shape, _ in self.tensors)
        return (self.code, self.structure, shapes, self.checkpoint)


def block_kind(module: nn.Module, checkpoint: Any = None) -> BlockKind:
    """``module``'s kind, run under the checkpoint function ``checkpoint`` (None: none)."""
    tensors = tuple(
        (name, type(t).__name__, tuple(t.shape), t.dtype)
        for name, t in (*module.named_parameters(), *module.named_buffers())
    )
    structure = tuple((name, type(m), hooks_key(m)) for name, m in module.named_modules())
    return BlockKind(
        type(module).forward, structure, tensors, None if checkpoint is None else identity(checkpoint)
    )


# Hooks change what a block runs, and dynamo does not guard on them
# (``skip_nnmodule_hook_guards``): a block whose hook differs from its neighbours'
# would run their compiled code, its hook gone from the second call on. Hooks torch's
# distributed wrappers install (FSDP2's, a bound method of each unit's own state)
# and autoweave's own do the same for every block: they do not split a kind. The
# dispatcher re-plans a block whose key changed (``dispatch/tree_watch`` signals it).
_UNIFORM_HOOK_MODULES = ("torch.distributed", "autoweave")


def hooks_key(module: nn.Module) -> tuple:
    """``module``'s own hooks as its kind holds them (FSDP's and autoweave's left out)."""
    key = []
    for store, hooks in _compat.modules.hooks_of(module):  # most modules have none: the walk reads every one
        own = tuple(_hook_identity(hook) for hook in hooks if not uniform_hook(hook))
        if own:
            key.append((store, own))
    return tuple(key)


def _hook_identity(hook: Any) -> Any:
    # ``torch.compiler.disable(f)`` makes a new wrapper per call: hooks disabled per
    # block over one function are the same hook (the wrapper adds no state of its own).
    original = _compat.dynamo.disabled_original(hook)
    if original is not None:
        return ("dynamo-disabled", _hook_identity(original))
    return identity(hook)


def uniform_hook(hook: Any) -> bool:
    """Is ``hook`` one torch's distributed wrappers or autoweave put on every block alike?"""
    owner = getattr(getattr(hook, "func", hook), "__module__", None) or ""
    return owner.startswith(_UNIFORM_HOOK_MODULES)


def identity(value: Any, _depth: int = 0) -> Any:
    """A hashable key for a policy or option value: equal for the same functions, partials and constants.

    Closures made by one factory per block (a ``context_fn`` built per layer, as
    torchtitan's and NeMo's recipes build them) are equal when they run the same
    code over equal captured values (``_captured``): blocks that differ only in
    such a closure then share one compiled region, where a key by object kept
    every block apart, compiling each on its own.
    """
    if _depth > 8:
        return ("deep", id(value))
    func = getattr(value, "func", None)
    if func is not None:  # functools.partial: the function and its arguments
        return (
            "partial",
            identity(func, _depth + 1),
            tuple(identity(a, _depth + 1) for a in value.args),
            identity(value.keywords, _depth + 1),
        )
    if isinstance(value, dict):
        return tuple(sorted((k, identity(v, _depth + 1)) for k, v in value.items()))
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, types.FunctionType) and value.__closure__:
        return (
            "closure",
            id(value.__code__),
            id(value.__globals__),
            tuple(_captured(cell, _depth + 1) for cell in value.__closure__),
            _captured_value(value.__defaults__, _depth + 1),
        )
    return id(value)


_EMPTY = ("empty",)  # the key of a cell not filled yet


def _captured(cell: Any, depth: int) -> Any:
    contents = sources.cell_value(cell, _EMPTY)
    return _EMPTY if contents is _EMPTY else _captured_value(contents, depth)


def _captured_value(value: Any, depth: int) -> Any:
    """A captured value's key: constants and frozen collections by value, anything mutable by object.

    A dict, a list or any object a closure captures may be state it changes
    (a per-block counter): two closures are equal only when they share it. A
    set (a policy's op list) or tuple is read-only in practice and compared by
    its items.
    """
    if isinstance(value, (tuple, frozenset, set)) and len(value) <= 256:
        items = [_captured_value(item, depth + 1) for item in value]
        if isinstance(value, tuple):
            return ("tuple", tuple(items))
        try:
            return ("set", frozenset(items))
        except TypeError:
            return id(value)
    if isinstance(value, dict):
        return id(value)
    return identity(value, depth)
