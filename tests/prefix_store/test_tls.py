"""TLS and mTLS on the store: certificates from `vericache certs`, round trips over gRPC and
the data plane, and every connection that must be refused (plaintext, no client certificate,
an untrusted CA). Real shards on loopback, real Redis; certificates made by the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import stat
import threading

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from cluster.certs import CertsRequest, key_pem, leaf_certificate, make_certs, pem
from cluster.cli import main
from prefix_store.client import AsyncStoreClient
from prefix_store.client.transfer import host_port
from prefix_store.config import ClientConfig
from prefix_store.errors import Unavailable
from prefix_store.metadata import Metadata
from prefix_store.protocol.frames import ERROR, OK, error_frame
from prefix_store.tls import TLSClientConfig, TLSConfig, client_context
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(7000, 7000 + 16 * 4 + 5))
KEYS = ("ca-key.pem", "server-key.pem", "client-key.pem")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """`vericache certs DIR` (through the CLI's main)."""
    directory = tmp_path_factory.mktemp("tls") / "certs"
    assert main(["certs", str(directory), "--hosts", "node-1.example,10.1.2.3"]) == 0
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """Certificates of an unrelated CA."""
    directory = tmp_path_factory.mktemp("tls") / "other"
    make_certs(CertsRequest(directory))
    return directory


def server_tls(certs, mutual: bool = False) -> TLSConfig:
    return TLSConfig.from_files(
        certs / "server.pem", certs / "server-key.pem", certs / "ca.pem" if mutual else None
    )


def client_tls(certs, with_cert: bool = False, ca_dir=None) -> TLSClientConfig:
    ca = (ca_dir or certs) / "ca.pem"
    if not with_cert:
        return TLSClientConfig.from_files(ca)
    return TLSClientConfig.from_files(ca, certs / "client.pem", certs / "client-key.pem")


def empty(tokens):
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def round_trip(store, token, tls, data_plane: bool, seed: int = 0) -> None:
    """Publish, look up and fetch through `store.client`; the bytes come back equal."""
    kv = random_kv(LAYOUT, len(TOKENS), seed=seed)
    with store.client(token, tls=tls, data_plane=data_plane) as client:
        assert bool(client.topology.data_addresses) is True
        client.publish_prefix(TOKENS, kv, LAYOUT)
        prefix = client.lookup(TOKENS, LAYOUT)
        assert prefix.tokens == len(TOKENS)
        k, v = empty(prefix.tokens)
        client.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def plane_reply(address: str, context: ssl.SSLContext | None) -> bytes:
    """Redeem an unknown ticket at a data plane (TLS when `context`): what comes back before
    the server ends the connection (a refusal: b"", or a TLS alert for a plaintext client)."""
    host, port = host_port(address)
    received = b""
    with socket.create_connection((host, port), timeout=5) as raw:
        try:
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            sock.sendall(b"\x00" * 48)
            while chunk := sock.recv(4096):
                received += chunk
        except TimeoutError:
            raise AssertionError("the data plane left the connection open") from None
        except OSError:  # reset, or the server's TLS alert (ssl.SSLError)
            pass
    return received


def useless(reply: bytes) -> bool:
    """Not a frame of the data plane (not even an error frame)."""
    return not reply.startswith((OK, ERROR))


UNKNOWN_TICKET = error_frame("UNAVAILABLE", "unknown or expired ticket")


# ---- vericache certs -------------------------------------------------------------------------


def test_certs_makes_a_ca_and_server_and_client_certificates_with_private_keys(certs):
    for name in KEYS:
        assert stat.S_IMODE((certs / name).stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((certs / "server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((certs / "client.pem").read_bytes())
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "node-1.example"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "::1",
        "10.1.2.3",
    }
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]


REASONS = {
    "dir is a file": "certs: not a directory",
    "files exist": "ca.pem exists: choose an empty directory",
    "bad host": "'bad host!' is neither a DNS name nor an IP address",
    "parent is a file": "Not a directory",
}


@pytest.mark.parametrize("case", list(REASONS))
def test_certs_refuses_a_bad_dir_in_one_line_with_status_2(tmp_path, capsys, case):
    target = tmp_path / "certs"
    hosts = []
    if case == "dir is a file":
        target.write_text("not a directory")
    elif case == "files exist":
        target.mkdir()
        (target / "ca.pem").write_text("an older CA")
    elif case == "bad host":
        hosts = ["--hosts", "good.example,bad host!"]
    else:
        (tmp_path / "file").write_text("")
        target = tmp_path / "file" / "certs"
    capsys.readouterr()
    assert main(["certs", str(target), *hosts]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vericache: error: ") and err.count("\n") == 1
    assert REASONS[case] in err
    if case == "files exist":
        assert (target / "ca.pem").read_text() == "an older CA"


def test_serve_refuses_a_key_that_is_not_the_certificates_in_one_line(certs, capsys):
    args = ["serve", "--tls-cert", str(certs / "server.pem")]
    assert main([*args, "--tls-key", str(certs / "client-key.pem")]) == 2
    err = capsys.readouterr().err
    assert err == "vericache: error: cert, key and client_ca: the key is not the certificate's\n"


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_a_tls_client_publishes_looks_up_and_fetches(store, metadata, certs, data_plane):
    store.start("shard-0", tls=server_tls(certs))
    store.start("shard-1", tls=server_tls(certs))
    round_trip(store, metadata.add_tenant("alice"), client_tls(certs), data_plane)


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_an_mtls_client_with_its_certificate_round_trips(store, metadata, certs, data_plane):
    store.start(tls=server_tls(certs, mutual=True))
    tls = client_tls(certs, with_cert=True)
    round_trip(store, metadata.add_tenant("alice"), tls, data_plane, seed=1)


def test_the_asyncio_client_round_trips_over_tls_and_its_data_plane(store, metadata, certs):
    store.start(tls=server_tls(certs, mutual=True))
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=2)
    config = ClientConfig(timeout_s=10, retries=2, tls=client_tls(certs, with_cert=True))

    async def run():
        async with await AsyncStoreClient.connect(store.endpoints, token, config) as client:
            assert client.topology.data_addresses
            await client.publish_prefix(TOKENS, kv, LAYOUT)
            prefix = await client.lookup(TOKENS, LAYOUT)
            k, v = empty(prefix.tokens)
            await client.fetch_layers(prefix, k, v)
            return prefix, k, v

    prefix, k, v = asyncio.run(run())
    assert torch.equal(k, kv[:, 0])
    assert torch.equal(v, kv[:, 1])


def test_the_data_plane_speaks_tls_to_a_trusting_client(store, certs):
    server = store.start(tls=server_tls(certs))
    assert plane_reply(server.data_address, client_context(client_tls(certs))) == UNKNOWN_TICKET


# ---- refusals --------------------------------------------------------------------------------


def test_a_plaintext_client_is_refused_by_a_tls_shard(store, metadata, certs):
    server = store.start(tls=server_tls(certs))
    token = metadata.add_tenant("alice")
    with pytest.raises(Unavailable):
        store.client(token, retries=1)
    channel = grpc.insecure_channel(server.address)
    with pytest.raises(grpc.RpcError) as caught:
        pb_grpc.PrefixStoreStub(channel).Describe(
            pb.DescribeRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=5
        )
    channel.close()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert useless(plane_reply(server.data_address, None))


def test_an_mtls_shard_refuses_a_client_without_a_certificate(store, metadata, certs):
    server = store.start(tls=server_tls(certs, mutual=True))
    token = metadata.add_tenant("alice")
    with pytest.raises(Unavailable):
        store.client(token, retries=1, tls=client_tls(certs))
    without = client_context(client_tls(certs))
    assert plane_reply(server.data_address, without) == b""
    with_cert = client_context(client_tls(certs, with_cert=True))
    assert plane_reply(server.data_address, with_cert) == UNKNOWN_TICKET


def test_a_client_that_does_not_trust_the_ca_is_refused(store, metadata, certs, other_ca):
    server = store.start(tls=server_tls(certs))
    token = metadata.add_tenant("alice")
    with pytest.raises(Unavailable):
        store.client(token, retries=1, tls=client_tls(certs, ca_dir=other_ca))
    host, port = host_port(server.data_address)
    context = client_context(client_tls(certs, ca_dir=other_ca))
    with (
        socket.create_connection((host, port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        context.wrap_socket(raw, server_hostname=host)


def test_a_certificate_that_does_not_name_the_host_dialled_is_refused(store, metadata, certs):
    """Signed by the trusted CA, but for another host: clients dialling 127.0.0.1 refuse it."""
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = leaf_certificate(ca, ca_key, key, "elsewhere", ("elsewhere.example",), 1)
    server = store.start(tls=TLSConfig(pem(cert), key_pem(key)))
    token = metadata.add_tenant("alice")
    with pytest.raises(Unavailable):
        store.client(token, retries=1, tls=client_tls(certs))
    host, port = host_port(server.data_address)
    with (
        socket.create_connection((host, port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"),
    ):
        client_context(client_tls(certs)).wrap_socket(raw, server_hostname=host)


# ---- Redis over TLS (rediss://) --------------------------------------------------------------


class TLSProxy:
    """A TLS-terminating TCP proxy in front of a plaintext server: an operator's Redis with
    TLS, as far as clients can tell (the embedded redis-server has no TLS)."""

    def __init__(self, certs, target: tuple[str, int]) -> None:
        self.target = target
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certs / "server.pem", certs / "server-key.pem")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with contextlib.suppress(OSError):
            secure = self.context.wrap_socket(conn, server_side=True)
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(upstream, secure), daemon=True).start()
            self._pipe(secure, upstream)

    @staticmethod
    def _pipe(source, sink) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_rediss_urls_with_a_ca_reach_redis_over_tls(store, metadata, redis_server, certs, other_ca):
    proxy = TLSProxy(certs, ("127.0.0.1", redis_server.port))
    try:
        base = f"rediss://:{redis_server.password}@127.0.0.1:{proxy.port}/0?ssl_ca_certs="
        over_tls = Metadata(base + str(certs / "ca.pem"))
        assert over_tls.ping()
        token = over_tls.add_tenant("alice")
        with pytest.raises(Unavailable):
            Metadata(base + str(other_ca / "ca.pem")).ping()
        store.redis_url = base + str(certs / "ca.pem")  # the shard's own metadata plane
        store.start(tls=server_tls(certs))
        round_trip(store, token, client_tls(certs), data_plane=True, seed=3)
    finally:
        proxy.close()
