"""The ASGI application: OpenAI's endpoints over a Decoder service.

Every request but `GET /health` is let in as a gRPC call is (`rpc.handler`): its bearer
token (`Authorization: Bearer <tenant token>`) is authenticated before any byte of its body
is read (401; 429 for an address that tried too many unknown tokens), then its body is
read within `max_body_bytes` and `body_timeout_s` (413, 408), then translated
(`openai`) and sent to the fronted service as a Generate call with the caller's own token,
so that the service authorizes, bounds (its per-tenant call slots: 429 with Retry-After),
routes, fails over and accounts for it exactly as for a gRPC caller. Its failures come back
as OpenAI's error object with the matching HTTP status; nothing else (no stack trace, no
other tenant's data) is ever in a response.

A stream's headers go out with its first verified tokens (so a refusal is still an HTTP
status); a failure after that is one last `data: {"error": ...}` event. A client that goes
away cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import grpc
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vericache.v1 import decoder_pb2 as dpb

from decoder.http.config import HttpConfig
from decoder.http.openai import (
    ApiError,
    Model,
    Output,
    Plan,
    chat_request,
    completion_request,
    http_status,
    parse_json,
)
from decoder.service.client import generate_stub
from prefix_store.auth import BEARER
from prefix_store.errors import LimitExceeded, StoreError, Unauthenticated, Unavailable
from prefix_store.status import busy_retry_s

log = logging.getLogger(__name__)
TOKEN = re.compile(r"[\x21-\x7e]+")
"""What a bearer key can be: visible ASCII."""
TRANSLATORS = 4
UNAVAILABLE = {
    503: "no decoder can serve the request now; try again later",
    504: "the request did not finish within its deadline",
}


@dataclass(frozen=True)
class Upstream:
    """The Decoder service the API fronts."""

    target: str
    """Its gRPC address for this process ("unix:/path" or host:port, in the clear)."""
    authenticate: Callable[[str, str], None]
    """(token, the caller's address) -> None when the store knows the token; raises
    Unauthenticated (LimitExceeded for a throttled address, Unavailable). Blocking."""
    max_new_tokens: Callable[[], int] = lambda: 0
    """The most new tokens its decoders let a request ask for, as they report it now (0:
    not known; the model's `max_new_tokens` holds). Non-blocking."""


class ClientGone(Exception):
    """The client closed its connection before its response."""


def api(config: HttpConfig, model: Model, upstream: Upstream, registry: CollectorRegistry):
    """The application."""
    requests = Counter(
        "vericache_http_requests_total",
        "OpenAI-compatible HTTP requests by endpoint and status.",
        ["endpoint", "status"],
        registry=registry,
    )
    front = FrontDoor(config, model, upstream)

    def counted(name: str, handler: Callable[[Request], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                response = error_response(error)
            requests.labels(name, str(response.status_code)).inc()
            return response

        return endpoint

    routes = [
        Route("/health", counted("health", front.health), methods=["GET"]),
        Route("/v1/models", counted("models", front.models), methods=["GET"]),
        Route("/v1/completions", counted("completions", front.completions), methods=["POST"]),
        Route("/v1/chat/completions", counted("chat", front.chat), methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=front.lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _internal},
    )


class FrontDoor:
    """The endpoints."""

    def __init__(self, config: HttpConfig, model: Model, upstream: Upstream) -> None:
        self.config, self.model, self.upstream = config, model, upstream
        self.channel: grpc.aio.Channel | None = None
        self.translating = anyio.CapacityLimiter(TRANSLATORS)
        """Threads that parse bodies and render prompts (bounded sizes, ~0.2 s at most
        each): apart from the key checks' threads, so that no body delays a login."""

    @asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(self.upstream.target, options=options)
        try:
            yield
        finally:
            await self.channel.close()

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        await self._caller(request)
        card = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "vericache",
                "max_model_len": self.model.context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    def _served(self) -> Model:
        """The model as the decoders serve it now: their bound on new tokens."""
        bound = self.upstream.max_new_tokens()
        return replace(self.model, max_new_tokens=bound) if bound else self.model

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat_request)

    async def _generate(self, request: Request, translate) -> Response:
        token = await self._caller(request)
        try:
            raw = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        plan: Plan = await anyio.to_thread.run_sync(
            _translated, translate, raw, self._served(), limiter=self.translating
        )
        output = Output(plan, self.model.name, self._decode)
        events = self._events(plan, token)
        try:
            if plan.stream:
                first = await _until_gone(request, anext(events, None))
                return StreamingResponse(
                    self._sse(output, first, events),
                    media_type="text/event-stream",
                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                )
            await _until_gone(request, self._collect(output, events))
            return JSONResponse(output.response())
        except ClientGone:
            await events.aclose()
            return Response(status_code=499)

    def _decode(self, ids: list[int]) -> str:
        return self.model.tokenizer.decode(ids, skip_special_tokens=True)

    async def _caller(self, request: Request) -> str:
        """The caller's token, once the store knows it (nothing of the body read yet)."""
        header = request.headers.get("authorization", "")
        token = header[len(BEARER) :].strip() if header.lower().startswith(BEARER) else ""
        if not TOKEN.fullmatch(token):  # no key, or bytes no key has (gRPC metadata refuses them)
            raise ApiError(401, "Authorization: expected 'Bearer <token>'", code="invalid_api_key")
        peer = request.client.host if request.client else ""
        try:
            await anyio.to_thread.run_sync(self.upstream.authenticate, token, peer)
        except Unauthenticated:
            raise ApiError(401, "the API key is not known", code="invalid_api_key") from None
        except LimitExceeded as error:
            raise ApiError(429, str(error), code="rate_limit_exceeded", retry_after_s=1) from None
        except Unavailable:
            raise ApiError(503, "the store cannot be reached to check the API key") from None
        except StoreError as error:
            why = type(error).__name__
            raise ApiError(503, f"the API key could not be checked ({why})") from None
        return token

    async def _body(self, request: Request) -> bytes:
        """The request's JSON body, bounded in size and time."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, "Content-Type must be application/json")
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise ApiError(413, f"the body exceeds {limit} bytes")
        body = bytearray()
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise ApiError(413, f"the body exceeds {limit} bytes")
        except TimeoutError:
            why = f"the body did not arrive within {self.config.body_timeout_s}s"
            raise ApiError(408, why) from None
        return bytes(body)

    async def _events(self, plan: Plan, token: str) -> AsyncIterator[dpb.GenerateEvent]:
        """The fronted service's events for `plan`; its failure as an ApiError."""
        call = generate_stub(self.channel)(
            plan.request.SerializeToString(),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=self.config.request_timeout_s,
        )
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            raise _api_error(error) from None
        finally:
            call.cancel()

    async def _collect(self, output: Output, events) -> None:
        """Every event to the end (after a stop, the decoder ends the request at once)."""
        async for event in events:
            if event.HasField("tokens"):
                output.feed(event.tokens.ids, event.tokens.text)
            else:
                output.finish(event.done.stop_reason, event.done.stats_json)

    async def _sse(self, output: Output, first, events) -> AsyncIterator[bytes]:
        """The stream: a chunk per verified text piece, the final chunk, usage, [DONE]."""
        try:
            yield _data(output.chunk("", first=True))
            event, ended = first, False
            while event is not None and not ended:
                if event.HasField("tokens"):
                    text = output.feed(event.tokens.ids, event.tokens.text)
                    if text:
                        yield _data(output.chunk(text))
                else:
                    rest = output.finish(event.done.stop_reason, event.done.stats_json)
                    yield _data(output.chunk(rest, output.finish_reason))
                    ended = True
                event = await anext(events, None)
            if ended:
                if output.plan.include_usage:
                    yield _data(output.usage_chunk())
                yield b"data: [DONE]\n\n"
            else:
                yield _data(ApiError(502, "the stream ended without its final event").body())
        except ApiError as error:
            yield _data(error.body())
        finally:
            await events.aclose()


def _api_error(error: grpc.aio.AioRpcError) -> ApiError:
    """The service's failure as the client sees it: its message for a request's own failure
    (4xx: it names the field or limit), a generic one for the service's (5xx: a decoder's
    address or a socket path is nobody's business), the request id of an internal error."""
    code = error.code()
    status = http_status(code)
    message = error.details() or code.name
    if status == 500:
        message = f"internal error ({message})"  # only a request id (rpc.status)
    elif status >= 500:
        message = UNAVAILABLE.get(status, "the service cannot serve the request now")
        log.warning("http: a request failed %s: %s", code.name, error.details())
    retry = busy_retry_s(error)
    return ApiError(status, message, code=code.name.lower(), retry_after_s=retry)


async def _until_gone(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; ClientGone (the work cancelled, and ended) if the client leaves
    first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # so that its generator is free
    raise ClientGone


def _translated(translate, raw: bytes, model: Model) -> Plan:
    return translate(parse_json(raw), model)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _not_found(request: Request, exc) -> Response:
    return error_response(ApiError(404, f"no endpoint {request.url.path}"))


async def _not_allowed(request: Request, exc) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed here"))


async def _internal(request: Request, exc) -> Response:
    log.error("http: %s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, "internal error"))
