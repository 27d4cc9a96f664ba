"""The planner's inputs, assembled in one place for whoever asks: a dispatcher, ``autoweave.plan()``, explain.

A plan depends on more than the module: how it was compiled (``fullgraph``,
whether ``torch.compile`` traces its ``__call__``), the AC wrapper around an
in-place compile, the mode and strategy (arguments, then ``set_mode``, then the
settings), what a fallback taught its dispatcher, and what the run learned
(``planning/learned``). A ``Request`` holds what belongs to one compile (its
dispatcher makes it; ``request_of`` finds it); ``plan`` adds the mode, the
strategy and what the run learned, the same way for every caller, so
``autoweave.plan(model)`` after a run is the plan its dispatcher runs.

The side effects planning needs happen here, not in ``planning/``: the boundary
plug-ins are loaded (once, before the first plan) and the checkpoints'
``context_fn``s are probed (lazily, at the planner's first lookup), and what one
rank's data taught is agreed with the ranks beside it.

**Every rank makes the same decisions** (``groups_running``, ``any_rank``). Two decisions are made from what a rank observes, and ranks see different data
(sequence lengths differ per rank in real jobs):

- a learned break (``planning/learned``): dynamo falls back on the
  checkpoint only on the rank whose data took the path that breaks;
- the first-call memory verdict of a ``pieces`` block (``weave/first_call_memory``):
  what the pieces hold against eager selective AC depends on the length the rank saw.

Ranks that plan a block differently run different code around its FSDP hooks
(a block under eager AC recomputes its nested unit's all-gather, one woven as
pieces does not), and can order their collectives differently: a hang. So both
are agreed: each is a few flags (which modules broke, did the pieces hold more),
all-reduced with MAX: what any rank saw counts on every rank (the break is
planned around everywhere; hoist holds at most what eager AC holds everywhere).

Where, and over whom. A collective is safe only where every rank of its group
issues it, in the same order with the others. Both agreements are made at a
module's first call (``_watched``: the first call of a plan, watched for
dynamo's fallback; ``FirstCall``: the first call with grad of a pieces block),
right after it returns, on every call that is such a first call whether or not
this rank saw anything. Whether a call is one depends only on the plan and the
state of the process (grad mode, the user's saved-tensor hooks), which agreed
decisions keep the same on every rank. The group is the ranks that run the
module: those its parameters are sharded over (``_compat.modules.process_groups_of``:
FSDP2's meshes, FSDP1's groups, a DTensor's mesh), found under the module
``torch.compile`` was handed (an FSDP unit wrapping the compiled module counts).
Those ranks gather its parameters at each forward, so they all reach the call;
under pipeline parallelism a stage's meshes hold only that stage's ranks. A
module with no sharded parameter (DDP, which wraps the model from outside; one
process; no process group) agrees with no one: nothing inside it is a
collective that a different plan could reorder, and it cannot be told which
ranks run it.

Decisions that need no agreement: a plan is a function of the module tree and
of what was learned (agreed); the split of a kind by a guarded value
(``weave/shared_kinds``) only chooses which of its own code objects holds a
graph dynamo specialized on the value (the graphs that run are the same), and
is read while dynamo compiles, which ranks do at different calls: no collective
is safe there. A graph or frame that fails to compile on one rank runs eager on
that rank alone, as plain torch does (``[graph-eager]``, ``[region-eager]``), and
so does a woven region at its recompile limit (``_compat.regions.lookups_in_order``).

**The probe of a checkpoint's ``context_fn``** (``probe``, ``Lazily``): called once, outside any
trace, to see what it returns. ``planning/checkpoint_calls`` judges the returned value; this is the only
place that calls the user's ``context_fn`` for it. Plain torch calls it at every
checkpointed forward, so one more call before the first one changes nothing a
``context_fn`` may rely on (it must hand out fresh contexts per call). One that
raises is the user's to raise, at the forward: nothing is decided from it. The
verdict is kept per ``context_fn`` object (``planning/learned``).

Lazily: the planner looks a checkpoint up only when it plans a checkpointed
block with a boundary inside (or an AC outside one), so blocks with nothing to
weave (torchtitan's, whose compile has no break) are never probed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from autoweave import _compat, _instances, _settings
from autoweave._failopen import swallowed
from autoweave._log import logger
from autoweave.planning import boundaries, checkpoint_calls, learned, planner
from autoweave.planning.learned import Learned


@dataclass(frozen=True)
class Request:
    """What a compile of ``module`` asks for, besides what the run learned.

    ``outer``: the AC wrapper around an in-place compiled block
    (``checkpoint_wrapper(torch.compile(block))``), if any. ``taught``: what a
    fallback taught this target's dispatcher: its own ``breaks`` (ids -> why),
    a forced ``mode``, and ``children_one_by_one`` (the last resort when a
    learned plan would not weave).
    """

    module: nn.Module
    fullgraph: bool = False
    outer: nn.Module | None = None
    call_traced: bool = True  # torch.compile(module) traces __call__; in-place compile does not
    taught: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def request_of(module: nn.Module, *, fullgraph: bool | None = None) -> Request:
    """The request behind ``module``: its dispatcher's when it was compiled, else ``torch.compile(module)``'s.

    ``fullgraph`` None: as compiled (False for a module not compiled).
    """
    dispatcher = _instances.dispatcher_of(module)
    if dispatcher is None:
        return Request(module, fullgraph=bool(fullgraph))
    request = dispatcher.request()
    return request if fullgraph is None else replace(request, fullgraph=fullgraph)


def plan(request: Request, *, mode: str | None = None, strategy: str | None = None) -> planner.Plan:
    """The plan for ``request`` now; ``mode`` / ``strategy`` win over what was taught, set or configured."""
    load_boundary_plugins()
    taught = request.taught
    mode, strategy = _settings.mode_and_strategy(
        request.module, mode or taught.get("mode"), strategy or taught.get("strategy")
    )
    outer = request.outer
    learned = Learned.for_target(
        request.module,
        breaks=taught.get("breaks"),
        untraceable=Lazily(request.module, outer, strategy=strategy, mode=mode),
    )
    return planner.plan(
        request.module,
        mode=mode,
        strategy=strategy,
        fullgraph=request.fullgraph,
        outer_ac=planner.checkpoint_spec(outer) if outer is not None else None,
        call_traced=request.call_traced,
        learned=learned,
        children_one_by_one=bool(taught.get("children_one_by_one")),
        nested_breaks=_compat.dynamo.nested_breaks_supported(),
    )


# -- boundary plug-ins ---------------------------------------------------------------------

_plugins_loaded = False


def load_boundary_plugins() -> None:
    """Register the boundary kinds third-party packages declare (entry points), once per process.

    At the first plan, not at start-up: start-up never pays for the metadata
    scan. What it registers is autoweave's own list of classifiers (nothing on
    torch or logging), so it stays for the process, like a ``register_boundary``.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        # The standard library's reader (3.10+ selects by group): importing the
        # importlib_metadata backport would put its finder on sys.meta_path for good.
        import importlib.metadata

        found = importlib.metadata.entry_points(group=boundaries.ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - metadata is best effort
        logger.debug("could not read entry points %s", boundaries.ENTRY_POINT_GROUP, exc_info=True)
        return
    for entry_point in found:
        try:
            boundaries.register_boundary(entry_point.load(), name=f"{entry_point.name} (plug-in)")
        except Exception as exc:
            swallowed(
                "boundary-plugin",
                f"plugin:{entry_point.name}",
                f"the boundary plug-in {entry_point.name!r} ({entry_point.value}) failed to load: "
                f"{type(exc).__name__}: {exc}; planning goes on without it",
                exc,
            )


def groups_running(module: Any) -> list[Any]:
    """The process groups of the ranks that run ``module`` (more than one rank each), in module order."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    found: dict[int, Any] = {}
    for sub in module.modules():
        for group in _compat.modules.process_groups_of(sub):
            if group.size() > 1:
                found.setdefault(id(group), group)
    return list(found.values())


def _device(group: Any) -> Any:
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    accelerator = None if "gloo" in backend or "mpi" in backend else torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def any_rank(module: Any, flags: Sequence[bool]) -> list[bool]:
    """Each flag, true if it is true on any rank that runs ``module`` (the same list on each of them).

    Every rank that runs ``module`` must call this at the same point with as
    many flags; with no group to agree with, the flags come back as they are.
    """
    import torch.distributed as dist

    agreed = [bool(f) for f in flags]
    groups = groups_running(module) if agreed else []
    try:
        # One group after another: the MAX over each mesh dimension in turn is the MAX over the mesh.
        for group in groups:
            tensor = torch.tensor(agreed, dtype=torch.int32, device=_device(group))
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            agreed = [bool(v) for v in tensor.tolist()]
    except Exception as exc:
        swallowed(
            "internal-error",
            "rank-agreement",
            f"the ranks running {type(module).__name__} could not agree on what they saw; "
            "each decides from its own",
            exc,
        )
        return [bool(f) for f in flags]
    return agreed


def probe(context_fn: Any) -> str | None:
    """Why a traced checkpoint cannot take ``context_fn``; None when it can (or it cannot be told)."""
    if context_fn is None:
        return None
    verdict = learned.context_verdict(context_fn)
    if verdict is learned.UNJUDGED:
        verdict = _call_and_judge(context_fn)
        learned.learn_context(context_fn, verdict)
    return verdict


def _call_and_judge(context_fn: Any) -> str | None:
    if checkpoint_calls.known_traceable(context_fn):
        return None  # torch's own: two dispatch modes, not called
    try:
        contexts = context_fn()
    except Exception as exc:  # the user's error, raised again by their checkpoint at the forward
        logger.debug("context_fn %r raised when probed; not judged", context_fn, exc_info=exc)
        return None
    return checkpoint_calls.why_not_traceable(context_fn, contexts)


def untraceable(
    target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto"
) -> dict[int, str]:
    """Checkpoint wrappers under ``target`` (and ``outer``) whose ``context_fn`` cannot be traced.

    Keyed by ``id`` of the wrapper's ``checkpoint_fn`` (what ``planner.CheckpointSpec``
    carries), with why: ``Learned.untraceable``. Nothing is probed where the plan
    would not trace a checkpoint (blocks under ``hoist``, anything
    under ``mode=off``).
    """
    found: dict[int, str] = {}
    if mode == "off":
        return found
    # A selective AC outside the compile is moved into the regions under every strategy;
    # the blocks inside are traced only under the tracing ones.
    modules = list(target.modules()) if strategy in checkpoint_calls.TRACING_STRATEGIES else []
    if outer is not None:
        modules.append(outer)
    try:
        wrapper_cls = _compat.modules.checkpoint_wrapper_class()
    except _compat.lookup.UnsupportedTorch:
        return found
    for module in modules:
        if not isinstance(module, wrapper_cls):
            continue
        # probe: None for a wrapper without a context_fn
        fn = _compat.modules.checkpoint_fn(module)
        why = probe(checkpoint_calls.context_fn_of(fn))
        if why is not None:
            found[id(fn)] = why
    return found


class Lazily(Mapping[int, str]):
    """``untraceable(...)``'s answer, probed at the first lookup: a plan that weaves nothing calls no ``context_fn``."""

    def __init__(self, target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto") -> None:
        self._args = (target, outer)
        self._options = {"strategy": strategy, "mode": mode}
        self._found: dict[int, str] | None = None

    def _probed(self) -> dict[int, str]:
        if self._found is None:
            self._found = untraceable(*self._args, **self._options)
        return self._found

    def __getitem__(self, key: int) -> str:
        return self._probed()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._probed())

    def __len__(self) -> int:
        return len(self._probed())
