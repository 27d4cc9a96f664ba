"""Run one drawn case under plain torch and under autoweave, in this process, and compare (issue 31).

Both runs start from the same state: dynamo reset, autoweave's run state reset,
the same parameters and inputs. Plain torch is the same code compiled inside
``autoweave.disabled()``. What is compared is what the guarantee promises
(docs/guarantees.md): the same error where plain raises (none where it trains),
equal losses and grads, equal hook calls, activation memory at most 1.05x,
recompiles at most plain's plus the woven frames', nothing left alive after the
model is dropped that plain torch frees, and the same torch warnings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import re
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._dynamo.utils import counters

import autoweave
from autoweave import _compat, _state
from benchmarks.measure import heap_in_use
from tests.fuzz.grammar import DIM, Case, block_of, build, lengths_of, one_rank, real_unit

BACKEND = "aot_eager"
MEMORY_RATIO = 1.05
# The C heap also holds what a forward allocates besides tensors (autograd's nodes, Python's
# objects): a few KiB, against activations of 16 KiB each (a batch of 64).
MEMORY_SLACK = 8 * 1024
# torch's records that follow from what autoweave compiles, not from what it observes: a
# recompile-limit warning (compared as recompiles), and torch's note that a selective
# checkpoint runs under torch.compile (the ``pieces`` strategy puts it there).
CONSEQUENCES = {"torch._dynamo.convert_frame", "torch._higher_order_ops.wrap"}


MEASURE_STEPS = 5


@dataclasses.dataclass
class Outcome:
    error: tuple[int, str] | None = None  # (step, exception type) where the run raised
    error_bases: tuple[str, ...] = ()  # the names of that type's classes (what an ``except`` catches)
    refused_recompile: bool = False  # dynamo raised for a recompile under ``fail_on_recompile``
    settled: bool = False  # autoweave's watchdog (or the recompile limit) settled a block
    losses: list[float] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    none_grads: list[tuple[bool, ...]] = dataclasses.field(default_factory=list)  # per step: grad is None
    steady_frames: int = 0  # frames dynamo converted in a repeated last step (after warm-up)
    own_warnings: list[str] = dataclasses.field(default_factory=list)  # autoweave's warnings, by key
    hook_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    hook_lists: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # traced hooks' records
    forward_passes: dict[str, int] = dataclasses.field(default_factory=dict)  # per hook, while registered
    held_bytes: int | None = None  # C heap a training forward leaves held for backward
    frames: dict[int, int] = dataclasses.field(default_factory=dict)  # frame id -> its recompiles
    recompiles: int = 0
    # Recompiles whose every cached entry failed on its backend alone (BACKEND_MATCH): a frame's
    # first compile under another backend. autoweave builds one backend per kind of region, and a
    # helper every kind reaches at a break compiles once per kind: counted as the kind's, as the
    # kind's own region code (a frame of its own) is. A kind splits only on a number dynamo
    # guards on, which plain torch.compile of the same blocks recompiles their code on too.
    new_backend_compiles: dict[int, int] = dataclasses.field(default_factory=dict)  # per frame id
    kinds: int = 0  # the kinds of region autoweave built a backend for
    alive_after_drop: bool = False
    warnings: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    degraded: dict[str, int] = dataclasses.field(default_factory=dict)  # autoweave's fail-open slugs


class _TorchWarnings(logging.Handler):
    """torch's WARNING-and-above records (what a user sees by default), as (logger, level)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.name, record.levelno))


