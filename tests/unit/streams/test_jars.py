"""The jar lock: it matches the pom, and a fetch verifies every checksum and writes all or nothing."""

import hashlib
import socket
import threading
from pathlib import Path

import pytest

from streams.errors import JarsError
from streams.jars import JarLock, LockedJar, ensure_kafka_jars, format_lock, jars_dir, parse_lock, pom_text, read_lock


def test_the_packaged_lock_was_generated_from_the_current_pom():
    # Editing the pom without `rlstream broker lock` would start the broker on stale jars.
    lock = read_lock()
    assert lock.pom_sha256 == hashlib.sha256(pom_text()).hexdigest()
    files = {j.file for j in lock.jars}
    assert any(f.startswith("kafka_2.13-") for f in files) and any(f.startswith("log4j-core-") for f in files)


def test_lock_text_round_trips_and_a_bad_line_is_named():
    lock = read_lock()
    assert parse_lock(format_lock(lock)) == lock
    with pytest.raises(JarsError, match="line 2"):
        parse_lock("# pom-sha256 " + "0" * 64 + "\ng a v f.jar nothex\n")


def _repo(tmp_path: Path, content: bytes, locked_sha: str | None = None) -> tuple[str, JarLock]:
    repo = tmp_path / "repo"
    jar_dir = repo / "org" / "example" / "thing" / "1.0"
    jar_dir.mkdir(parents=True)
    (jar_dir / "thing-1.0.jar").write_bytes(content)
    sha = locked_sha or hashlib.sha256(content).hexdigest()
    return repo.as_uri(), JarLock("0" * 64, (LockedJar("org.example", "thing", "1.0", "thing-1.0.jar", sha),))


def test_fetch_verifies_the_checksum_and_fills_the_cache_once(tmp_path):
    repo, lock = _repo(tmp_path, b"jar bytes")
    cache = tmp_path / "cache"
    got = ensure_kafka_jars(cache, repository=repo, lock=lock, log=lambda m: None)
    assert (got / "thing-1.0.jar").read_bytes() == b"jar bytes" and (got / ".complete").exists()
    (Path(repo.removeprefix("file://")) / "org/example/thing/1.0/thing-1.0.jar").unlink()
    assert ensure_kafka_jars(cache, repository=repo, lock=lock, log=lambda m: None) == got  # no second fetch


def test_a_checksum_mismatch_names_the_jar_and_leaves_nothing_in_the_cache(tmp_path):
    repo, lock = _repo(tmp_path, b"tampered", locked_sha="a" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(JarsError, match=r"thing-1\.0\.jar \(org\.example:thing:1\.0\)"):
        ensure_kafka_jars(cache, repository=repo, lock=lock, log=lambda m: None)
    assert list(cache.iterdir()) == []


def test_an_unreachable_jar_is_an_error_naming_its_address(tmp_path):
    repo, lock = _repo(tmp_path, b"x")
    with pytest.raises(JarsError, match="nowhere"):
        ensure_kafka_jars(tmp_path / "cache", repository=repo + "/nowhere", lock=lock, log=lambda m: None)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_target_completed_by_a_concurrent_fetch_is_kept_and_used(tmp_path):
    repo, lock = _repo(tmp_path, b"jar bytes")
    cache = tmp_path / "cache"
    target = jars_dir(cache, lock)

    def log(message):
        # Another process finishes the same fetch while this one downloads.
        if message.startswith("fetching"):
            target.mkdir(parents=True)
            (target / "thing-1.0.jar").write_bytes(b"theirs")
            (target / ".complete").write_text("ok\n")

    assert ensure_kafka_jars(cache, repository=repo, lock=lock, log=log) == target
    assert (target / "thing-1.0.jar").read_bytes() == b"theirs"  # never removed, never replaced
    assert [p.name for p in cache.iterdir()] == [target.name]  # our copy is gone


def test_an_incomplete_leftover_is_replaced(tmp_path):
    repo, lock = _repo(tmp_path, b"jar bytes")
    cache = tmp_path / "cache"
    target = jars_dir(cache, lock)
    target.mkdir(parents=True)
    (target / "half.jar").write_bytes(b"x")
    assert ensure_kafka_jars(cache, repository=repo, lock=lock, log=lambda m: None) == target
    assert sorted(p.name for p in target.iterdir()) == [".complete", "thing-1.0.jar"]
    assert [p.name for p in cache.iterdir()] == [target.name]


TRUNCATED = {
    "length": (b"Content-Length: 1000\r\n\r\nabc", "closed after 3 of 1000 bytes"),
    "chunked": (b"Transfer-Encoding: chunked\r\n\r\n3e8\r\nabc", "IncompleteRead"),
}


@pytest.fixture(params=sorted(TRUNCATED))
def truncating_server(request):
    """An HTTP server that promises 1000 bytes, sends 3 and hangs up, as a dropped connection does."""
    response, reason = TRUNCATED[request.param]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + response)

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/maven2", reason
    listener.close()


def test_a_connection_dropped_mid_download_is_a_jars_error(tmp_path, truncating_server):
    repository, reason = truncating_server
    _, lock = _repo(tmp_path, b"x")
    with pytest.raises(JarsError, match=rf"thing-1\.0\.jar failed: .*{reason}"):
        ensure_kafka_jars(tmp_path / "cache", repository=repository, lock=lock, log=lambda m: None)
    assert list((tmp_path / "cache").iterdir()) == []
