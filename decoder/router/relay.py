"""One Generate call relayed to decoders, continued on another decoder when one fails.

A request's tokens are a pure function of the model, the prompt, the parameters and the
seed (docs/DESIGN.md section 1), and a sampled request without a seed is given one here
before its first attempt. So when its decoder fails or falls silent, the same request
sent to another decoder streams the same tokens from the start: the relay drops the ones
the caller already has, checks that they are the ones it sent (a difference is DATA_LOSS,
never a spliced stream), and goes on. The caller sees one uninterrupted stream.

Which failures move a request: a decoder that is unreachable or went away (UNAVAILABLE,
or a stream that ended without its final event), one the router cut (out, or silent:
CANCELLED), a deadline, a decoder busy before the first token (RESOURCE_EXHAUSTED), or an
INTERNAL error. Anything else is the request's own failure (a bad argument, an unknown
token, a prefix that cannot be served) and reaches the caller as the decoder said it.
Once tokens were streamed, a request moves only within its identity domain: to a decoder
whose Info names the same model id (the model and its exact kernel, `store_source.
kv_layout`) as the one that streamed them, since another kernel's tokens may differ in a
near-tie and would end the stream in DATA_LOSS. (A decoder whose Info the router cannot
read, having no internal credential, is not filtered; the check above still holds.)
A request is failed only when no decoder is left to try, or after `max_attempts`: as
RESOURCE_EXHAUSTED (with the decoder's own message and `retry-after-ms` when it sent one)
when a decoder refused it as busy or over its budget, else UNAVAILABLE.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import grpc
from vericache.v1 import decoder_pb2 as dpb

from decoder.router.members import Members
from decoder.service.client import generate_stub
from rpc.status import Relayed

log = logging.getLogger(__name__)

MOVE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
"""Codes on which a request moves to another decoder (RESOURCE_EXHAUSTED too, before the
first token: a busy decoder)."""


class Forwarded(Relayed):
    """A decoder's final status for the call, to give the caller as it is."""


class Diverged(Exception):
    """Another decoder's stream disagrees with the tokens already sent (DATA_LOSS)."""


class Relay:
    """The events of one Generate request, over as many decoders as it takes."""

    def __init__(
        self,
        members: Members,
        order: Callable[[], list[str]],
        request: bytes,
        metadata: tuple,
        max_attempts: int,
        on_failover: Callable[[], None] = lambda: None,
        stop_strings: bool = False,
    ) -> None:
        """order(): the decoders to try, best first (asked again before every attempt).
        stop_strings: the request has stop strings, so a decoder that takes it over may end
        it a few tokens earlier than the one before did (where a stop string is seen
        depends on how tokens are grouped into events): that is not a divergence."""
        self.members = members
        self.order = order
        self.request = request
        self.metadata = metadata
        self.max_attempts = max_attempts
        self.on_failover = on_failover
        self.stop_strings = stop_strings
        self.sent: list[int] = []
        self.text = ""
        self.decoders: list[str] = []
        """Where each attempt went, in order."""
        self.domain = ""
        """The model id of the decoder that streamed the first tokens ("" before, or unknown)."""

    def events(self) -> Iterator[dpb.GenerateEvent]:
        tried: set[str] = set()
        last: Forwarded | None = None
        refused: Forwarded | None = None
        while len(self.decoders) < self.max_attempts:
            decoder = next((d for d in self.order() if d not in tried and self._may(d)), None)
            if decoder is None:
                break
            tried.add(decoder)
            if self.decoders:
                self.on_failover()
            self.decoders.append(decoder)
            try:
                yield from self._attempt(decoder)
                return
            except Forwarded as failure:
                if not self._moves(failure):
                    raise
                log.warning(
                    "router: decoder %s failed a request after %d tokens (%s); moving it",
                    decoder,
                    len(self.sent),
                    failure.code.name,
                )
                last = failure
                if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused = failure
        if refused is not None:  # busy or over budget: waiting may help, another node not
            raise refused
        why = f"{last.code.name}: {last.details}" if last else "no decoder is live"
        if self.domain:
            why += f"; after its first tokens only decoders of model id {self.domain!r} may go on"
        raise Forwarded(
            grpc.StatusCode.UNAVAILABLE,
            f"no decoder could serve the request after {len(self.decoders)} attempt(s) ({why})",
        )

    def _may(self, decoder: str) -> bool:
        """Whether the request may go to `decoder`: anywhere before its first tokens, then
        only within their identity domain."""
        return not self.domain or self.members.model_id(decoder) == self.domain

    def _moves(self, failure: Forwarded) -> bool:
        if failure.code in MOVE:
            return True
        return failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not self.sent

    def _attempt(self, decoder: str) -> Iterator[dpb.GenerateEvent]:
        got: list[int] = []
        text = ""
        try:
            with self.members.holding(decoder) as watch:
                call = generate_stub(self.members.channel(decoder))(
                    self.request, metadata=self.metadata
                )
                watch.call = call
                try:
                    for event in call:
                        if event.HasField("tokens"):
                            watch.heard()
                            if not self.sent:
                                self.domain = self.members.model_id(decoder)
                            got.extend(event.tokens.ids)
                            text += event.tokens.text
                            fresh = self._fresh(got, text)
                            if fresh is not None:
                                yield fresh
                        else:
                            yield self._done(event, got)
                            return
                finally:
                    call.cancel()  # the caller went away, or this attempt ended: stop it
        except LookupError:
            raise Forwarded(grpc.StatusCode.UNAVAILABLE, f"decoder {decoder} left") from None
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.members.failed(decoder)
            details = error.details() or ""
            raise Forwarded(error.code(), details, error.trailing_metadata()) from None
        raise Forwarded(grpc.StatusCode.UNAVAILABLE, "the stream ended without its final event")

    def _fresh(self, got: list[int], text: str) -> dpb.GenerateEvent | None:
        """The part of this attempt's tokens the caller has not seen (None: nothing new);
        the part it has seen must be exactly what it was sent."""
        overlap = min(len(got), len(self.sent))
        if got[:overlap] != self.sent[:overlap]:
            raise Diverged(
                f"a decoder's tokens differ from those already streamed at position "
                f"{next(i for i in range(overlap) if got[i] != self.sent[i])}"
            )
        if len(got) <= len(self.sent):
            return None
        ids, piece = got[len(self.sent) :], text[len(self.text) :]
        self.sent, self.text = list(got), text
        return dpb.GenerateEvent(tokens=dpb.Tokens(ids=ids, text=piece))

    def _done(self, event: dpb.GenerateEvent, got: list[int]) -> dpb.GenerateEvent:
        if len(got) < len(self.sent) and not (
            self.stop_strings and event.done.stop_reason == "stop"
        ):
            raise Diverged(f"a decoder ended after {len(got)} of the {len(self.sent)} tokens sent")
        stats = json.loads(event.done.stats_json or "{}")
        stats["router"] = {"decoders": list(self.decoders), "failovers": len(self.decoders) - 1}
        return dpb.GenerateEvent(
            done=dpb.Done(stop_reason=event.done.stop_reason, stats_json=json.dumps(stats))
        )
