"""The only reader of ``AUTOWEAVE_*`` environment variables.

Standard library only: the start-up file imports this module in every Python
process where ``AUTOWEAVE`` is set, long before torch is loaded.
It also holds the package version (``__version__``, read by the build) and its name on the
package index, at the bottom of the layers so any of them may name it."""

from __future__ import annotations

import os

# Not `from typing import TYPE_CHECKING`: typing costs milliseconds at start-up.
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

# Each variable is a named constant with its one-line meaning; the README's
# switches table is checked against ``VARIABLES`` by a test.
AUTOWEAVE = "AUTOWEAVE"
AUTOWEAVE_DISABLE = "AUTOWEAVE_DISABLE"
AUTOWEAVE_DISABLED_PATCHES = "AUTOWEAVE_DISABLED_PATCHES"
AUTOWEAVE_LOG_LEVEL = "AUTOWEAVE_LOG_LEVEL"
AUTOWEAVE_STRICT = "AUTOWEAVE_STRICT"
AUTOWEAVE_MODE = "AUTOWEAVE_MODE"
AUTOWEAVE_STRATEGY = "AUTOWEAVE_STRATEGY"
AUTOWEAVE_REPORT = "AUTOWEAVE_REPORT"
AUTOWEAVE_UNTESTED_TORCH = "AUTOWEAVE_UNTESTED_TORCH"

VARIABLES: dict[str, str] = {
    AUTOWEAVE: "turn autoweave on for this process and its children",
    AUTOWEAVE_DISABLE: "hard off for this run, even when AUTOWEAVE=1 is baked in",
    AUTOWEAVE_DISABLED_PATCHES: "comma-separated patches to leave alone",
    AUTOWEAVE_LOG_LEVEL: "level of the 'autoweave' logger",
    AUTOWEAVE_STRICT: "raise on internal failures instead of falling back",
    AUTOWEAVE_MODE: "when to weave: auto, always or off",
    AUTOWEAVE_STRATEGY: "how to place AC in a woven block: auto, hoist, pieces",
    AUTOWEAVE_REPORT: "write a JSON report of the plan and what compiled to this path at exit",
    AUTOWEAVE_UNTESTED_TORCH: "on a torch newer than tested: check (on if all it needs is there) or off",
}

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("", "0", "false", "no", "off")
PATCH_NAMES = ("compile", "module_compile", "checkpoint_wrapper")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MODES = ("auto", "always", "off")
STRATEGIES = ("auto", "hoist", "pieces")
UNTESTED_TORCH = ("check", "off")


