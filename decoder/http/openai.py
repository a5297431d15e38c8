"""OpenAI's API, translated: request bodies into Decoder requests (`completion_request`,
`chat_request`), Decoder events into OpenAI's response objects and stream chunks
(`Output`), and failures into OpenAI's error object with the HTTP status its clients
expect (`ApiError`, `http_status`). Pure: no I/O, no server.

What is served (the defaults are OpenAI's):
- `model` must name the served model (else 404 `model_not_found`).
- `max_tokens` (chat: also `max_completion_tokens`): at most what the prompt leaves of the
  model's context, and at most the decoders' bound on new tokens (as their Info reports
  it); default 16 for completions, and for chat the most allowed.
- `temperature` (default 1.0; 0 is greedy), `top_p` (default 1.0), `top_k` (vLLM's; 0 or
  -1 is off), `seed`: a request with a seed streams the same tokens every time.
- `stop`: a string or up to 4 of them, and `stop_token_ids` (vLLM's): the output ends
  before the first one (a stop string is not part of the text, a stop token not a
  completion token). The decoder ends the request there (`GenerateRequest.stop`); the text
  is cut here, from verified tokens only.
- `n` = 1, `best_of` = 1, `echo` false, `logprobs` / `top_logprobs` off, no penalties,
  no `logit_bias`, `response_format` text, no tools: anything else is a 400 naming the
  parameter, never ignored.
- `stream` with `stream_options.include_usage`; `user` (accepted, not used).
- `vericache`: {"mode", "compressor", "horizon", "namespace", "ngram"}; absent ones take
  the deployment's defaults.
- An unknown field is a 400 naming it.
Chat messages go through the model's chat template here (`Tokenizer.apply_chat_template`);
content that contains one of the model's control tokens (`<|im_start|>`, ...) is refused,
so that no message can forge another turn or role.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import grpc
from vericache.v1 import decoder_pb2 as dpb

from decoder.service.config import MAX_NEW_TOKENS, MAX_NGRAM, MAX_STOP_CHARS, MAX_STOP_IDS

MODES = ("vericache", "full", "lossy")
MAX_STOPS = 4
"""OpenAI's bound (the decoder takes more)."""
MAX_HORIZON = 64
ROLES = ("system", "user", "assistant", "developer")
CHARS_PER_TOKEN = 32
"""Text longer than the context times this cannot fit it (refused before tokenizing)."""

COMMON = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
     "n", "stream", "stream_options", "user", "logprobs", "presence_penalty",
     "frequency_penalty", "logit_bias", "vericache"}
)  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                        "tools", "tool_choice", "parallel_tool_calls"}  # fmt: skip
VERICACHE_FIELDS = frozenset({"mode", "compressor", "horizon", "namespace", "ngram"})

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 503,  # the service cut it (shutting down): try again
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC status -> the HTTP status an OpenAI client expects; anything else is 500."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request's failure as OpenAI reports it: an HTTP status and an error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


@dataclass(frozen=True)
class Model:
    """What the HTTP layer knows of the served model."""

    name: str
    """The id clients name it by (`GET /v1/models`)."""
    context: int
    """Its context length in tokens."""
    tokenizer: Any
    """Its tokenizer (`decoder.tokenizer`): chat templates and prompt counts."""
    control_tokens: frozenset[str] = frozenset()
    """Its special tokens' texts: chat content may not contain them."""
    max_new_tokens: int = MAX_NEW_TOKENS
    """The decoders' bound on a request's new tokens (a chat request's default is at most
    this)."""


