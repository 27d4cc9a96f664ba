"""Worker for tests/test_disable.py: what ``autoweave.disable()`` leaves behind, in a fresh process.

``python tests/disable_worker.py SCENARIO`` snapshots everything autoweave may touch
(torch's patched functions, ``sys.meta_path``, every ``torch``/``autoweave``
logger, logging's level names, torch's module registration hooks, FSDP2's
``FSDPState.init``, dynamo's compile callbacks, torch's log registry, the exit
callbacks), then turns autoweave on, compiles and runs models (woven, gated by
an outer ``checkpoint_wrapper``, compiled in place), turns it off and snapshots
again. It prints one JSON object: each field that differs, before and after.

Scenarios: ``once`` (enable, run, disable), ``cycle`` (that twice over, with a
second ``enable()`` each time, which must install nothing). The test sets the
environment (``AUTOWEAVE_REPORT``, ``TORCH_LOGS``, ``TORCH_TRACE``,
``AUTOWEAVE_LOG_LEVEL``) so the report, trace, graph-break watch and log
installs happen too.

Nothing of autoweave beyond ``import autoweave`` (standard library only) is
imported before the first snapshot: importing it must change nothing either.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import pkgutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo.callback as dynamo_callback  # noqa: E402
import torch._dynamo.output_graph as output_graph  # noqa: E402
import torch._logging._internal as torch_logging  # noqa: E402
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.modules.module as module_module  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fsdp_state  # noqa: E402

import autoweave  # noqa: E402

DEFAULT_LOGGER = ("NOTSET", True, (), (), False)
# torch's own artifact loggers, made when torch imports the module that owns one
# (a first compile imports more of torch): off by default, so not propagating.
ARTIFACT_LOGGER = ("NOTSET", False, (), (), False)

# atexit cannot list its callbacks: keep the ones autoweave's modules register
# (torch's lazily imported modules, and tqdm's monitor, register their own).
_exit_callbacks: list = []
_register, _unregister = atexit.register, atexit.unregister


def _register_exit(function, *args, **kwargs):
    if (getattr(function, "__module__", None) or "").startswith("autoweave"):
        _exit_callbacks.append(function)
    return _register(function, *args, **kwargs)


def _unregister_exit(function):
    _exit_callbacks[:] = [f for f in _exit_callbacks if f != function]
    return _unregister(function)


atexit.register, atexit.unregister = _register_exit, _unregister_exit


def _skip(module: nn.Module, args: Any) -> None:
    return None


class Experts(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        # A torch.compiler.disable'd pre-hook, as fully_shard gives a unit: a real graph break.
        self.register_forward_pre_hook(torch.compiler.disable(_skip))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = Experts(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.experts(self.norm(x)))


def _logger_state(log: Any) -> tuple:
    if not isinstance(log, logging.Logger):
        return DEFAULT_LOGGER  # a PlaceHolder: no logger yet, so nothing set on it
    return (
        logging.getLevelName(log.level),
        log.propagate,
        tuple(log.handlers),
        tuple(log.filters),
        log.disabled,
    )


def snapshot() -> dict[str, Any]:
    loggers = {
        name: _logger_state(log)
        for name, log in logging.Logger.manager.loggerDict.items()
        if name.split(".")[0] in ("torch", "autoweave")
    }
    loggers[""] = _logger_state(logging.getLogger())
    return {
        "torch.compile": torch.compile,
        "nn.Module.compile": nn.Module.__dict__["compile"],
        "checkpoint_wrapper": cw.checkpoint_wrapper,
        "apply_activation_checkpointing.__defaults__": cw.apply_activation_checkpointing.__defaults__,
        "sys.meta_path": tuple(sys.meta_path),
        "logging level names": (dict(logging._levelToName), dict(logging._nameToLevel)),
        "module registration hooks": tuple(module_module._global_module_registration_hooks.values()),
        "FSDPState.init": _fsdp_state.FSDPState.__dict__["init"],
        "dynamo start callbacks": tuple(dynamo_callback.callback_handler.start_callbacks),
        "dynamo end callbacks": tuple(dynamo_callback.callback_handler.end_callbacks),
        # Where the report hears dynamo hand each graph to its backend.
        "OutputGraph.call_user_compiler": output_graph.OutputGraph.__dict__["call_user_compiler"],
        # Kept across torch._dynamo.reset() by a wrapper on the registry's clear (observe.trace).
        "dynamo callback registry's clear": dynamo_callback.callback_handler.__dict__.get("clear"),
        "torch log aliases": tuple(sorted(torch_logging.log_registry.log_alias_to_log_qnames)),
        "atexit callbacks (autoweave's)": tuple(_exit_callbacks),
        "loggers": loggers,
    }


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[str]]:
    """Each field that differs (loggers one by one, as ``loggers:NAME``): [before, after] reprs."""
    out: dict[str, list[str]] = {}
    for key in before:
        if key == "loggers":
            continue
        if before[key] != after[key]:
            out[key] = [repr(before[key]), repr(after[key])]
    for name in sorted(set(before["loggers"]) | set(after["loggers"])):
        old = before["loggers"].get(name, DEFAULT_LOGGER)
        new = after["loggers"].get(name, DEFAULT_LOGGER)
        if (
            old == DEFAULT_LOGGER
            and new == ARTIFACT_LOGGER
            and name in torch_logging.log_registry.artifact_log_qnames
        ):
            continue  # made by torch since (a module of torch imported by the first compiles)
        if old != new:
            out[f"loggers:{name or '<root>'}"] = [repr(old), repr(new)]
    return out


def _train(model: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    for _ in range(steps):
        model(x).square().mean().backward()


def _run_models() -> None:
    """Every kind of compile, run, so the lazy installs (first calls, plans) happen."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    woven = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    gated = cw.checkpoint_wrapper(torch.compile(Block(), backend="aot_eager"))
    in_place = cw.checkpoint_wrapper(Block())
    in_place.compile(backend="aot_eager")
    model = nn.Sequential(Block(), Block())
    cw.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    model = torch.compile(model, backend="aot_eager")
    for m in (woven, gated, in_place, model):
        _train(m, x)


