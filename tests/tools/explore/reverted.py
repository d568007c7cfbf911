"""`python -m tests.tools.explore.reverted ITEM [args]`: the explorer on a copy of this tree with one fix undone.

Each `reverts/<ITEM>.patch` undoes one fix the explorer must be able to find (REVERTS.md lists them,
with the seed that found each, its shrunk history and how long it took). The patch is applied to a
copy of the working tree's files (tracked and new) in a temporary directory, never here, and the explorer runs
there (`python -m tests.tools.explore`, PYTHONHASHSEED=0) with the arguments given, so what it finds
is the reverted code's, imported from the copy. Failures are saved under `.explore/reverted/<ITEM>/`
of this tree unless `--out` says otherwise; `--replay FILE` replays a saved one on the reverted code.

    python -m tests.tools.explore.reverted item-3a --seeds 300 --minutes 10 --mix trainer
    python -m tests.tools.explore.reverted item-3a --replay tests/explore_seeds/item-3a-*.json
    python -m tests.tools.explore.reverted --check     # every patch still applies to this tree

After an exploration that failed, each saved failure is replayed on this tree as it is: one that
passes here is the revert's (its line says so), one that fails here too is a bug of this tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PATCHES = Path(__file__).resolve().parent / "reverts"


def patches() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PATCHES.glob("*.patch"))}


def _copy_tree(dest: Path) -> None:
    """The working tree's files (tracked, and new ones not ignored), and the built extension modules."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    files = [f for f in listed.decode().split("\0") if f]
    files += [str(p.relative_to(ROOT)) for pkg in ("schemas", "streams", "workers") for p in (ROOT / pkg).rglob("*.so")]
    for rel in files:
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def _apply(patch: Path, tree: Path, *, check: bool = False) -> subprocess.CompletedProcess:
    cmd = ["git", "apply", *(["--check"] if check else []), str(patch)]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)


def check_all() -> int:
    """Whether every patch applies to a copy of this tree (a fix moved on: the patch must follow it)."""
    bad = 0
    with tempfile.TemporaryDirectory(prefix="rlstream-reverted-") as tmp:
        _copy_tree(Path(tmp))
        for name, patch in patches().items():
            done = _apply(patch, Path(tmp), check=True)
            status = "applies" if done.returncode == 0 else f"DOES NOT apply: {done.stderr.strip().splitlines()[0]}"
            print(f"reverted: {name}: {status}", flush=True)
            bad += done.returncode != 0
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        return check_all()
    known = patches()
    if not argv or argv[0] not in known:
        print(f"reverted: name a revert first: {', '.join(known) or '(none in ' + str(PATCHES) + ')'}", flush=True)
        return 2
    name, args = argv[0], argv[1:]
    # Paths given are this tree's, whatever directory the copy runs in.
    args = [str(Path(a).resolve()) if Path(a).exists() else a for a in args]
    if "--out" in args:
        at = args.index("--out") + 1
        args[at] = str(Path(args[at]).resolve())
    elif "--replay" not in args:
        args += ["--out", str(ROOT / ".explore" / "reverted" / name)]
    with tempfile.TemporaryDirectory(prefix=f"rlstream-reverted-{name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        done = _apply(known[name], tree)
        if done.returncode != 0:
            print(f"reverted: {name}.patch does not apply to this tree: {done.stderr.strip()}", flush=True)
            return 2
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        probe = "import workers, sys; sys.stdout.write(workers.__file__)"
        where = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env, capture_output=True, text=True)
        if not where.stdout.startswith(tmp):
            print(f"reverted: the copy's code is not the one imported ({where.stdout or where.stderr})", flush=True)
            return 2
        print(f"reverted: {name} applied to a copy of {ROOT} in {tmp}; exploring there", flush=True)
        code = subprocess.run([sys.executable, "-m", "tests.tools.explore", *args], cwd=tree, env=env).returncode
    if "--replay" not in args and code == 1:
        attribute(Path(args[args.index("--out") + 1]), env)
    return code


def attribute(out: Path, env: dict) -> None:
    """Which failures are the revert's: each saved failure replayed on this tree, unpatched. One that
    passes here fails only with the fix undone; one that fails here too is a bug of this tree's own."""
    for path in sorted(out.glob("*.json"), key=lambda p: int(p.stem.split("-")[1])):
        done = subprocess.run(
            [sys.executable, "-m", "tests.tools.explore", "--replay", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        verdict = "the revert's (passes with the fix)" if done.returncode == 0 else "fails with the fix too"
        print(f"reverted: {path.name}: {verdict}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
