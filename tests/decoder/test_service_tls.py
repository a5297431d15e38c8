"""A decoder behind mTLS, configured as `vericache serve --tls-cert ... --tls-client-ca ...`
configures it: it serves TLS, connects to mTLS shards with the servers' certificate, and the
CLI reaches it with --tls-* flags or VERICACHE_TLS_* variables. Real components on loopback:
a redis-server, a store shard, a decoder with the built-in model."""

from __future__ import annotations

import json

import pytest

from cluster.certs import CertsRequest, make_certs
from cluster.cli import main
from cluster.serve import ServeConfig
from decoder.internal import load_or_create_credential
from decoder.service.client import DecoderClient
from decoder.service.server import DecoderServer
from decoder.service.worker import DecoderWorker
from prefix_store.errors import Unavailable
from prefix_store.provenance import load_or_create_key
from prefix_store.tls import TLSClientConfig, TLSConfig
from tests.prefix_store.conftest import Store


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls") / "certs"
    make_certs(CertsRequest(directory))
    return directory


@pytest.fixture
def serve_config(certs, tmp_path):
    """What `serve --tls-cert server.pem --tls-key server-key.pem --tls-client-ca ca.pem`
    builds (the CA verifying the servers defaults to the client CA)."""
    tls = TLSConfig.from_files(certs / "server.pem", certs / "server-key.pem", certs / "ca.pem")
    return ServeConfig(state_dir=tmp_path, tls=tls, tls_ca=tls.client_ca)


@pytest.fixture
def decoder(serve_config, metadata, redis_server, tmp_path, builtin_model):
    store = Store(redis_server.url, tmp_path)
    store.start(tls=serve_config.shard(0).tls)
    config = serve_config.decoder(0, store.endpoints)
    load_or_create_key(config.provenance_key_file)  # what `serve` makes in its state dir
    load_or_create_credential(config.internal_token_file)
    server = DecoderServer(config, DecoderWorker(config, model=builtin_model))
    server.start()
    yield server
    server.stop(0)
    store.close()


def client_tls(certs, with_cert: bool) -> TLSClientConfig:
    if not with_cert:
        return TLSClientConfig.from_files(certs / "ca.pem")
    return TLSClientConfig.from_files(
        certs / "ca.pem", certs / "client.pem", certs / "client-key.pem"
    )


def test_serve_config_gives_shards_and_decoders_the_tls_and_the_decoders_a_client_identity(
    serve_config,
):
    tls = serve_config.tls
    assert serve_config.shard(0).tls == tls and serve_config.tls_mode == "mtls"
    decoder = serve_config.decoder(0, ["127.0.0.1:1"])
    assert decoder.tls == tls
    assert decoder.client.tls == TLSClientConfig(tls.client_ca, tls.cert, tls.key)
    assert "PRIVATE KEY" not in repr(serve_config) + repr(decoder)


def test_an_mtls_decoder_serves_a_client_with_its_certificate_only(decoder, metadata, certs):
    token = metadata.add_tenant("alice")
    # Info authenticates the token with the store: the decoder's own mTLS client at work
    with DecoderClient(decoder.address, token, 30, client_tls(certs, with_cert=True)) as client:
        assert client.info().worker_id == "decoder-0"
    for tls in (None, client_tls(certs, with_cert=False)):
        with DecoderClient(decoder.address, token, 30, tls) as client, pytest.raises(Unavailable):
            client.info()


def test_publish_reaches_an_mtls_decoder_with_tls_flags_or_variables(
    decoder, metadata, certs, capsys, monkeypatch
):
    token = metadata.add_tenant("alice")
    base = ["publish", "--text", "Hello there.", "--endpoint", decoder.address, "--json"]
    flags = ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "client.pem")]
    flags += ["--tls-key", str(certs / "client-key.pem")]
    assert main([*base, "--token", token, *flags]) == 0
    assert json.loads(capsys.readouterr().out)["stored_bytes"] > 0  # via the decoder's mTLS
    monkeypatch.setenv("VERICACHE_TOKEN", token)
    monkeypatch.setenv("VERICACHE_TLS_CA", str(certs / "ca.pem"))
    monkeypatch.setenv("VERICACHE_TLS_CERT", str(certs / "client.pem"))
    monkeypatch.setenv("VERICACHE_TLS_KEY", str(certs / "client-key.pem"))
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    monkeypatch.delenv("VERICACHE_TLS_CERT")
    monkeypatch.delenv("VERICACHE_TLS_KEY")
    assert main(base) == 1  # no client certificate: refused
    err = capsys.readouterr().err
    assert err.startswith("vericache: error: ") and err.count("\n") == 1
    assert main([*base, "--tls-ca", str(certs / "missing.pem")]) == 2


def test_a_routers_http_api_serves_the_deployments_tls_to_certified_clients_only(
    decoder, serve_config, metadata, certs
):
    import dataclasses
    import ssl

    import httpx

    from decoder.http.config import HttpConfig
    from decoder.router import RouterServer

    stores = [decoder.config.store_endpoints[0]]
    config = serve_config.router(0, stores, [decoder.address])
    router = RouterServer(dataclasses.replace(config, http=HttpConfig()))
    router.start()
    try:
        assert router.http_url.startswith("https://")
        token = metadata.add_tenant("tls-http")
        auth = {"authorization": f"Bearer {token}"}
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        context.load_cert_chain(certs / "client.pem", certs / "client-key.pem")
        with httpx.Client(verify=context, timeout=30) as client:
            models = client.get(f"{router.http_url}/v1/models", headers=auth)
            assert models.json()["data"][0]["id"] == "smollm2-135m-instruct"
            body = {"model": "smollm2-135m-instruct", "prompt": "Hello there", "max_tokens": 3,
                    "temperature": 0}  # fmt: skip
            reply = client.post(f"{router.http_url}/v1/completions", json=body, headers=auth)
            assert reply.json()["usage"]["completion_tokens"] == 3
        anonymous = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # no client cert
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{router.http_url}/health", verify=anonymous, timeout=10).raise_for_status()
        with pytest.raises(httpx.HTTPError):  # in the clear: no answer
            httpx.get(router.http_url.replace("https", "http") + "/health", timeout=10)
    finally:
        router.stop(0)
