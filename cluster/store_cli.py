"""Store subcommands of `vericache`: serve, status, tenant, namespace."""

from __future__ import annotations

import argparse
import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import tls_cli
from cluster.secret_flags import add_secret
from decoder.config import PLACEMENTS
from prefix_store.errors import InvalidArgument

if TYPE_CHECKING:
    from prefix_store.metadata import Metadata

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_weight(text: str) -> float:
    """A tenant's fair-share weight: a finite number > 0 (else exit status 2)."""
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not (weight > 0 and weight != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a weight (a finite number > 0)")
    return weight


REDIS_HELP = "the deployment's Redis (none: the service started on this machine)"


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1000, 512MiB, 4GiB, 10GB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def add_commands(sub) -> None:
    """Register the store subcommands (each sets `parse` and `run`, as cli.py expects)."""
    serve = sub.add_parser("serve", help="run the prefix store (embedded, or on a Ray cluster)")
    serve.add_argument(
        "--config",
        type=Path,
        help="YAML file of flags (keys: flag names, e.g. 'shards: 4', 'memory-bytes: 4GiB'); "
        "every flag may also come from $VERICACHE_<FLAG>; the command line wins, then the "
        "environment, then the file",
    )
    serve.add_argument(
        "--address",
        help="Ray cluster address ('auto' on a cluster node); default: embedded on this machine",
    )
    serve.add_argument("--shards", type=int, default=2, help="store shards (default 2)")
    add_secret(serve, "redis-url", "existing Redis; none: start one (on this node, for a cluster)")
    serve.add_argument(
        "--redis-port", type=int, default=0, help="port of the Redis serve starts (default: free)"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="bind address of the shards (0.0.0.0 for other hosts)"
    )
    serve.add_argument(
        "--port",
        type=int,
        default=0,
        help="first shard port, shard i on PORT+i (default: free ports)",
    )
    serve.add_argument(
        "--data-port",
        type=int,
        default=0,
        help="first shard bulk data-plane port, shard i on DATA_PORT+i (default: free ports)",
    )
    serve.add_argument(
        "--memory-bytes",
        type=parse_bytes,
        default="2GiB",
        help="memory tier per shard (default 2GiB)",
    )
    serve.add_argument(
        "--disk-bytes",
        type=parse_bytes,
        default="8GiB",
        help="disk tier per shard, 0 for none (default 8GiB)",
    )
    serve.add_argument("--state-dir", type=Path, help="Redis data and disk tiers")
    serve.add_argument(
        "--replication", type=int, help="copies per chunk (default 2 if >= 2 shards)"
    )
    serve.add_argument(
        "--decoders", type=int, default=1, help="decoder workers (default 1; 0 = store only)"
    )
    serve.add_argument(
        "--decoder-port",
        type=int,
        default=0,
        help="first decoder port, decoder i on DECODER_PORT+i (default: free ports)",
    )
    serve.add_argument(
        "--routers",
        type=int,
        help="routers in front of the decoders: the one endpoint applications need, with "
        "prefix affinity and mid-stream failover (default 1 when there are decoders; 0: none)",
    )
    serve.add_argument(
        "--router-port",
        type=int,
        default=0,
        help="first router port, router i on ROUTER_PORT+i (default: free ports)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        help="routers also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...), "
        "router i on HTTP_PORT+i (0: free ports; default: none)",
    )
    serve.add_argument(
        "--router-policy",
        choices=("affinity", "round-robin"),
        default="affinity",
        help="how routers choose a decoder: affinity (prefix affinity with bounded loads; "
        "default) or round-robin (for comparison)",
    )
    serve.add_argument(
        "--kv-budget",
        type=parse_bytes,
        help="KV bytes per decoder: compressed prefixes, tails, staging (default unlimited)",
    )
    serve.add_argument(
        "--compressor",
        default="snapkv:budget=0.125",
        help="the decoders' default compressor spec (default: %(default)s)",
    )
    serve.add_argument(
        "--ngram",
        type=int,
        default=0,
        help="the decoders' default prompt-lookup guesses per forward, 0-32, for requests "
        "that do not say (default: %(default)s, off)",
    )
    serve.add_argument(
        "--no-resident-prefixes",
        dest="resident_prefixes",
        action="store_false",
        help="decoders pull the full KV for every verification instead of keeping prefixes "
        "in flight resident while their KV budget has room",
    )
    serve.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="auto",
        help="where decoders verify against a stored prefix that is not resident: near "
        "(attention partials computed on the shards that hold it), pull (its full KV pulled "
        "for every pass), auto (near when the shards run the decoders' kernel; default)",
    )
    serve.add_argument(
        "--detach",
        action="store_true",
        help="with --address: leave the service running on the cluster and exit "
        "(`vericache stop --address ...` removes it)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="first Prometheus metrics port: shard i on PORT+i, decoder i on PORT+shards+i "
        "(default: free ports)",
    )
    serve.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no Prometheus metrics endpoints",
    )
    add_secret(
        serve,
        "metrics-token",
        "bearer token the metrics endpoints require (none: a random one, in the state file)",
    )
    serve.add_argument(
        "--lmcache-port",
        type=int,
        help="start an LMCache gateway (remote_url: lm://HOST:PORT, remote_serde: naive) on "
        "this port, 0 for a free one (default: none)",
    )
    serve.add_argument(
        "--lmcache-host",
        default="127.0.0.1",
        help="where the LMCache gateway binds (default loopback: LMCache's protocol has no "
        "credentials, every connection acts as the gateway's tenant)",
    )
    add_secret(
        serve,
        "lmcache-token",
        "token of the tenant the gateway acts as (none: the tenant 'lmcache', created or its "
        "token rotated)",
    )
    serve.add_argument(
        "--lmcache-namespace", default="", help="the namespace the gateway stores into"
    )
    serve.add_argument(
        "--audit-rate",
        type=float,
        default=0.0,
        help="share of vericache requests decoded again with full KV off the hot path and "
        "compared token for token (the vericache_decoder_audits_total metric; default 0: off)",
    )
    tls_cli.add_server_flags(serve)
    serve.set_defaults(parse=lambda ns: ns, run=run_serve)

    stop = sub.add_parser("stop", help="stop a service deployed with `serve --detach`")
    stop.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    stop.set_defaults(parse=lambda ns: ns, run=run_stop)

    status = sub.add_parser("status", help="shards, capacity, usage per tenant, hit rates")
    add_secret(status, "redis-url", "the deployment's Redis (none: this machine's service)")
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="refresh the figures every SECONDS (default 2) until Ctrl-C",
    )
    tls_cli.add_client_flags(status)
    status.set_defaults(parse=lambda ns: ns, run=run_status)

    tenant = sub.add_parser("tenant", help="manage tenants").add_subparsers(
        dest="action", required=True, parser_class=sub._parser_class
    )
    add = tenant.add_parser("add", help="create a tenant and print its bearer token")
    add.add_argument("name")
    add.add_argument(
        "--quota",
        type=parse_bytes,
        default=8 << 30,  # prefix_store.metadata.records.DEFAULT_QUOTA (not imported: redis)
        help="bytes the tenant may store, replicas included (default 8GiB; 0 = unlimited)",
    )
    add.add_argument(
        "--weight",
        type=parse_weight,
        default=1.0,
        help="its weight in every server's fair shares of calls, tickets, connections and "
        "bytes (default 1; a tenant of weight 2 gets twice the share of weight 1)",
    )
    add.add_argument(
        "--admin",
        action="store_true",
        help="the admin role: its calls use a small reserved pool of call slots that "
        "tenants cannot fill (operators' tooling)",
    )
    add_secret(add, "redis-url", REDIS_HELP)
    add.set_defaults(parse=lambda ns: ns, run=run_tenant_add)
    rotate = tenant.add_parser(
        "rotate", help="print a new bearer token for a tenant; the old one stops working"
    )
    rotate.add_argument("name")
    add_secret(rotate, "redis-url", REDIS_HELP)
    rotate.set_defaults(parse=lambda ns: ns, run=run_tenant_rotate)
    remove = tenant.add_parser(
        "remove", help="delete a tenant: its token and memberships stop working"
    )
    remove.add_argument("name")
    add_secret(remove, "redis-url", REDIS_HELP)
    remove.set_defaults(parse=lambda ns: ns, run=run_tenant_remove)
    lst = tenant.add_parser("list", help="tenants with quotas, usage and namespaces")
    add_secret(lst, "redis-url", REDIS_HELP)
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(parse=lambda ns: ns, run=run_tenant_list)

    space = sub.add_parser("namespace", help="manage shared namespaces").add_subparsers(
        dest="action", required=True, parser_class=sub._parser_class
    )
    nadd = space.add_parser("add", help="create a shared namespace or add members to it")
    nadd.add_argument("name")
    nadd.add_argument(
        "--member", action="append", default=[], help="a tenant that may read and publish"
    )
    nadd.add_argument("--reader", action="append", default=[], help="a tenant that may only read")
    nadd.add_argument("--owner", help="the tenant that may also delete what others stored")
    add_secret(nadd, "redis-url", REDIS_HELP)
    nadd.set_defaults(parse=lambda ns: ns, run=run_namespace_add)
    nrm = space.add_parser("remove-member", help="take a tenant out of a shared namespace")
    nrm.add_argument("name")
    nrm.add_argument("--member", required=True, help="the tenant to remove")
    add_secret(nrm, "redis-url", REDIS_HELP)
    nrm.set_defaults(parse=lambda ns: ns, run=run_namespace_remove_member)
    nlist = space.add_parser("list", help="shared namespaces and their members")
    add_secret(nlist, "redis-url", REDIS_HELP)
    nlist.set_defaults(parse=lambda ns: ns, run=run_namespace_list)


def apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`serve`'s flags from its --config file and VERICACHE_* variables (`config_file`)."""
    from cluster import config_file

    if argv[:1] != ["serve"]:
        return
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    config_file.apply(
        sub.choices["serve"], config_file.config_path(argv), config_file.environment()
    )


def _compressor(spec: str) -> str:
    from decoder.compressors import parse_compressor
    from decoder.errors import CompressorSpecError

    try:
        return parse_compressor(spec).spec
    except CompressorSpecError as error:
        raise InvalidArgument(f"--compressor: {error}") from None


def metadata(ns) -> Metadata:
    from cluster.state import read_state
    from prefix_store.metadata import Metadata

    url = ns.redis_url or read_state()["redis_url"]
    return Metadata(url)


def run_serve(ns) -> int:
    from cluster.serve import Deployment

    config = serve_config(ns)
    if config.detach:
        return serve_detached(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deployment = Deployment(config)
    try:
        deployment.start()
        print_endpoints(deployment)
        print("  next: vericache tenant add NAME   (Ctrl-C stops the service)", flush=True)
        stop.wait()
    finally:
        print("vericache store: shutting down", flush=True)
        deployment.stop()
    return 0


def serve_config(ns):
    """The typed `ServeConfig` of serve's flags (from the command line, the environment
    and --config alike)."""
    from cluster.serve import ServeConfig, home

    tls, tls_ca = tls_cli.server_tls(ns)
    try:
        config = ServeConfig(
            address=ns.address,
            shards=ns.shards,
            redis_url=ns.redis_url,
            redis_port=ns.redis_port,
            host=ns.host,
            port=ns.port,
            data_port=ns.data_port,
            memory_bytes=ns.memory_bytes,
            disk_bytes=ns.disk_bytes,
            state_dir=ns.state_dir or home() / "state",
            replication=ns.replication,
            decoders=ns.decoders,
            decoder_port=ns.decoder_port,
            routers=ns.routers,
            router_port=ns.router_port,
            router_policy=ns.router_policy,
            http_port=ns.http_port,
            kv_budget=ns.kv_budget,
            compressor=_compressor(ns.compressor),
            ngram=ns.ngram,
            resident_prefixes=ns.resident_prefixes,
            placement=ns.placement,
            detach=ns.detach,
            tls=tls,
            tls_ca=tls_ca,
            metrics=ns.metrics,
            metrics_port=ns.metrics_port,
            metrics_token=ns.metrics_token,
            audit_rate=ns.audit_rate,
            lmcache_port=ns.lmcache_port,
            lmcache_host=ns.lmcache_host,
            lmcache_token=ns.lmcache_token,
            lmcache_namespace=ns.lmcache_namespace,
        )
    except ValueError as error:
        raise InvalidArgument(str(error)) from error
    return config


def serve_detached(config) -> int:
    """Deploy onto the cluster and leave it running (the `ray up` path)."""
    import ray

    from cluster.serve import Deployment

    deployment = Deployment(config).start()
    print_endpoints(deployment)
    print(f"  next: vericache tenant add NAME   (`vericache stop --address {config.address}` "
          "removes the service)", flush=True)  # fmt: skip
    ray.shutdown()
    return 0


def print_endpoints(deployment) -> None:
    config = deployment.config
    print(
        f"vericache: {config.shards} shard(s), {config.decoders} decoder(s) and "
        f"{len(deployment.routers)} router(s) up, TLS: {config.tls_mode}",
        flush=True,
    )
    for endpoint in deployment.endpoints.values():
        print(f"  store    {endpoint}")
    for endpoint in deployment.decoders.values():
        print(f"  decoder  {endpoint}")
    for endpoint in deployment.routers.values():
        print(f"  router   {endpoint}   (vericache generate --endpoint {endpoint} ...)")
    for url in deployment.http.values():
        print(f"  http     {url}/v1   (OpenAI-compatible: base_url; the tenant token as API key)")
    if deployment.lmcache:
        print(f"  lmcache  lm://{deployment.lmcache}   (LMCache remote_url; remote_serde: naive)")
    for name, url in sorted(deployment.metrics.items()):
        print(f"  metrics  {url}   ({name}; bearer token in the state file)")
    from cluster.serve import state_file

    print(
        f"  redis    {_redacted(deployment.redis_url)}   (full URL in {state_file()})", flush=True
    )


def run_stop(ns) -> int:
    from cluster.serve import stop_detached

    stopped = stop_detached(ns.address)
    if not stopped:
        print("vericache: no detached service on this cluster")
        return 1
    print(f"vericache: stopped {', '.join(stopped)}")
    return 0


def _redacted(url: str) -> str:
    from prefix_store.metadata.records import redact_url

    return redact_url(url)


def _status(md: Metadata) -> dict:
    shards = md.shards()
    usage = md.usage()
    tenants = []
    for name in md.tenant_names():
        record = md.tenant(name)
        tenants.append(
            {
                "name": name,
                "quota": record.quota if record else 0,
                "bytes": usage.get(name, 0),
                "namespaces": sorted(n for n in (record.namespaces if record else {}) if n),
            }
        )
    return {
        "shards": [{"shard_id": s.shard_id, "address": s.address, **s.info} for s in shards],
        "tenants": tenants,
        "replication": md.replication() or min(2, max(1, len(shards))),
    }


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


FAULTS = ("corrupt", "lost_spills", "disk_write_errors", "disk_rejected")
"""A shard's fault counters (`prefix_store.server.Service.shard_stats`)."""


def run_status(ns) -> int:
    if ns.watch is not None and ns.watch <= 0:
        raise InvalidArgument("--watch: the period must be > 0 seconds")
    if ns.watch is None:
        _print_status(ns)
        return 0
    try:
        while True:
            print("\033[H\033[2J", end="")  # clear the terminal
            _print_status(ns)
            print(f"(every {ns.watch:g} s; Ctrl-C stops)", flush=True)
            time.sleep(ns.watch)
    except KeyboardInterrupt:
        return 0


def _print_status(ns) -> None:
    status = _status(metadata(ns))
    status["live"], status["http"] = _live(ns)
    if ns.json:
        print(json.dumps(status, indent=2))
        return
    for url in status["http"]:
        print(f"OpenAI-compatible API: {url}/v1")
    print(f"shards: {len(status['shards'])} live, replication {status['replication']}")
    print(
        f"  {'shard':<10} {'address':<22} {'memory':>21} {'disk':>21} {'chunks':>7} "
        f"{'hit rate':>8} {'faults':>6}"
    )
    for s in status["shards"]:
        lookups = s["lookup_hits"] + s["lookup_misses"]
        rate = f"{s['lookup_hits'] / lookups:.0%}" if lookups else "-"
        memory = f"{_size(s['memory_bytes'])}/{_size(s['memory_capacity'])}"
        disk = f"{_size(s['disk_bytes'])}/{_size(s['disk_capacity'])}"
        faults = sum(s.get(k, 0) for k in FAULTS)  # details in --json
        print(
            f"  {s['shard_id']:<10} {s['address']:<22} {memory:>21} {disk:>21} "
            f"{s['chunks']:>7} {rate:>8} {faults:>6}"
        )
    print(f"tenants: {len(status['tenants'])}")
    for t in status["tenants"]:
        quota = _size(t["quota"]) if t["quota"] else "unlimited"
        shared = ", ".join(t["namespaces"]) or "-"
        print(f"  {t['name']:<16} {_size(t['bytes']):>12} of {quota:<12} shared: {shared}")
    if status["live"] is not None:
        from cluster.live import render

        print("\n".join(render(status["live"])), flush=True)


def _live(ns) -> tuple[dict | None, list[str]]:
    """Live figures from the metrics endpoints of the service this machine runs, and its
    routers' HTTP API URLs (None and none when the status is of another deployment, by
    --redis-url)."""
    from cluster.live import live_figures
    from cluster.state import read_state

    try:
        state = read_state()
    except FileNotFoundError:
        return None, []
    if ns.redis_url and ns.redis_url != state.get("redis_url"):
        return None, []
    return live_figures(state, tls_cli.client_tls(ns)), list(state.get("http", []))


def run_tenant_add(ns) -> int:
    token = metadata(ns).add_tenant(ns.name, ns.quota, ns.weight, ns.admin)
    print(token)
    return 0


def run_tenant_list(ns) -> int:
    status = _status(metadata(ns))
    if ns.json:
        print(json.dumps(status["tenants"], indent=2))
        return 0
    for t in status["tenants"]:
        quota = _size(t["quota"]) if t["quota"] else "unlimited"
        print(f"{t['name']}\t{_size(t['bytes'])}\t{quota}\t{','.join(t['namespaces']) or '-'}")
    return 0


def run_tenant_rotate(ns) -> int:
    print(metadata(ns).rotate_token(ns.name))
    return 0


def run_tenant_remove(ns) -> int:
    metadata(ns).remove_tenant(ns.name)
    print(f"tenant {ns.name} removed")
    return 0


def _roles(md: Metadata, namespace: str) -> str:
    return ", ".join(f"{m} ({role})" for m, role in md.roles(namespace).items()) or "-"


def run_namespace_add(ns) -> int:
    md = metadata(ns)
    md.add_shared(ns.name, ns.member, ns.reader, ns.owner)
    print(f"namespace {ns.name}: members {_roles(md, ns.name)}")
    return 0


def run_namespace_remove_member(ns) -> int:
    md = metadata(ns)
    md.remove_member(ns.name, ns.member)
    print(f"namespace {ns.name}: members {_roles(md, ns.name)}")
    return 0


def run_namespace_list(ns) -> int:
    md = metadata(ns)
    for name in md.shared_namespaces():
        print(f"{name}\t{_roles(md, name)}")
    return 0
