"""The long run of the differential fuzzer: ``python -m tests.fuzz --cases 500 [--first 1000] [--json F]``.

Each case runs in this process, one after the other (``--seed N`` runs one).
It prints one line per case and a table of the differences found by kind, and
exits 1 when any case differs from plain torch.
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
    args = parser.parse_args(argv)
    os.environ.setdefault("AUTOWEAVE_LOG_LEVEL", "error")  # the plan summaries of hundreds of models
    logging.getLogger("torch").setLevel(logging.ERROR)

    import autoweave
    from tests.fuzz import differential

    autoweave.enable()
    seeds = args.seed or list(range(args.first, args.first + args.cases))
    results, kinds = [], collections.Counter()
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
            {"seed": seed, "case": case.describe(), "differences": found, "seconds": round(seconds, 1)}
        )
        kinds.update(f.split(":", 1)[0] for f in found)
        print(
            f"seed {seed}: {'ok' if not found else 'DIFFERS'} ({seconds:.1f} s) {case.describe()}", flush=True
        )
        for line in found:
            print(f"    {line}", flush=True)
    failed = [r for r in results if r["differences"]]
    print(
        f"\n{len(results)} cases in {time.perf_counter() - start:.0f} s: {len(failed)} differ from plain torch"
    )
    print("| difference | cases |\n|---|---|")
    for kind, count in sorted(kinds.items()):
        print(f"| {kind} | {count} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": len(results), "differ": len(failed), "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