@contextlib.contextmanager
def _compiles(outcome: Outcome) -> Iterator[Any]:
    """dynamo's compiles while inside: frames by id, recompiles counted (re-registered after resets)."""
    callbacks = _compat.dynamo.compile_callbacks()

    def on_start(args: object = None, *_: object) -> None:
        if getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO") != "DYNAMO":
            return
        if ids := _frame_and_attempt(getattr(args, "compile_id", "")):
            frame, attempt = ids
            outcome.frames[frame] = max(outcome.frames.get(frame, 0), attempt)
            outcome.recompiles += attempt > 0

    def register() -> None:
        callbacks.remove_start_callback(on_start) if on_start in _starts(callbacks) else None
        callbacks.register_start_callback(on_start)

    convert = torch._dynamo.convert_frame
    reasons_of = getattr(convert, "get_and_maybe_log_recompilation_reasons", None)

    def reasons(*args: Any, **kwargs: Any) -> Any:  # dynamo's, called at each recompile
        found = reasons_of(*args, **kwargs)
        if found and all("BACKEND_MATCH" in reason for reason in found):
            if ids := _frame_and_attempt(torch._guards.CompileContext.current_compile_id()):
                outcome.new_backend_compiles[ids[0]] = outcome.new_backend_compiles.get(ids[0], 0) + 1
        return found

    register()
    if reasons_of is not None:
        convert.get_and_maybe_log_recompilation_reasons = reasons
    try:
        yield register
    finally:
        if reasons_of is not None:
            convert.get_and_maybe_log_recompilation_reasons = reasons_of
        with contextlib.suppress(Exception):
            callbacks.remove_start_callback(on_start)


def _frame_and_attempt(compile_id: object) -> tuple[int, int] | None:
    """The frame id and attempt of a dynamo compile id (``"3/1"``), None where it has none."""
    match = re.search(r"(\d+)/(\d+)", str(compile_id))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _starts(callbacks: Any) -> list[Any]:
    return list(getattr(callbacks, "start_callbacks", ()))


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad``, whole: an FSDP2 parameter's (``parallel="fsdp-mp"``) is a DTensor."""
    full = getattr(grad, "full_tensor", None)
    return (full() if full is not None else grad).detach().clone()


def _compile(case: Case, model: torch.nn.Module, *, on: bool) -> torch.nn.Module:
    """``model`` compiled as ``case.form`` says; returns what the training loop calls."""
    options: dict[str, Any] = {"backend": BACKEND, "fullgraph": case.fullgraph}
    if case.lengths == "dynamic=True":
        options["dynamic"] = True
    targets = list(model.layers) if "block" in case.form else [model]
    if on:
        for target in targets:
            autoweave.set_mode(target, strategy=case.strategy)
    with contextlib.nullcontext() if on else autoweave.disabled():
        if case.form == "torch.compile(block)":
            for i, layer in enumerate(list(model.layers)):
                model.layers[i] = torch.compile(layer, **options)
        elif case.form == "block.compile()":
            for layer in model.layers:
                layer.compile(**options)
        elif case.form == "torch.compile(model)":
            return torch.compile(model, **options)
        else:
            model.compile(**options)
    return model


def _hook(case: Case, outcome: Outcome, key: str, kind: str) -> Any:
    """A hook that counts its calls and changes what it sees (a skipped hook changes the loss).

    ``disabled-count``: counted outside dynamo (traced, the count is a value dynamo guards on).
    ``traced-list`` and ``activation-stats`` count as users write hooks, traced: an append to a
    list, or a statistic of what the hook sees; both are counted from the list's length.
    """
    calls: list[Any] = []
    outcome.hook_lists[key] = calls

    @torch.compiler.disable
    def disabled_count() -> None:
        outcome.hook_calls[key] = outcome.hook_calls.get(key, 0) + 1

    def count(seen: Any = None) -> None:
        if case.hook_style == "disabled-count":
            disabled_count()
        elif case.hook_style == "traced-list" or not isinstance(seen, torch.Tensor):
            calls.append(1)
        else:
            calls.append(seen.detach().abs().mean())

    def forward_hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        count(output)
        return output * 1.25

    def pre_hook(module: Any, args: tuple) -> tuple:
        count(args[0])
        return (args[0] * 0.75, *args[1:])

    def backward_hook(module: Any, grad_input: tuple, grad_output: tuple) -> tuple:
        count(grad_output[0])
        return tuple(None if g is None else g * 1.5 for g in grad_input)

    return {"forward": forward_hook, "pre": pre_hook, "backward": backward_hook}[kind]


def _register(module: torch.nn.Module, kind: str, hook: Any) -> Any:
    if kind == "forward":
        return module.register_forward_hook(hook)
    if kind == "pre":
        return module.register_forward_pre_hook(hook)
    return module.register_full_backward_hook(hook)


def _input(case: Case, step: int, length: int) -> torch.Tensor:
    x = torch.randn(64, length, DIM, generator=torch.Generator().manual_seed(1000 + step))
    if case.lengths == "mark_dynamic":
        torch._dynamo.mark_dynamic(x, 1)
    return x


