"""Every rank makes the same decisions: what one rank's data taught is agreed with the ranks beside it.

Two decisions are made from what a rank observes, and ranks see different data
(sequence lengths differ per rank in real jobs):

- a learned break (``planning/learned_breaks``): dynamo falls back on the
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
so does a pieces block past dynamo's recompile limit (``keep_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoweave import _compat
from autoweave._failopen import swallowed


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
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return (
        torch.device("cpu")
        if accelerator is None
        else torch.device(accelerator.type, torch.accelerator.current_device_index())
    )


def any_rank(module: Any, flags: Sequence[bool]) -> list[bool]:
    """Each flag, true if it is true on any rank that runs ``module`` (the same list on each of them).

    Every rank that runs ``module`` must call this at the same point with as
    many flags; with no group to agree with, the flags come back as they are.
    """
    import torch
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
