"""``counting.FallbackCounter``: overlapping counters leave dynamo's logger as they found it.

They share the one tap on dynamo's fallback logger (``autoweave._taps``): a
filter on the logger, and its ``isEnabledFor`` widened to INFO while anyone
listens; the logger's level is never touched.
"""

from __future__ import annotations

import logging
import threading

import pytest

from autoweave import _compat, _taps
from autoweave.sense import counting


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def dynamo_logger():
    log = logging.getLogger(_compat.log_strings.FALLBACK_LOGGER)
    saved = (log.level, log.propagate)
    log.setLevel(logging.WARNING)  # torch's default: INFO is not shown
    log.propagate = True
    yield log
    log.setLevel(saved[0])
    log.propagate = saved[1]


def test_counters_uninstalled_out_of_order_restore_the_logger(dynamo_logger: logging.Logger) -> None:
    first, second = counting.FallbackCounter().install(), counting.FallbackCounter().install()
    first.uninstall()  # not last-in-first-out
    assert _taps.tap(_compat.log_strings.FALLBACK_LOGGER) in dynamo_logger.filters  # second still listens
    assert (dynamo_logger.level, dynamo_logger.propagate) == (logging.WARNING, True)
    dynamo_logger.info("... will fall back to eager-mode PyTorch")
    assert (first.count, second.count) == (0, 1)
    second.uninstall()
    assert (dynamo_logger.level, dynamo_logger.propagate) == (logging.WARNING, True)
    assert _taps.tap(_compat.log_strings.FALLBACK_LOGGER) not in dynamo_logger.filters
    assert "isEnabledFor" not in vars(dynamo_logger)


def test_a_level_set_while_listening_shows_what_it_shows_without_the_tap(
    dynamo_logger: logging.Logger,
) -> None:
    # torch's set_logs / TORCH_LOGS, or the user, change levels while a tap listens: the
    # tap lets through what the logger shows now, never what it showed when attached.
    seen = _Records()
    parent = dynamo_logger.parent
    assert parent is not None
    parent.addHandler(seen)
    try:
        with counting.FallbackCounter() as counter:
            dynamo_logger.info("hidden: WARNING, as attached")
            dynamo_logger.setLevel(logging.INFO)
            dynamo_logger.info("shown: INFO set since")
            dynamo_logger.setLevel(logging.ERROR)
            dynamo_logger.warning("hidden: ERROR set since")
            logging.disable(logging.CRITICAL)
            try:
                dynamo_logger.critical("hidden by logging.disable... will fall back to eager-mode PyTorch")
            finally:
                logging.disable(logging.NOTSET)
            assert dynamo_logger.level == logging.ERROR  # the tap set no level of its own
        assert [r.getMessage() for r in seen.records] == ["shown: INFO set since"]
        assert counter.count == 1  # heard even where logging.disable hides it
    finally:
        parent.removeHandler(seen)


def test_overlapping_counters_pass_a_warning_on_once(dynamo_logger: logging.Logger) -> None:
    seen = _Records()
    parent = dynamo_logger.parent
    assert parent is not None
    parent.addHandler(seen)
    try:
        with counting.FallbackCounter() as a, counting.FallbackCounter() as b:
            dynamo_logger.warning("shown by torch's handlers as before")
            dynamo_logger.info("hidden: torch shows no INFO here")
        assert [r.getMessage() for r in seen.records] == ["shown by torch's handlers as before"]
        assert a.count == b.count == 0
    finally:
        parent.removeHandler(seen)


def test_counters_in_two_threads_entered_and_exited_interleaved(dynamo_logger: logging.Logger) -> None:
    # Thread A enters, B enters, A exits, B exits: the order that left INFO/propagate=False before.
    steps = [threading.Event() for _ in range(4)]
    counts: dict[str, int] = {}

    def run(name: str, enter_after: int, exit_after: int, done: int, entered: int) -> None:
        if enter_after >= 0:
            steps[enter_after].wait(10)
        with counting.FallbackCounter() as counter:
            steps[entered].set()
            steps[exit_after].wait(10)
            dynamo_logger.info(f"{name}: will fall back to eager-mode PyTorch")
        counts[name] = counter.count
        steps[done].set()

    a = threading.Thread(target=run, args=("a", -1, 1, 2, 0))
    b = threading.Thread(target=run, args=("b", 0, 2, 3, 1))
    a.start(), b.start()
    a.join(20), b.join(20)
    assert all(step.is_set() for step in steps)
    # a logged while both listened; b logged after a had left, and still heard its own.
    assert counts == {"a": 1, "b": 2}
    assert (dynamo_logger.level, dynamo_logger.propagate) == (logging.WARNING, True)
