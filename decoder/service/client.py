"""The Decoder client SDK.

    with DecoderClient("host:port", token) as client:
        for piece in client.stream(text="...", max_new_tokens=64):
            print(piece.text, end="")
        reply = client.generate(token_ids=ids, mode="vericache", compressor="kivi:bits=4")

Errors arrive as the store's typed errors (`prefix_store.errors`): INVALID_ARGUMENT is
InvalidArgument, UNAVAILABLE Unavailable, RESOURCE_EXHAUSTED QuotaExceeded, and so on. A
call the decoder refuses because it is busy (its call limits) is made again with backoff
until the client's deadline, then raised like any other.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from vericache.v1 import decoder_pb2 as dpb
from vericache.v1 import decoder_pb2_grpc as dpb_grpc

from prefix_store.client.retry import rpc_error
from prefix_store.status import busy_retry_s
from prefix_store.tls import TLSClientConfig, make_channel

BUSY_MAX_BACKOFF_S = 2.0
"""The longest wait between attempts of a call the decoder refuses as busy."""


@dataclass
class GenerateReply:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Piece:
    """Verified tokens as they arrive."""

    tokens: list[int]
    text: str


class DecoderClient:
    def __init__(
        self,
        endpoint: str,
        token: str,
        timeout_s: float = 3600.0,
        tls: TLSClientConfig | None = None,
    ) -> None:
        """`tls`: connect with TLS, verifying the decoder's certificate (and presenting a
        client certificate under mTLS); None: in the clear."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._channel = make_channel(endpoint, (), tls)
        self._stub = dpb_grpc.DecoderStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DecoderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def info(self) -> dpb.InfoResponse:
        return self._call(self._stub.Info, dpb.InfoRequest())

    def publish(
        self,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        chat: bool = False,
        namespace: str = "",
        compressors: Sequence[str] = (),
    ) -> dpb.PublishResponse:
        request = dpb.PublishRequest(chat=chat, namespace=namespace, compressors=compressors)
        _set_prompt(request, text, token_ids)
        return self._call(self._stub.Publish, request)

    def stream(self, *, reply: GenerateReply | None = None, **kwargs) -> Iterator[Piece]:
        """Yield verified tokens as they are accepted; fills `reply` (if given) as it goes.
        A call the decoder refuses as busy is made again (see `_when_not_busy`)."""
        reply = reply if reply is not None else GenerateReply()
        request = generate_request(**kwargs)
        call, first = self._when_not_busy(lambda: self._started(request))
        try:
            for event in itertools.chain(first, call):
                if event.HasField("tokens"):
                    piece = Piece(list(event.tokens.ids), event.tokens.text)
                    reply.tokens.extend(piece.tokens)
                    reply.text += piece.text
                    yield piece
                else:
                    reply.stop_reason = event.done.stop_reason
                    reply.stats = json.loads(event.done.stats_json)
        except grpc.RpcError as error:
            raise rpc_error(error) from None
        finally:
            call.cancel()

    def generate(self, **kwargs) -> GenerateReply:
        """Generate to the end; see `generate_request` for the arguments."""
        reply = GenerateReply()
        for _ in self.stream(reply=reply, **kwargs):
            pass
        return reply

    def _started(self, request):
        """A Generate call and its first event (so that a refusal is raised here)."""
        call = self._stub.Generate(request, metadata=self._metadata, timeout=self.timeout_s)
        try:
            return call, [next(call)]
        except StopIteration:
            return call, []
        except BaseException:
            call.cancel()
            raise

    def _call(self, method, request):
        return self._when_not_busy(
            lambda: method(request, metadata=self._metadata, timeout=self.timeout_s)
        )

    def _when_not_busy(self, attempt):
        """`attempt()`, made again while the decoder refuses it as busy (its call limits:
        RESOURCE_EXHAUSTED with `RETRY_AFTER`), backing off up to BUSY_MAX_BACKOFF_S, until
        the client's deadline; any other failure is raised as a typed error at once."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0
        while True:
            try:
                return attempt()
            except grpc.RpcError as error:
                wait = busy_retry_s(error)
                delay = min(BUSY_MAX_BACKOFF_S, max(wait or 0.0, 2 * delay))
                if wait is None or time.monotonic() + delay >= deadline:
                    raise rpc_error(error) from None
                time.sleep(delay * random.uniform(0.5, 1.0))


def generate_request(
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    chat: bool = False,
    max_new_tokens: int = 64,
    mode: str = "vericache",
    compressor: str = "",
    horizon: int | None = None,
    ngram: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    namespace: str = "",
    use_unsigned_prefix: bool = False,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
) -> dpb.GenerateRequest:
    """stop, stop_token_ids: end the request there (`GenerateRequest.stop`)."""
    request = dpb.GenerateRequest(
        chat=chat,
        max_new_tokens=max_new_tokens,
        mode=mode,
        compressor=compressor,
        namespace=namespace,
        use_unsigned_prefix=use_unsigned_prefix,
        sampling=dpb.Sampling(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=stop,
        stop_token_ids=stop_token_ids,
    )
    if seed is not None:
        request.sampling.seed = seed
    if horizon is not None:
        request.horizon = horizon
    if ngram is not None:
        request.ngram = ngram
    _set_prompt(request, text, token_ids)
    return request


def generate_stub(channel):
    """Decoder.Generate on `channel` (grpc's or grpc.aio's) with the request as bytes
    (already serialised) and parsed events."""
    return channel.unary_stream(
        "/vericache.v1.Decoder/Generate",
        request_serializer=lambda raw: raw,
        response_deserializer=dpb.GenerateEvent.FromString,
    )


def _set_prompt(request, text, token_ids) -> None:
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text or token_ids")
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(token_ids)
