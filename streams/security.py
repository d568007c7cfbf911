"""A secured local broker: TLS from a generated CA, SCRAM-SHA-512 users, and ACLs by name prefix.

    <dir>/security/            0700, created on the first secured start, wiped by --fresh
        ca.pem                 the CA clients trust (ssl.ca.location)
        ca.key                 the CA's key, kept to sign nothing else but the broker's certificate
        broker.pem             the broker's key and certificate chain (a PEM keystore)
        broker.secrets         JSON: the admin user's SCRAM password
        admin.properties       librdkafka client settings of the admin user (super user)
        users/<name>.properties  those of each user added by `rlstream broker user add`

Every file holding a secret is written 0600 and no secret is ever printed or put on a command line:
the admin credential reaches `kafka-storage format --add-scram` through a Java @argfile, the
broker's own login through its 0600 server.properties, and clients through these properties files.

Clients use SASL_SSL; the controller listener stays on loopback and uses mutual TLS (the broker's
certificate is its only accepted client certificate), so nobody without the broker's key may talk
to the controller. The authorizer is KRaft's StandardAuthorizer with allow.everyone.if.no.acl.found
off: a user may do only what an ACL allows; `admin` and the broker itself are super users.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from streams.config import KafkaConfig, read_client_properties, write_private
from streams.errors import BrokerError
from streams.kraft_dir import SECURITY_DIR, StoredNode

PLAINTEXT = "plaintext"
SASL_SSL = "sasl_ssl"
MODES = (PLAINTEXT, SASL_SSL)
ADMIN_USER = "admin"
MECHANISM = "SCRAM-SHA-512"
BROKER_CN = "rlstream-broker"
SCRAM_ITERATIONS = 8192
_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True)
class SecurityFiles:
    """Where a broker's security material lives under its data directory."""

    root: Path

    @classmethod
    def of(cls, data_dir: Path) -> SecurityFiles:
        return cls(Path(data_dir).resolve() / SECURITY_DIR)

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def keystore(self) -> Path:
        return self.root / "broker.pem"

    @property
    def secrets(self) -> Path:
        return self.root / "broker.secrets"

    @property
    def admin_client(self) -> Path:
        return self.root / "admin.properties"

    def user_client(self, user: str) -> Path:
        return self.root / "users" / f"{user}.properties"


def new_password() -> str:
    # Hex only: it travels inside a JAAS line, a Java @argfile and a properties file unquoted.
    return secrets.token_hex(24)


def ensure_material(data_dir: Path) -> tuple[SecurityFiles, str]:
    """The CA, the broker's certificate and the admin password, generated once; returns (files, admin password)."""
    files = SecurityFiles.of(data_dir)
    files.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(files.root, 0o700)
    if not (files.ca.is_file() and files.keystore.is_file()):
        _write_pki(files)
    try:
        return files, json.loads(files.secrets.read_text())["admin_password"]
    except (OSError, ValueError, KeyError):
        password = new_password()
        write_private(files.secrets, json.dumps({"admin_password": password}) + "\n")
        return files, password


def wipe_material(data_dir: Path) -> None:
    shutil.rmtree(SecurityFiles.of(data_dir).root, ignore_errors=True)


