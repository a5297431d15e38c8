"""The deployment's internal credential at a decoder: Info only, never a tenant's token.

Real components on loopback: a redis-server, a store shard, a decoder server with the
built-in model reading its internal credential from a 0600 file, and plain gRPC callers.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from decoder.internal import (
    InternalCredential,
    load_or_create_credential,
    read_credential,
)
from decoder.service.client import DecoderClient
from tests.decoder.service.conftest import serve
from tests.decoder.service.test_auth import GARBAGE, METHODS, raw_call


@pytest.fixture
def credential(tmp_path):
    return load_or_create_credential(tmp_path / "state" / "internal.token")


@pytest.fixture
def decoder(store, builtin_model, tmp_path, credential):
    server = serve(
        store.endpoints, builtin_model, internal_token_file=tmp_path / "state" / "internal.token"
    )
    yield server
    server.stop(0)


def test_the_internal_credential_reads_info_and_nothing_else(decoder, credential, caplog):
    caplog.set_level(logging.DEBUG)
    secret = credential.metadata()[0][1].split()[-1]
    with grpc.insecure_channel(decoder.address) as channel:
        for name in METHODS:
            code, details = raw_call(channel, name, GARBAGE, credential.metadata())
            if name == "Info":  # allowed: then its request is read (and is garbage)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (name, code, details)
                assert details == f"the deployment's internal credential may not call {name}"
            assert secret not in details
    with DecoderClient(decoder.address, secret) as client:
        info = client.info()
    assert info.worker_id == decoder.config.worker_id and info.kv_used >= 0
    assert decoder.worker.cached_clients() == 0  # it never reached the store
    assert secret not in caplog.text


def test_a_wrong_internal_credential_is_unauthenticated(decoder, credential, metadata):
    wrong = InternalCredential.generate()
    with grpc.insecure_channel(decoder.address) as channel:
        for name in METHODS:
            code, details = raw_call(channel, name, GARBAGE, wrong.metadata())
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
    token = metadata.add_tenant("alice")  # tenants are served as before
    with DecoderClient(decoder.address, token) as client:
        assert client.info().worker_id == decoder.config.worker_id


def test_the_credential_file_is_private_and_its_secret_hidden(tmp_path):
    path = tmp_path / "internal.token"
    made = load_or_create_credential(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_credential(path).metadata() == made.metadata()
    assert "vci_" not in repr(made)
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_credential(path)
    with pytest.raises(FileNotFoundError, match="missing on this host"):
        read_credential(tmp_path / "absent")
