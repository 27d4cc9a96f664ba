"""The user's checkpoint, kept in torch 2.15's decorator form.

(A block woven as ``pieces`` at dynamo's recompile limit runs eager under the user's checkpoint
from the call that finds its region at the limit: ``_compat.regions.lookups_in_order``, decided
at the region's entry, ``weave.apply._at_limit``.)

**The decorator form** (``make_traceable``): torch 2.15 lets ``checkpoint`` decorate a function (``@checkpoint(use_reentrant=False)`` on a
method, ``checkpoint(**options)(fn)``): the result is a ``_CheckpointedFunction``. dynamo does
not turn it into its checkpoint operator: it skips torch's checkpoint code and compiles the
decorated function as a frame of its own, so in backward the recompute calls that function
outside the compile, eagerly, and non-reentrant checkpoint finds other saved tensors than the
forward's: ``CheckpointError`` in the first backward (measured: torch 2.15.0, aot_eager, with
and without a graph break inside).

A module compiled through autoweave whose ``forward`` is such a function gets an instance
``forward`` that makes the same call in the form dynamo traces, ``checkpoint(forward, *args,
**options)`` with the decorator's options, so it is planned and compiled as any block that
checkpoints in its forward (a break inside is woven around). Only the instance attribute
changes, through ``_instances`` (a pickle or copy sheds it): the class, parameters and
``state_dict`` are untouched, and a pickle or copy gets the decorated forward back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autoweave import _compat, _instances
from autoweave._log import logger


def decorated_forward(module: nn.Module) -> Any:
    """The ``_CheckpointedFunction`` that is ``module``'s forward (instance or class), or None."""
    cls = _compat.checkpoints.checkpointed_function_class()
    if cls is None:
        return None
    found = module.__dict__.get("forward")
    if found is None:
        found = next((c.__dict__["forward"] for c in type(module).__mro__ if "forward" in c.__dict__), None)
    return found if isinstance(found, cls) else None


def _call_form(module: nn.Module, decorated: Any, options: dict[str, Any]) -> Any:
    """``module``'s decorated forward as the call ``checkpoint(forward, *args, **options)``."""
    function = decorated.function
    if getattr(function, "__self__", None) is None:
        function = functools.partial(function, module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Keyword arguments are bound here: they must not be read as checkpoint's own options.
        return checkpoint(functools.partial(function, **kwargs) if kwargs else function, *args, **options)

    return forward


def make_traceable(root: nn.Module) -> int:
    """Give every module under ``root`` whose forward is a decorated checkpoint the call form.

    Only non-reentrant checkpoints (the decorator's own reentrant path takes no keyword
    arguments and is left as written). The call form is a stand-in for the user's
    forward (``_instances.install_stand_in``): a module pickled or copied afterwards
    carries its decorated forward, as in plain torch, and loads without autoweave.
    Returns how many modules changed; idempotent.
    """
    changed = 0
    for module in root.modules():
        if _instances.stands_in(module.__dict__.get("forward")):
            continue  # already in the call form
        decorated = decorated_forward(module)
        if decorated is None or decorated.checkpoint_kwargs.get("use_reentrant") is not False:
            continue
        _instances.install_stand_in(
            module, _call_form(module, decorated, _options(decorated.checkpoint_kwargs))
        )
        changed += 1
        logger.debug(
            "%s: forward decorated with checkpoint(...) is called as checkpoint(forward, ...) "
            "so the compile traces the checkpoint",
            type(module).__name__,
        )
    return changed


def _options(given: dict[str, Any]) -> dict[str, Any]:
    """The decorator's options that differ from ``checkpoint``'s defaults.

    dynamo's checkpoint operator rejects some defaults passed explicitly
    (``context_fn=noop_context_fn``: "checkpoint not implemented for ... context_fn").
    """
    import inspect

    defaults = {
        name: p.default
        for name, p in inspect.signature(inspect.unwrap(checkpoint)).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {k: v for k, v in given.items() if k == "use_reentrant" or defaults.get(k, _UNSET) is not v}


_UNSET = object()