def _train(case: Case, outcome: Outcome, *, on: bool) -> None:
    torch._dynamo.reset()
    _state.reset()
    model = build(case)
    param = weakref.ref(model.layers[0].get_parameter(next(n for n, _ in model.layers[0].named_parameters())))
    hooks: dict[tuple, Any] = {}
    step = -1

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer, on_sub, kind in hooks:
            name = f"{layer}.{on_sub}.{kind}"
            outcome.forward_passes[name] = outcome.forward_passes.get(name, 0) + 1
        if case.autocast:  # mixed precision as trainers run it: the loss in fp32
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return call(x).float()
        return call(x)

    with _compiles(outcome) as reregister:
        try:
            call = _compile(case, model, on=on)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            sticky = "default"
            for step, length in enumerate(lengths_of(case)):
                stance = sticky
                for at, event, layer, on_sub, kind in case.events:
                    if at != step:
                        continue
                    block = block_of(model, layer)
                    sub = block.q if case.call_path == "forward" else block.out_module
                    target = sub if on_sub else block
                    key = (layer, on_sub, kind)
                    if event == "hook-add" and key not in hooks:
                        hooks[key] = _register(
                            target, kind, _hook(case, outcome, f"{layer}.{on_sub}.{kind}", kind)
                        )
                    elif event == "hook-remove" and key in hooks:
                        hooks.pop(key).remove()
                    elif event == "reset":
                        torch._dynamo.reset()
                        reregister()
                    elif event == "force-eager":
                        stance = "force_eager"
                    elif event in ("freeze", "unfreeze"):  # staged or LoRA-style fine-tuning
                        for p in block.parameters():
                            p.requires_grad_(event == "unfreeze")
                    elif event == "fail-on-recompile":  # from this step on: warm-up is over
                        sticky = "fail_on_recompile"
                    elif event == "eval-step":
                        call.eval()
                        with torch.no_grad():
                            outcome.losses.append(
                                forward(_input(case, 100 + step, length)).square().mean().item()
                            )
                        call.train()
                with torch.compiler.set_stance(stance):
                    loss = forward(_input(case, step, length)).square().mean()
                    loss.backward()
                outcome.losses.append(loss.item())
                outcome.none_grads.append(tuple(p.grad is None for p in model.parameters()))
                if step == case.steps - 1:
                    outcome.grads = [None if p.grad is None else _whole(p.grad) for p in model.parameters()]
                opt.step()
                opt.zero_grad()
            step = case.steps
            # One more step, its forward under the user's saved-tensor hooks (CPU offload's form).
            x = _input(case, step, lengths_of(case)[-1])
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = forward(x).square().mean()
            loss.backward()
            outcome.losses.append(loss.item())
            # Then MEASURE_STEPS steps (as many in every run: hook calls are compared), the held
            # memory of a forward the least of those that compile nothing (a compile keeps its
            # caches on the heap; a block planned again, or settled by the watchdog, compiles
            # its new frames a step or two later; and the call after a compile may still keep
            # ~128 KB of one-time heap: seed 14030, 181 KB at that call and 54 KB after, its
            # saved tensors the same 36,992 B at every call), else at the last.
            quiet: list[int] = []
            for _ in range(MEASURE_STEPS):
                compiles = sum(outcome.frames.values()) + len(outcome.frames)
                gc.collect()
                before = heap_in_use()
                loss = forward(x).square().mean()
                held = None if before is None else heap_in_use() - before
                loss.backward()
                if held is not None and sum(outcome.frames.values()) + len(outcome.frames) == compiles:
                    quiet.append(held)
                outcome.held_bytes = min(quiet) if quiet else held
            outcome.losses.append(loss.item())
            # The steady state: the same step once more converts no frame plain torch does not.
            frames = counters["frames"]["total"]
            forward(x).square().mean().backward()
            outcome.steady_frames = counters["frames"]["total"] - frames
        except Exception as exc:  # the comparison is whether plain torch raises it too
            outcome.error = (step, type(exc).__name__)
            outcome.error_bases = tuple(c.__name__ for c in type(exc).__mro__)
            outcome.refused_recompile = "fail_on_recompile" in str(exc)
        finally:
            for handle in hooks.values():
                handle.remove()
    model = call = opt = None  # the closure above holds ``call`` too
    hooks.clear()
    for key, calls in outcome.hook_lists.items():
        outcome.hook_calls[key] = outcome.hook_calls.get(key, 0) + len(calls)
    outcome.hook_lists.clear()
    # Freed as the collector frees it, pass after pass: an error's traceback may hold tensors
    # whose autograd nodes (C++, which the collector cannot see into) hold FSDP2's state and
    # the model; one pass frees the frames, the next what they held (seeds 30054, 31089: a
    # fullgraph error raised after FSDP2's pre-forward ran; plain raised before it).
    for _ in range(4):
        if not gc.collect():
            break
    outcome.alive_after_drop = param() is not None


