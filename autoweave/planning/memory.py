"""The activation memory a block woven as ``pieces`` holds, measured against eager selective AC's.

``pieces`` keeps for backward every tensor that crosses a break and is needed
there (the experts' input and output, the routing weights): whole-block eager
selective AC would recompute them from the block's input. With a policy that
saves the GEMM outputs that costs nothing (eager SAC keeps those too); with
one that saves little it can cost several times eager SAC's memory. Which it
is depends on the model, the break and the policy, so it is measured, once
per kind of block, at the first call that builds a graph for backward:

- what pieces hold: the bytes autograd saves during the block's forward. Every
  piece is a compiled graph that checkpoints inside itself, so each tensor it
  keeps passes through saved-tensor hooks installed around the call (none of
  torch's eager checkpoints runs inside, whose own hooks would take precedence);
  a storage counts once, parameters not at all (they are kept anyway);
- what eager selective AC would hold: its checkpoint keeps the block's tensor
  inputs, and its policy's saves (the outputs of the ops it saves, as the
  pieces' tracing showed them to it).

When pieces hold more than ``TOLERANCE`` times that, the block and every block
of its kind is planned again from its next call with ``hoist``: eager AC around
the compiled block holds at most eager SAC's memory. What that costs (it
recomputes each compiled graph whole; with inductor its policy sees inductor's
kernels, so it recomputes what full AC does) is in README "Limits" and
``benchmarks/sac_memory.py``. When the caller's own saved-tensor hooks are in
force around that first call (activation offloading, an eager checkpoint
around the model), nothing is measured: ours would shadow theirs.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave import _compat
from autoweave._log import logger
from autoweave._state import run
from autoweave.planning import tree_changes

_lock = threading.Lock()
# Pieces may hold this much more than eager SAC before the block is planned with hoist.
TOLERANCE = 1.05


def size_text(size: int) -> str:
    """``0.61 MB``, or ``13.7 KB`` below a megabyte."""
    return f"{size / 2**20:.2f} MB" if size >= 2**20 else f"{size / 2**10:.1f} KB"


@dataclass(frozen=True)
class Verdict:
    """One measured first call of a block woven as pieces."""

    held: int  # bytes the pieces kept for backward
    eager_sac: int | None  # bytes eager selective AC would keep (None: cannot be told)
    failed: tuple[str, ...] = ()  # why pieces autoweave could not compile ran eager instead

    @property
    def hoist(self) -> bool:
        """Plan the block with ``hoist`` instead: pieces ran eager, or hold more than eager SAC would."""
        return bool(self.failed) or (self.eager_sac is not None and self.held > self.eager_sac * TOLERANCE)

    def describe(self) -> str:
        if self.failed:
            return f"{len(self.failed)} of its pieces ran eager under their checkpoint: {self.failed[0]}"
        if self.eager_sac is None:
            return f"pieces hold {size_text(self.held)} for backward (eager selective AC's could not be told)"
        return (
            f"pieces hold {size_text(self.held)} for backward, eager selective AC "
            f"{size_text(self.eager_sac)} (its input and its policy's saves)"
        )


# -- counting ------------------------------------------------------------------------------


class _Storages:
    """Distinct storages of tensors (data pointer -> storage), sized when asked.

    Sized at the end, not when saved: a storage FSDP freed after the forward
    (an unsharded parameter, resized to nothing) holds nothing. Parameters,
    and whatever shares their storage (a transposed weight saved for
    backward), are kept anyway and left out.
    """

    def __init__(self) -> None:
        self.storages: dict[int, Any] = {}
        self.parameters: set[int] = set()

    def add(self, tensor: Any) -> None:
        import torch.nn as nn

        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
        except Exception:  # a subclass without one storage: not counted
            return
        if isinstance(tensor, nn.Parameter):
            self.parameters.add(pointer)
        else:
            self.storages.setdefault(pointer, storage)

    def leave_out(self, module: Any) -> None:
        """Leave out the storages of ``module``'s parameters and buffers (as they are now)."""
        for tensor in (*module.parameters(), *module.buffers()):
            try:
                self.parameters.add(tensor.untyped_storage().data_ptr())
            except Exception:
                pass

    @property
    def total(self) -> int:
        return sum(s.nbytes() for pointer, s in self.storages.items() if pointer not in self.parameters)


