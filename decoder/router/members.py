"""The live decoders, as one router sees them.

The set comes from whoever deploys the router (`set`: at start, and on every change: a
decoder added, restarted on a new port, or removed); nothing else is kept, so a restarted
router rebuilds it from the deployment. Every `poll_s` each decoder gets a gRPC health
check and an Info call presenting the deployment's internal credential
(`decoder.internal`), which gives its load: requests in flight and queued, KV
budget use. A router without the credential, or one a decoder refuses (logged once), counts
only its own requests on that decoder. A decoder that fails `down_after` checks in a row is
out: the streams it serves are cancelled, so that they move to other decoders, and it gets
no new request until a check succeeds again. A stream that has sent tokens and then nothing
for `silence_s` is cancelled the same way (a hung decoder).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from vericache.v1 import decoder_pb2 as dpb
from vericache.v1 import decoder_pb2_grpc

from decoder.internal import InternalCredential, read_credential
from decoder.router.config import RouterConfig
from decoder.router.policies import Load
from prefix_store.tls import make_channel

log = logging.getLogger(__name__)
SERVICE = "vericache.v1.Decoder"


@dataclass(eq=False)
class Watch:
    """One forwarded stream: cancelled when its decoder goes out or falls silent."""

    call: grpc.Future | None = None
    last: float = field(default_factory=time.monotonic)
    streaming: bool = False
    """It has sent tokens (silence counts from then on)."""
    reason: str = ""
    """Why the router cancelled it ("" = it did not)."""

    def heard(self) -> None:
        self.last = time.monotonic()
        self.streaming = True

    def cut(self, reason: str) -> None:
        self.reason = reason
        if self.call is not None:
            self.call.cancel()


@dataclass(eq=False)
class Member:
    endpoint: str
    channel: grpc.Channel
    healthy: bool = True
    failures: int = 0
    reported: Load = field(default_factory=Load)
    """Its own report (every caller's requests), from its Info."""
    refused: bool = False
    """It refused the internal credential (its Info unread until it accepts it)."""
    max_new_tokens: int = 0
    """The most new tokens it lets a request ask for, from its Info (0 until read)."""
    model_id: str = ""
    """Its identity domain from its Info: the model and the exact kernel whose bits its tokens
    have ("" until its Info was read)."""
    in_flight: int = 0
    """Requests this router has on it now."""
    routed: int = 0
    """Requests this router sent it, in all."""
    watches: set[Watch] = field(default_factory=set)

    def load(self) -> Load:
        requests = max(self.in_flight, self.reported.requests)
        return Load(requests, self.reported.budget_use)


class Members:
    """The decoders and their load; thread-safe. `close` stops the polling."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.credential = internal_credential(config)
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="router-poll", daemon=True)
        self.set(config.decoders)
        self._thread.start()

    def set(self, decoders: Iterable[str]) -> None:
        """The decoders are now exactly `decoders` (host:port each)."""
        decoders = set(decoders)
        with self._lock:
            gone = [m for e, m in self._members.items() if e not in decoders]
            for endpoint in decoders - self._members.keys():
                channel = make_channel(endpoint, (), self.config.decoder_tls)
                self._members[endpoint] = Member(endpoint, channel)
            for member in gone:
                del self._members[member.endpoint]
        for member in gone:
            self._out(member, "it left the deployment")
            member.channel.close()

    def model_id(self, endpoint: str) -> str:
        """A decoder's identity domain ("" unknown: its Info not read yet, or no credential
        to read it with)."""
        with self._lock:
            member = self._members.get(endpoint)
            return member.model_id if member is not None else ""

    def loads(self) -> dict[str, Load]:
        """The healthy decoders and their load."""
        with self._lock:
            return {e: m.load() for e, m in self._members.items() if m.healthy}

    def channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            return self._members[endpoint].channel

    @contextmanager
    def holding(self, endpoint: str) -> Iterator[Watch]:
        """A request on `endpoint` for the block: counted in its load, and watched."""
        watch = Watch()
        with self._lock:
            member = self._members.get(endpoint)
            if member is None:
                raise LookupError(endpoint)
            member.in_flight += 1
            member.routed += 1
            member.watches.add(watch)
        try:
            yield watch
        finally:
            with self._lock:
                member.in_flight -= 1
                member.watches.discard(watch)

    def failed(self, endpoint: str) -> None:
        """A call found `endpoint` unreachable: out now (the next good check brings it back)."""
        with self._lock:
            member = self._members.get(endpoint)
        if member is not None:
            member.failures = self.config.down_after
            self._out(member, "a call found it unreachable")

    def max_new_tokens(self) -> int:
        """The most new tokens every healthy decoder lets a request ask for, as their Info
        reports it (0: none has reported)."""
        with self._lock:
            bounds = [m.max_new_tokens for m in self._members.values() if m.healthy]
        return functools.reduce(least, bounds, 0)

    def snapshot(self) -> list[dict]:
        """Per decoder: health, load and requests routed (`vericache status`)."""
        with self._lock:
            return [
                {
                    "endpoint": m.endpoint,
                    "healthy": m.healthy,
                    "in_flight": m.in_flight,
                    "reported_requests": m.reported.requests,
                    "budget_use": round(m.reported.budget_use, 3),
                    "routed": m.routed,
                }
                for m in self._members.values()
            ]

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            members = list(self._members.values())
        for member in members:
            member.channel.close()

    # -- polling ------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            with self._lock:
                members = list(self._members.values())
            for member in members:
                try:
                    self._poll(member)
                except Exception as error:  # noqa: BLE001 - keep watching the others
                    log.warning("router: polling %s failed: %s", member.endpoint, error)

    def _poll(self, member: Member) -> None:
        if self._healthy(member):
            member.failures = 0
            if not member.healthy:
                log.info("router: decoder %s is back", member.endpoint)
            member.healthy = True
            member.reported = self._reported(member)
        else:
            member.failures += 1
            if member.failures >= self.config.down_after:
                self._out(member, f"{member.failures} health checks failed")
        now = time.monotonic()
        with self._lock:
            silent = [
                w
                for w in member.watches
                if w.streaming and now - w.last > self.config.silence_s and not w.reason
            ]
        for watch in silent:
            log.warning("router: decoder %s went silent mid-stream; moving it", member.endpoint)
            watch.cut("silent")

    def _healthy(self, member: Member) -> bool:
        stub = health_pb2_grpc.HealthStub(member.channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _reported(self, member: Member) -> Load:
        """The decoder's load from its Info; the last one read when it cannot be read now."""
        if self.credential is None:
            return member.reported
        stub = decoder_pb2_grpc.DecoderStub(member.channel)
        try:
            info = stub.Info(dpb.InfoRequest(), metadata=self.credential.metadata(), timeout=1.0)
        except grpc.RpcError as error:
            self._refused(member, error.code())
            return member.reported
        member.refused = False
        member.model_id = info.model_id
        member.max_new_tokens = info.max_new_tokens
        return load_of(info)

    def _refused(self, member: Member, code: grpc.StatusCode) -> None:
        if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return
        if not member.refused:
            log.warning(
                "router: decoder %s refuses the deployment's internal credential (%s): its "
                "load is this router's own count",
                member.endpoint,
                code.name,
            )
        member.refused = True

    def _out(self, member: Member, why: str) -> None:
        if member.healthy:
            log.warning("router: decoder %s is out (%s)", member.endpoint, why)
        member.healthy = False
        with self._lock:
            watches = list(member.watches)
        for watch in watches:
            watch.cut("decoder out")


def least(a: int, b: int) -> int:
    """The smaller of two bounds where 0 means none."""
    return min(a, b) if a and b else a or b


def load_of(info: dpb.InfoResponse) -> Load:
    """A decoder's load as its Info reports it."""
    budget_use = info.kv_used / info.kv_budget if info.kv_budget else 0.0
    return Load(info.in_flight + info.queued, budget_use)


def internal_credential(config: RouterConfig) -> InternalCredential | None:
    """The router's internal credential, read from its file (FileNotFoundError or
    PermissionError stop the router); None when it has none (then a warning)."""
    if config.internal_token_file is not None:
        return read_credential(config.internal_token_file)
    log.warning(
        "router %s: no internal credential; decoders' loads are its own in-flight counts",
        config.router_id,
    )
    return None