def run(case: Case, *, on: bool, dynamo: dict[str, Any] | None = None) -> Outcome:
    """One run of ``case``: plain torch (``on=False``) or autoweave; ``dynamo``: more of dynamo's config."""
    outcome = Outcome()
    handler = _TorchWarnings()
    torch_logger = logging.getLogger("torch")
    torch_logger.addHandler(handler)
    config = {} if case.recompile_limit is None else {"recompile_limit": case.recompile_limit}
    config.update(dynamo or {})
    try:
        with torch._dynamo.config.patch(**config), torch.random.fork_rng(), one_rank(case):
            _train(case, outcome, on=on)
    finally:
        torch_logger.removeHandler(handler)
        outcome.degraded = dict(_state.run.swallowed)
        outcome.kinds = len(_state.run.region_backends)
        warned = set(_state.run.warned_keys)
        torch._dynamo.reset()
        _state.reset()
    outcome.warnings = sorted(handler.seen)
    # autoweave's own warnings (stderr, once per key), but for the settling it warns of by design:
    # at the recompile limit, and the steady-state watchdog (docs/guarantees.md).
    outcome.settled = any(key.startswith(("recompile-limit", "steady-state")) for key in warned)
    outcome.own_warnings = sorted(
        key for key in warned if not key.startswith(("recompile-limit", "steady-state", "fail-on-recompile"))
    )
    return outcome