def _write_pki(files: SecurityFiles) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ten_years = now + datetime.timedelta(days=3650)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"rlstream local CA {secrets.token_hex(4)}")
    ca = (
        x509.CertificateBuilder(subject_name=ca_name, issuer_name=ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(ten_years)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # client: the controller's mTLS
    cert = (
        x509.CertificateBuilder(subject_name=name(BROKER_CN), issuer_name=ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(ten_years)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    write_private(files.ca_key, ca_key.private_bytes(pem, pkcs8, plain).decode())
    chain = cert.public_bytes(pem) + ca.public_bytes(pem)
    write_private(files.keystore, key.private_bytes(pem, pkcs8, plain).decode() + chain.decode())
    write_private(files.ca, ca.public_bytes(pem).decode())


@dataclass(frozen=True)
class SecuredStart:
    """What securing a broker start adds: server properties, format arguments, the admin client file."""

    properties: tuple[tuple[str, str], ...] = ()
    format_args: tuple[str, ...] = ()
    files: SecurityFiles | None = None
    admin_password: str = ""

    def write_admin_client(self, address: str) -> Path | None:
        if self.files is None:
            return None
        settings = client_settings(self.files, ADMIN_USER, self.admin_password)
        about = f"rlstream: the {ADMIN_USER} (super user) of the local broker at {address}"
        return write_client_file(self.files.admin_client, address, settings, about=about)


def secure_start(mode: str, data_dir: Path, stored: StoredNode | None, port: int, cport: int) -> SecuredStart:
    if mode not in MODES:
        raise BrokerError(f"unknown broker security {mode!r}; choose one of {', '.join(MODES)}")
    if stored is not None and stored.security != mode:
        raise BrokerError(
            f"the Kafka storage in {data_dir} was formatted for {stored.security} clients, not {mode}; "
            f"start it with --security {stored.security}, or pass --fresh to discard it"
        )
    if mode == PLAINTEXT:
        return SecuredStart()
    files, password = ensure_material(data_dir)
    props = tuple(broker_settings(files, password, port, cport).items())
    return SecuredStart(props, tuple(format_arguments(password)), files, password)


def broker_settings(files: SecurityFiles, admin_password: str, port: int, controller_port: int) -> dict[str, str]:
    """server.properties entries that put the node's listeners behind SASL_SSL and the authorizer."""
    jaas = f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN_USER}" password="{admin_password}";'  # noqa: E501
    return {
        "listeners": f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
        "inter.broker.listener.name": "SASL_SSL",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        # The broker's own login on its listener (transaction markers go through it).
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(files.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files.ca),
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": _AUTHORIZER,
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN_USER};User:CN={BROKER_CN}",
    }


def format_arguments(admin_password: str) -> list[str]:
    """`kafka-storage format` arguments that store the admin's SCRAM credential in the new metadata log."""
    return ["--add-scram", f"{MECHANISM}=[name={ADMIN_USER},password={admin_password}]"]


def client_settings(files: SecurityFiles, user: str, password: str) -> dict[str, str]:
    """librdkafka settings for `user` on the local secured broker."""
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": MECHANISM,
        "sasl.username": user,
        "sasl.password": password,
        "ssl.ca.location": str(files.ca),
    }


def write_client_file(path: Path, bootstrap: str, settings: Mapping[str, str], *, about: str) -> Path:
    """A 0600 librdkafka properties file (for `--kafka-config`, kcat -F, ...) with the cluster's address."""
    lines = [f"# {about}", "# Holds a password: keep it 0600 and out of version control."]
    lines.append(f"bootstrap.servers={bootstrap}")
    lines += [f"{k}={v}" for k, v in settings.items()]
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, "\n".join(lines) + "\n")
    return path


def admin_kafka(data_dir: Path) -> KafkaConfig:
    """The admin user's client configuration of the secured broker running from data_dir."""
    path = SecurityFiles.of(data_dir).admin_client
    if not path.is_file():
        raise BrokerError(f"no secured broker was started from {data_dir} (no {path}); start one with --security")
    settings = read_client_properties(path)
    return KafkaConfig(settings.pop("bootstrap.servers"), settings)


@dataclass(frozen=True)
class Grant:
    """What one pipeline user may touch: names starting with these prefixes."""

    topics: tuple[str, ...]
    groups: tuple[str, ...]
    transactional_ids: tuple[str, ...]


def pipeline_acls(user: str, grant: Grant) -> list:
    """The prefixed ACLs a pipeline user needs: topics, consumer groups, transactional ids, idempotent writes."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    principal = f"User:{user}"
    wanted: list[tuple[ResourceType, str, Iterable[AclOperation]]] = []
    topic_ops = ("READ", "WRITE", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS")
    wanted += [(ResourceType.TOPIC, p, topic_ops) for p in grant.topics]
    wanted += [(ResourceType.GROUP, p, ("READ", "DESCRIBE")) for p in grant.groups]
    wanted += [(ResourceType.TRANSACTIONAL_ID, p, ("WRITE", "DESCRIBE")) for p in grant.transactional_ids]
    allow = AclPermissionType.ALLOW
    out = [
        AclBinding(kind, prefix, ResourcePatternType.PREFIXED, principal, "*", AclOperation[op], allow)
        for kind, prefix, ops in wanted
        for op in ops
    ]
    cluster = (ResourceType.BROKER, "kafka-cluster", ResourcePatternType.LITERAL, principal, "*")
    out.append(AclBinding(*cluster, AclOperation.IDEMPOTENT_WRITE, allow))
    return out


def add_user(admin: KafkaConfig, user: str, password: str, grant: Grant, *, timeout_s: float = 30.0) -> int:
    """Create (or reset) `user`'s SCRAM credential and allow it `grant`; returns the number of ACLs."""
    from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    if not user or any(c in user for c in ",=[] \t\n"):
        raise BrokerError(f"user name {user[:40]!r} is empty or holds one of , = [ ] or whitespace")
    client = AdminClient(admin.admin())
    try:
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
        upsert = UserScramCredentialUpsertion(user, info, password.encode())
        for future in client.alter_user_scram_credentials([upsert], request_timeout=timeout_s).values():
            future.result()
        bindings = pipeline_acls(user, grant)
        for future in client.create_acls(bindings, request_timeout=timeout_s).values():
            future.result()
        return len(bindings)
    finally:
        client.poll(0)
