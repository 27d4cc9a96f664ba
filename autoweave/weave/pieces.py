"""The one backend a woven region hands dynamo, and the pieces it checkpoints.

**Pieces** (``CheckpointPieces``): checkpointing each compiled piece of a region that
dynamo splits (the ``pieces`` strategy).

A checkpoint that dynamo traces cannot hold a graph break: the whole region
would run eager. A region compiled *without* a checkpoint may break: dynamo
splits its forward at each break and hands every graph between two breaks to
the backend. The region's backend (``RegionBackend``) has ``CheckpointPieces``
compile each of them: it wraps the graph in torch's own checkpoint operator (``tag_activation_checkpoint``, what dynamo
emits for a traced ``checkpoint(...)``) with the user's ``context_fn`` and
options, then compiles it with the user's backend. So every op of the region
(the block's glue between its children and an FSDP unit included) is compiled
and checkpointed under the user's policy, applied to the aten ``.default`` ops
it was written for, and no checkpoint contains a break.

What it costs: a piece's inputs are kept for its backward (the whole block
kept only its input), so activation memory grows by the tensors that cross a
break. ``weave/first_call_memory`` measures it at a block's first call against what eager
selective AC would keep (its input, and the outputs the policy saves: this
helper tells it, having watched the policy while the pieces were traced);
``benchmarks/sac_memory.py`` measures both on whole models.

A piece that changes in place an input backward needs is compiled without the
checkpoint (see ``changed_inputs_backward_needs``); a policy that raises while a
piece is traced is the user's error: that piece runs as plain torch runs it,
eager under the checkpoint, where the policy raises again.

**The region backend** (``RegionBackend``): compile, fail open per graph, pieces, observers.
dynamo calls a region's backend once per graph it traces (a region that breaks
is several graphs). ``RegionBackend`` is that backend, alone between torch's own
``_TorchCompileWrapper`` (which ``torch.compile`` puts around any backend) and
the callable torch would have built from the user's ``backend``/``mode``/
``options``. It owns every reason autoweave has to touch a graph:

- compiling it with the user's backend;
- failing open, graph by graph: a graph the backend fails on runs eager, in the
  same call, the rest stays compiled (torch's ``suppress_errors`` would run the
  whole frame eager instead);
- pieces, when the region's checkpoint moved into it: each graph wrapped in
  torch's checkpoint operator (``CheckpointPieces``, the helper that
  knows how);
- publishing each graph (``_events.GRAPH_COMPILED``; the report subscribes):
  observing hands dynamo the very same backend, so a run with the report on
  compiles exactly what a run without it does;
- counting the graphs it was handed, compiled or run eager, per region
  (``_state.run.region_graphs``, always: once per graph, never per call), so the
  plan summary says what ran, not only what was planned.

``apply`` builds one backend per region key, so identical blocks share it by
construction, and dynamo (which matches a frame's cached graphs to the current
backend with ``==``) shares their graphs. (The one exception: a region of an
instance-level forward under pieces has one of its own, since its pieces
measure what that region holds.) Backends of different regions compare equal
when they compile alike (the same inner backend, no pieces), as torch's own
wrappers do: a submodule's class ``forward`` that dynamo traces as a frame of
its own after a break (it runs on the class's shared code) is reached from the
regions of every layer, and unequal backends would recompile it per layer up
to the recompile limit.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave import _compat, _events
from autoweave._failopen import RAN_EAGER, first_line, runs_eager, swallowed
from autoweave._log import logger
from autoweave._state import run
from autoweave.planning import checkpoint_calls
from autoweave.weave.grad_none import keep_none_grads

# The keyword options of torch.utils.checkpoint that the operator takes as they are.
_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")


def _returns_only_tensors(gm: Any) -> bool:
    """The checkpoint operator returns tensors: a piece returning anything else is left unwrapped."""
    import torch
    import torch.fx as fx

    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        results = (results,)
    return all(
        isinstance(r, fx.Node) and isinstance(_compat.checkpoints.traced_value(r), torch.Tensor)
        for r in results
    )


# -- inputs changed in place ---------------------------------------------------------------
#
# A checkpointed piece keeps its inputs to recompute from them in backward. One
# that changes an input in place (``relu(y, inplace=True)``, ``y.view(-1).add_(1)``,
# ``y[i] = v``, ``torch.mul(y, 2, out=y)``, ``y.copy_(...)``) destroys what its
# recompute needs: backward fails ("modified by an inplace operation") or
# would apply the change twice. Which inputs a graph changes is read from the
# graph itself, not from op names: it runs once on fake copies of its inputs,
# and autograd's version counter, which every in-place write bumps (through
# any view: views share their base's counter), tells which changed.


class _NoHint(Exception):
    """A symbolic size without a hint (unbacked): the replay cannot be made static."""


def _static(value: Any) -> Any:
    """``value``'s size (or a size-like scalar) as a plain number, read from its hint: never guarded on."""
    if isinstance(value, (int, float, bool)) or not hasattr(value, "node"):
        return value
    hint = _compat.checkpoints.size_hint(value)
    if hint is None:
        raise _NoHint(str(value))
    return hint


