"""torch 2.15's decorator form of ``checkpoint`` on a ``forward``, made traceable.

torch 2.15 lets ``checkpoint`` decorate a function (``@checkpoint(use_reentrant=False)`` on a
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
changes: the class, parameters and ``state_dict`` are untouched, and ``restore`` undoes it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autoweave import _compat
from autoweave._log import logger

# Where the decorated forward is kept on the instance while autoweave's call form stands in.
DECORATED = "_autoweave_decorated_forward"


def decorated_forward(module: nn.Module) -> Any:
    """The ``_CheckpointedFunction`` that is ``module``'s forward (instance or class), or None."""
    cls = _compat.checkpointed_function_class()
    if cls is None:
        return None
    own = module.__dict__.get("forward")
    if own is not None:
        return own if isinstance(own, cls) else None
    for klass in type(module).__mro__:
        if "forward" in klass.__dict__:
            found = klass.__dict__["forward"]
            return found if isinstance(found, cls) else None
    return None


# Named ``forward``: a pickled module rebuilds a bound method by name, which then finds the
# class's decorated forward again (as plain torch would have it).
def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    decorated, options = self.__dict__[DECORATED]
    function = decorated.function
    if getattr(function, "__self__", None) is None:
        function = functools.partial(function, self, **kwargs)
    elif kwargs:
        function = functools.partial(function, **kwargs)
    # Keyword arguments are bound above: they must not be read as checkpoint's own options.
    return checkpoint(function, *args, **options)


def make_traceable(root: nn.Module) -> int:
    """Give every module under ``root`` whose forward is a decorated checkpoint the call form.

    Only non-reentrant checkpoints (the decorator's own reentrant path takes no keyword
    arguments and is left as written). Returns how many modules changed; idempotent.
    """
    import types

    changed = 0
    for module in root.modules():
        decorated = decorated_forward(module)
        if decorated is None or decorated.checkpoint_kwargs.get("use_reentrant") is not False:
            continue
        module.__dict__[DECORATED] = (decorated, _options(decorated.checkpoint_kwargs))
        module.__dict__["forward"] = types.MethodType(forward, module)
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


def restore(root: nn.Module) -> None:
    """Put back each decorated forward ``make_traceable`` replaced under ``root``."""
    for module in root.modules():
        found = module.__dict__.pop(DECORATED, None)
        if found is None:
            continue
        decorated = found[0]
        own = module.__dict__.get("forward")
        if getattr(own, "__func__", None) is forward:
            del module.__dict__["forward"]
        if decorated_forward(module) is not decorated:
            module.__dict__["forward"] = decorated  # it was the instance's own
