"""A KRaft data directory read back without a broker: which storage a start resumes, which it
refuses (and says why), and what --fresh wipes."""

import pytest

from streams.errors import BrokerError
from streams.kraft_dir import (
    StoredNode,
    is_formatted,
    node_dir,
    prepare_storage,
    read_properties,
    server_properties,
    stored_node,
    write_node_files,
)


def _formatted(data_dir, *, node_id=1, cluster_id="c-1", port=9101, controller_port=9102):
    """What a start leaves behind: the properties, and the storage the format tool wrote."""
    extra = (("node.id", str(node_id)),)
    write_node_files(data_dir, server_properties(data_dir, port, controller_port, extra))
    (data_dir / "kraft-logs").mkdir()
    (data_dir / "kraft-logs" / "meta.properties").write_text(
        f"#\n#Mon Nov 30 13:15:14 UTC 2026\ncluster.id={cluster_id}\ndirectory.id=x\nnode.id={node_id}\nversion=1\n"
    )
    (data_dir / "kraft-logs" / "kept-0").mkdir()  # a topic's partition
    return data_dir


def _cluster(data_dir, brokers, cluster_id="c-3"):
    for i in range(1, brokers + 1):
        _formatted(
            node_dir(data_dir, i), node_id=i, cluster_id=cluster_id, port=9200 + 2 * i, controller_port=9201 + 2 * i
        )


def test_an_empty_directory_is_formatted_anew(tmp_path):
    assert prepare_storage(tmp_path, 1, fresh=False) == []
    assert prepare_storage(tmp_path, 3, fresh=False) == []


def test_a_formatted_broker_resumes_with_its_cluster_id_node_id_and_ports(tmp_path):
    _formatted(tmp_path, cluster_id="abc", port=9101, controller_port=9102)
    assert prepare_storage(tmp_path, 1, fresh=False) == [StoredNode(1, "abc", 9101, 9102, tmp_path)]
    # Writing the node's files again (as every start does) leaves the storage alone.
    write_node_files(tmp_path, server_properties(tmp_path, 9101, 9102))
    assert is_formatted(tmp_path) and (tmp_path / "kraft-logs" / "kept-0").is_dir()


def test_a_cluster_resumes_every_node(tmp_path):
    _cluster(tmp_path, 3)
    nodes = prepare_storage(tmp_path, 3, fresh=False)
    assert [(n.node_id, n.cluster_id, n.port, n.controller_port) for n in nodes] == [
        (1, "c-3", 9202, 9203),
        (2, "c-3", 9204, 9205),
        (3, "c-3", 9206, 9207),
    ]


@pytest.mark.parametrize(
    ("layout", "brokers", "reason"),
    [
        ("single", 3, "holds the Kafka storage of a single broker; start it without --brokers"),
        ("cluster3", 1, "holds the Kafka storage of a 3-broker cluster; start it with --brokers 3"),
        ("cluster3", 2, r"of cluster nodes \[1, 2, 3\], not of nodes 1..2; start it with --brokers 3"),
        ("mixed", 2, "belong to different clusters"),
    ],
)
def test_storage_of_another_shape_is_refused_with_what_to_do(tmp_path, layout, brokers, reason):
    if layout == "single":
        _formatted(tmp_path)
    elif layout == "cluster3":
        _cluster(tmp_path, 3)
    else:
        _formatted(node_dir(tmp_path, 1), node_id=1, cluster_id="one")
        _formatted(node_dir(tmp_path, 2), node_id=2, cluster_id="two", port=9111, controller_port=9112)
    with pytest.raises(BrokerError, match=reason) as err:
        prepare_storage(tmp_path, brokers, fresh=False)
    assert "--fresh" in str(err.value) and str(tmp_path) in str(err.value)


def test_fresh_wipes_a_brokers_and_a_clusters_storage(tmp_path):
    _formatted(tmp_path)
    _cluster(tmp_path, 3)
    assert prepare_storage(tmp_path, 3, fresh=True) == []
    assert not any(is_formatted(d) for d in (tmp_path, *(node_dir(tmp_path, i) for i in (1, 2, 3))))
    assert (tmp_path / "server.properties").exists()  # only the data goes


def test_storage_without_its_properties_cannot_be_resumed(tmp_path):
    _formatted(tmp_path)
    (tmp_path / "server.properties").unlink()
    with pytest.raises(BrokerError, match=r"cannot resume the Kafka storage in .*server\.properties is unreadable"):
        stored_node(tmp_path)


def test_storage_of_another_node_id_cannot_be_resumed(tmp_path):
    _formatted(tmp_path, node_id=1)
    meta = tmp_path / "kraft-logs" / "meta.properties"
    meta.write_text(meta.read_text().replace("node.id=1", "node.id=2"))
    with pytest.raises(BrokerError, match="disagree on the node id.*pass --fresh"):
        stored_node(tmp_path)


def test_a_failed_format_leaves_no_half_storage_to_resume(tmp_path):
    (tmp_path / "kraft-logs").mkdir()
    (tmp_path / "kraft-logs" / "bootstrap.checkpoint").write_text("partial")
    write_node_files(tmp_path, server_properties(tmp_path, 1, 2))
    assert not (tmp_path / "kraft-logs").exists()


def test_properties_are_read_as_java_writes_them(tmp_path):
    path = tmp_path / "p.properties"
    path.write_text("# comment\n! also\n\nlisteners=PLAINTEXT\\://h\\:1\n  key = value \nnoequals\n")
    assert read_properties(path) == {"listeners": "PLAINTEXT://h:1", "key": "value"}


def test_a_local_broker_keeps_committed_offsets_as_long_as_the_records(tmp_path):
    # Kafka's default forgets an empty group's offsets after 7 days: a job down a week lost its place.
    write_node_files(tmp_path, server_properties(tmp_path, 9101, 9102))
    minutes = int(read_properties(tmp_path / "server.properties")["offsets.retention.minutes"])
    assert minutes >= 10 * 365 * 24 * 60
