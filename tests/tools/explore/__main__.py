"""`python -m tests.tools.explore`: explore seeds, or replay seed files (`make explore`).

    python -m tests.tools.explore --seeds 500 --minutes 30        # seeds 0..499, at most 30 minutes
    python -m tests.tools.explore --seeds 40 --mix crash,job      # only those fault mixes, in turn
    python -m tests.tools.explore --replay .explore/failures/     # run saved cases again (files or dirs)

Each seed is one run (`cases.Case.draw(seed, mix)`, the mixes taken in turn); a failing one is
replayed once to check it repeats exactly, shrunk (`shrink.py`) and saved as a replayable seed file
under `--out` (default `.explore/failures/`), with the faults and events that matter printed. A
progress line shows every `--every` seconds; the last line says how many seeds ran and how many
failed, and the exit status is 1 if any did. Replayed files pass when they break nothing (the
regression seeds in tests/explore_seeds/ must, once their bug is fixed). Runs depend on the order
sets of strings iterate in, so the command sets PYTHONHASHSEED=0 for itself (re-running itself).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

HASH_SEED = "0"


def _reexec() -> None:
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
        os.execve(sys.executable, [sys.executable, "-m", "tests.tools.explore", *sys.argv[1:]], env)


def _args(argv: list[str] | None) -> argparse.Namespace:
    from tests.tools.explore.faults import MIXES

    p = argparse.ArgumentParser(prog="python -m tests.tools.explore", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=100, help="seeds to run (default 100)")
    p.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--minutes", type=float, default=None, help="stop starting seeds after this many minutes")
    p.add_argument("--mix", default=",".join(MIXES), help="fault mixes, taken in turn per seed (default: all of them)")
    p.add_argument("--out", type=Path, default=Path(".explore/failures"), help="where failing seeds are saved")
    p.add_argument("--no-shrink", action="store_true", help="save failures as found, unshrunk")
    p.add_argument("--shrink-runs", type=int, default=60, help="runs a shrink may take (default 60)")
    p.add_argument("--replay", nargs="+", type=Path, help="seed files or directories of them to run again")
    p.add_argument("--trace", action="store_true", help="with --replay: print the last points of each run")
    p.add_argument("--every", type=float, default=10.0, help="seconds between progress lines (default 10)")
    return p.parse_args(argv)


def _say(line: str) -> None:
    print(line, flush=True)


def _report(prefix: str, result, lines) -> None:
    for v in result.violations:
        _say(f"{prefix}  broke: {v}")
    for line in lines:
        _say(f"{prefix}    {line}")


def _explore(a: argparse.Namespace) -> int:
    from tests.tools.explore.cases import Case, history, run, save
    from tests.tools.explore.faults import MIXES
    from tests.tools.explore.shrink import shrink

    mixes = [m.strip() for m in a.mix.split(",") if m.strip()]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        _say(f"explore: unknown mix {', '.join(unknown)}; choose from {', '.join(MIXES)}")
        return 2
    t0 = last = time.monotonic()
    ran = failed = 0
    virtual = 0.0
    _say(f"explore: seeds {a.first}..{a.first + a.seeds - 1}, mixes {', '.join(mixes)}; failures go to {a.out}/")
    for i in range(a.seeds):
        if a.minutes is not None and time.monotonic() - t0 > a.minutes * 60:
            _say(f"explore: {a.minutes:g} minute(s) up")
            break
        seed = a.first + i
        case = Case.draw(seed, mixes[i % len(mixes)])
        result = run(case)
        ran += 1
        virtual += result.virtual_s
        if result.failed:
            failed += 1
            found_at = time.monotonic() - t0
            _say(f"explore: seed {seed} FAILED ({case.mix}, {result.real_s:.1f}s, {found_at:.0f} s in): {case}")
            again = run(case)
            exact = "replays exactly" if again.digest == result.digest else "DOES NOT replay exactly"
            _say(f"explore: seed {seed} {exact}")
            original = case
            if not a.no_shrink:
                s = shrink(case, result, budget=a.shrink_runs)
                case, result = s.case, s.result
                _say(f"explore: seed {seed} shrunk in {s.runs} run(s) to: {case}")
            path = a.out / f"seed-{seed}-{original.mix}.json"
            save(path, case, result, original=original)
            _report(f"explore: seed {seed}", result, history(result))
            _say(f"explore: seed {seed} saved as {path} (replay: python -m tests.tools.explore --replay {path})")
        now = time.monotonic()
        if now - last >= a.every:
            last = now
            _say(
                f"explore: {ran} seed(s), {failed} failed, {(now - t0) / ran:.2f} s a seed,"
                f" {virtual / ran:.0f} virtual s a run, {now - t0:.0f} s so far"
            )
    took = time.monotonic() - t0
    saved = f"; saved under {a.out}/" if failed else ""
    _say(f"explore: {ran} seed(s) ran, {failed} failed, in {took:.0f} s{saved}")
    return 1 if failed else 0


def _replay(a: argparse.Namespace) -> int:
    from tests.tools.explore.cases import history, load, run

    files = []
    for p in a.replay:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    failed = 0
    for path in files:
        case, data = load(path)
        result = run(case)
        same = data.get("digest") in (None, result.digest)
        status = "FAILED" if result.failed else "passed"
        other = "" if same else " (a different run than saved)"
        _say(f"replay: {path}: {status} ({result.real_s:.1f}s, {result.virtual_s:.0f} virtual s){other}")
        _say(f"replay:   {case}")
        if result.failed:
            failed += 1
            _report("replay:", result, history(result))
        if a.trace:
            for line in result.trace:
                _say(f"replay:   | {line}")
    _say(f"replay: {len(files)} seed file(s) ran, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    # The components' own warnings are part of the runs they describe, not of this command's output.
    logging.disable(logging.CRITICAL)
    return _replay(a) if a.replay else _explore(a)


if __name__ == "__main__":
    _reexec()
    sys.exit(main())
