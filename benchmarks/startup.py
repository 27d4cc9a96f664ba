"""What the start-up file costs a Python process that never imports torch.

Times ``python -c pass`` in three throw-away venvs (built the way the start-up tests
build them, see ``tests/startup/venvs.py``):

* ``not installed``: a venv without autoweave (the baseline);
* ``installed, unset``: autoweave installed from its wheel, ``AUTOWEAVE`` unset;
* ``installed, on``: the same venv with ``AUTOWEAVE=1`` (torch is not imported).

Runs are interleaved (A B C A B C ...) so drift hits all three alike; the table
reports medians and the ratio of each median to the baseline's, beside the targets.

``--import-torch N`` adds a second table: the CPU seconds (user + system) of
``python -c "import torch"`` that never compiles (a dataloader worker, torchrun's
launcher, a tool), in the venv without autoweave and with ``AUTOWEAVE=1``, with and
without the report, N interleaved rounds. Plain torch leaves dynamo unimported; so
must autoweave (each run checks it), and the ratios say what autoweave's patching
of torch costs such a process.

    python benchmarks/startup.py [--rounds 60] [--import-torch 20] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "startup"))

import venvs  # noqa: E402 - the one venv recipe, shared with the tests

TARGETS = {"installed, unset": 1.02, "installed, on": 1.10}


IMPORT_TORCH = "import sys, torch; assert 'torch._dynamo' not in sys.modules, 'dynamo imported'"


def _cpu_once(python: Path, env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one ``import torch`` process."""
    proc = subprocess.Popen([str(python), "-c", IMPORT_TORCH], env=env, stdin=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"import torch failed ({proc.returncode}) with {env.get('AUTOWEAVE')=}")
    return usage.ru_utime + usage.ru_stime


def import_torch(
    configs: dict[str, tuple[Path, dict[str, str], bool]], rounds: int, report: Path
) -> list[dict]:
    """The ``import torch`` table: median CPU seconds per configuration, and the ratio to plain."""
    python, env_on = configs["installed, on"][0], configs["installed, on"][1]
    cases = {
        "not installed": configs["not installed"][:2],
        "installed, on": (python, env_on),
        "installed, on, report": (python, {**env_on, "AUTOWEAVE_REPORT": str(report)}),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for py, env in cases.values():
        _cpu_once(py, env)  # warm the page cache; also checks dynamo stays unimported
    for _ in range(rounds):
        for name, (py, env) in cases.items():
            samples[name].append(_cpu_once(py, env))
    base = statistics.median(samples["not installed"])
    return [
        {
            "config": name,
            "median_cpu_s": statistics.median(v),
            "min_cpu_s": min(v),
            "ratio": statistics.median(v) / base,
        }
        for name, v in samples.items()
    ]


def import_torch_markdown(rows: list[dict], rounds: int) -> str:
    lines = [
        f'`python -c "import torch"` (dynamo left unimported), CPU seconds, {rounds} interleaved rounds',
        "",
        "| configuration | median CPU (s) | min CPU (s) | ratio vs not installed |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['config']} | {r['median_cpu_s']:.2f} | {r['min_cpu_s']:.2f} | {r['ratio']:.2f}× |"
        for r in rows
    ]
    return "\n".join(lines)


def _time_once(python: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - start


def _check(python: Path, env: dict[str, str], expect_autoweave: bool) -> None:
    """Make sure each configuration does what its name says before timing it."""
    proc = subprocess.run(
        [
            str(python),
            "-c",
            "import sys; print(sorted(m for m in ('_autoweave_start', 'autoweave', 'wrapt', 'torch') if m in sys.modules))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    expected = "['_autoweave_start']" if expect_autoweave else "[]"
    if proc.stdout.strip() != expected or proc.stderr:
        raise SystemExit(
            f"unexpected start-up state {proc.stdout.strip()} {proc.stderr!r} (wanted {expected})"
        )


def build(workdir: Path) -> dict[str, tuple[Path, dict[str, str], bool]]:
    source = venvs.source_tree(workdir)
    wheel = venvs.build_wheel(source, workdir / "wheelhouse")
    bare = venvs.make_venv(workdir / "venv-bare")
    installed = venvs.make_venv(workdir / "venv-installed")
    venvs.install_wheel(installed, wheel)  # pip byte-compiles what it installs
    # Byte-code writing on, so every run after the first reads .pyc files as a user's would.
    env_off = venvs.child_env(keep_bytecode_flag=False)
    env_on = venvs.child_env({"AUTOWEAVE": "1"}, keep_bytecode_flag=False)
    return {
        "not installed": (bare.python, env_off, False),
        "installed, unset": (installed.python, env_off, False),
        "installed, on": (installed.python, env_on, True),
    }


def measure(
    configs: dict[str, tuple[Path, dict[str, str], bool]], rounds: int, warmup: int
) -> dict[str, list[float]]:
    for python, env, expect in configs.values():
        _check(python, env, expect)
        for _ in range(warmup):
            _time_once(python, env)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (python, env, _expect) in configs.items():
            samples[name].append(_time_once(python, env))
    return samples


def summarize(samples: dict[str, list[float]]) -> list[dict[str, object]]:
    base = statistics.median(samples["not installed"])
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / base
        target = TARGETS.get(name)
        rows.append(
            {
                "config": name,
                "median_ms": median * 1e3,
                "min_ms": min(values) * 1e3,
                "p90_ms": statistics.quantiles(values, n=10)[-1] * 1e3 if len(values) > 1 else median * 1e3,
                "stdev_ms": statistics.stdev(values) * 1e3 if len(values) > 1 else 0.0,
                "ratio": ratio,
                "target": target,
                "meets_target": None if target is None else ratio <= target,
            }
        )
    return rows


def markdown(rows: list[dict[str, object]], rounds: int) -> str:
    lines = [
        f"`python -c pass`, {rounds} interleaved rounds, Python {platform.python_version()} on {platform.machine()}",
        "",
        "| configuration | median (ms) | min (ms) | p90 (ms) | ratio vs not installed | target | meets |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in rows:
        target = "" if row["target"] is None else f"≤ {row['target']:.2f}×"
        meets = "" if row["meets_target"] is None else ("yes" if row["meets_target"] else "**no**")
        lines.append(
            f"| {row['config']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['p90_ms']:.1f} "
            f"| {row['ratio']:.3f}× | {target} | {meets} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds (default 60)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per configuration first")
    parser.add_argument("--json", type=Path, help="write the samples and the summary here")
    parser.add_argument("--workdir", type=Path, help="build the venvs here (default: a temporary directory)")
    parser.add_argument(
        "--import-torch", type=int, default=0, metavar="N", help="also time `import torch`, N rounds"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    with tempfile.TemporaryDirectory(prefix="autoweave-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        configs = build(workdir)
        samples = measure(configs, args.rounds, args.warmup)
        torch_rows = (
            import_torch(configs, args.import_torch, workdir / "report.json") if args.import_torch else []
        )
    rows = summarize(samples)
    print(markdown(rows, args.rounds))
    if torch_rows:
        print()
        print(import_torch_markdown(torch_rows, args.import_torch))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "python": platform.python_version(),
                    "summary": rows,
                    "samples_s": samples,
                    "import_torch": {"rounds": args.import_torch, "summary": torch_rows},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
