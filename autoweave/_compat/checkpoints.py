"""Checkpoint and activation-memory internals: the traced checkpoint operator, the SAC policy,
saved-tensor hooks, autograd's node numbers, fake tensors.

Torch range: 2.11-2.15 (``version.self_check`` probes the operator and its
metadata key on a newer torch; the rest degrade to "cannot tell" where a name
moved). Upstream: the decorator form ``checkpoint(**options)(fn)`` (2.15+) is not
traced as the checkpoint operator (pytorch PR #189412 would trace it; open;
docs/upstream.md U6); no public API lists a SAC policy's context or autograd's node numbers either.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from autoweave._compat.lookup import UnsupportedTorch, find, find_optional, need, need_source

# The metadata key on a checkpoint body's GraphModule that carries the selective-AC policy,
# read by ``tag_activation_checkpoint``'s implementation (torch/_higher_order_ops/wrap.py).
CHECKPOINT_CONTEXT_FN_KEY = "_checkpoint_context_fn"
_TAG_ACTIVATION_CHECKPOINT = need("torch._higher_order_ops.wrap.tag_activation_checkpoint")
need_source(
    f"the checkpoint operator's {CHECKPOINT_CONTEXT_FN_KEY!r} key",
    "torch._higher_order_ops.wrap",
    CHECKPOINT_CONTEXT_FN_KEY,
)
# What a checkpoint's recompute reads to find its forward (``eager_checkpoint_frame``).
_CHECKPOINT = need_source(
    "the recompute hook's 'target_frame_ref'", "torch.utils.checkpoint", "target_frame_ref"
)
_CHECKPOINTED_FUNCTION = need("torch.utils.checkpoint._CheckpointedFunction", required=False)
_EAGER_CHECKPOINT_HOOKS = (
    need("torch.utils.checkpoint._checkpoint_hook", required=False),
    need("torch.utils.checkpoint._recomputation_hook", required=False),
)
_SAC_FORWARD_MODE = need("torch.utils.checkpoint._CachingTorchDispatchMode", required=False)
_SAC_CONTEXT = need("torch.utils.checkpoint.SelectiveCheckpointContext", required=False)
_SAC_CONTEXTS = need("torch.utils.checkpoint.create_selective_checkpoint_contexts", required=False)
# Reading beneath the innermost saved-tensor hooks (``_hooks_beneath_innermost``).
_HOOKS_STACK = tuple(
    need(f"torch._C._autograd.{name}", required=False)
    for name in (
        "_saved_tensors_hooks_is_enabled",
        "_pop_saved_tensors_default_hooks",
        "_push_saved_tensors_default_hooks",
    )
)
_DISPATCH_MODE = need("torch.utils._python_dispatch.TorchDispatchMode", required=False)
# A recompute's ``view_as`` of autoweave's own, hidden from eager SAC's mode (``as_recompute_sees``).
_NO_DISPATCH_MODES = need("torch.utils._python_dispatch._disable_current_modes", required=False)
_FAKE_TENSOR_MODE = need("torch._subclasses.fake_tensor.FakeTensorMode", required=False)
_IS_FAKE = need("torch._subclasses.fake_tensor.is_fake", required=False)


@functools.cache
def tag_activation_checkpoint() -> Any:
    """torch's checkpoint operator for compiled graphs: what dynamo emits for a traced ``checkpoint``."""
    return find(_TAG_ACTIVATION_CHECKPOINT)


@functools.cache
def checkpointed_function_class() -> type | None:
    """torch 2.15+'s ``checkpoint(**options)(fn)`` result class, or None on an older torch.

    Private: the decorator form returns it and nothing public names it. Needed until
    dynamo traces it as its checkpoint operator.
    """
    return find_optional(_CHECKPOINTED_FUNCTION)


def saved_tensors_hooks_active() -> bool:
    """Are saved-tensor hooks in force here (a user's, or an eager checkpoint's around this call)?

    A measure that installs its own would shadow them: autoweave then does not measure.
    """
    return _top_saved_tensors_hooks(unknown=True) is not None  # cannot tell: assume so, and do not measure