@dataclass
class Plan:
    """One API request, ready to send: the Decoder request and what the HTTP layer does
    with its events."""

    kind: str
    """"chat" or "completion"."""
    request: dpb.GenerateRequest
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @cached_property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.request.stop)

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.request.stop_token_ids)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise bad(f"the body is not valid JSON ({error})") from None
    except RecursionError:
        raise bad("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def completion_request(body: Mapping[str, Any], model: Model) -> Plan:
    """`POST /v1/completions`."""
    _known(body, COMPLETION_FIELDS)
    _model(body, model)
    if _get(body, "echo", bool, False):
        raise bad("echo is not supported", "echo")
    if _get(body, "best_of", int, 1) != 1:
        raise bad("best_of must be 1", "best_of")
    if _get(body, "suffix", str, None):
        raise bad("suffix is not supported", "suffix")
    if _get(body, "logprobs", int, None) is not None:
        raise bad("logprobs are not supported", "logprobs")
    ids = _prompt(body.get("prompt"), model)
    max_tokens = _max_tokens(body, "max_tokens", min(16, model.max_new_tokens), len(ids), model)
    return _plan("completion", body, ids, max_tokens)


def chat_request(body: Mapping[str, Any], model: Model) -> Plan:
    """`POST /v1/chat/completions`: the messages through the model's chat template."""
    _known(body, CHAT_FIELDS)
    _model(body, model)
    if _get(body, "logprobs", bool, False) or _get(body, "top_logprobs", int, None):
        raise bad("logprobs are not supported", "logprobs")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise bad("tools are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format: only {'type': 'text'} is supported", "response_format")
    messages = _messages(body.get("messages"), model)
    try:
        ids = chat_ids(model.tokenizer, messages)
    except Exception as error:  # noqa: BLE001 - the template refused these messages
        why = f"messages: the model's chat template refused them ({error})"
        raise bad(why, "messages") from None
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    default = min(model.context - len(ids), model.max_new_tokens)
    max_tokens = _max_tokens(body, name, default, len(ids), model)
    return _plan("chat", body, ids, max_tokens)


def _plan(kind: str, body: Mapping[str, Any], ids: list[int], max_tokens: int) -> Plan:
    if _get(body, "n", int, 1) != 1:
        raise bad("n must be 1", "n")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _get(body, penalty, float, 0.0) != 0:
            raise bad(f"{penalty} is not supported (only 0)", penalty)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias")
    _get(body, "user", str, None)
    request = dpb.GenerateRequest(token_ids=dpb.TokenIds(ids=ids), max_new_tokens=max_tokens)
    request.sampling.CopyFrom(_sampling(body))
    request.stop.extend(_stops(body))  # the decoder ends the request there (its text is cut here)
    request.stop_token_ids.extend(sorted(_stop_ids(body)))
    _vericache(body.get("vericache"), request)
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options: an object, with stream true", "stream_options")
    include_usage = bool(options and _get(options, "include_usage", bool, False))
    return Plan(kind, request, len(ids), stream, include_usage)


def _known(body: Mapping[str, Any], fields: frozenset[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(f"unrecognized field {unknown[0]!r}", unknown[0])


def _model(body: Mapping[str, Any], model: Model) -> None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model: required, the served model's id", "model")
    if name != model.name:
        raise ApiError(404, f"the model {name!r} does not exist (served: {model.name!r})",
                       "model", "model_not_found")  # fmt: skip


def _get(body: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """body[name] as `kind` (absent or null: `default`); a 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad(f"{name}: expected {kind.__name__}, got {type(value).__name__}", name)
    if kind is float and not math.isfinite(value):
        raise bad(f"{name}: must be finite", name)
    return value


def _prompt(prompt: Any, model: Model) -> list[int]:
    """A completion prompt: a string, token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt: empty", "prompt")
        if len(prompt) > model.context * CHARS_PER_TOKEN:
            raise bad(f"prompt: {len(prompt)} characters cannot fit the context", "prompt")
        return list(model.tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and prompt and all(_token(t) for t in prompt):
        if len(prompt) > model.context:
            raise bad(f"prompt: {len(prompt)} tokens exceed the context", "prompt")
        return list(prompt)
    raise bad("prompt: a non-empty string or list of token ids (one prompt: n = 1)", "prompt")


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the chat template, the assistant's turn opened (a
    `transformers` tokenizer may answer with a BatchEncoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _messages(messages: Any, model: Model) -> list[dict[str, str]]:
    """The messages as the chat template takes them, bounded before it runs: at most
    `context` / 2 messages and `context` * CHARS_PER_TOKEN characters of content in all."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages: a non-empty list", "messages")
    if len(messages) > model.context // 2:
        raise bad(f"messages: at most {model.context // 2} can fit the context", "messages")
    chars = 0
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise bad(f"{where}: an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role: one of {', '.join(ROLES)}", f"{where}.role")
        content = _content(message.get("content"), where)
        chars += len(content)
        if chars > model.context * CHARS_PER_TOKEN:
            raise bad(f"messages: {chars}+ characters cannot fit the context", "messages")
        for token in model.control_tokens:
            if token in content:
                raise bad(f"{where}.content: contains the control token {token!r}", where)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}.content: only text parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content: a text part needs its text", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content: a string or a list of text parts", where)


def _max_tokens(body: Mapping[str, Any], name: str, default: int, prompt: int, model: Model):
    value = _get(body, name, int, default)
    room = model.context - prompt
    if room < 1:
        raise bad(f"the prompt's {prompt} tokens leave no room in the context of "
                  f"{model.context}", "messages" if "messages" in body else "prompt")  # fmt: skip
    if not 1 <= value <= room:
        raise bad(f"{name}: must be in [1, {room}] (the context of {model.context} less the "
                  f"prompt's {prompt} tokens)", name)  # fmt: skip
    if value > model.max_new_tokens:
        raise bad(f"{name}: must be at most {model.max_new_tokens} (the decoders' bound on "
                  "new tokens)", name)  # fmt: skip
    return value


def _sampling(body: Mapping[str, Any]) -> dpb.Sampling:
    temperature = _get(body, "temperature", float, 1.0)
    top_p = _get(body, "top_p", float, 1.0)
    top_k = _get(body, "top_k", int, 0)
    if not 0 <= temperature <= 2:
        raise bad("temperature: must be in [0, 2]", "temperature")
    if not 0 < top_p <= 1:
        raise bad("top_p: must be in (0, 1]", "top_p")
    if top_k < -1:
        raise bad("top_k: -1 or 0 (off), or a positive count", "top_k")
    sampling = dpb.Sampling(temperature=temperature, top_p=top_p, top_k=max(0, top_k))
    seed = _get(body, "seed", int, None)
    if seed is not None:
        if not -(1 << 63) <= seed < 1 << 64:
            raise bad("seed: must fit 64 bits", "seed")
        sampling.seed = seed % (1 << 64)
    return sampling


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
        or any("\ufffd" in s for s in stops)
    ):
        raise bad(f"stop: a string or up to {MAX_STOPS} non-empty strings of at most "
                  f"{MAX_STOP_CHARS} characters", "stop")  # fmt: skip
    return tuple(stops)


def _stop_ids(body: Mapping[str, Any]) -> frozenset[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or len(ids) > MAX_STOP_IDS or not all(map(_token, ids)):
        raise bad(f"stop_token_ids: up to {MAX_STOP_IDS} token ids", "stop_token_ids")
    return frozenset(ids)


def _vericache(options: Any, request: dpb.GenerateRequest) -> None:
    """VeriCache's own parameters; each one absent takes the deployment's default."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise bad("vericache: an object", "vericache")
    unknown = sorted(set(options) - VERICACHE_FIELDS)
    if unknown:
        raise bad(f"vericache: unrecognized field {unknown[0]!r}", f"vericache.{unknown[0]}")
    mode = _get(options, "mode", str, "vericache")
    if mode not in MODES:
        raise bad(f"vericache.mode: one of {', '.join(MODES)}", "vericache.mode")
    request.mode = mode
    request.compressor = _get(options, "compressor", str, "")
    request.namespace = _get(options, "namespace", str, "")
    horizon = _get(options, "horizon", int, None)
    if horizon is not None:
        if not 1 <= horizon <= MAX_HORIZON:
            raise bad(f"vericache.horizon: must be in [1, {MAX_HORIZON}]", "vericache.horizon")
        request.horizon = horizon
    ngram = _get(options, "ngram", int, None)
    if ngram is not None:
        if not 0 <= ngram <= MAX_NGRAM:
            raise bad(f"vericache.ngram: must be in [0, {MAX_NGRAM}]", "vericache.ngram")
        request.ngram = ngram


class Output:
    """One request's verified tokens, cut at its stops, as OpenAI's objects: `feed` each
    Tokens event (the text it may send now), `finish` with the Done event."""

    def __init__(self, plan: Plan, model: str, decode: Callable[[list[int]], str]) -> None:
        """decode: token ids -> text, as the decoder makes its events' text."""
        self.plan, self.model, self.decode = plan, model, decode
        self.text = ""
        """Text sent so far (stops excluded)."""
        self.tokens = 0
        """Completion tokens so far (up to the one that completed a stop)."""
        self.finish_reason: str | None = None
        self.stats: dict[str, Any] = {}
        self._ids: list[int] = []
        self._received = ""
        """The text of `_ids`, as the events gave it."""
        self._pending = ""
        """Text received but held back: it may be the start of a stop string."""
        self._stop_end: int | None = None
        """Where in the output's text the stop string that ended it ends."""

    @property
    def stopped(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ids: Sequence[int], text: str) -> str:
        """The text of `ids` (verified tokens) that may be sent now ("" when all of it is
        held back); after a stop, nothing more."""
        if self.stopped:
            return ""
        cut = next((i for i, t in enumerate(ids) if t in self.plan.stop_ids), None)
        if cut is not None:
            self._ids.extend(ids[:cut])
            self.tokens += cut
            self.finish_reason = "stop"
            whole = self.decode(self._ids)  # the text up to the stop token, not past it
            fresh = whole[len(self._received) :] if whole.startswith(self._received) else ""
            return self._send(self._pending + fresh, final=True)
        before = len(self._ids)
        self._ids.extend(ids)
        self._received += text
        self.tokens += len(ids)
        ready = self._send(self._pending + text, final=False)
        if self._stop_end is not None:  # count the tokens up to the one completing the stop
            needed = (k for k in range(1, len(ids)) if len(self.decode(self._ids[: before + k]))
                      >= self._stop_end)  # fmt: skip
            self.tokens = before + next(needed, len(ids))
        return ready

    def _send(self, text: str, final: bool) -> str:
        hit = min(((text.find(s), s) for s in self.plan.stops if s in text), default=None)
        if hit is not None:
            self.finish_reason = "stop"
            self._stop_end = len(self.text) + hit[0] + len(hit[1])
            text, final = text[: hit[0]], True
        held = 0 if final else _held_back(text, self.plan.stops)
        ready, self._pending = text[: len(text) - held], text[len(text) - held :]
        self.text += ready
        return ready

    def finish(self, stop_reason: str, stats_json: str) -> str:
        """The Done event: the text still held back (no stop came), and the stats."""
        self.stats = json.loads(stats_json or "{}")
        if self.stopped:
            return ""
        self.finish_reason = "length" if stop_reason == "length" else "stop"
        rest, self._pending = self._pending, ""
        self.text += rest
        return rest

    # -- OpenAI's objects -----------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        cached = int(self.stats.get("cached_tokens", 0))
        prompt = self.plan.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def vericache(self) -> dict[str, Any]:
        """VeriCache's figures of the request (never a token)."""
        keys = ("request_id", "mode", "accepted_per_verification", "compressor", "seed")
        out = {k: self.stats[k] for k in keys if k in self.stats}
        if "router" in self.stats:
            out["failovers"] = self.stats["router"].get("failovers", 0)
        return out

    def response(self) -> dict[str, Any]:
        """The whole response (not streamed)."""
        if self.plan.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "logprobs": None, "finish_reason": self.finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None,
                      "finish_reason": self.finish_reason}  # fmt: skip
        return {**self._head(final=True), "choices": [choice], "usage": self.usage(),
                "vericache": self.vericache()}  # fmt: skip

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False):
        """A stream chunk carrying `text` (and the finish reason on the last one)."""
        if self.plan.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            delta = delta if first or text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(final=False), "choices": [choice]}
        if self.plan.include_usage:
            chunk["usage"] = None
        if finish_reason is not None:
            chunk["vericache"] = self.vericache()
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The stream's last chunk when the client asked for usage."""
        return {**self._head(final=False), "choices": [], "usage": self.usage()}

    def _head(self, final: bool) -> dict[str, Any]:
        if self.plan.kind == "chat":
            kind, prefix = ("chat.completion" if final else "chat.completion.chunk"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {"id": f"{prefix}-{self.plan.id}", "object": kind, "created": self.plan.created,
                "model": self.model}  # fmt: skip


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def control_tokens(tokenizer: Any) -> frozenset[str]:
    """The texts of `tokenizer`'s special tokens (`decoder.tokenizer.Tokenizer` or a
    `transformers` tokenizer)."""
    special: Callable[[], Any] | None = getattr(tokenizer, "special_token_texts", None)
    if special is not None:
        return frozenset(special())
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {str(t) for t in decoder.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return frozenset(t for t in texts if t)
