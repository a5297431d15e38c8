"""TLS on the command line: `vericache certs`, and the one place where TLS flags and
environment variables become `prefix_store.tls` configs.

Servers (`serve`): --tls-cert, --tls-key, --tls-client-ca (mTLS), --tls-ca.
Clients (`generate --endpoint`, `publish`): --tls-ca, --tls-cert, --tls-key, each defaulting
to $VERICACHE_TLS_CA, $VERICACHE_TLS_CERT, $VERICACHE_TLS_KEY. Bad input is InvalidArgument
(one line, exit status 2).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefix_store.errors import InvalidArgument
from prefix_store.tls import TLSClientConfig, TLSConfig, read_pem

CLIENT_ENV = {"ca": "VERICACHE_TLS_CA", "cert": "VERICACHE_TLS_CERT", "key": "VERICACHE_TLS_KEY"}


def add_commands(sub) -> None:
    certs = sub.add_parser(
        "certs", help="make a development CA, a server and a client certificate (TLS, mTLS)"
    )
    certs.add_argument("dir", type=Path, metavar="DIR", help="where the PEM files go")
    certs.add_argument(
        "--hosts",
        default="",
        help="comma-separated DNS names and IPs the server certificate names besides "
        "localhost, 127.0.0.1 and ::1 (every host clients dial)",
    )
    certs.add_argument("--days", type=int, default=825, help="validity (default %(default)s)")
    certs.set_defaults(parse=parse_certs, run=run_certs)


def parse_certs(ns: argparse.Namespace):
    from cluster.certs import CertsRequest

    hosts = tuple(h.strip() for h in ns.hosts.split(",")) if ns.hosts else ()
    try:
        return CertsRequest(ns.dir, hosts, ns.days)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def run_certs(request) -> int:
    from cluster.certs import make_certs

    try:
        written = make_certs(request)
    except OSError as error:
        raise InvalidArgument(f"{request.directory}: {error.strerror or error}") from None
    for path in written:
        print(path)
    d = request.directory
    print(
        f"next: vericache serve --tls-cert {d}/server.pem --tls-key {d}/server-key.pem "
        f"[--tls-client-ca {d}/ca.pem]\n"
        f"      export VERICACHE_TLS_CA={d}/ca.pem  "
        f"(mTLS: VERICACHE_TLS_CERT={d}/client.pem VERICACHE_TLS_KEY={d}/client-key.pem)"
    )
    return 0


# ---- servers -------------------------------------------------------------------------------


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", help="PEM certificate of the shards and decoders (TLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        help="require client certificates signed by this CA (mTLS); the decoders present "
        "--tls-cert to the shards",
    )
    parser.add_argument(
        "--tls-ca",
        help="the CA that signed --tls-cert, with which decoders verify the shards "
        "(default: $VERICACHE_TLS_CA, else --tls-client-ca)",
    )


def server_tls(ns: argparse.Namespace) -> tuple[TLSConfig | None, bytes | None]:
    """(the servers' TLSConfig, the CA verifying them) from serve's flags; (None, None) when
    TLS is off."""
    if not (ns.tls_cert or ns.tls_key):
        if ns.tls_client_ca or ns.tls_ca:
            raise InvalidArgument("--tls-client-ca and --tls-ca need --tls-cert and --tls-key")
        return None, None
    if not (ns.tls_cert and ns.tls_key):
        raise InvalidArgument("--tls-cert and --tls-key: give both")
    ca = ns.tls_ca or os.environ.get(CLIENT_ENV["ca"]) or ns.tls_client_ca
    try:
        tls = TLSConfig.from_files(ns.tls_cert, ns.tls_key, ns.tls_client_ca)
        return tls, read_pem(ca, "--tls-ca") if ca else None
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


# ---- clients -------------------------------------------------------------------------------


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", help="connect with TLS, trusting this CA ($VERICACHE_TLS_CA)")
    parser.add_argument(
        "--tls-cert", help="client certificate, for mTLS services ($VERICACHE_TLS_CERT)"
    )
    parser.add_argument("--tls-key", help="private key of --tls-cert ($VERICACHE_TLS_KEY)")


def client_tls(ns: argparse.Namespace) -> TLSClientConfig | None:
    """The client TLS of the flags, each defaulting to its environment variable; None (in the
    clear) when neither gives any."""
    paths = {
        name: getattr(ns, f"tls_{name}") or os.environ.get(v) for name, v in CLIENT_ENV.items()
    }
    if not any(paths.values()):
        return None
    try:
        return TLSClientConfig.from_files(**paths)
    except ValueError as error:
        raise InvalidArgument(f"TLS: {error} (--tls-ca/--tls-cert/--tls-key)") from None


def client_flags_given(ns: argparse.Namespace) -> bool:
    return any(getattr(ns, f"tls_{name}") for name in CLIENT_ENV)