def _top_saved_tensors_hooks(unknown: Any = None) -> Any:
    # The innermost (pack, unpack) hooks in force, None if none; ``unknown`` on a torch that cannot tell.
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return unknown
    try:
        return top(True)
    except TypeError:  # an older signature, without the tracing flag
        return top()


@functools.cache
def _eager_checkpoint_hook_classes() -> tuple[str, ...]:
    """Qualified-name prefixes of the pack hooks torch's eager checkpoint installs (forward, recompute)."""
    return tuple(
        f"{cls.__qualname__}." for cls in map(find_optional, _EAGER_CHECKPOINT_HOOKS) if cls is not None
    )


def in_eager_checkpoint() -> bool:
    """Is this call in an eager (non-reentrant) checkpoint's forward or recompute, innermost?

    Told by the saved-tensor hooks in force: the checkpoint's own (private
    classes, looked up; a torch where they moved answers False).
    """
    hooks, prefixes = _top_saved_tensors_hooks(), _eager_checkpoint_hook_classes()
    if not hooks or not prefixes:
        return False
    pack = hooks[0]
    return getattr(pack, "__module__", None) == _CHECKPOINT and getattr(pack, "__qualname__", "").startswith(
        prefixes
    )


def eager_checkpoint_frame() -> tuple[Any, bool] | None:
    """The innermost eager checkpoint around this call (its ``_CheckpointFrame``), and whether this is its recompute.

    Its forward and its recompute share that object: what a forward decided can be
    found again by its recompute. Read from the pack hook's closure (``frame``
    in the forward, ``target_frame_ref`` in the recompute, as on 2.11-2.15); None
    where there is no eager checkpoint, or the names moved.
    """
    if not in_eager_checkpoint():
        return None
    cells = _innermost_pack_cells()
    try:
        if "frame" in cells:
            return cells["frame"].cell_contents, False
        if "target_frame_ref" in cells:
            frame = cells["target_frame_ref"].cell_contents()
            return (frame, True) if frame is not None else None
    except (ValueError, TypeError):  # an empty cell, or not a weak reference
        pass
    return None


def _innermost_pack_cells() -> dict[str, Any]:
    """The closure cells, by name, of the innermost saved-tensor pack hook (an eager checkpoint's)."""
    # The recompute's hook is ``torch._dynamo.disable``d (2.13): its wrapper keeps ``__wrapped__``.
    pack = inspect.unwrap(_top_saved_tensors_hooks()[0])
    return dict(zip(pack.__code__.co_freevars, pack.__closure__ or (), strict=False))


@functools.cache
def _unviewed() -> Any:
    import torch

    class Unviewed(torch.autograd.Function):
        """The input as a tensor of its own (same storage, sizes and strides), not a view; identity for grad."""

        @staticmethod
        def forward(ctx: Any, tensor: Any) -> Any:
            return tensor.detach()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    return Unviewed.apply