def _static_copy(mode: Any, value: Any) -> Any:
    """(Under ``mode``.) A fake copy of a graph's example input ``value``: its SymInts (dynamic sizes) replaced by their hints.

    The replay runs under a mode of autoweave's own, with no shape env; a SymInt
    of dynamo's met by a static fake op would be compared to a plain number
    there, and every such comparison is a guard in dynamo's shape env
    (``Eq(128*s27, 12288)`` from a reshape): the size would be specialized and
    the frame recompile at every new length, up to the recompile limit.
    """
    import torch

    if isinstance(value, torch.SymBool):
        hint = getattr(value.node, "hint", None)
        if hint is None:
            raise _NoHint(str(value))
        return bool(hint)
    if not isinstance(value, torch.Tensor):
        return _static(value)
    if all(isinstance(s, int) for s in (*value.shape, *value.stride(), value.storage_offset())):
        return mode.from_tensor(value).detach().clone()
    # A tensor of a trace (an outer compile's): the same layout at its hinted sizes,
    # made fake by ``mode``, under which the caller runs this.
    return torch.empty_strided(
        [_static(s) for s in value.shape],
        [_static(s) for s in value.stride()],
        dtype=value.dtype,
        device=value.device,
    )


def _tensors(value: Any) -> list[Any]:
    import torch
    import torch.fx as fx

    found: list[Any] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def changed_inputs_backward_needs(gm: Any, example_inputs: Any) -> list[int] | None:
    """Indexes of ``gm``'s inputs that it changes in place and that backward needs; None if unknown.

    An input backward needs is one that requires grad, or one read by an op
    whose result depends on one that does (its value is saved, or recomputed
    from). A buffer only counted into (``self.load += counts``) is changed but
    not needed: its piece stays checkpointed.

    The fake run is without autograd (a nested checkpoint then just runs its
    body); which results depend on an input that requires grad is followed
    from node to node instead.
    """
    import torch
    import torch.fx as fx

    mode = _compat.checkpoints.fake_tensor_mode()
    graded: set[int] = set()  # ids of fake results that depend on an input requiring grad
    read_for_grad: set[Any] = set()  # storages read by an op whose result does

    class Reading(fx.Interpreter):
        def run_node(self, node: Any) -> Any:
            out = super().run_node(node)
            if node.op in ("call_function", "call_method", "call_module"):
                args = _tensors(self.fetch_args_kwargs_from_env(node))
                if any(id(t) in graded for t in args):
                    graded.update(id(t) for t in _tensors(out))
                    read_for_grad.update(_compat.checkpoints.storage_key(t) for t in args)
            return out

    try:
        with mode, torch.no_grad():
            copies = [_static_copy(mode, v) for v in example_inputs]
            graded.update(
                id(c)
                for c, v in zip(copies, example_inputs, strict=True)
                if getattr(v, "requires_grad", False)
            )
            needs_grad = set(graded)
            versions = [_compat.checkpoints.version_of(c) for c in copies]
            Reading(gm).run(*copies)
    except Exception as exc:  # a graph the fake run cannot take: assume the worst
        logger.debug("could not tell which inputs a piece changes in place", exc_info=exc)
        return None
    return [
        i
        for i, (copy, version) in enumerate(zip(copies, versions, strict=True))
        if version is not None
        and _compat.checkpoints.version_of(copy) != version
        and (id(copy) in needs_grad or _compat.checkpoints.storage_key(copy) in read_for_grad)
    ]


