"""Which decorator wrappers merely pass their call on (``planning.wrappers``): only those run eager.

The rule reads the wrapper's source. Pass-throughs as libraries write them (transformers'
``deprecate_kwarg`` and ``GradientCheckpointingLayer``'s wrapper) must read as such, or their
frames are compiled one by one; anything that computes on the call's tensors, or that the
rule does not read, must not.
"""

from __future__ import annotations

import functools
import warnings
from functools import partial

import pytest
import torch

from autoweave.planning.wrappers import passes_call_on


def _forward(self, x, cache=None):
    return x


def _wraps(body):
    """A decorator whose wrapper is ``body`` with the wrapped function bound as ``fn``."""

    def decorate(fn):
        return functools.wraps(fn)(body(fn))

    return decorate


def _plain(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _renames(fn):
    def wrapper(self, *args, **kwargs):
        if "past" in kwargs and kwargs["past"] is not None:
            message = f"`past` is deprecated for {type(self).__name__}; use `cache`"
            message += "."
            warnings.warn(message, FutureWarning, stacklevel=2)
            kwargs["cache"] = kwargs.pop("past")
        elif not self.training and len(args) > 3:
            raise ValueError(f"too many arguments: {args}")
        out = fn(self, *args, **kwargs)
        return out

    return wrapper


def _checkpoints(fn):
    def wrapper(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(partial(fn, self, **kwargs), *args)
        return fn(self, *args, **kwargs)

    return wrapper


def _scales_input(fn):
    def wrapper(self, x, *args, **kwargs):
        x = x * 2
        return fn(self, x, *args, **kwargs)

    return wrapper


def _scales_output(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 0.5

    return wrapper


def _casts_result(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out.float()

    return wrapper


def _calls_a_child(fn):
    def wrapper(self, x):
        return fn(self, self.norm(x))

    return wrapper


def _applies_torch(fn):
    def wrapper(self, x, **kwargs):
        return fn(self, torch.relu(x), **kwargs)

    return wrapper


def _indexes(fn):
    def wrapper(self, x):
        return fn(self, x[:, :4])

    return wrapper


def _compares(fn):
    def wrapper(self, x):
        if (x > 0).all():
            return fn(self, x)
        return fn(self, -x)

    return wrapper


def _returns_a_part(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)[0]

    return wrapper


def _comprehension(fn):
    def wrapper(*args, **kwargs):
        return fn(*[a for a in args], **kwargs)

    return wrapper


@pytest.mark.parametrize("body", [_plain, _renames, _checkpoints], ids=lambda b: b.__name__)
def test_a_wrapper_that_passes_its_call_on_is_read_as_one(body) -> None:
    assert passes_call_on(_wraps(body)(_forward))


@pytest.mark.parametrize(
    "body",
    [
        _scales_input,
        _scales_output,
        _casts_result,
        _calls_a_child,
        _applies_torch,
        _indexes,
        _compares,
        _returns_a_part,
        _comprehension,
    ],
    ids=lambda b: b.__name__,
)
def test_a_wrapper_that_computes_or_is_not_read_is_not(body) -> None:
    assert not passes_call_on(_wraps(body)(_forward))


def test_without_source_or_without_the_wrapped_function_it_is_not() -> None:
    namespace: dict = {"functools": functools}
    exec(
        "def deco(fn):\n"
        "    @functools.wraps(fn)\n"
        "    def wrapper(*args, **kwargs):\n"
        "        return fn(*args, **kwargs)\n"
        "    return wrapper\n",
        namespace,
    )
    assert not passes_call_on(namespace["deco"](_forward))  # no source to read
    assert not passes_call_on(_forward)  # not a wrapper


def test_transformers_wrappers_pass_their_call_on() -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.utils.deprecation import deprecate_kwarg

    class Layer(GradientCheckpointingLayer):
        @deprecate_kwarg("past_key_value", new_name="past_key_values", version="4.58")
        def forward(self, x, past_key_values=None):
            return x

    chain, fn = [], Layer.forward
    while hasattr(fn, "__wrapped__"):
        chain.append(fn)
        fn = fn.__wrapped__
    assert len(chain) == 2
    assert all(passes_call_on(wrapper) for wrapper in chain)