def differences(case: Case, plain: Outcome, woven: Outcome, bound: Outcome) -> list[str]:
    """What autoweave did that plain torch did not, in words; [] when the run is as plain.

    ``bound``: plain torch on the same blocks without their break (what compiling them costs).
    """
    out = []
    if woven.degraded:  # a failure of autoweave's own, failed open: plain torch has none
        out.append(f"degraded: {woven.degraded}")
    # The same error: caught by the same ``except`` (autoweave's fullgraph error subclasses dynamo's).
    same_error = plain.error == woven.error or (
        plain.error is not None
        and woven.error is not None
        and plain.error[0] == woven.error[0]
        and plain.error[1] in woven.error_bases
    )
    # Under ``fail_on_recompile`` plain torch may raise where a frame of its own around a block
    # (the checkpoint wrapper's ``forward``, static again after a reset) must recompile for a new
    # length; autoweave's regions stand in for that frame and, holding a dynamic length or
    # running eager where none of their graphs fits ([fail-on-recompile]), recompile nothing.
    # The stance forbids recompiles; under autoweave none happened (docs/guarantees.md).
    refused = plain.refused_recompile and woven.error is None
    if not same_error and not refused:
        out.append(f"error: plain {plain.error}, autoweave {woven.error}")
        return out
    if refused:  # compared up to plain's last step; nothing after it is plain's
        if not all(
            math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
            for a, b in zip(plain.losses, woven.losses, strict=False)
        ):
            out.append(f"losses: plain {plain.losses}, autoweave {woven.losses[: len(plain.losses)]}")
        return out
    if len(plain.losses) != len(woven.losses) or not all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
        for a, b in zip(plain.losses, woven.losses, strict=True)
    ):
        out.append(f"losses: plain {plain.losses}, autoweave {woven.losses}")
    for step, (a, b) in enumerate(zip(plain.none_grads, woven.none_grads, strict=False)):
        if a != b:
            which = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            out.append(f"grad is None at step {step} differs for parameters {which}")
            break
    if woven.steady_frames > plain.steady_frames:
        out.append(f"steady-state frames: plain {plain.steady_frames}, autoweave {woven.steady_frames}")
    if woven.own_warnings and not plain.warnings:
        out.append(f"autoweave warned where plain torch warns nothing: {woven.own_warnings[:2]}")
    for i, (a, b) in enumerate(zip(plain.grads, woven.grads, strict=False)):
        if (a is None) != (b is None) or (
            a is not None and not torch.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
        ):
            out.append(f"grad of parameter {i} differs")
            break
    # A backward hook runs once a backward; a forward or pre-forward hook once a forward pass, and
    # again in a checkpoint's recompute where that recompute runs it eager (plain torch, up to its
    # early stop). A recompute inside a compiled graph does not replay its Python side effects, so
    # a woven block's count lies between the forward passes and plain torch's (docs/guarantees.md).
    for name in sorted(set(plain.hook_calls) | set(woven.hook_calls)):
        got, want = woven.hook_calls.get(name, 0), plain.hook_calls.get(name, 0)
        low = want if name.endswith("backward") else min(want, woven.forward_passes.get(name, 0))
        if not low <= got <= want:
            out.append(
                f"hook {name} calls: plain {want}, autoweave {got} ({woven.forward_passes.get(name, 0)} forward passes)"
            )
    # The memory bound is the default's (``auto``); a strategy asked for by name holds what it holds.
    if case.strategy == "auto" and plain.held_bytes is not None and woven.held_bytes is not None:
        if woven.held_bytes > MEMORY_RATIO * plain.held_bytes + MEMORY_SLACK:
            out.append(f"activation memory: plain {plain.held_bytes} B, autoweave {woven.held_bytes} B")
    # Each frame autoweave compiles may recompile as often as plain torch recompiles the same
    # block without its break (per value, per shape, per grad mode), once more for a dynamic
    # length learned a step later, and again after each reset. A frame that recompiles at every
    # call (a counter, a hook appending to a list) does so STORM_CALLS times before the watchdog
    # sees the storm and settles its block (docs/guarantees.md, the steady state).
    resets = 1 + sum(event == "reset" for _, event, *_ in case.events)
    storm = _compat.regions.STORM_CALLS if woven.settled else 0
    per_frame = resets * (1 + max(max(bound.frames.values(), default=0), storm))
    # A frame's first compile under another kind's backend is that kind's compile, not a
    # recompile (seed 50153: three kinds split on a counter, each compiling the helper ``_at``
    # and its resume frame; the bound's checkpointed blocks fell back on the counter and
    # compiled nothing): at most one per frame for each kind beyond the first. The check stays a
    # sum over frames: one frame's count alone cannot tell a resume frame that recompiles per
    # ``.item()`` value up to the limit (as ``torch.compile`` of the block without AC does) from
    # a storm; the watchdog's own tests bound a region's frame (seed 39271's).
    per_kind = resets * max(woven.kinds - 1, 0)
    first_compiles = sum(min(n, per_kind) for n in woven.new_backend_compiles.values())
    if woven.recompiles - first_compiles > plain.recompiles + len(woven.frames) * per_frame:
        out.append(
            f"recompiles: plain {plain.recompiles}, autoweave {woven.recompiles} over {len(woven.frames)} "
            f"frames (at most {per_frame} each; the block without its break recompiles a frame "
            f"{max(bound.frames.values(), default=0)} times"
            + (f"; {first_compiles} of them first compiles of other kinds" if first_compiles else "")
            + ")"
        )
    if woven.alive_after_drop and not plain.alive_after_drop:
        out.append("the dropped model stays alive (plain torch frees it)")
    shown = {w for w in plain.warnings if w[0] not in CONSEQUENCES}
    woven_shown = {w for w in woven.warnings if w[0] not in CONSEQUENCES}
    if shown != woven_shown:
        out.append(f"torch warnings: plain {sorted(shown)}, autoweave {sorted(woven_shown)}")
    return out


