"""Development certificates: a CA, a server certificate and a client certificate.

`make_certs(CertsRequest(directory, hosts))` writes, with the `cryptography` package:

    ca.pem, ca-key.pem          the CA (signs the other two; clients and mTLS servers trust it)
    server.pem, server-key.pem  shards and decoders; names localhost, 127.0.0.1, ::1 and every
                                host given (IP addresses as IP SANs), for server and client
                                authentication (decoders present it to the shards under mTLS)
    client.pem, client-key.pem  a client under mTLS (client authentication only)

Keys are ECDSA P-256, written unencrypted and readable by their owner only (0600 from their
first byte). For production, use certificates from your own CA with the same properties.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names every server certificate carries."""
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
DNS_NAME = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9][A-Za-z0-9-]{0,62})*")
Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True, slots=True)
class CertsRequest:
    """What `vericache certs` makes."""

    directory: Path
    """Where the six files go (created 0700 if missing); none of them may exist yet."""
    hosts: tuple[str, ...] = ()
    """Names the server certificate carries besides DEFAULT_HOSTS: DNS names or IP
    addresses (the hosts clients dial: a cluster's node IPs or names)."""
    days: int = 825
    """Validity of the server and client certificates (the CA's: ten years)."""

    def __post_init__(self) -> None:
        for host in self.hosts:
            if not (is_ip(host) or DNS_NAME.fullmatch(host)):
                raise ValueError(f"hosts: {host!r} is neither a DNS name nor an IP address")
        if not 1 <= self.days <= 3650:
            raise ValueError(f"days must be in [1, 3650], got {self.days}")
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"{self.directory}: not a directory")
        for name in FILES:
            if (self.directory / name).exists():
                raise ValueError(f"{self.directory / name} exists: choose an empty directory")


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def make_certs(request: CertsRequest) -> list[Path]:
    """Write the CA, server and client files; returns their paths."""
    request.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = ca_certificate(ca_key)
    hosts = tuple(dict.fromkeys(DEFAULT_HOSTS + request.hosts))
    server = leaf_certificate(ca, ca_key, server_key, "vericache-server", hosts, request.days)
    client = leaf_certificate(ca, ca_key, client_key, "vericache-client", (), request.days)
    written = []
    for name, cert, key in (("ca", ca, ca_key), ("server", server, server_key),
                            ("client", client, client_key)):  # fmt: skip
        written.append(write(request.directory / f"{name}.pem", pem(cert), 0o644))
        written.append(write(request.directory / f"{name}-key.pem", key_pem(key), 0o600))
    return written


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "VeriCache development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, key: Key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )


def ca_certificate(key: Key) -> x509.Certificate:
    name = _name("VeriCache development CA")
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    return (
        _builder(name, name, key, 3650)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )


def leaf_certificate(
    ca: x509.Certificate, ca_key: Key, key: Key, common_name: str, hosts: Sequence[str], days: int
) -> x509.Certificate:
    """Signed by the CA; with `hosts`, a server certificate (server and client auth) naming
    them; without, a client certificate."""
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    purposes = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        _builder(_name(common_name), ca.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )
    if hosts:
        purposes.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = builder.add_extension(x509.SubjectAlternativeName(sans(hosts)), False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(purposes), False)
    return builder.sign(ca_key, hashes.SHA256())


def sans(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """IP addresses as IP SANs, the rest as DNS SANs."""
    return [x509.IPAddress(ipaddress.ip_address(h)) if is_ip(h) else x509.DNSName(h) for h in hosts]


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: Key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write(path: Path, data: bytes, mode: int) -> Path:
    """A new file `path` with `mode` from its first byte (O_EXCL: never over another)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return path
