"""Private names of torch's modules and wrappers: OptimizedModule, CheckpointWrapper, FSDP, nn.Module.

Torch range: the same names on every torch in ``version.TESTED_TORCH`` (2.11-2.15)
and long before. None has a public accessor upstream, and no upstream issue asks
for one that we found: each read below would go with a public accessor.
``version.self_check`` probes them on a torch newer than tested.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from autoweave._compat.lookup import find, find_optional, need, need_any

_OPTIMIZED_MODULE = need("torch._dynamo.eval_frame.OptimizedModule")
CHECKPOINT_WRAPPER_MODULE = need(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", required=False
)
_CHECKPOINT_WRAPPER = need(f"{CHECKPOINT_WRAPPER_MODULE}.CheckpointWrapper", what="CheckpointWrapper")
# None: torch built without distributed.
_FSDP2_MODULE = need_any(
    "torch.distributed.fsdp.FSDPModule", "torch.distributed._composable.fsdp.FSDPModule", required=False
)
_FSDP1_MODULE = need("torch.distributed.fsdp.FullyShardedDataParallel", required=False)


@functools.cache
def optimized_module() -> type:
    return find(_OPTIMIZED_MODULE)


@functools.cache
def checkpoint_wrapper_class() -> type:
    return find(_CHECKPOINT_WRAPPER)


@functools.cache
def fsdp2_module() -> type | None:
    return find_optional(*_FSDP2_MODULE)


@functools.cache
def fsdp1_module() -> type | None:
    return find_optional(_FSDP1_MODULE)


# OptimizedModule (torch/_dynamo/eval_frame.py): the module torch.compile wrapped.
COMPILED_INNER = "_orig_mod"
# nn.Module.compile stores its compiled ``_call_impl`` here (torch 2.2+; torch/nn/modules/module.py).
COMPILED_CALL = "_compiled_call_impl"
# CheckpointWrapper (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py): the wrapped
# module and the checkpoint function it calls (a functools.partial of torch.utils.checkpoint).
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
CHECKPOINT_FN = "checkpoint_fn"
# FSDP1's wrapper (torch/distributed/fsdp/fully_sharded_data_parallel.py).
FSDP1_WRAPPED = "_fsdp_wrapped_module"
# torch's wrappers whose child is the user's module, looked through for messages and plans.
WRAPPED_CHILD_ATTRS = (CHECKPOINT_WRAPPED, FSDP1_WRAPPED, COMPILED_INNER)
# nn.Module's own stores for children, parameters and buffers (read without running
# ``__getattr__``): the same on every torch since 1.0.
MODULE_STORES = ("_modules", "_parameters", "_buffers")


def _init_names(cls: type, *names: str) -> bool:
    """Do the ``__init__``s of ``cls`` and its bases set (or read) every attribute in ``names``?"""
    seen: set[str] = set()
    for klass in cls.__mro__:
        code = getattr(inspect.unwrap(vars(klass).get("__init__")), "__code__", None)
        seen.update(code.co_names if code is not None else ())
    return set(names) <= seen


need(
    _OPTIMIZED_MODULE,
    what="OptimizedModule._orig_mod/dynamo_ctx",
    probe=lambda: _init_names(optimized_module(), COMPILED_INNER, "dynamo_ctx"),
)
need(
    _CHECKPOINT_WRAPPER,
    what="CheckpointWrapper._checkpoint_wrapped_module/checkpoint_fn",
    probe=lambda: _init_names(checkpoint_wrapper_class(), CHECKPOINT_WRAPPED, CHECKPOINT_FN),
)
_NN_MODULE = need(
    "torch.nn.Module",
    what="torch.nn.Module._forward_pre_hooks/_forward_hooks",
    probe=lambda: {"_forward_pre_hooks", "_forward_hooks"} <= set(vars(find(_NN_MODULE)())),
)
need(f"{_NN_MODULE}.{COMPILED_CALL}", probe=lambda: COMPILED_CALL in vars(find(_NN_MODULE)))


def compiled_inner(optimized: Any) -> Any:
    """The module ``torch.compile`` wrapped in ``optimized`` (an OptimizedModule)."""
    return getattr(optimized, COMPILED_INNER)


def set_compiled_call(module: Any, call: Any) -> None:
    """Install ``call`` where ``module.compile()`` puts the compiled ``_call_impl``."""
    setattr(module, COMPILED_CALL, call)


def checkpoint_wrapped(wrapper: Any) -> Any:
    """The module a ``CheckpointWrapper`` wraps."""
    return getattr(wrapper, CHECKPOINT_WRAPPED)


def checkpoint_fn(wrapper: Any) -> Any:
    """The checkpoint function a ``CheckpointWrapper`` calls (a partial of torch.utils.checkpoint)."""
    return getattr(wrapper, CHECKPOINT_FN, None)


def reentrant(wrapper: Any) -> bool:
    """Does a ``CheckpointWrapper`` run the reentrant checkpoint (its ``checkpoint_impl``)?"""
    return getattr(getattr(wrapper, "checkpoint_impl", None), "name", "") == "REENTRANT"


def wrapped_child(module: Any) -> Any:
    """The child a torch wrapper (CheckpointWrapper, FSDP1, OptimizedModule) wraps; None if not one."""
    children = getattr(module, "_modules", None) or {}
    return next((children[a] for a in WRAPPED_CHILD_ATTRS if a in children), None)


def children_of(module: Any) -> dict[str, Any]:
    """``module``'s registered children, the dict nn.Module keeps them in (no copy, no property run)."""
    return module.__dict__.get("_modules", {})


