"""Every private torch name and dynamo log string autoweave uses, one module per concern.

torch moves private names between releases; every one autoweave touches is
resolved in this package so an unsupported torch gives one clear message
instead of a traceback deep inside a patch (tests/unit/test_layers.py keeps
them here). Each module states the torch range it holds for and the upstream
issue that would retire it, at the workaround:

- ``lookup``: finding a torch name by path, and the one registry of the names the others
  declare where they use them (``need``), which ``version`` checks; ``UnsupportedTorch``.
- ``modules``: private attributes of torch's modules and wrappers (OptimizedModule,
  CheckpointWrapper, FSDP, nn.Module's stores and hooks).
- ``dynamo``: dynamo's counters, callbacks, code resets, the compile in progress, stances,
  and failing open inside dynamo (suppressed errors, compiling a skipped frame again).
- ``regions``: a woven region's frames in dynamo's cache: the order of lookups, the
  recompile limit kept at the region's entry, the steady-state watchdog.
- ``backends``: the backend ``torch.compile`` builds, wrapping it unchanged, what dynamo
  guards a compiled function on (its cache entries), and each graph handed to a backend.
- ``log_strings``: dynamo's log messages, each read in one place into a typed record.
- ``checkpoints``: the traced checkpoint operator, the SAC policy, saved-tensor hooks,
  autograd's node numbers, fake tensors.
- ``version``: the tested torch range and the self-check of a newer torch.

Why so much is needed: a graph break inside a checkpointed region makes dynamo
run the whole region eager (pytorch/pytorch#139989; PR #193143 proposes
compiling ``ac(compile(f))`` instead, and reviewers note it does not hold for
selective AC); FSDP2's hooks are ``torch._dynamo.disable``d unconditionally since
pytorch/pytorch PR #174863 (custom-op hooks that dynamo could keep in the graph
were tried in PR #181924, closed). docs/upstream.md lists every workaround here with its
upstream issue, or the report drafted to file where none exists.

Callers name the concern with the name: ``_compat.dynamo.outside_dynamo``. This
package only imports its modules, so ``from autoweave import _compat`` reaches them all.
"""

from autoweave._compat import backends, checkpoints, dynamo, log_strings, lookup, modules, regions, version

__all__ = ["backends", "checkpoints", "dynamo", "log_strings", "lookup", "modules", "regions", "version"]
