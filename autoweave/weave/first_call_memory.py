"""The first call of a block woven as ``pieces``, measured: what its pieces hold for backward.

``planning/learned`` says what is measured and how it is judged (``Verdict``);
this module measures it, around the block's first call with grad:

- what pieces hold: every tensor autograd saves during the block's forward
  passes through saved-tensor hooks installed around the call (``SavedBytes``;
  none of torch's eager checkpoints runs inside, whose own hooks would take
  precedence); a storage counts once, parameters not at all;
- what eager selective AC would hold: the block's tensor inputs
  (``tensor_bytes``) and its policy's saves, as the pieces' tracing showed them.

The verdict is agreed with the other ranks that run the block (``agree``, from
``dispatch/plan_inputs``: the length each rank saw changes what it measures, and
ranks planning the block differently could hang), kept for every block of its
kind (``planning/learned``); the measure then steps aside (``FirstCall``), so
later calls pay nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from autoweave import _compat
from autoweave._log import logger
from autoweave._state import run
from autoweave.planning import learned
from autoweave.planning.learned import Verdict


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

    def add(self, tensor: Any, parameter: bool = False) -> None:
        import torch.nn as nn

        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
        except Exception:  # a subclass without one storage: not counted
            return
        if parameter or isinstance(tensor, nn.Parameter):
            self.parameters.add(pointer)
        else:
            self.storages.setdefault(pointer, storage)

    def leave_out(self, module: Any) -> None:
        """Leave out the storages of ``module``'s parameters and buffers (as they are now)."""
        for tensor in (*module.parameters(), *module.buffers()):
            self.add(tensor, parameter=True)

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
        elif isinstance(item, (tuple, list, dict)):
            for inner in item.values() if isinstance(item, dict) else item:
                visit(inner)

    visit(value)
    return storages.total


class SavedBytes(_Storages):
    """While inside: every tensor autograd saves for backward is counted (``total`` bytes, ``count``).

    The hooks hand each tensor back unchanged. Inside an eager checkpoint its
    own hooks take precedence and this counts nothing of it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._hooks: Any = None

    def _pack(self, tensor: Any) -> Any:
        # Not a fake tensor: a trace that runs meanwhile (dynamo's, a piece's inspection).
        if not _compat.checkpoints.is_fake(tensor):
            self.count += 1
            self.add(tensor)
        return tensor

    @staticmethod
    def _unpack(tensor: Any) -> Any:
        return tensor

    def __enter__(self) -> SavedBytes:
        import torch

        # Never traced: autograd calls the hooks from wherever a tensor is saved, also from
        # eager code that runs under a compiled frame (a piece that runs eager), and dynamo
        # would compile the hook there, on every call (its storage pointers break the graph),
        # until the recompile limit: NeMo's selective AC showed 23 recompiles against hoist's 2.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            _compat.dynamo.disable(self._pack, recursive=True),
            _compat.dynamo.disable(self._unpack, recursive=True),
        )
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


HOOKED_CALLS = 3  # calls with grad under the user's saved-tensor hooks before a block is left unmeasured


@dataclasses.dataclass(eq=False, repr=False)
class FirstCall:
    """A pieces block's forward that measures its first call with grad, then gets out of the way.

    ``forward`` runs the block without its checkpoint (the pieces carry it);
    ``policy_bytes()`` is what the policy saved while the pieces were traced
    (None: not known), ``failed()`` why pieces autoweave could not compile ran
    eager (a block whose pieces fail is planned with hoist); ``done(verdict)`` is told once, at the first call with
    grad outside the caller's saved-tensor hooks, or at the ``HOOKED_CALLS``-th under them
    (None: not measured, the caller's saved-tensor hooks were active, and
    no other rank's measure said hoist), and is expected to install ``forward``
    in place of this object. ``agree([hoist])`` is called at that same call on
    every rank, measured or not: whether any rank running the block says hoist.
    """

    wrapper: Any
    forward: Callable[..., Any]
    policy_bytes: Callable[[], int | None]
    done: Callable[[Verdict | None], None]
    failed: Callable[[], tuple[str, ...]] = tuple
    agree: Callable[[list[bool]], list[bool]] = list
    finished: bool = dataclasses.field(default=False, init=False)
    hooked: int = dataclasses.field(default=0, init=False)  # calls passed under the user's hooks

    def __post_init__(self) -> None:
        run.measuring.add(self)  # the plan summary waits for its first call with grad

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        # A call under an eager ``set_stance`` (an eval or debug step) runs the pieces eager: what
        # they hold then is not what they hold compiled, and their policy's saves were never
        # traced, so nothing could be judged. Such a call passes, as one without grad does.
        if (
            self.finished
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or _compat.dynamo.eager_stance() is not None
        ):
            return self.forward(*args, **kwargs)
        hooked = _compat.checkpoints.saved_tensors_hooks_active()
        if hooked:
            # The user's hooks (offloading, say) or an eager checkpoint around the call: ours
            # would shadow them. Such a call passes too, as long as a later one may come
            # without (one step under hooks: fuzzer seed 31002, whose next calls kept pieces
            # holding 1.2x eager selective AC's memory); after HOOKED_CALLS, not measured,
            # pieces stay.
            self.hooked += 1
            if self.hooked < HOOKED_CALLS:
                return self.forward(*args, **kwargs)
        self.finished = True
        if hooked:
            out = self.forward(*args, **kwargs)
            [elsewhere] = self.agree([False])
            self._learn(Verdict(None, None, elsewhere=True) if elsewhere else None)
            return out
        with SavedBytes() as saved:
            out = self.forward(*args, **kwargs)
        saved.leave_out(self.wrapper)
        policy = self.policy_bytes()
        eager_sac = None if policy is None else tensor_bytes((args, kwargs)) + policy
        here = Verdict(saved.total, eager_sac, self.failed())
        [anywhere] = self.agree([here.hoist_here])
        self._learn(dataclasses.replace(here, elsewhere=anywhere and not here.hoist_here))
        return out

    def _learn(self, verdict: Verdict | None) -> None:
        if verdict is not None:
            logger.info("%s: %s", type(self.wrapper).__name__, verdict.describe())
            learned.learn_verdict(self.wrapper, verdict)
        self.done(verdict)