def tensor_bytes(value: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``value`` (nested tuples, lists, dicts)."""
    import torch

    storages = _Storages()

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storages.add(item)
        elif isinstance(item, (tuple, list)):
            for inner in item:
                visit(inner)
        elif isinstance(item, dict):
            for inner in item.values():
                visit(inner)

    visit(value)
    return storages.total


class SavedBytes:
    """While inside: every tensor autograd saves for backward is counted (``total`` bytes, ``count``).

    The hooks hand each tensor back unchanged. Inside an eager checkpoint its
    own hooks take precedence and this counts nothing of it.
    """

    def __init__(self) -> None:
        self._storages = _Storages()
        self.count = 0
        self._hooks: Any = None

    def _pack(self, tensor: Any) -> Any:
        if not _compat.is_fake(tensor):  # a trace that runs meanwhile (dynamo's, a piece's inspection)
            self.count += 1
            self._storages.add(tensor)
        return tensor

    @staticmethod
    def _unpack(tensor: Any) -> Any:
        return tensor

    @property
    def total(self) -> int:
        return self._storages.total

    def leave_out(self, module: Any) -> None:
        self._storages.leave_out(module)

    def __enter__(self) -> SavedBytes:
        import torch

        # Never traced: autograd calls the hooks from wherever a tensor is saved, also from
        # eager code that runs under a compiled frame (a piece that runs eager), and dynamo
        # would compile the hook there, on every call (its storage pointers break the graph),
        # until the recompile limit: NeMo's selective AC showed 23 recompiles against hoist's 2.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            _compat.disable(self._pack, recursive=True), _compat.disable(self._unpack, recursive=True)
        )
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# -- what one block taught its kind ---------------------------------------------------------


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


def _captured(cell: Any, depth: int) -> Any:
    try:
        contents = cell.cell_contents
    except ValueError:  # a cell not filled yet
        return ("empty",)
    return _captured_value(contents, depth)


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


def kind(wrapper: Any) -> tuple | None:
    """Blocks of one kind hold the same for backward: same code, parameter shapes and checkpoint."""
    inner = _compat.children_of(wrapper).get(_compat.CHECKPOINT_WRAPPED)
    if inner is None:
        return None
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in inner.named_parameters())
    return (type(inner), shapes, identity(_compat.checkpoint_fn(wrapper)))


def learn(wrapper: Any, verdict: Verdict) -> None:
    """Remember ``verdict`` for every block of ``wrapper``'s kind; a hoist verdict re-plans them."""
    key = kind(wrapper)
    if key is None:
        return
    with _lock:
        run.learned_memory.setdefault(key, verdict)
    if verdict.hoist:
        tree_changes.bump()  # the dispatchers holding blocks of this kind re-read their tree


def verdict_of(module: Any) -> Verdict | None:
    """What a block of ``module``'s kind was measured to hold (None: not measured yet)."""
    if not run.learned_memory:
        return None
    key = kind(module)
    return None if key is None else run.learned_memory.get(key)


def hoist_reason(module: Any) -> str | None:
    """Why a block of ``module``'s kind is to be planned with hoist; None when it is not."""
    verdict = verdict_of(module)
    return verdict.describe() if verdict is not None and verdict.hoist else None


def known(target: Any) -> dict[int, str]:
    """The blocks under ``target`` (ids) to plan with hoist, and why (for ``planner.plan``)."""
    if not run.learned_memory:
        return {}
    return {id(m): why for m in target.modules() if (why := hoist_reason(m)) is not None}


class FirstCall:
    """A pieces block's forward that measures its first call with grad, then gets out of the way.

    ``forward`` runs the block without its checkpoint (the pieces carry it);
    ``policy_bytes()`` is what the policy saved while the pieces were traced
    (None: not known), ``failed()`` why pieces autoweave could not compile ran
    eager (a block whose pieces fail is planned with hoist); ``done(verdict)`` is told once, at the first call with
    grad (None: not measured, the caller's saved-tensor hooks were active), and
    is expected to install ``forward`` in place of this object.
    """

    def __init__(
        self,
        wrapper: Any,
        forward: Callable[..., Any],
        policy_bytes: Callable[[], int | None],
        done: Callable[[Verdict | None], None],
        failed: Callable[[], tuple[str, ...]] = tuple,
    ) -> None:
        self.wrapper = wrapper
        self.forward = forward
        self.policy_bytes = policy_bytes
        self.failed = failed
        self.done = done
        self.finished = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.finished or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        self.finished = True
        if _compat.saved_tensors_hooks_active():
            # The user's hooks (offloading, say) or an eager checkpoint around the
            # call: ours would shadow them. Not measured; pieces stay.
            out = self.forward(*args, **kwargs)
            self.done(None)
            return out
        with SavedBytes() as saved:
            out = self.forward(*args, **kwargs)
        saved.leave_out(self.wrapper)
        policy = self.policy_bytes()
        eager_sac = None if policy is None else tensor_bytes((args, kwargs)) + policy
        verdict = Verdict(saved.total, eager_sac, self.failed())
        logger.info("%s: %s", type(self.wrapper).__name__, verdict.describe())
        learn(self.wrapper, verdict)
        self.done(verdict)
        return out
