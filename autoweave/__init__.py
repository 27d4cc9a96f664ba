"""autoweave: torch.compile around FSDP units inside activation-checkpointed blocks.

Turn it on for a run with ``AUTOWEAVE=1`` (the start-up file does the rest) or
from code with :func:`enable`. Importing this package imports only the
standard library; torch-dependent names load on first use.
"""

import os
import sys

from autoweave import _installs, _settings, startup
from autoweave._settings import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

    import torch.nn as nn

    from autoweave._failopen import AutoweaveError
    from autoweave.planning.plans import Plan

from autoweave._settings import __version__

__all__ = [
    "AutoweaveError",
    "boundary",
    "disable",
    "disabled",
    "enable",
    "explain",
    "is_enabled",
    "plan",
    "register_boundary",
    "set_mode",
    "__version__",
]


def enable() -> bool:
    """Turn autoweave on in this process (as ``AUTOWEAVE=1`` would); idempotent.

    Returns whether it is on afterwards: ``AUTOWEAVE_DISABLE=1`` still wins, and
    an unsupported torch leaves it off with a warning.
    """
    from autoweave._settings import AUTOWEAVE_DISABLE

    forced = _settings.Settings.from_environ({**os.environ, "AUTOWEAVE": "1"})
    if not forced.enabled:
        import logging

        logging.getLogger("autoweave").warning("enable() ignored: %s is set for this run", AUTOWEAVE_DISABLE)
        return False
    if not _settings.current().enabled:
        _settings.reload(forced)
    startup.install()
    return is_enabled()


def disable() -> None:
    """Turn autoweave off: undo every install of :func:`enable`, newest first.

    torch's functions, the import hooks, logging (levels, handlers, filters,
    level names), dynamo's callbacks and the exit hook end as they were before
    ``enable()``; what exit would have done is done now (the pending plan
    summary, the ``AUTOWEAVE_REPORT`` report). Modules compiled meanwhile: one
    not yet called runs what plain ``torch.compile`` would; one already woven
    keeps its plan; a ``checkpoint_wrapper`` around a compiled block that has
    not woven is plain torch's wrapper again.
    """
    startup.uninstall()
    _settings.reload(_settings.Settings(enabled=False))


def is_enabled() -> bool:
    """True when at least one of autoweave's patches is in place (or will be at torch import)."""
    if not _settings.current().enabled or startup.off_reason() is not None:
        return False  # off_reason: a missing dependency or an unsupported torch, said once, staying off
    if "torch" not in sys.modules:
        # A hook waits for torch: enable()'s, or the start-up file's (registered without enable()).
        return _installs.registered("torch")
    from autoweave.dispatch import patches

    return bool(patches.applied())


class disabled:  # noqa: N801 - used like a function: `with autoweave.disabled():`
    """Context manager: compile requests made inside go to plain torch.

    A class, not ``@contextmanager``: this module is imported at start-up in every
    process with ``AUTOWEAVE`` on, and ``contextlib`` would cost a millisecond there.
    """

    def __enter__(self) -> None:
        from autoweave.dispatch import routes

        self._cm = routes.disabled()
        self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)


def boundary(module: "nn.Module", reason: str = "marked with autoweave.boundary()") -> "nn.Module":
    """Mark ``module`` as a boundary: compiled regions stop at its call. Returns it."""
    from autoweave.planning import boundaries

    return boundaries.boundary(module, reason)


def register_boundary(predicate: "Any", *, name: str | None = None) -> "Any":
    """Register ``predicate(module) -> reason | True | None`` as a boundary kind."""
    from autoweave.planning import boundaries

    return boundaries.register_boundary(predicate, name=name)


def set_mode(module: "nn.Module", mode: str | None = None, *, strategy: str | None = None) -> "nn.Module":
    """Per-module weave mode (``auto``/``always``/``off``) and AC strategy."""
    from autoweave.dispatch import dispatchers

    return dispatchers.set_mode(module, mode, strategy=strategy)


def plan(
    module: "nn.Module",
    *,
    fullgraph: "bool | None" = None,
    mode: str | None = None,
    strategy: str | None = None,
) -> "Plan":
    """The plan autoweave would apply to ``torch.compile(module)`` now, without compiling.

    For a module already compiled (``torch.compile``'s result, or one compiled
    in place), the plan its dispatcher would run now: how it was compiled and
    what the run learned included. ``fullgraph`` None: as compiled (False for a
    module not compiled).
    """
    from autoweave.dispatch import plan_inputs

    return plan_inputs.plan(plan_inputs.request_of(module, fullgraph=fullgraph), mode=mode, strategy=strategy)


def explain(model_or_factory: "Any", **options: "Any") -> str:
    """The plan of each block of a model built on the meta device, without compiling.

    See :func:`autoweave.tools.explainer.explain` for ``ac``, ``shard``, ``recipe``,
    ``mode``, ``strategy`` and ``fullgraph``.
    """
    from autoweave.tools import explainer

    return explainer.explain(model_or_factory, **options)


def __getattr__(name: str) -> "Any":
    # AutoweaveError lives with the fail-open guard, which imports logging, inspect and
    # dataclasses (~25 ms); loaded on first use, so ``import autoweave`` stays cheap.
    if name == "AutoweaveError":
        from autoweave._failopen import AutoweaveError

        return AutoweaveError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