# -- what the policy saves -----------------------------------------------------------------


def _saves(decision: Any) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy

    return decision is True or decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _fresh_bytes(op: Any, output: Any) -> int | None:
    """Bytes of the outputs of ``op`` with storage of their own (what SAC keeps when it saves them)."""
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    total = 0
    for index, value in enumerate(outputs):
        for tensor in _tensors(value):
            if not _compat.checkpoints.returns_fresh_storage(op, index):
                continue
            numel = _compat.checkpoints.size_hint(tensor.numel())
            if numel is None:
                return None
            total += numel * tensor.element_size()
    return total


class CheckpointPieces:
    """The pieces of one kind of region: each graph compiled as ``checkpoint(piece, context_fn=..., ...)``.

    Held by the region's backend (``RegionBackend``), one per
    region key, so identical blocks share it with their graphs.

    While the pieces are traced it also learns, for ``memory``, what eager
    selective AC would keep of them: the bytes of the outputs the user's policy
    saves (``policy_saved_bytes``; None when that cannot be told).
    """

    def __init__(self, checkpoint_fn: Any, label: str) -> None:
        # None for full AC: the operator's own always-recompute policy.
        self.context_fn = checkpoint_calls.context_fn_of(checkpoint_fn)
        keywords = getattr(checkpoint_fn, "keywords", {}) or {}
        self.options = {k: v for k, v in keywords.items() if k in _OPTIONS}
        self.label = label  # the region's label: notes about its pieces are kept under it
        # Per checkpointed graph, the bytes its policy saved in its latest trace
        # (AOTAutograd may trace a graph more than once); None: cannot be told.
        # What the policy saves in each piece, by the code dynamo compiled it from (``_traced_context_fn``).
        self._saved_by_policy: dict[Any, list[int | None]] = {}
        self._graphs = 0
        self._raised: list[BaseException] = []  # raised by the user's context_fn or policy while tracing
        # Why each piece autoweave could not compile runs eager (its saves unmeasured).
        self.failed_pieces: list[str] = []

    def compile(self, gm: Any, example_inputs: Any, inner: Callable[..., Any]) -> Any:
        """``gm`` compiled by ``inner`` under the checkpoint operator (or, where that would be wrong, without)."""
        if not any(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes):
            return inner(gm, example_inputs)  # nothing to checkpoint
        self._graphs += 1
        if not _returns_only_tensors(gm):
            logger.info("a piece of a woven region returns non-tensors: compiled without its checkpoint")
            return inner(gm, example_inputs)
        changed = changed_inputs_backward_needs(gm, example_inputs)
        if changed is None or changed:
            # Its recompute would start from inputs it destroyed: compiled without
            # the checkpoint (its activations are kept), numerics intact.
            why = (
                "it may change an input in place (the graph could not be run on fake inputs to tell)"
                if changed is None
                else f"it changes {'an input' if len(changed) == 1 else f'{len(changed)} inputs'} "
                "in place that backward needs"
            )
            self.note(
                f"piece {self._graphs} compiled without its checkpoint: {why}; its activations are kept"
            )
            return inner(gm, example_inputs)
        del self._raised[:]
        try:
            wrapped = self.wrap(gm)
            compiled = inner(wrapped, example_inputs)
            if compiled is wrapped or getattr(compiled, "__self__", None) is wrapped:
                # The backend runs the graph as it is (``eager``): the checkpoint operator runs
                # torch's eager checkpoint, whose own saved-tensor hooks hide this piece's saves
                # from the first-call measure (226 KB read where the heap held 561 KB,
                # benchmarks/results/static_memory.md). Unmeasurable: the block is hoisted.
                self.failed_pieces.append("its backend runs it as it is, its checkpoint eager")
            return compiled
        except _compat.dynamo.backend_errors_dynamo_handles():
            # A restart (a float made a tensor, say), a skip, a user's dim error: dynamo acts on
            # it as it does for plain torch's backend; swallowed, the piece would run eager.
            raise
        except Exception as exc:
            if self._users(exc):
                # The user's policy (or context_fn) raised: not autoweave's to report.
                # The piece runs as plain torch runs it, eager under the same
                # checkpoint, where the policy raises (or not) when the checkpoint runs.
                logger.info(
                    "the selective-AC policy raised %s while a piece compiled; that piece runs eager under "
                    "its checkpoint, as plain torch runs it",
                    type(exc).__name__,
                )
                return self.eager(gm, "the selective-AC policy raised while it was traced")
            # Never a crash plain torch would not have had, nor a checkpoint lost:
            # this piece runs eager under the user's checkpoint, as eager AC would.
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            swallowed(
                "piece-eager",
                f"piece:{type(exc).__name__}:{first}",
                f"a piece of a woven region could not be compiled under its checkpoint "
                f"({type(exc).__name__}: {first}); it runs eager under the same checkpoint",
                exc,
            )
            why = f"could not be compiled under its checkpoint ({type(exc).__name__}: {first})"
            self.failed_pieces.append(why)
            return self.eager(gm, why)
        finally:
            del self._raised[:]

    @property
    def policy_saved_bytes(self) -> int | None:
        """Bytes of the outputs the user's policy saves in this region's checkpointed pieces, as traced."""
        slots = self._saved_by_policy.values()
        if self.context_fn is None or any(slot[0] is None for slot in slots):
            return None
        return sum(slot[0] or 0 for slot in slots)

    @property
    def traced(self) -> bool:
        """Has dynamo handed this region a graph with ops yet?"""
        return self._graphs > 0

    def note(self, text: str) -> None:
        """Something the plan log and the report should say about this region's pieces."""
        logger.info("%s: %s", self.label or "a woven region", text)
        run.note_region(self.label, text)

    def _users(self, exc: BaseException) -> bool:
        """Was ``exc`` (or an error it was raised from) raised by the user's context_fn or policy?"""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            if any(current is raised for raised in self._raised):
                return True
            seen.add(id(current))
            current = current.__cause__ or current.__context__
        return False

    def _users_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, the user's context_fn or policy: what it raises is kept for ``_users``."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            self._raised.append(exc)
            raise

    def _traced_context_fn(self) -> Any:
        """The user's ``context_fn`` as the operator calls it while tracing one graph: its policy observed."""
        slot: list[int | None] = [0]
        # One figure per piece of code: a graph compiled again from the same code (a
        # recompile, another layer's values) runs instead of the one before, not beside
        # it. Summed, both made eager SAC look heavier than it is, and pieces holding
        # 1.25x its memory were kept (fuzzer seed 3551).
        self._saved_by_policy[_compat.dynamo.code_being_compiled() or object()] = slot

        def context_fn() -> Any:
            contexts = self._users_call(self.context_fn)
            # A new trace of this graph: count its saves afresh. Not torch's SAC
            # contexts: what they keep is unknown.
            known = _compat.checkpoints.observe_sac_policy(contexts, functools.partial(self._observed, slot))
            slot[0] = 0 if known else None
            return contexts

        return context_fn

    def _observed(self, slot: list[int | None], policy: Callable[..., Any]) -> Callable[..., Any]:
        def observed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            decision = self._users_call(policy, ctx, op, *args, **kwargs)
            if not getattr(ctx, "is_recompute", False) and _saves(decision) and slot[0] is not None:
                # A torch whose policy context has no op_output: the size cannot be told.
                size = _fresh_bytes(op, ctx.op_output) if hasattr(ctx, "op_output") else None
                slot[0] = None if size is None else slot[0] + size
            return decision

        return observed

    def eager(self, gm: Any, why: str) -> Callable[..., Any]:
        """``gm`` run eagerly under torch's checkpoint with the same policy and options."""
        from torch.utils.checkpoint import checkpoint

        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}

        def run(*args: Any) -> Any:
            return checkpoint(gm, *args, use_reentrant=False, **extra, **self.options)

        return runs_eager(run, f"a piece ran eager under its checkpoint: {why}")

    def wrap(self, gm: Any) -> Any:
        """A graph module calling ``gm`` under the checkpoint operator, same inputs and outputs."""
        import torch.fx as fx
        import torch.nn as nn

        hop = _compat.checkpoints.tag_activation_checkpoint()
        if self.context_fn is not None:
            # Read by the operator's implementation when it is traced.
            gm.meta[_compat.checkpoints.CHECKPOINT_CONTEXT_FN_KEY] = self._traced_context_fn()
        root = nn.Module()
        root.piece = gm
        graph = fx.Graph()
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        inputs = [graph.placeholder(node.name, type_expr=node.type) for node in placeholders]
        for placeholder, node in zip(inputs, placeholders, strict=True):
            placeholder.meta.update(node.meta)
        (output,) = (n for n in gm.graph.nodes if n.op == "output")
        results = output.args[0]
        call = graph.call_function(hop, (graph.get_attr("piece"), *inputs), dict(self.options))
        values = tuple(_compat.checkpoints.traced_value(r) if isinstance(r, fx.Node) else r for r in results)
        _compat.checkpoints.set_traced_value(call, values)
        outputs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(values))]
        for item, value in zip(outputs, values, strict=True):
            _compat.checkpoints.set_traced_value(item, value)
        graph.output(tuple(outputs) if isinstance(results, (tuple, list)) else outputs[0])
        return fx.GraphModule(root, graph)