def forward_hook_dicts(module: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """``module``'s forward pre-hooks and forward hooks (nn.Module has no public way to list them)."""
    return module._forward_pre_hooks, module._forward_hooks


# nn.Module's per-instance hook stores that change what a call runs (not the ``*_with_kwargs``
# / ``*_always_called`` flags, which only qualify entries of these).
HOOK_STORES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hooks_of(module: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """``module``'s own hooks, store by store (the stores that hold any), in the order they run.

    nn.Module has no public list. Read at every walk of a compiled tree, where most
    modules have none: a loop, not generators (a third of the walk's time otherwise).
    """
    stores = vars(module)
    found = []
    for name in HOOK_STORES:
        hooks = stores.get(name)
        if hooks:
            found.append((name, tuple(hooks.values())))
    return found


def backward_hooked(module: Any) -> bool:
    """Does a call of ``module`` set up full backward hooks (its own, or every module's, global)?"""
    import torch.nn.modules.module as module_py

    stores = vars(module)
    globals_ = (
        getattr(module_py, name, None) for name in ("_global_backward_hooks", "_global_backward_pre_hooks")
    )
    return bool(stores.get("_backward_hooks") or stores.get("_backward_pre_hooks") or any(globals_))


def call_impl(module: Any) -> Any:
    """``module._call_impl``, what ``nn.Module.compile`` compiles (torch 2.2+)."""
    return module._call_impl


def checkpoint_wrapper_module() -> Any:
    """The module that defines ``checkpoint_wrapper`` (a private package path, torch 1.12 to today)."""
    return importlib.import_module(CHECKPOINT_WRAPPER_MODULE)


# Where FSDP2's per-unit state class lives (its ``init`` runs once per ``fully_shard`` call),
# newest path first.
FSDP2_STATE_MODULES = need_any(
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed._composable.fsdp._fsdp_state",
    required=False,
)


def _fsdp2_state_hooks() -> bool:
    state = find_optional(*_FSDP2_STATE)
    return state is not None and all(
        callable(getattr(state, attr, None)) for attr in ("init", "_pre_forward", "_post_forward")
    )


_FSDP2_STATE = need_any(
    *(f"{name}.FSDPState" for name in FSDP2_STATE_MODULES),
    what="FSDP2's FSDPState.init/_pre_forward/_post_forward",
    probe=_fsdp2_state_hooks,
)
_REGISTRATION_HOOK = need("torch.nn.modules.module.register_module_module_registration_hook")
_DTENSOR = need("torch.distributed.tensor.DTensor", required=False)


def register_module_registration_hook(hook: Any) -> Any:
    """torch's global hook on every submodule registration; returns its handle (None if missing)."""
    register = find_optional(_REGISTRATION_HOOK)
    return None if register is None else register(hook)


def process_groups_of(module: Any) -> list[Any]:
    """The process groups ``module``'s own parameters are sharded over, in a fixed order; [] if none.

    The ranks in each run ``module``'s forward: they gather its parameters together.
    FSDP2 (``fully_shard``): each mesh dimension of each of its parameter groups
    (``FSDPState._fsdp_param_groups``, ``_fsdp_param_group`` before per-parameter
    meshes), read from its state because inside its forward the parameters are
    unsharded, plain tensors. FSDP1: its public ``process_group``, and the
    replicas' ``_inter_node_pg`` under hybrid sharding. Tensor parallel: the mesh
    of a ``DTensor`` parameter (public). Anything unreadable counts as none.
    """
    groups: list[Any] = []
    try:
        fsdp2, fsdp1 = fsdp2_module(), fsdp1_module()
        meshes = []
        if fsdp2 is not None and isinstance(module, fsdp2):
            state = module._get_fsdp_state()
            param_groups = getattr(state, "_fsdp_param_groups", None)
            if param_groups is None:
                param_groups = [getattr(state, "_fsdp_param_group", None)]
            meshes += [g.mesh_info.mesh for g in param_groups if g is not None]
        if fsdp1 is not None and isinstance(module, fsdp1):
            groups += [
                g for g in (module.process_group, getattr(module, "_inter_node_pg", None)) if g is not None
            ]
        dtensor = find_optional(_DTENSOR)
        if dtensor is not None:
            meshes += [p.device_mesh for p in module.parameters(recurse=False) if isinstance(p, dtensor)]
        for mesh in meshes:
            groups += mesh.get_all_groups()
    except Exception:  # a torch whose FSDP keeps its mesh elsewhere: no group known
        return []
    return groups
