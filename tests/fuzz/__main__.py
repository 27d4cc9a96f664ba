"""The long run of the differential fuzzer: ``python -m tests.fuzz --cases 500 [--first 1000] [--json F]``.

The cases run one after the other (``--seed N`` runs one), ``--per-process``
of them in each fresh Python process (0: all in this one). A process that runs
many cases slows down case after case (measured: 3.5 s a case at its start, 24
s after 60 cases, plain and autoweave runs alike): dynamo installs each
compiled graph as a global of the module whose code it traced (the fuzzer's
grammar), and ``torch._dynamo.reset()`` leaves them. It prints one line per
case and a table of the differences found by kind, and exits 1 when any case
differs from plain torch.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=50, help="how many seeds to run (default 50)")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seed", type=int, action="append", help="run these seeds only")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--per-process", type=int, default=20, help="cases per fresh process (default 20; 0: all in this one)"
    )
    parser.add_argument("--batch", action="store_true", help=argparse.SUPPRESS)  # one of _in_processes'
    args = parser.parse_args(argv)
    seeds = args.seed or list(range(args.first, args.first + args.cases))
    if 0 < args.per_process < len(seeds):
        return _in_processes(seeds, args.per_process, args.json)
    os.environ.setdefault("AUTOWEAVE_LOG_LEVEL", "error")  # the plan summaries of hundreds of models
    logging.getLogger("torch").setLevel(logging.ERROR)

    import autoweave
    from tests.fuzz import differential

    autoweave.enable()
    results = []
    start = time.perf_counter()
    for i, seed in enumerate(seeds):
        began = time.perf_counter()
        case, found = differential.check(seed)
        seconds = time.perf_counter() - began
        if i == 0:
            # What torch imported and built by the first case's end stays for the process: the
            # collector skips it from now on. A case collects a dozen times (its memory measure,
            # its dropped model), each a full pass over torch's heap otherwise: ~0.4 s a pass.
            gc.collect()
            gc.freeze()
        results.append(
            {
                "seed": seed,
                "case": case.describe(),
                "differences": found,
                "seconds": round(seconds, 1),
                "pid": os.getpid(),
            }
        )
        print(
            f"seed {seed}: {'ok' if not found else 'DIFFERS'} ({seconds:.1f} s) {case.describe()}", flush=True
        )
        for line in found:
            print(f"    {line}", flush=True)
    return _summary(results, time.perf_counter() - start, args.json, quiet=args.batch)


def _summary(results: list[dict], seconds: float, path: str | None, quiet: bool = False) -> int:
    failed = [r for r in results if r["differences"]]
    kinds = collections.Counter(f.split(":", 1)[0] for r in results for f in r["differences"])
    if path:
        with open(path, "w") as f:
            json.dump({"cases": len(results), "differ": len(failed), "results": results}, f, indent=1)
    if quiet:
        return 1 if failed else 0
    print(f"\n{len(results)} cases in {seconds:.0f} s: {len(failed)} differ from plain torch")
    print("| difference | cases |\n|---|---|")
    for kind, count in sorted(kinds.items()):
        print(f"| {kind} | {count} |")
    return 1 if failed else 0


def _in_processes(seeds: list[int], per_process: int, path: str | None) -> int:
    """Run ``seeds`` ``per_process`` at a time, each batch in a fresh ``python -m tests.fuzz``; one summary."""
    import subprocess
    import tempfile

    results: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz_") as folder:
        for i in range(0, len(seeds), per_process):
            batch, out = seeds[i : i + per_process], os.path.join(folder, f"{i}.json")
            command = [sys.executable, "-m", "tests.fuzz", "--per-process", "0", "--batch", "--json", out]
            for seed in batch:
                command += ["--seed", str(seed)]
            subprocess.run(
                command, check=False, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
            )
            try:
                with open(out) as f:
                    results += json.load(f)["results"]
            except (OSError, ValueError):  # the process died: its cases say so, the run goes on
                print(f"seeds {batch[0]}-{batch[-1]}: the process ended without results", flush=True)
                results += [
                    {"seed": s, "case": "?", "differences": ["crash: no result"], "seconds": 0.0}
                    for s in batch
                ]
    return _summary(results, time.perf_counter() - start, path)


if __name__ == "__main__":
    sys.exit(main())