class Settings:
    """Effective settings for this process, parsed once from the environment.

    A plain frozen class rather than a dataclass: ``dataclasses`` costs ~6 ms
    to import, paid at start-up by every process with ``AUTOWEAVE`` set.
    """

    __slots__ = (
        "enabled",
        "disabled_patches",
        "log_level",
        "strict",
        "mode",
        "strategy",
        "problems",
        "report",
        "untested_torch",
    )

    enabled: bool
    disabled_patches: frozenset[str]
    log_level: str | None
    strict: bool
    mode: str
    strategy: str
    # Human-readable complaints about values we could not use; each names the
    # variable and the accepted values.
    problems: tuple[str, ...]
    # Path template of the JSON report written at exit ("{rank}" is replaced), or None.
    report: str | None
    # On a torch newer than tested: "check" what autoweave needs (on if all there) or stay "off".
    untested_torch: str

    def __init__(
        self,
        enabled: bool = False,
        disabled_patches: frozenset[str] = frozenset(),
        log_level: str | None = None,
        strict: bool = False,
        mode: str = "auto",
        strategy: str = "auto",
        problems: tuple[str, ...] = (),
        report: str | None = None,
        untested_torch: str = "check",
    ) -> None:
        for name, value in zip(
            self.__slots__,
            (enabled, disabled_patches, log_level, strict, mode, strategy, problems, report, untested_torch),
            strict=True,
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Settings is frozen")

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Settings({fields})"

    def as_dict(self) -> dict[str, object]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["disabled_patches"] = sorted(self.disabled_patches)
        out["problems"] = list(self.problems)
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        problems: list[str] = []

        def choice(name: str, accepted: tuple[str, ...], default: str | None) -> str | None:
            raw = env.get(name)
            if raw is None or not raw.strip():
                return default
            value = raw.strip().lower()
            if value in accepted:
                return value
            problems.append(
                f"{name}={raw!r} not understood (accepted: {','.join(accepted)}); "
                f"using {default or 'the default'}"
            )
            return default

        def flag(name: str) -> bool:
            # Off by default: an empty value is off, one not understood is reported and off.
            return choice(name, TRUE_VALUES + FALSE_VALUES[1:], "off") in TRUE_VALUES

        enabled, disabled = flag(AUTOWEAVE), flag(AUTOWEAVE_DISABLE)  # both read: each may be a problem

        patches: set[str] = set()
        for item in env.get(AUTOWEAVE_DISABLED_PATCHES, "").split(","):
            item = item.strip().lower().replace("-", "_")
            if item in PATCH_NAMES:
                patches.add(item)
            elif item:
                problems.append(
                    f"{AUTOWEAVE_DISABLED_PATCHES} names unknown patch {item!r} "
                    f"(accepted: {','.join(PATCH_NAMES)}); ignoring it"
                )

        report: str | None = env.get(AUTOWEAVE_REPORT, "").strip() or None
        if report is not None:
            try:
                report.format(rank=0)
            except (KeyError, IndexError, ValueError):
                problems.append(
                    f"{AUTOWEAVE_REPORT}={report!r} is not a usable path "
                    "(accepted: a file path; '{rank}' is the only placeholder); writing no report"
                )
                report = None

        return cls(
            enabled=enabled and not disabled,
            disabled_patches=frozenset(patches),
            log_level=choice(AUTOWEAVE_LOG_LEVEL, LOG_LEVELS, None),
            strict=flag(AUTOWEAVE_STRICT),
            mode=choice(AUTOWEAVE_MODE, MODES, "auto") or "auto",
            strategy=choice(AUTOWEAVE_STRATEGY, STRATEGIES, "auto") or "auto",
            problems=tuple(problems),
            report=report,
            untested_torch=choice(AUTOWEAVE_UNTESTED_TORCH, UNTESTED_TORCH, "check") or "check",
        )


# -- the settings of this process ---------------------------------------------------------
#
# Owned here, so every layer reads them without importing the start-up code.

_current: Settings | None = None


def current() -> Settings:
    """The settings of this process, read from the environment on first use."""
    return _current if _current is not None else reload()


def reload(new: Settings | None = None) -> Settings:
    """Re-read the environment (or take ``new``); for tests and ``autoweave.enable()``."""
    global _current
    _current = Settings.from_environ() if new is None else new
    return _current


# -- per-module choices -------------------------------------------------------------------

# Where ``autoweave.set_mode`` leaves a module's own mode and strategy.
MODE_ATTR = "_autoweave_mode"
STRATEGY_ATTR = "_autoweave_strategy"


def check_choice(kind: str, value: str, accepted: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the accepted values unless ``value`` is one of them."""
    if value not in accepted:
        raise ValueError(f"{kind}={value!r} not understood (accepted: {', '.join(accepted)})")


def mode_and_strategy(
    module: object, mode: str | None = None, strategy: str | None = None
) -> tuple[str, str]:
    """The weave mode and AC strategy for ``module``: the arguments, then ``set_mode``'s, then the settings."""
    settings = current()
    return (
        mode or getattr(module, MODE_ATTR, None) or settings.mode,
        strategy or getattr(module, STRATEGY_ATTR, None) or settings.strategy,
    )


__version__ = "0.1.0"

# The name on the package index (``pip install torch-autoweave``): "autoweave" there is
# an unrelated project that also ships an ``autoweave`` import package. The import
# package keeps its name.
DISTRIBUTION = "torch-autoweave"
