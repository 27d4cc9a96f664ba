"""``python -m autoweave doctor``, ``python -m autoweave explain MODULE:FACTORY``, and ``autoweave-run``."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from autoweave import _settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autoweave", description="autoweave commands")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="would AUTOWEAVE=1 activate autoweave here, and if not, why")
    doctor.add_argument("--no-live", action="store_true", help="skip the check in a fresh subprocess")
    explain = sub.add_parser("explain", help="print the plan for a model built on the meta device")
    explain.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a module name or .py path, and a zero-argument factory or an expression, "
        "e.g. examples/train_moe.py:'Transformer(ModelArgs())'",
    )
    explain.add_argument(
        "--ac", choices=("full", "selective", "none"), default="full", help="simulated AC per block"
    )
    explain.add_argument(
        "--shard",
        type=lambda raw: tuple(s.strip() for s in raw.split(",") if s.strip()),
        help="comma list of submodule names treated as FSDP units (default: experts, where present); "
        "a name that matches nothing is an error",
    )
    explain.add_argument(
        "--blocks",
        metavar="PATH",
        help="dotted name of the container whose children are the blocks, e.g. model.layers "
        "(default: the ModuleList/ModuleDict holding the most parameters)",
    )
    explain.add_argument(
        "--recipe", metavar="MODULE:FUNCTION", help="apply your own AC / FSDP marking instead"
    )
    explain.add_argument("--mode", choices=_settings.MODES)
    explain.add_argument("--strategy", choices=_settings.STRATEGIES)
    explain.add_argument("--fullgraph", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        from autoweave.tools import doctor

        return doctor.main(live=not args.no_live)
    from autoweave.tools import explainer as explain_mod

    settings = _settings.current()
    try:
        factory = explain_mod.load_object(args.factory)
        recipe = explain_mod.load_object(args.recipe) if args.recipe else None
        text = explain_mod.explain(
            factory,
            ac=args.ac,
            shard=args.shard,
            blocks=args.blocks,
            recipe=recipe,
            mode=args.mode or settings.mode,
            strategy=args.strategy or settings.strategy,
            fullgraph=args.fullgraph,
        )
    except Exception as exc:  # BadInput says what to change; anything else is named by its type
        detail = exc if isinstance(exc, explain_mod.BadInput) else f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"autoweave explain: {detail}\n")
        return 2
    sys.stdout.write(text + "\n")
    return 0


def run_command(argv: list[str] | None = None) -> int:
    """``autoweave-run <command...>``: run a command with autoweave on (like ``ddtrace-run``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write("usage: autoweave-run COMMAND [ARGS...]\n  runs COMMAND with AUTOWEAVE=1\n")
        return 0 if args else 2
    # The installed start-up file (autoweave.pth) reads it in every Python the command starts.
    os.environ["AUTOWEAVE"] = "1"
    try:
        os.execvp(shutil.which(args[0]) or args[0], args)
    except OSError as exc:
        sys.stderr.write(f"autoweave-run: cannot run {args[0]!r}: {exc}\n")
        return 127
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    raise SystemExit(main())
