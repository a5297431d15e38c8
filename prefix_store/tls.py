"""TLS material and what is built from it: gRPC credentials and `ssl` contexts.

One place for every component: store shards and decoders serve with a `TLSConfig` (gRPC and
the store's data plane alike); every client (StoreClient, AsyncStoreClient, the data-plane
transfer, DecoderClient) connects with a `TLSClientConfig`.

The configs carry PEM bytes, not paths: a config travels whole to a Ray actor on another host,
so no certificate file has to exist there. Read files with `from_files`.

Servers verify nothing about clients unless `TLSConfig.client_ca` is set (mutual TLS: a client
without a certificate signed by that CA is refused during the handshake). Clients always verify
the server's certificate against `TLSClientConfig.ca` and check that it names the host they
dial (a DNS or IP subject alternative name), for gRPC and the data plane alike.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # gRPC is imported where it is used: the CLI reads TLS files without it
    import grpc

PEM = b"-----BEGIN "
MISMATCH = "the key is not the certificate's"


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    """The PEM file at `path`; ValueError naming `what` and the path if unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror or error}") from None
    if PEM not in data:
        raise ValueError(f"{what} {path}: not a PEM file")
    return data


def _check_pem(name: str, data: bytes | None) -> None:
    if data is not None and PEM not in data:
        raise ValueError(f"{name}: PEM bytes expected (-----BEGIN ...)")


def _loads(names: str, context_of, config) -> None:
    """ValueError now, not at the first handshake, when OpenSSL refuses the material (a key
    that is not the certificate's, a certificate that does not parse)."""
    try:
        context_of(config)
    except ssl.SSLError as error:
        reason = MISMATCH if error.reason == "KEY_VALUES_MISMATCH" else error.reason or error
        raise ValueError(f"{names}: {reason}") from None


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """A server's TLS: its certificate and key, and optionally the CA its clients must have
    certificates from (mutual TLS)."""

    cert: bytes
    """PEM certificate chain the server presents (leaf first). It must name every host
    clients dial (subject alternative names), e.g. `vericache certs DIR --hosts ...`."""
    key: bytes = field(repr=False)
    """PEM private key of `cert`."""
    client_ca: bytes | None = None
    """PEM CA certificate(s): when set, every client must present a certificate signed by
    it (mTLS) or its connection is refused; None: clients are not asked for one."""

    def __post_init__(self) -> None:
        _check_pem("cert", self.cert)
        _check_pem("key", self.key)
        _check_pem("client_ca", self.client_ca)
        _loads("cert, key and client_ca", server_context, self)

    @classmethod
    def from_files(cls, cert: str | os.PathLike, key: str | os.PathLike, client_ca=None):
        ca = read_pem(client_ca, "client CA") if client_ca else None
        return cls(read_pem(cert, "certificate"), read_pem(key, "key"), ca)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


@dataclass(frozen=True, slots=True)
class TLSClientConfig:
    """A client's TLS: the CA it trusts, and its own certificate for servers requiring mTLS."""

    ca: bytes | None = None
    """PEM CA certificate(s) the server's certificate must chain to; None: the system's
    trusted roots."""
    cert: bytes | None = None
    """PEM certificate chain presented to servers that require one (mTLS); None: none."""
    key: bytes | None = field(default=None, repr=False)
    """PEM private key of `cert` (required with it)."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key: give both (mTLS) or neither")
        _check_pem("ca", self.ca)
        _check_pem("cert", self.cert)
        _check_pem("key", self.key)
        _loads("ca, cert and key", client_context, self)

    @classmethod
    def from_files(cls, ca=None, cert=None, key=None) -> TLSClientConfig:
        """Any of the three may be None (see the fields); `cert` needs `key` and vice versa."""
        return cls(
            read_pem(ca, "CA") if ca else None,
            read_pem(cert, "certificate") if cert else None,
            read_pem(key, "key") if key else None,
        )


# ---- gRPC -----------------------------------------------------------------------------------


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    import grpc

    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.client_ca, require_client_auth=tls.mutual
    )


def channel_credentials(tls: TLSClientConfig) -> grpc.ChannelCredentials:
    import grpc

    return grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)


def bind(server: grpc.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind `address` (host:port) with TLS when `tls` is given, in the clear otherwise;
    returns the port bound (0 = it could not bind)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


def make_channel(address: str, options: Sequence, tls: TLSClientConfig | None) -> grpc.Channel:
    """A channel to `address`: TLS (verifying the server) when `tls` is given."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(tls), options=options)


def make_aio_channel(
    address: str, options: Sequence, tls: TLSClientConfig | None
) -> grpc.aio.Channel:
    """`make_channel` for grpc.aio."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


# ---- ssl (the data plane) -------------------------------------------------------------------


def server_context(tls: TLSConfig) -> ssl.SSLContext:
    """The data plane's server side: TLS 1.2+, client certificates required under mTLS."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(context, tls.cert, tls.key)
    if tls.mutual:
        context.load_verify_locations(cadata=tls.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TLSClientConfig) -> ssl.SSLContext:
    """The data plane's client side: verifies the server's chain and host name."""
    if tls.ca is None:
        context = ssl.create_default_context()
    else:
        context = ssl.create_default_context(cadata=tls.ca.decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert is not None:
        load_chain(context, tls.cert, tls.key)
    return context


def load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`context.load_cert_chain` from bytes: `ssl` reads only files, so the PEM goes to an
    anonymous in-memory file (Linux memfd) or, elsewhere, a 0600 file in a 0700 temporary
    directory that is removed at once."""
    with _private_file(cert + b"\n" + key) as path:
        context.load_cert_chain(path)


@contextlib.contextmanager
def _private_file(data: bytes) -> Iterator[str]:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("vericache-tls")
        try:
            with open(fd, "wb", closefd=False) as file:
                file.write(data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="vericache-tls-") as directory:
        path = Path(directory) / "chain.pem"
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data)
        yield str(path)