def reference(case: Case, plain: Outcome, woven: Outcome) -> Outcome:
    """What autoweave's run of ``case`` is compared with: plain torch's, ``plain``, but for one case.

    Under ``fullgraph=True`` with real FSDP2 units and no break but theirs, plain torch raises
    at a unit's hooks (dynamo is told to skip them) where autoweave, by design, splits the
    block at them and compiles the rest whole (docs/strategies.md, "fullgraph=True"). Where
    plain raised that way at the first step and autoweave trained, plain torch without
    ``fullgraph`` is the reference (seed 21090: the layers' own units inside a checkpoint
    around ``__call__``).
    """
    units_only = case.fullgraph and case.brk == "fsdp-unit" and real_unit(case)
    raised = plain.error is not None and plain.error[0] == 0 and "Unsupported" in plain.error_bases
    if units_only and raised and woven.error is None:
        return run(dataclasses.replace(case, fullgraph=False), on=False)
    # And where autoweave raised too: past FSDP2's hooks it met an error of the user's code,
    # which plain torch raises once those hooks are out of its way: on the same blocks without
    # FSDP2 (seeds 30062, 30144, 31089: plain ``fullgraph=True``'s ``UserError`` at a ``.item()``
    # under a dynamic length), or without ``fullgraph`` (seed 30363: a float tensor met FSDP2's
    # bf16 parameters, ``RuntimeError``, as plain torch without ``fullgraph`` raises it).
    units = case.fullgraph and case.parallel == "fsdp-mp"
    if units and raised and woven.error is not None and woven.error[0] == 0:
        for variant in ({"parallel": "none"}, {"fullgraph": False}):
            other = run(dataclasses.replace(case, **variant), on=False)
            if other.error is not None and other.error[0] == 0 and other.error[1] in woven.error_bases:
                return other
    # And where autoweave's own fullgraph error came after the first call ran compiled (by
    # design, docs/strategies.md) and plain's came before any: what a run that compiled and ran
    # a forward leaves held at that moment (dynamo's state of that call, freed once the caller
    # returns) is plain torch's without ``fullgraph``, which holds it too (seed 31485).
    if raised and woven.error is not None and woven.error[0] == 0 and woven.error[1] == "FullgraphBreak":
        ran = run(dataclasses.replace(case, fullgraph=False), on=False)
        return dataclasses.replace(plain, alive_after_drop=plain.alive_after_drop or ran.alive_after_drop)
    # And where a hook was added after plain torch compiled the code it sits in: dynamo does not
    # guard on hooks by default (``skip_nnmodule_hook_guards``), so plain torch.compile may run a
    # graph traced without it, where eager torch runs the hook (seed 34327: a pre-hook added at
    # step 1, then an eval step, whose blocks run without their checkpoint around ``__call__`` and
    # are traced by the whole-model compile: plain skipped the hook, eager and autoweave ran it).
    # The reference is then plain torch told to guard on hooks, which runs the user's program.
    added = any(event == "hook-add" and at > 0 for at, event, *_ in case.events)
    if added and plain.error is None and plain.losses != woven.losses:
        return run(case, on=False, dynamo={"skip_nnmodule_hook_guards": False})
    return plain


def check(seed: int) -> tuple[Case, list[str]]:
    """Draw case ``seed``, run it both ways, and list the differences."""
    from tests.fuzz.grammar import draw

    case = draw(seed)
    return case, compare(case)[0]


def compare(case: Case) -> tuple[list[str], Outcome]:
    """Run ``case`` both ways: the differences, and autoweave's run."""
    plain = run(case, on=False)
    woven = run(case, on=True)
    plain = reference(case, plain, woven)
    found = differences(case, plain, woven, Outcome())
    if any(line.startswith("recompiles:") for line in found):
        # The bound is run only where the recompiles need it: a third run costs as much again,
        # and it can only allow more (an empty bound allows the least).
        found = differences(case, plain, woven, run(bound_of(case), on=False))
    return found, woven


def bound_of(case: Case) -> Case:
    """The same blocks without their break, each compiled as ``torch.compile(block)``.

    What plain torch compiles per kind of block and per shape: autoweave's regions are
    per kind of block whatever the compile form, and a whole-model compile of blocks
    without a break inlines them all into one frame that says nothing of that.
    """
    form = case.form if "block" in case.form else "torch.compile(block)"
    # The router statistic read on the host (``stat_gate``) is a break too: kept, the bound's
    # checkpointed blocks fell back to eager and compiled nothing (seed 34651: 0 recompiles
    # where the blocks without a break recompile per value and per grad mode).
    return dataclasses.replace(case, brk="none", stat_gate=False, form=form)
