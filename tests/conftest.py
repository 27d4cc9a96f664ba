from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Inductor's C++ builder imports setuptools (through torch.utils.cpp_extension), and
# setuptools' distutils shim asserts that the standard library's distutils was not imported
# before it. Which test of a worker's share imports distutils first depends on the order
# xdist hands them out (CI failed once on it, in an inductor test, alone it passes):
# setuptools first, so every later ``import distutils`` finds its copy.
try:
    import setuptools  # noqa: F401
except ImportError:  # a venv without setuptools has no shim to trip either
    pass


# -- autoweave on, dynamo and autoweave's state fresh (the in-process tests) -----------------
# Imported here, after the path is set, so a test run from any directory finds the checkout.
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import autoweave  # noqa: E402
from autoweave import _settings, _state  # noqa: E402

# The strict lane (``AUTOWEAVE_STRICT=1 pytest -m "not slow"``, see .ci/run): every error
# autoweave would swallow and fall back from raises instead, so a test fails on it.
STRICT_LANE = _settings.Settings.from_environ(
    {"AUTOWEAVE_STRICT": os.environ.get("AUTOWEAVE_STRICT", "")}
).strict


def _with_strict(settings: _settings.Settings, strict: bool) -> _settings.Settings:
    values = {name: getattr(settings, name) for name in _settings.Settings.__slots__}
    return _settings.Settings(**{**values, "strict": strict})


@pytest.fixture(autouse=True)
def _strict_lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Strict in the strict lane, unless the test is marked ``fail_open``.

    ``fail_open`` tests provoke autoweave's fallbacks on purpose and check the warning:
    they run with ``AUTOWEAVE_STRICT`` unset. In the strict lane every other test starts
    strict even when an earlier one left other settings (``autoweave.disable()`` forgets
    them until the next ``enable()`` reads the environment again).
    """
    if not STRICT_LANE:  # the other lanes: settings as each test makes them
        yield
        return
    fail_open = request.node.get_closest_marker("fail_open") is not None
    if fail_open:
        monkeypatch.delenv("AUTOWEAVE_STRICT")
    strict = not fail_open
    before = _settings.current()
    if before.strict != strict:
        _settings.reload(_with_strict(before, strict))
    yield
    after = _settings.current()
    if after.strict != before.strict:
        _settings.reload(_with_strict(after, before.strict))


@pytest.fixture(autouse=True)
def _no_rank_seen_before(monkeypatch: pytest.MonkeyPatch):
    """A process group an earlier test made and destroyed is not this test's job.

    ``_log`` keeps the (rank, world size) it last read from a group, because a job may
    destroy its group before the report at exit (``test_report``'s rank tests); within one
    test worker that memory would leak a world of 2 into the next test's summary.
    """
    from autoweave import _log

    monkeypatch.setattr(_log, "_seen", None)


@pytest.fixture
def weave_on():
    torch._dynamo.reset()
    _state.reset()
    assert autoweave.enable()
    yield
    autoweave.disable()
    _state.reset()
    torch._dynamo.reset()
