"""Probe run in child interpreters: reports what autoweave did, as one JSON line after 'PROBE '.

Copied into a scratch directory by the ``probe_dir`` fixture; scripts there import it.
"""

import json
import sys
import types

WATCH = ("autoweave", "_autoweave_start", "wrapt", "torch")
CW = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
AT_START = [m for m in WATCH if m in sys.modules]


def layers(obj):
    """How many AutoweaveWrapper layers ``obj`` has, walking ``__wrapped__``."""
    count = 0
    for _ in range(64):
        if obj is None:
            break
        if type(obj).__name__ == "AutoweaveWrapper":
            count += 1
        obj = getattr(obj, "__wrapped__", None)
    return count


def state():
    out = {"modules": [m for m in WATCH if m in sys.modules]}
    torch = sys.modules.get("torch")
    if torch is not None:
        c = torch.compile
        mc = torch.nn.Module.__dict__["compile"]
        out.update(
            compile_type=type(c).__name__,
            compile_is_function=type(c) is types.FunctionType,
            compile_module=getattr(c, "__module__", None),
            compile_has_wrapped=hasattr(c, "__wrapped__"),
            compile_layers=layers(c),
            module_compile_is_function=type(mc) is types.FunctionType,
            module_compile_layers=layers(mc),
        )
    cw = sys.modules.get(CW)
    if cw is not None:
        out.update(
            cw_is_function=type(cw.checkpoint_wrapper) is types.FunctionType,
            cw_layers=layers(cw.checkpoint_wrapper),
            cw_default_layers=[layers(d) for d in cw.apply_activation_checkpointing.__defaults__ or ()],
        )
    patches = sys.modules.get("autoweave.dispatch.patches")
    out["applied"] = patches.applied() if patches is not None else None
    return out


def state_after_imports(with_cw=True):
    import torch  # noqa: F401

    if with_cw:
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
    return state()


def emit(payload):
    sys.stdout.write("PROBE " + json.dumps(payload) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    args = sys.argv[1:]
    if "torch" in args:
        import torch  # noqa: F401
    if "cw" in args:
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
    payload = state()
    payload["at_start"] = AT_START
    emit(payload)