def ops_in(gm: Any) -> int:
    """The ops of a graph dynamo traced (``call_function`` nodes), its sub-graphs' included.

    Higher-order ops (the checkpoint of a traced AC region) keep their bodies in
    sub-GraphModules.
    """
    return sum(
        1 for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes if n.op == "call_function"
    )


def graph_name(gm: Any) -> str:
    return type(gm).__name__  # fx names each GraphModule's class (``_get_name`` reads the same)


@dataclass(frozen=True)
class CompiledGraph:
    """What a region's backend did with one graph dynamo handed it (``_events.GRAPH_COMPILED``)."""

    label: str  # the region's label (shared by identical blocks)
    name: str  # the graph module's name
    ops: int  # its ops as dynamo traced them (``ops_in``), before pieces or the backend touched it
    eager: str | None  # why it runs eager instead of compiled; None: compiled
    seconds: float  # time spent in the backend on it


class RegionBackend(_compat.backends.ForwardsToInner):
    """The backend of one kind of woven region (see the module docstring)."""

    def __init__(
        self, inner: Callable[..., Any], label: str, checkpoint_fn: Any = None, untuned: Any = None
    ) -> None:
        super().__init__(inner)
        self.label = label
        # The inner backend without inductor's autotuning, where the user asked for it: a graph
        # the tuned backend fails on is compiled with this one (``_compat.backends.untuned_backend``).
        self.untuned = untuned
        # Told before each graph dynamo hands this backend (``shared_kinds`` reads the kind's
        # guards then): nothing runs on a call that compiles nothing.
        self.before_graph: list[Callable[[], None]] = []
        # The region's checkpoint, applied to each graph piece; None: graphs compiled as they are.
        self.pieces = None if checkpoint_fn is None else CheckpointPieces(checkpoint_fn, label)
        run.region_graphs.setdefault(label, (0, 0))  # counted from now on: 0 graphs is a fact

    def __eq__(self, other: object) -> bool:
        # Equal when compiling alike: the same inner backend and no pieces (a pieces
        # backend checkpoints its graphs its own way: equal to itself only).
        return other is self or (
            type(other) is type(self)
            and self.pieces is None
            and other.pieces is None  # type: ignore[attr-defined]
            and bool(self.inner == other.inner)  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash(type(self.inner))  # equal backends wrap equal inner backends, of one type

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        _compat.regions.note_converted()  # the frame dynamo converts is the running region's
        for listener in self.before_graph:
            try:
                listener()
            except Exception as exc:  # reading evidence must never fail a compile
                logger.debug("a listener of %s failed", self.label, exc_info=exc)
        if not _events.listened(_events.GRAPH_COMPILED):
            return self._count(self._compile(gm, example_inputs))
        ops = ops_in(gm)  # before the backend, which may rewrite the graph
        start = time.perf_counter()
        compiled = self._count(self._compile(gm, example_inputs))
        seconds = time.perf_counter() - start
        graph = CompiledGraph(self.label, graph_name(gm), ops, getattr(compiled, RAN_EAGER, None), seconds)
        _events.publish(_events.GRAPH_COMPILED, graph)
        return compiled

    def _count(self, compiled: Any) -> Any:
        done, eager = run.region_graphs.get(self.label, (0, 0))
        ran_eager = getattr(compiled, RAN_EAGER, None) is not None
        run.region_graphs[self.label] = (done + (not ran_eager), eager + ran_eager)
        return compiled

    def _compile(self, gm: Any, example_inputs: Any) -> Any:
        try:
            return self._compile_with(self.inner, gm, example_inputs)
        except _compat.dynamo.backend_errors_dynamo_handles() as exc:
            # A restart, a skip, a graph break, a dim error of the user's: dynamo's to act on.
            # But inductor's own failure (``InductorError``) under autotuning: compiled untuned.
            if self.untuned is None or not isinstance(exc, _compat.dynamo.backend_failed()):
                raise
            failed: Exception = exc
        except Exception as exc:
            if self.untuned is None:
                return self._eager(gm, exc)
            failed = exc
        try:
            compiled = self._compile_with(self.untuned, gm, example_inputs)
        except Exception:
            if isinstance(failed, _compat.dynamo.backend_errors_dynamo_handles()):
                raise failed from None
            return self._eager(gm, failed)
        # Plain torch prints nothing here (it runs the checkpointed block eager): no warning of
        # ours either. Counted in the report, said in the plan summary, raised in strict mode.
        note = f"a graph compiled without autotuning: the backend raised under it ({first_line(failed)})"
        swallowed("graph-untuned", f"untuned:{self.label}", f"{self.label}: {note}", failed, quiet=True)
        run.note_region(self.label, note)
        return compiled

    def _compile_with(self, backend: Any, gm: Any, example_inputs: Any) -> Any:
        if self.pieces is not None:
            compiled = self.pieces.compile(gm, example_inputs, backend)
        else:
            compiled = backend(gm, example_inputs)
        return keep_none_grads(compiled, gm, example_inputs)

    def _eager(self, gm: Any, exc: Exception) -> Any:
        """A graph the backend failed on, run eager (the rest of the region stays compiled)."""
        why = first_line(exc)
        swallowed(
            "graph-eager",
            f"graph:{why}",
            f"the backend {self.__name__!r} failed on a graph of the woven region {self.label} ({why}); "
            "that graph runs eager, the rest stays compiled",
            exc,
        )
        forward = gm.forward

        def eager(*args: Any) -> Any:
            return forward(*args)

        return runs_eager(eager, f"the backend failed on it ({why})")