def as_recompute_sees(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every view among their tensors as its recompute will see it.

    dynamo guards a view input's base (``x._base.stride()``), so a view in the
    forward and a non-view in the recompute meet other guards: a compiled call
    would run one graph in forward and look up another in the recompute (or,
    past the recompile limit, run eager), whose ops and saves differ from the
    forward's. A recompute meets a non-view where its forward met a view when
    the view was made by code the recompute may skip (FSDP2's pre-forward hook,
    whose ``RegisterPostBackwardFunction`` outputs are views, returns early in
    a recompute after the unit's pre-backward) or saved under saved-tensor
    hooks (a user's, ``save_on_cpu``, an outer checkpoint's: autograd unpacks a
    hooked tensor as one of its own, saved_variable.cpp). And the same input
    must meet the same guards step after step, hooks or none (fuzzer seed 60709:
    a step under saved-tensor hooks compiled every frame once more).

    So each view takes one form in both, every step. A view whose base has its
    own sizes, strides, offset, dtype and grad (FSDP2's views) passes as it is;
    where the recompute meets a non-view in its place it gets ``view_as`` of
    that, whose base is alike (``_ViewsOfFrame``). The checkpoint's kwargs come
    back as the very tensors: they pass as they are. Any other view is given as
    a non-view in both, with no copy (the same storage, sizes and strides).
    """
    import torch

    if not in_eager_checkpoint():
        return args, kwargs  # nothing saves them for a recompute
    found = eager_checkpoint_frame()
    views = None if found is None else _ViewsOfFrame.of(found[0])
    if views is None:  # cannot tell what the recompute meets: no view passes
        if not any(type(v) is torch.Tensor and v._is_view() for v in (*args, *kwargs.values())):
            return args, kwargs
        return tuple(map(_unview, args)), {k: _unview(v) for k, v in kwargs.items()}
    if found[1]:  # a recompute, its calls in its forward's order
        alike = views.next_in(_recompute_pass())

        def seen(key: Any, value: Any) -> Any:
            if type(value) is not torch.Tensor:
                return value
            if key in alike:
                return value if _alike_view(value) else _view_again(value)
            return value if not value._is_view() or id(value) in views.kwargs else _unview(value)

    else:
        passed: set[Any] = set()

        def seen(key: Any, value: Any) -> Any:
            if type(value) is not torch.Tensor or not value._is_view():
                return value
            if _alike_view(value):
                passed.add(key)
                return value
            return value if id(value) in views.kwargs else _unview(value)

    out = tuple(seen(i, v) for i, v in enumerate(args)), {k: seen(k, v) for k, v in kwargs.items()}
    if not found[1]:
        views.alike.append(frozenset(passed))
    return out


def _unview(value: Any) -> Any:
    """A view as a tensor of its own (same storage, sizes and strides); anything else as it is."""
    import torch

    if type(value) is not torch.Tensor or not value._is_view():
        return value
    return _unviewed()(value) if value.requires_grad else value.detach()


def _view_again(value: Any) -> Any:
    """``value`` as a view alike its base: ``view_as`` of it (of its non-view form if a view).

    Out of sight of torch's dispatch modes: eager SAC's recompute mode looks up each
    op it meets in what its forward stored, and this op has no forward (an ``aten.view``
    it never met raises); ``detach`` (``_unview``) is one it ignores.
    """
    with find(_NO_DISPATCH_MODES)():
        return _unview(value).view_as(value)


def _alike_view(value: Any) -> bool:
    """Is ``value`` a view whose base has its sizes, strides, offset, dtype and grad (``x.view_as(x)``'s form)?

    False on a torch where a recompute could not make one unseen (``_view_again``).
    """
    base = value._base if value._is_view() else None
    return (
        base is not None
        and find_optional(_NO_DISPATCH_MODES) is not None
        and (
            base.size() == value.size()
            and base.stride() == value.stride()
            and base.storage_offset() == value.storage_offset()
            and base.dtype == value.dtype
            and base.requires_grad == value.requires_grad
        )
    )


class _ViewsOfFrame:
    """What one eager checkpoint's forward passed, found again by its recompute (they share its frame).

    ``kwargs``: the ids of the checkpoint's kwarg views, which its recompute gets
    back as they are (read where no hooks lie beneath its own). ``alike``: per
    woven call of its forward, in order, the inputs passed as alike views; a
    recompute's calls come in the same order (and may stop early, never reorder).
    Each recompute reads from the first: a graph kept (``retain_graph``) is
    recomputed at each backward, each its own pass (``_recompute_pass``).
    """

    __slots__ = ("__weakref__", "alike", "kwargs", "read")
    _of: weakref.WeakKeyDictionary[Any, _ViewsOfFrame] = weakref.WeakKeyDictionary()

    def __init__(self, kwargs: frozenset[int]) -> None:
        self.kwargs = kwargs
        self.alike: list[frozenset[Any]] = []
        self.read: dict[Any, int] = {}  # per recompute pass, the calls it has made

    def next_in(self, recompute: Any) -> frozenset[Any]:
        """What the forward passed as alike views at this call of recompute pass ``recompute``."""
        at = self.read.get(recompute, 0)
        self.read[recompute] = at + 1
        return self.alike[at] if at < len(self.alike) else frozenset()

    @classmethod
    def of(cls, frame: Any) -> _ViewsOfFrame | None:
        """The frame's record, made at its forward's first woven call; None where it takes no weak reference."""
        try:
            views = cls._of.get(frame)
            if views is None:
                views = cls._of[frame] = cls(_kwarg_views(frame))
        except TypeError:
            return None
        return views


def _recompute_pass() -> Any:
    """Which backward this recompute runs for: the ``gid`` its hook keeps (2.11-2.15), else None."""
    cells = _innermost_pack_cells()
    try:
        gid = cells["gid"].cell_contents if "gid" in cells else None
        hash(gid)
    except (ValueError, TypeError):  # an empty cell, or not a key
        return None
    return gid


def _kwarg_views(frame: Any) -> frozenset[int]:
    """The ids of the checkpoint's kwargs that are views; empty where it cannot tell."""
    import torch

    try:
        kwargs = _kwargs_of(frame)
    # RuntimeError: an input changed in place since (the checkpoint's own error, at its recompute);
    # the others: the names moved. Either way it cannot tell.
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(id(t) for t in kwargs.values() if type(t) is torch.Tensor and t._is_view())


def _kwargs_of(frame: Any) -> dict[str, Any]:
    """The checkpoint's kwargs, never saved: held by the recompute's closure (2.13+) or beside the saved tensors.

    On 2.11 they lie beside the saved args in ``_NoopSaveInputs`` (kwargs first),
    read by unpacking them, which runs any hooks beneath the checkpoint's own:
    not read then.
    """
    if getattr(frame, "get_inputs", None) is not None:
        fn = inspect.unwrap(frame.recompute_fn)  # torch's, under any ``functools.wraps`` wrapper
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
        return cells["kwargs"].cell_contents if "kwargs" in cells else {}
    node = getattr(getattr(frame, "input_saver", None), "grad_fn", None)
    if node is None or _hooks_beneath_innermost():
        return {}
    kwargs, *_ = node.get_args(node.saved_tensors)
    return kwargs


def _hooks_beneath_innermost() -> bool:
    # The stack of saved-tensor hooks has no reader below its top: lift the top off, read, put it
    # back (the same objects; thread-local). Where hooks are disabled nothing may be pushed.
    enabled, pop, push = map(find_optional, _HOOKS_STACK)
    top = _top_saved_tensors_hooks()
    if None in (enabled, pop, push, top) or not enabled():
        return True
    pop()
    try:
        return _top_saved_tensors_hooks(unknown=True) is not None
    finally:
        push(*top)


@functools.cache
def _sac_forward_mode() -> type | None:
    return find_optional(_SAC_FORWARD_MODE)


@functools.cache
def policy_sees_outputs() -> bool:
    """Does torch's SAC call the policy with the op's output (``ctx.op_output``)?

    torch 2.11 asks the policy before the op runs, without it (its context is
    ``SelectiveCheckpointContext(*, is_recompute)``, seen on an H200); 2.13 passes
    it. Without it, what eager SAC keeps cannot be sized.
    """
    context = find_optional(_SAC_CONTEXT)
    try:
        return context is not None and hasattr(context(is_recompute=False), "op_output")
    except Exception:  # a context built another way: cannot tell, so not sized
        return False


def observe_sac_policy(contexts: Any, observe: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Swap the policy of torch's SAC forward context in ``contexts`` for ``observe(policy)``.

    ``contexts`` is what a ``context_fn`` returned, ``(forward, recompute)``;
    only the forward one (``create_selective_checkpoint_contexts``'s caching
    mode, whose ``policy_fn`` it calls for every op) is changed, so the
    recompute context decides as before. False when it is not torch's.
    """
    mode_cls = _sac_forward_mode()
    forward = contexts[0] if isinstance(contexts, tuple) and contexts else None
    if (
        mode_cls is None
        or not isinstance(forward, mode_cls)
        or not callable(getattr(forward, "policy_fn", None))
    ):
        return False
    forward.policy_fn = observe(forward.policy_fn)
    return True


def in_backward() -> bool:
    """Is this code running inside autograd's backward (a checkpoint's recompute, say)?"""
    import torch

    try:
        return int(torch._C._current_graph_task_id()) != -1
    except Exception:  # a torch without it: not known to be in backward
        return False


def next_autograd_sequence_nr() -> int | None:
    """The number autograd gives the next node it creates (no op is run to learn it); None if unknown."""
    import torch

    try:
        return int(torch._C._autograd._get_sequence_nr())
    except Exception:  # a torch without it
        return None


def autograd_sequence_nr(node: Any) -> int | None:
    """The creation number autograd gave ``node`` (per thread, increasing); None where it cannot be read."""
    try:
        return int(node._sequence_nr())
    except Exception:
        return None


def is_dispatch_mode(value: Any) -> bool:
    """Is ``value`` a ``TorchDispatchMode`` (what a traced checkpoint needs its ``context_fn`` to return)?"""
    mode_cls = find_optional(_DISPATCH_MODE)
    return mode_cls is not None and isinstance(value, mode_cls)


def selective_contexts_factory() -> Any:
    """torch's ``create_selective_checkpoint_contexts`` (None on a torch without it)."""
    return find_optional(_SAC_CONTEXTS)


def fake_tensor_mode() -> Any:
    """A fresh ``FakeTensorMode`` of autoweave's own (no shape env: static shapes), for inspecting a graph.

    A real tensor a graph holds as a constant is made fake when an op meets it.
    """
    return find(_FAKE_TENSOR_MODE)(allow_non_fake_inputs=True)


def storage_key(tensor: Any) -> Any:
    """What identifies ``tensor``'s storage (shared by its views), fake tensors included; None if none."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:  # a subclass without one storage (a DTensor), a sparse tensor
        return None


def returns_fresh_storage(op: Any, index: int) -> bool:
    """Does output ``index`` of aten op ``op`` have storage of its own (no view of, or write into, an input)?"""
    try:
        returns = op._schema.returns
        return returns[index].alias_info is None if index < len(returns) else True
    except AttributeError:  # not an OpOverload (a higher-order operator)
        return True


def size_hint(value: Any) -> int | None:
    """An int for a size, a symbolic one read from its hint (never guarded on); None if it has none."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else None


def is_fake(tensor: Any) -> bool:
    """Is ``tensor`` a fake tensor (dynamo's or AOTAutograd's tracing, or autoweave's own inspection)?"""
    try:
        return bool(find(_IS_FAKE)(tensor))
    except UnsupportedTorch:
        return False


def version_of(tensor: Any) -> int | None:
    """``tensor``'s version counter (bumped by every in-place write), None for anything else."""
    return getattr(tensor, "_version", None) if _is_tensor(tensor) else None


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


# Where dynamo's graphs keep what a node computes (a fake tensor), on every torch in
# ``version.TESTED_TORCH``; AOTAutograd's graphs call it ``val``.
_EXAMPLE_VALUE = "example_value"


def traced_value(node: Any) -> Any:
    """What dynamo recorded an fx ``node`` computes (a fake tensor, a tuple of them), or None."""
    meta = getattr(node, "meta", None) or {}
    return meta.get(_EXAMPLE_VALUE, meta.get("val"))


def set_traced_value(node: Any, value: Any) -> None:
    """Record what ``node`` computes, as dynamo records it for the nodes it builds."""
    node.meta[_EXAMPLE_VALUE] = value
