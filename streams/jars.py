"""The Kafka broker's jars: a checksummed lock in the package, fetched over HTTPS without Maven.

`resources/kafka-jars.lock` lists every jar of the broker's runtime classpath (group, artifact,
version, file name, SHA-256) and the SHA-256 of the pom it was resolved from. `ensure_kafka_jars`
downloads the locked jars from a Maven repository (Maven Central unless `RLSTREAM_MAVEN_REPOSITORY`
says otherwise), verifies each checksum and moves the complete set into the cache in one rename, so
the cache holds all of them or none. Maven is needed only by a maintainer, to regenerate the lock
from the pom (`rlstream broker lock`).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from streams.errors import JarsError

LOCK_RESOURCE = "resources/kafka-jars.lock"
POM_RESOURCE = "resources/kafka-pom.xml"
REPOSITORY_ENV = "RLSTREAM_MAVEN_REPOSITORY"
# Maven's own default for the central repository.
DEFAULT_REPOSITORY = "https://repo.maven.apache.org/maven2"
_POM_LINE = re.compile(r"^# pom-sha256 ([0-9a-f]{64})$")


@dataclass(frozen=True)
class LockedJar:
    group: str
    artifact: str
    version: str
    file: str
    sha256: str

    def path_in(self, repository: str) -> str:
        return f"{repository.rstrip('/')}/{self.group.replace('.', '/')}/{self.artifact}/{self.version}/{self.file}"


@dataclass(frozen=True)
class JarLock:
    pom_sha256: str
    jars: tuple[LockedJar, ...]

    @property
    def digest(self) -> str:
        """Short content key of the locked set: an edited lock lands in a cache directory of its own."""
        text = "\n".join(f"{j.file} {j.sha256}" for j in self.jars)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def pom_text() -> bytes:
    return resources.files("streams").joinpath(POM_RESOURCE).read_bytes()


def parse_lock(text: str) -> JarLock:
    pom = None
    jars = []
    for n, line in enumerate(text.splitlines(), 1):
        if m := _POM_LINE.match(line):
            pom = m.group(1)
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 5 or not re.fullmatch(r"[0-9a-f]{64}", parts[4]):
            raise JarsError(f"{LOCK_RESOURCE} line {n}: expected 'group artifact version file sha256'")
        jars.append(LockedJar(*parts))
    if pom is None or not jars:
        raise JarsError(f"{LOCK_RESOURCE}: needs a '# pom-sha256 <hex>' line and at least one jar")
    return JarLock(pom, tuple(jars))


def format_lock(lock: JarLock) -> str:
    head = [
        "# The Kafka broker's runtime classpath, resolved by Maven from kafka-pom.xml.",
        "# Regenerate after editing the pom: rlstream broker lock",
        f"# pom-sha256 {lock.pom_sha256}",
    ]
    rows = [f"{j.group} {j.artifact} {j.version} {j.file} {j.sha256}" for j in lock.jars]
    return "\n".join(head + rows) + "\n"


def read_lock() -> JarLock:
    return parse_lock(resources.files("streams").joinpath(LOCK_RESOURCE).read_text())


def jars_dir(cache_dir: Path, lock: JarLock | None = None) -> Path:
    return Path(cache_dir) / f"kafka-jars-{(lock or read_lock()).digest}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Progress:
    """One line per jar on a pipe; a bar redrawn in place on a terminal."""

    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.done, self.log = total, 0, log
        self.tty = sys.stderr.isatty()

    def step(self, jar: LockedJar, size: int) -> None:
        self.done += 1
        if self.tty:
            bar = "#" * (24 * self.done // self.total)
            sys.stderr.write(f"\r[{bar:<24}] {self.done}/{self.total} {jar.file[:48]:<48}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            self.log(f"  {self.done}/{self.total} {jar.file} ({size / 1e6:.1f} MB, sha256 ok)")


def _download(url: str, dest: Path, timeout_s: float = 60.0) -> None:
    # A connection dropped mid-body raises http.client's own errors (IncompleteRead, ...), not OSError.
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp, open(dest, "wb") as out:
            shutil.copyfileobj(resp, out, 1 << 20)
            promised, got = resp.headers.get("Content-Length", ""), out.tell()
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise JarsError(f"downloading {url} failed: {type(exc).__name__}: {reason}") from None
    if promised.isdigit() and got != int(promised):
        raise JarsError(f"downloading {url} failed: the connection closed after {got} of {promised} bytes")


def _complete(target: Path) -> bool:
    return (target / ".complete").exists()


def ensure_kafka_jars(
    cache_dir: Path, *, log: Callable[[str], None] = print, repository: str | None = None, lock: JarLock | None = None
) -> Path:
    """The directory of the locked jars, fetched and verified the first time.

    Safe against concurrent fetches into the same cache: each downloads into a private directory,
    the first complete set to be renamed into place wins, and a complete target is never removed.
    """
    lock = lock or read_lock()
    target = jars_dir(cache_dir, lock)
    if _complete(target):
        return target
    repository = repository or os.environ.get(REPOSITORY_ENV) or DEFAULT_REPOSITORY
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching {len(lock.jars)} Kafka jars from {repository} into {target} (once)")
    # Everything lands in a private directory next to the target; a failure leaves nothing behind.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        staging = Path(tmp) / "libs"
        staging.mkdir()
        _fetch_into(staging, lock, repository, target, log)
        (staging / ".complete").write_text("ok\n")
        _move_into_place(staging, target, Path(tmp))
    return target


def _fetch_into(staging: Path, lock: JarLock, repository: str, target: Path, log: Callable[[str], None]) -> None:
    progress = _Progress(len(lock.jars), log)
    for jar in lock.jars:
        dest = staging / jar.file
        _download(jar.path_in(repository), dest)
        got = _sha256(dest)
        if got != jar.sha256:
            raise JarsError(
                f"checksum mismatch for {jar.file} ({jar.group}:{jar.artifact}:{jar.version}): "
                f"expected sha256 {jar.sha256}, got {got}; nothing was written to {target}"
            )
        progress.step(jar, dest.stat().st_size)


def _move_into_place(staging: Path, target: Path, tmp: Path) -> None:
    """Rename the verified `staging` to `target`, unless another fetch completed it first."""
    if _complete(target):
        return  # a concurrent fetch won: use its jars (a broker may already run on them); ours go
    if target.exists():
        # An incomplete leftover: moved aside (into our temporary directory, removed with it), not
        # removed in place, so a complete target renamed there meanwhile is never deleted.
        try:
            target.rename(tmp / "stale")
        except FileNotFoundError:
            pass
        except OSError as exc:
            if not _complete(target):
                raise JarsError(f"cannot replace the incomplete {target}: {exc.strerror or exc}") from None
            return
    try:
        staging.rename(target)
    except OSError as exc:
        if not _complete(target):
            raise JarsError(f"cannot move the fetched jars into {target}: {exc.strerror or exc}") from None


def resolve_lock(*, mvn: str | None = None, log: Callable[[str], None] = print) -> JarLock:
    """Resolve the pom's runtime classpath with Maven and checksum each jar: the lock to write."""
    mvn = mvn or shutil.which("mvn")
    if mvn is None:
        raise JarsError("mvn not found on PATH: Maven is needed to regenerate the jar lock from the pom")
    with tempfile.TemporaryDirectory(prefix="rlstream-lock-") as tmp:
        pom = Path(tmp) / "pom.xml"
        pom.write_bytes(pom_text())
        listing = Path(tmp) / "deps.txt"
        cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:list", "-DincludeScope=runtime",
               "-DoutputAbsoluteArtifactFilename=true", f"-DoutputFile={listing}"]  # fmt: skip
        log("resolving the pom's runtime classpath with Maven")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not listing.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise JarsError(f"Maven failed to resolve the pom (exit {proc.returncode}):\n{tail}")
        jars = [_locked(line) for line in listing.read_text().splitlines() if line.count(":") >= 5]
    return JarLock(hashlib.sha256(pom_text()).hexdigest(), tuple(sorted(jars, key=lambda j: j.file)))


def _locked(line: str) -> LockedJar:
    # group:artifact:type[:classifier]:version:scope:/absolute/path.jar
    coords, _, path = line.strip().split(" -- ")[0].partition(":/")
    parts = coords.split(":")
    group, artifact, version = parts[0], parts[1], parts[-2]
    file = Path("/" + path).name
    return LockedJar(group, artifact, version, file, _sha256(Path("/" + path)))
