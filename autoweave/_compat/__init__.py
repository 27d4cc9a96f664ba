"""Every private torch name and dynamo log string autoweave uses, one module per concern.

torch moves private names between releases; every one autoweave touches is
resolved in this package so an unsupported torch gives one clear message
instead of a traceback deep inside a patch (tests/unit/test_layers.py keeps
them here). Each module states the torch range it holds for and the upstream
issue that would retire it, at the workaround:

- ``lookup``: finding a torch name by path; ``UnsupportedTorch``.
- ``modules``: private attributes of torch's modules and wrappers (OptimizedModule,
  CheckpointWrapper, FSDP, nn.Module's stores and hooks).
- ``guards``: what dynamo guards a compiled function on (its cache entries' guards).
- ``dynamo``: dynamo's counters, callbacks, code resets, the compile in progress.
- ``backends``: the backend ``torch.compile`` builds, and wrapping it unchanged.
- ``conversion``: failing open inside dynamo (suppressed errors, compiling a skipped frame again).
- ``log_strings``: dynamo's log messages, each read in one place into a typed record.
- ``checkpoints``: the traced checkpoint operator, the SAC policy, saved-tensor hooks,
  autograd's node numbers, fake tensors.
- ``version``: the tested torch range and the self-check of a newer torch.

Why so much is needed: a graph break inside a checkpointed region makes dynamo
run the whole region eager (pytorch/pytorch#139989; PR #193143 proposes
compiling ``ac(compile(f))`` instead, and reviewers note it does not hold for
selective AC); FSDP2's hooks are ``torch._dynamo.disable``d unconditionally since
pytorch/pytorch PR #174863 (custom-op hooks that dynamo could keep in the graph
were tried in PR #181924, closed); ``backend="eager"`` ignores a traced checkpoint
(pytorch/pytorch#160773).

This module only re-exports, so ``from autoweave import _compat; _compat.name``
reads the same wherever a name lives.
"""

from autoweave._compat.backends import BackendWrapper, ForwardsToInner, lookup_backend, wrap_backend
from autoweave._compat.checkpoints import (
    CHECKPOINT_CONTEXT_FN_KEY,
    as_recompute_sees,
    autograd_sequence_nr,
    checkpointed_function_class,
    fake_tensor_mode,
    in_backward,
    is_dispatch_mode,
    is_fake,
    next_autograd_sequence_nr,
    observe_sac_policy,
    returns_fresh_storage,
    saved_tensors_hooks_active,
    selective_contexts_factory,
    size_hint,
    storage_key,
    tag_activation_checkpoint,
)
from autoweave._compat.conversion import (
    backend_errors_dynamo_handles,
    compile_again,
    converting_code,
    suppressing_errors,
)
from autoweave._compat.dynamo import (
    COMPILE_CALLBACKS_MODULE,
    backends_within,
    code_being_compiled,
    compile_callbacks,
    compile_in_progress,
    disable,
    disabled_original,
    dynamo_counters,
    dynamo_disabled,
    eager_stance,
    fullgraph_break,
    lookups_in_order,
    outside_dynamo,
    reset_code,
    resumed_name,
    skip_own_frame,
    torch_logging_internal,
    trace_structured,
)
from autoweave._compat.guards import guarded_attributes
from autoweave._compat.log_strings import (
    FALLBACK_LOGGER,
    FALLBACK_NEEDLE,
    GRAPH_BREAK_LOGGER,
    RECOMPILE_LIMIT_LOGGER,
    RECOMPILE_LIMIT_NEEDLE,
)
from autoweave._compat.lookup import UnsupportedTorch, find
from autoweave._compat.modules import (
    CHECKPOINT_WRAPPED,
    CHECKPOINT_WRAPPER_MODULE,
    COMPILED_INNER,
    FSDP2_STATE_MODULES,
    MODULE_STORES,
    WRAPPED_CHILD_ATTRS,
    call_impl,
    checkpoint_fn,
    checkpoint_wrapped,
    checkpoint_wrapper_class,
    checkpoint_wrapper_module,
    children_of,
    compiled_inner,
    forward_hook_dicts,
    fsdp1_module,
    fsdp2_module,
    hooks_of,
    optimized_module,
    process_groups_of,
    register_module_registration_hook,
    set_compiled_call,
    wrapped_child,
)
from autoweave._compat.version import (
    TESTED_TORCH,
    check_torch_version,
    self_check,
    torch_support,
    torch_version,
)

__all__ = [
    "BackendWrapper",
    "ForwardsToInner",
    "CHECKPOINT_CONTEXT_FN_KEY",
    "CHECKPOINT_WRAPPED",
    "CHECKPOINT_WRAPPER_MODULE",
    "COMPILED_INNER",
    "FALLBACK_LOGGER",
    "FALLBACK_NEEDLE",
    "FSDP2_STATE_MODULES",
    "GRAPH_BREAK_LOGGER",
    "MODULE_STORES",
    "RECOMPILE_LIMIT_LOGGER",
    "RECOMPILE_LIMIT_NEEDLE",
    "TESTED_TORCH",
    "UnsupportedTorch",
    "WRAPPED_CHILD_ATTRS",
    "as_recompute_sees",
    "autograd_sequence_nr",
    "backend_errors_dynamo_handles",
    "backends_within",
    "call_impl",
    "check_torch_version",
    "checkpoint_fn",
    "checkpoint_wrapped",
    "checkpoint_wrapper_class",
    "checkpoint_wrapper_module",
    "checkpointed_function_class",
    "children_of",
    "code_being_compiled",
    "compile_again",
    "COMPILE_CALLBACKS_MODULE",
    "compile_callbacks",
    "compile_in_progress",
    "compiled_inner",
    "converting_code",
    "disable",
    "disabled_original",
    "dynamo_counters",
    "dynamo_disabled",
    "eager_stance",
    "fake_tensor_mode",
    "find",
    "forward_hook_dicts",
    "guarded_attributes",
    "hooks_of",
    "fsdp1_module",
    "fsdp2_module",
    "fullgraph_break",
    "lookups_in_order",
    "in_backward",
    "is_dispatch_mode",
    "is_fake",
    "lookup_backend",
    "next_autograd_sequence_nr",
    "observe_sac_policy",
    "optimized_module",
    "process_groups_of",
    "outside_dynamo",
    "register_module_registration_hook",
    "reset_code",
    "resumed_name",
    "returns_fresh_storage",
    "saved_tensors_hooks_active",
    "selective_contexts_factory",
    "self_check",
    "set_compiled_call",
    "size_hint",
    "skip_own_frame",
    "storage_key",
    "suppressing_errors",
    "tag_activation_checkpoint",
    "torch_logging_internal",
    "torch_support",
    "torch_version",
    "trace_structured",
    "wrap_backend",
    "wrapped_child",
]
