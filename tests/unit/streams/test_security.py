"""A secured broker's material and settings, read back without a broker: files, properties, ACLs, format."""

import ipaddress
import stat
import sys

import pytest
from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

from schemas.errors import RlstreamError
from streams import security
from streams.config import read_client_properties, write_private
from streams.errors import BrokerError
from streams.kraft_dir import (
    format_storage,
    prepare_storage,
    server_properties,
    stored_node,
    wipe_storage,
    write_node_files,
)


def _private(path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_properties_files_are_key_value_lines_with_comments(tmp_path):
    path = tmp_path / "c.properties"
    path.write_text(
        '# a comment\n! another\n\nbootstrap.servers = h:1,h:2\nsasl.jaas.config=a=b;c="d"\nssl.ca.location=/x/ca.pem\n'
    )
    assert read_client_properties(path) == {
        "bootstrap.servers": "h:1,h:2",
        "sasl.jaas.config": 'a=b;c="d"',
        "ssl.ca.location": "/x/ca.pem",
    }


def test_a_malformed_properties_line_names_the_line_and_key_never_the_value(tmp_path):
    path = tmp_path / "c.properties"
    path.write_text("security.protocol=SASL_SSL\nsasl.password hunter2\n")
    with pytest.raises(RlstreamError, match=r"c\.properties line 2: 'sasl\.password'") as info:
        read_client_properties(path)
    assert "hunter2" not in str(info.value)
    with pytest.raises(RlstreamError, match="missing.properties"):
        read_client_properties(tmp_path / "missing.properties")


def test_private_files_are_0600_even_when_they_existed_readable(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_material_is_generated_once_private_and_names_the_loopback_address(tmp_path):
    from cryptography import x509

    files, password = security.ensure_material(tmp_path)
    assert stat.S_IMODE(files.root.stat().st_mode) == 0o700
    for path in (files.ca_key, files.keystore, files.secrets):
        assert _private(path), path
    assert security.ensure_material(tmp_path) == (files, password)  # a resumed broker keeps its admin login
    chain = x509.load_pem_x509_certificates(files.keystore.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    assert chain[0].issuer == ca.subject and chain[1] == ca
    san = chain[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "PRIVATE KEY" in files.keystore.read_text()
    wipe_storage(tmp_path)  # --fresh: new storage, new credentials
    assert not files.root.exists()


def test_broker_settings_enforce_acls_and_keep_the_password_out_of_the_listeners(tmp_path):
    files = security.SecurityFiles.of(tmp_path)
    props = security.broker_settings(files, "pw123", 9101, 9102)
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["listeners"] == "SASL_SSL://127.0.0.1:9101,CONTROLLER://127.0.0.1:9102"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SSL"
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    assert set(props["super.users"].split(";")) == {"User:admin", f"User:CN={security.BROKER_CN}"}
    assert [k for k, v in props.items() if "pw123" in v] == ["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]


def test_secured_storage_resumes_as_secured_and_refuses_the_other_mode(tmp_path):
    extra = tuple(security.broker_settings(security.SecurityFiles.of(tmp_path), "pw", 9101, 9102).items())
    write_node_files(tmp_path, server_properties(tmp_path, 9101, 9102, extra))
    assert _private(tmp_path / "server.properties")
    (tmp_path / "kraft-logs").mkdir()
    (tmp_path / "kraft-logs" / "meta.properties").write_text("cluster.id=c-1\nnode.id=1\n")
    node = stored_node(tmp_path)
    assert (node.port, node.controller_port, node.security) == (9101, 9102, "sasl_ssl")
    assert prepare_storage(tmp_path, 1, fresh=False) == [node]
    with pytest.raises(BrokerError, match="formatted for sasl_ssl clients, not plaintext.*--fresh"):
        security.secure_start("plaintext", tmp_path, node, 9101, 9102)
    with pytest.raises(BrokerError, match="unknown broker security"):
        security.secure_start("ssl", tmp_path, None, 9101, 9102)
    assert security.secure_start("plaintext", tmp_path, None, 9101, 9102) == security.SecuredStart()


def test_the_pipeline_acls_are_prefixed_topics_groups_and_transactional_ids():
    grant = security.Grant(("run7",), ("run7", "g."), ("tx.",))
    acls = security.pipeline_acls("alice", grant)
    assert {a.principal for a in acls} == {"User:alice"}
    by = {}
    for a in acls:
        by.setdefault((a.restype, a.name, a.resource_pattern_type), set()).add(a.operation)
    prefixed = ResourcePatternType.PREFIXED
    topic_ops = {AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.CREATE}
    assert by[(ResourceType.TOPIC, "run7", prefixed)] >= topic_ops
    assert by[(ResourceType.GROUP, "g.", prefixed)] == {AclOperation.READ, AclOperation.DESCRIBE}
    assert by[(ResourceType.TRANSACTIONAL_ID, "tx.", prefixed)] == {AclOperation.WRITE, AclOperation.DESCRIBE}
    assert by[(ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL)] == {AclOperation.IDEMPOTENT_WRITE}
    assert not any(a.name == "" or a.resource_pattern_type == ResourcePatternType.MATCH for a in acls)


# A stand-in for `java`: records its argv and the @argfile it was given (and its mode), then fails.
_FAKE_JAVA = """
import os, stat, sys
out = sys.argv[1]
files = [a[1:] for a in sys.argv[2:] if a.startswith("@")]
body = open(files[0]).read() if files else ""
mode = oct(stat.S_IMODE(os.stat(files[0]).st_mode)) if files else ""
open(out, "w").write(repr(sys.argv) + "\\n" + mode + "\\n" + body)
print("bad argument: " + body.split()[-1], file=sys.stderr)
sys.exit(3)
"""


def test_the_admin_credential_reaches_the_format_tool_in_a_private_argfile_never_argv(tmp_path):
    seen = tmp_path / "seen"
    jvm = [sys.executable, "-c", _FAKE_JAVA, str(seen)]
    secret = security.format_arguments("s3cretpw")
    with pytest.raises(BrokerError) as info:
        format_storage(jvm, tmp_path / "server.properties", tmp_path, "cid", tuple(secret))
    argv, mode, body = seen.read_text().split("\n", 2)
    assert "s3cretpw" not in argv and "@" in argv
    assert mode == "0o600"
    assert '"--add-scram"' in body and '"SCRAM-SHA-512=[name=admin,password=s3cretpw]"' in body
    assert '"kafka.tools.StorageTool"' in body and '"format"' in body
    assert not (tmp_path / "format.args").exists()
    assert "s3cretpw" not in str(info.value) and "***" in str(info.value)