def _import_everything() -> None:
    import autoweave.dispatch
    import autoweave.observe
    import autoweave.planning
    import autoweave.sense
    import autoweave.tools
    import autoweave.weave

    packages = (
        autoweave,
        autoweave.planning,
        autoweave.weave,
        autoweave.sense,
        autoweave.dispatch,
        autoweave.observe,
    )
    for package in packages:
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg and info.name != "__main__":
                importlib.import_module(f"{package.__name__}.{info.name}")
    for info in pkgutil.iter_modules(autoweave.tools.__path__):
        importlib.import_module(f"autoweave.tools.{info.name}")


def _installs_now() -> list[str] | None:
    """The registry's entries, in install order (None where there is no registry)."""
    try:
        from autoweave import _installs
    except ImportError:
        return None
    return list(_installs.keys())


def main() -> None:
    scenario = sys.argv[1]
    # torch's own lazy imports (dynamo, aot, its loggers) happen here, with plain torch,
    # so that the snapshots compare what autoweave did, not what a first compile loads.
    torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")(torch.randn(4, 8)).sum().backward()
    torch._dynamo.reset()
    result: dict[str, Any] = {}
    fresh = snapshot()
    _import_everything()
    imported = snapshot()
    level, propagate, handlers, filters, disabled = imported["loggers"].get("autoweave", DEFAULT_LOGGER)
    # The library's NullHandler on its own logger is the one thing importing may add.
    had = fresh["loggers"].get("autoweave", DEFAULT_LOGGER)[2]
    handlers = tuple(h for h in handlers if h in had or type(h) is not logging.NullHandler)
    imported["loggers"]["autoweave"] = (level, propagate, handlers, filters, disabled)
    result["import"] = diff(fresh, imported)
    before = snapshot()
    rounds = 2 if scenario == "cycle" else 1
    result["disable"] = {}
    result["twice"] = {}
    for i in range(rounds):
        assert autoweave.enable()
        once, installs = snapshot(), _installs_now()
        assert autoweave.enable()
        # A second enable() installs nothing: the same snapshot, the same registry.
        result["twice"].update({f"{k} (round {i + 1})": v for k, v in diff(once, snapshot()).items()})
        if installs != _installs_now():
            result["twice"][f"installs (round {i + 1})"] = [repr(installs), repr(_installs_now())]
        _run_models()
        autoweave.disable()
        assert not autoweave.is_enabled()
        result["disable"].update({f"{k} (round {i + 1})": v for k, v in diff(before, snapshot()).items()})
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
