"""The Llama-family forward pass over explicit per-sequence KV caches.

One `forward` call processes any mix of sequences, each contributing `t >= 1` new tokens
on top of its own cache: a prefill (empty cache, T tokens), a decode step (1 token) and a
verification chunk (k tokens) are the same call. New tokens' keys and values are appended
to their sequence's cache.

In exact mode (the default) every token's logits and KV are bitwise independent of how
tokens are grouped into calls, of the other sequences in the batch, and of the context
that follows it (see `numerics.cpu.forward`). Fast mode uses torch's fused kernels without that
guarantee; it is meant for drafting.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from decoder.config import Mode, ModelConfig, RunnerConfig, ceil_to
from decoder.draft_cache import draft_stacks
from decoder.errors import ExactModeUnsupported
from decoder.kv_cache import KVCache
from decoder.quant import LinearFn, int8_engine, low_precision_linear
from decoder.selfcheck import check_exact_mode
from decoder.seq_input import Logits, SeqInput
from decoder.weights import LayerWeights, ModelWeights
from numerics.cpu.forward import (
    AttentionPlan,
    AttentionState,
    Linear,
    RopeTable,
    apply_rope,
    attend_chunks,
    exact_attention,
    fast_attention,
    fused_kernel,
    rms_norm,
    swiglu,
)
from numerics.cpu.partials import fold


class ModelRunner:
    """Runs the model; owns no sequence state (caches belong to the caller)."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, runner_config: RunnerConfig | None = None
    ) -> None:
        self.config = config
        self.weights = weights
        self.rc = runner_config or RunnerConfig()
        if self.rc.threads:
            torch.set_num_threads(self.rc.threads)
        self.rope = RopeTable(config.rope, config.head_dim)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.layers = [_PackedLayer(w) for w in weights.layers]
        self.lm_head = _packed(weights.lm_head, "exact")
        self._exact_checked = not self.rc.self_check
        self._exact_problem: str | None = None
        self._draft: _Linears | None = None  # built at the first fast forward
        self._draft_lock = threading.Lock()
        self._released = False
        self._held_bytes: int | None = None  # `weight_bytes` less the draft copy, once counted

    @classmethod
    def consuming(
        cls,
        config: ModelConfig,
        head: ModelWeights,
        layers: Iterator[LayerWeights],
        runner_config: RunnerConfig | None = None,
        draft: bool = True,
    ) -> ModelRunner:
        """A runner built from weights read one block at a time (`head`: the embedding,
        final norm and LM head; `layers`: the blocks in order, e.g. straight from the
        weight files, `loader.load_runner`): each block is packed (and, with `draft`, its
        fast-mode copy made) and let go before the next is read, so the process never holds
        the model in two forms, nor all of it unpacked. The exact-mode self-check runs on
        the first two blocks before they are packed. The result is a runner after
        `release_source_weights(draft)`."""
        from decoder.weights import check_shapes

        runner = cls.__new__(cls)
        runner.config, runner.rc = config, runner_config or RunnerConfig()
        if runner.rc.threads:
            torch.set_num_threads(runner.rc.threads)
        runner.rope = RopeTable(config.rope, config.head_dim)
        runner.scale = 1.0 / math.sqrt(config.head_dim)
        runner._draft, runner._draft_lock = None, threading.Lock()
        runner._held_bytes = None
        runner._exact_checked, runner._exact_problem = not runner.rc.self_check, None
        first = [next(layers) for _ in range(min(2, config.num_layers))]
        check_shapes(config, head.embed, first, head.lm_head)
        runner.weights = replace(head, layers=tuple(first))
        if runner.rc.self_check:
            runner._check_exact()
        kind = runner._draft_kind() if draft else "fp32"
        runner.weights = replace(head, layers=())
        runner.lm_head = _packed(head.lm_head, "exact")

        def blocks() -> Iterator[LayerWeights]:
            while first:  # the checked ones first, each let go as it is handed out
                yield first.pop(0)
            yield from layers

        runner.layers, drafts, slim = [], [], []
        for layer in blocks():
            runner.layers.append(_PackedLayer(layer))
            if kind != "fp32":
                drafts.append(_PackedLayer(layer, kind))
            slim.append(layer.without_linears())
            del layer  # this block's unpacked matrices go before the next is read
        if len(runner.layers) != config.num_layers:
            raise ValueError(f"{len(runner.layers)} blocks read, config has {config.num_layers}")
        runner.weights = replace(head, layers=tuple(slim))
        if kind != "fp32":
            runner._draft = runner._draft_from(drafts, kind)
        runner._released = True
        return runner

    def release_source_weights(self, draft: bool) -> int:
        """Keep every layer's linear weights in one form only, the packed one the exact
        kernels use (and, with `draft`, the fast mode's low-precision copy, built now):
        the unpacked matrices are let go, so once the caller drops its own reference to
        the loaded weights (`LoadedModel.without_weights`) their memory is freed. The
        exact-mode self-check runs first (it needs them). Returns the bytes let go.
        Afterwards fast mode works only if `draft` was given (or draft weights are fp32,
        which are the packed exact ones); the embedding and the tied LM head stay as they
        are (the lookup needs the plain matrix, the head its packed one)."""
        if not self._exact_checked:
            self._check_exact()
        if draft:
            self._draft_linears()
        before = self.weights.nbytes
        self.weights = self.weights.without_linears()
        self._released = True
        self._held_bytes = None
        return before - self.weights.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this runner holds, every form counted once per storage: the
        unpacked tensors it keeps, the packed linears, the draft copy. Counted once per
        form of the weights (Info reports it on every router poll)."""
        if self._held_bytes is None:
            linears = [self.lm_head] + [f for layer in self.layers for f in layer.linears]
            self._held_bytes = storage_bytes(self.weights, linears)
        return self._held_bytes + self.draft_weight_bytes

    @property
    def draft_weight_bytes(self) -> int:
        """Bytes of the fast mode's low-precision weight copy; 0 until the first fast forward
        builds it, and 0 for `draft_weights="fp32"` (which uses the exact weights)."""
        return self._draft.nbytes if self._draft is not None else 0

    def prepare_fast(self) -> None:
        """Build fast mode's draft weights now rather than in the first fast forward, so
        that no timed draft step includes this one-time cost (about 1.4 s for the built-in
        model in fp16: the horizon policy would read it as the draft step's price)."""
        self._draft_linears()

    def new_cache(self, capacity: int = 0) -> KVCache:
        return KVCache(self.config, granule=self.rc.key_chunk, capacity=capacity)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput], mode: Mode = "exact") -> list[torch.Tensor | None]:
        """Process new tokens of every sequence; returns logits per sequence.

        Logits are [t, V] for `logits="all"`, [1, V] for "last", None for "none".
        Raises ValueError on malformed input, ExactModeUnsupported when exact mode was
        refused by the start-up self-check.
        """
        exact = mode == "exact"
        if mode not in ("exact", "fast"):
            raise ValueError(f"mode must be 'exact' or 'fast', got {mode!r}")
        if exact:
            self.ensure_exact_supported()
        spans = input_spans(seqs, exact, self.config.vocab_size)
        n = spans[-1][1]
        rows = ceil_to(n, self.rc.row_tile) if exact else n
        positions = torch.zeros(rows, dtype=torch.long)
        positions[:n] = torch.cat([s.positions for s in seqs])
        token_ids = torch.zeros(rows, dtype=torch.long)  # padding rows: token 0, position 0
        token_ids[:n] = torch.cat([s.tokens for s in seqs])

        x = self.weights.embed[token_ids]  # [rows, d]
        cos, sin = self.rope.lookup(positions)  # [rows, D] each
        plans = [self._plan(s) for s in seqs] if exact else [None] * len(seqs)
        linears = _Linears(self.layers, self.lm_head) if exact else self._draft_linears()
        drafts = {} if exact else draft_stacks(seqs, spans, self.scale)
        for index, layer in enumerate(linears.layers):
            x = x + self._attention(index, layer, x, cos, sin, seqs, spans, plans, drafts)
            x = x + self._mlp(layer, x)
        return self._logits(x, seqs, spans, exact, linears.lm_head)

    def _draft_linears(self) -> _Linears:
        """Fast mode's linear layers (`RunnerConfig.draft_weights`), built on first use."""
        with self._draft_lock:
            if self._draft is None:
                self._draft = self._build_draft_linears()
            return self._draft

    def _build_draft_linears(self) -> _Linears:
        kind = self._draft_kind()
        if kind == "fp32":
            return _Linears(self.layers, self.lm_head)
        if self._released:
            raise RuntimeError(
                "fast mode's draft weights are built from the unpacked weights, which "
                "release_source_weights(draft=False) let go"
            )
        layers = [_PackedLayer(w, kind) for w in self.weights.layers]
        return self._draft_from(layers, kind)

    def _draft_kind(self) -> str:
        """`RunnerConfig.draft_weights`, or fp32 where the low-precision engine is missing."""
        kind = self.rc.draft_weights
        if kind in ("int8", "fp16") and int8_engine() is None:
            warnings.warn(
                f"{kind} draft weights need torch's fbgemm engine; drafting with fp32 weights",
                RuntimeWarning,
                stacklevel=4,
            )
            return "fp32"
        return kind

    def _draft_from(self, layers: list[_PackedLayer], kind: str) -> _Linears:
        lm_head = _packed(self.weights.lm_head, kind)
        linears = [lm_head] + [f for layer in layers for f in layer.linears]
        return _Linears(layers, lm_head, sum(f.nbytes for f in linears))

    def ensure_exact_supported(self) -> None:
        """Run the exact-mode self-check once (cached per platform and shapes); raise
        ExactModeUnsupported when it failed."""
        if not self._exact_checked:
            self._check_exact()
        if self._exact_problem:
            raise ExactModeUnsupported(
                f"exact mode refused on this platform: {self._exact_problem}. Lossless "
                "decoding needs grouping-independent kernels; use a supported torch build "
                "(CPU/MKL, torch 2.13) or run with --runner fast (no bitwise guarantee)."
            )

    def _check_exact(self) -> None:
        self._exact_problem = check_exact_mode(type(self), self.config, self.weights, self.rc)
        self._exact_checked = True

    def _plan(self, seq: SeqInput) -> AttentionPlan:
        return AttentionPlan.build(
            seq.positions,
            self.config.group_size,
            key_chunk=self.rc.key_chunk,
            row_tile=self.rc.attention_row_tile,
            query_block=self.rc.query_block,
            fused=fused_kernel(self.config.head_dim) is not None,
        )

    def _attention(self, index: int, w: _PackedLayer, x, cos, sin, seqs, spans, plans, drafts):
        c = self.config
        h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
        qkv = w.wqkv(h)  # [rows, (H + 2*KVH) * D]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv  # elementwise: a row's bits do not depend on the others
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :q_dim].view(-1, c.num_heads, c.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(-1, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(-1, c.num_kv_heads, c.head_dim)
        q = apply_rope(q, cos, sin)  # [rows, H, D]
        k = apply_rope(k, cos, sin)  # [rows, KVH, D]
        for seq, (_, end) in zip(seqs, spans, strict=True):
            if seq.observe:
                seq.observed.append(q[max(0, end - seq.observe) : end].clone())
        exact = plans[0] is not None
        if exact:
            q = q * self.scale
        out = torch.zeros_like(q)
        stacks = _prefix_stacks(seqs, spans, plans, self.rc.key_chunk)
        remote = _remote_stacks(index, seqs, spans, plans, self.rc.key_chunk)
        for stack in dict.fromkeys(remote.values()):
            stack.start(q)  # every prefix's shards work while we wait for the first
        stacks.update(remote)
        for stack in dict.fromkeys(drafts.values()):
            out[stack.rows] = stack.attend(index, q, k, v)
        for i, (seq, (start, end), plan) in enumerate(zip(seqs, spans, plans, strict=True)):
            if i in drafts:
                continue
            layer_kv = seq.cache.layer(index)
            layer_kv.append(
                k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), seq.positions
            )
            if i in stacks:
                out[start:end] = stacks[i].attend(i, layer_kv, q)
            else:
                out[start:end] = self._attend(layer_kv, q[start:end], seq.positions, plan)
            seq.cache.release(index)
        return w.wo(out.view(out.shape[0], -1))

    def _attend(self, layer_kv, q, q_pos, plan: AttentionPlan | None):
        if plan is not None:
            return exact_attention(q, layer_kv.k, layer_kv.v, plan)
        keys, values, k_pos = layer_kv.live()
        return fast_attention(q, keys, values, q_pos, k_pos, self.scale)

    def _mlp(self, w: _PackedLayer, x):
        h = rms_norm(x, w.mlp_norm, self.config.rms_norm_eps)
        return w.w_down(swiglu(w.w_gate_up(h)))

    def _logits(self, x, seqs, spans, exact: bool, lm_head) -> list[torch.Tensor | None]:
        picks = [
            _picked_rows(seq.logits, start, end)
            for seq, (start, end) in zip(seqs, spans, strict=True)
        ]
        rows = torch.cat(picks)
        if rows.numel() == 0:
            return [None] * len(seqs)
        padded = ceil_to(rows.numel(), self.rc.row_tile) if exact else rows.numel()
        selected = x.new_zeros(padded, x.shape[1])
        selected[: rows.numel()] = x[rows]
        h = rms_norm(selected, self.weights.final_norm, self.config.rms_norm_eps)
        logits = lm_head(h)  # [padded, V]
        out: list[torch.Tensor | None] = []
        offset = 0
        for seq, pick in zip(seqs, picks, strict=True):
            out.append(None if seq.logits == "none" else logits[offset : offset + pick.numel()])
            offset += pick.numel()
        return out


class _PrefixStack:
    """Sequences of one exact forward over one shared prefix buffer, attending together.

    Their caches are `SharedPrefixView`s with the same `prefix_id`: slots [0, prefix_length)
    of the buffer each borrows hold the same prefix. The prefix's full key chunks (those
    wholly below prefix_length, never touched by a borrower's tail) are attended once for
    every member's query rows stacked into one fused-kernel call; each member then continues
    from its rows' carried online-softmax state over its own remaining chunks (the prefix's
    partial last chunk, shared with its tail, and the tail). A row's result is bitwise what
    it is alone: the kernel computes every row on its own, and a row's chunks walked over two
    calls give the one-call result. One instance serves one layer.
    """

    def __init__(self, members: list[int], full_chunks: int, key_chunk: int, spans, plans):
        self.members = members
        self.full_chunks = full_chunks
        self.key_chunk = key_chunk
        self.spans = spans
        self.plans = plans
        self.offsets = _stacked_offsets(members, spans)
        self.state: AttentionState | None = None

    def attend(self, i: int, layer_kv, q: torch.Tensor) -> torch.Tensor:
        """Member i's attention output [t, H, D]; `layer_kv` is the buffer it borrowed (with
        its new tokens appended), q all rows of the forward (scaled, contiguous)."""
        if self.state is None:
            self.state = self._prefix_state(layer_kv, q)
        start, end = self.spans[i]
        offset = self.offsets[i]
        state = self.state.tokens(offset, offset + end - start)
        attend_chunks(
            q[start:end],
            layer_kv.k,
            layer_kv.v,
            self.plans[i].positions,
            state,
            key_chunk=self.key_chunk,
            first_chunk=self.full_chunks,
            finish=True,
        )
        return state.acc

    def _prefix_state(self, layer_kv, q: torch.Tensor) -> AttentionState:
        """Every member's rows after the prefix's full chunks, in one kernel call."""
        rows = torch.cat([q[self.spans[i][0] : self.spans[i][1]] for i in self.members])
        positions = torch.cat([self.plans[i].positions for i in self.members])
        state = AttentionState.start(*rows.shape)
        attend_chunks(
            rows,
            layer_kv.k,
            layer_kv.v,
            positions,
            state,
            key_chunk=self.key_chunk,
            stop_chunk=self.full_chunks,
        )
        return state


class _RemoteStack:
    """Sequences of one exact forward whose prefix's leading chunks are attended where the
    KV lives (near-data attention: their caches carry the same `remote`).

    Their caches' layer buffers hold positions [remote.base, ...) only (slot j holds
    position base + j; base is a multiple of the key chunk). At a layer, every member's
    query rows are sent together for the partials of the chunks below base (computed by the
    shards with this kernel), folded in chunk order, and each member continues from its
    rows' state over its own chunks, the positions shifted by base, which moves every chunk
    boundary by whole chunks and so changes no bit. One instance serves one layer.
    """

    def __init__(self, layer: int, remote, members: list[int], key_chunk: int, spans, plans):
        self.layer, self.remote = layer, remote
        self.key_chunk = key_chunk
        self.members, self.spans, self.plans = members, spans, plans
        self.offsets = _stacked_offsets(members, spans)
        self.rows: torch.Tensor | None = None
        self.state: AttentionState | None = None

    def start(self, q: torch.Tensor) -> None:
        """Send the members' rows (q: all rows of the forward, scaled) to the shards."""
        self.rows = torch.cat([q[self.spans[m][0] : self.spans[m][1]] for m in self.members])
        self.rows = self.rows.contiguous()
        self.remote.start(self.layer, self.rows)

    def attend(self, i: int, layer_kv, q: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            if self.rows is None:
                self.start(q)
            self.state = AttentionState.start(*self.rows.shape)
            parts = self.remote.partials(self.layer, self.rows)
            fold(self.state.m, self.state.l, self.state.acc, parts)
        start, end = self.spans[i]
        offset = self.offsets[i]
        state = self.state.tokens(offset, offset + end - start)
        positions = (self.plans[i].positions - self.remote.base).contiguous()
        attend_chunks(
            q[start:end],
            layer_kv.k,
            layer_kv.v,
            positions,
            state,
            key_chunk=self.key_chunk,
            finish=True,
        )
        return state.acc


def _stacked_offsets(members: list[int], spans) -> dict[int, int]:
    """Where each member's rows start once the members' rows are stacked, in order."""
    offsets, offset = {}, 0
    for i in members:
        offsets[i] = offset
        offset += spans[i][1] - spans[i][0]
    return offsets


def _remote_stacks(layer: int, seqs, spans, plans, key_chunk: int) -> dict[int, _RemoteStack]:
    """The near-data stack of each sequence whose cache attends a prefix remotely."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i, seq in enumerate(seqs):
        remote = getattr(seq.cache, "remote", None)
        if remote is not None:
            groups.setdefault(id(remote), (remote, []))[1].append(i)
    if groups and (not plans or plans[0] is None or not plans[0].fused):
        raise ValueError("near-data attention needs exact mode with the fused kernel")
    stacks: dict[int, _RemoteStack] = {}
    for remote, members in groups.values():
        stack = _RemoteStack(layer, remote, members, key_chunk, spans, plans)
        stacks.update(dict.fromkeys(members, stack))
    return stacks


def _prefix_stacks(seqs, spans, plans, key_chunk: int) -> dict[int, _PrefixStack]:
    """The stack of each sequence that shares its prefix buffer with another one in this
    exact forward (fused kernel only), by sequence index."""
    if not plans or plans[0] is None or not plans[0].fused:
        return {}
    groups: list[tuple[object, int, list[int]]] = []  # (prefix_id, prefix_length, members)
    for i, seq in enumerate(seqs):
        if getattr(seq.cache, "remote", None) is not None:
            continue
        prefix_id = getattr(seq.cache, "prefix_id", None)
        length = getattr(seq.cache, "prefix_length", 0)
        if prefix_id is None or length < key_chunk:
            continue
        group = next((g for g in groups if _same(g[0], prefix_id) and g[1] == length), None)
        if group is None:
            groups.append((prefix_id, length, [i]))
        else:
            group[2].append(i)
    stacks: dict[int, _PrefixStack] = {}
    for _, length, members in groups:
        if len(members) > 1:
            stack = _PrefixStack(members, length // key_chunk, key_chunk, spans, plans)
            stacks.update(dict.fromkeys(members, stack))
    return stacks


def input_spans(seqs: Sequence[SeqInput], exact: bool, vocab_size: int) -> list[tuple[int, int]]:
    """Each sequence's rows [start, end) in one forward's batch, its input checked first
    (ValueError naming the sequence: tokens, positions, caches, exact mode's density)."""
    if not seqs:
        raise ValueError("forward needs at least one sequence")
    if len({id(s.cache) for s in seqs}) != len(seqs):
        raise ValueError("each sequence in one forward call needs its own cache")
    spans, offset = [], 0
    for i, s in enumerate(seqs):
        s.observed.clear()
        t = s.tokens.numel()
        if t == 0 or s.tokens.dim() != 1 or s.positions.shape != s.tokens.shape:
            raise ValueError(f"seqs[{i}]: tokens and positions must be equal non-empty [t]")
        if int(s.tokens.min()) < 0 or int(s.tokens.max()) >= vocab_size:
            raise ValueError(f"seqs[{i}]: token ids must be in [0, {vocab_size})")
        start = s.cache.next_position
        if int(s.positions[0]) < start or (t > 1 and bool((s.positions.diff() <= 0).any())):
            raise ValueError(f"seqs[{i}]: positions must increase and start at >= {start}")
        if exact and not (
            s.cache.dense and int(s.positions[0]) == start and int(s.positions[-1]) == start + t - 1
        ):
            raise ValueError(
                f"seqs[{i}]: exact mode needs a dense cache and consecutive "
                "positions (compressed caches are for fast mode)"
            )
        spans.append((offset, offset + t))
        offset += t
    return spans


def _same(a: object, b: object) -> bool:
    return a is b or bool(a == b)


class _PackedLayer:
    """A block's weights with its linear layers packed for the matrix kernels (`kind`:
    "exact" for the exact fp32 `Linear`, else the drafter's low-precision kind)."""

    def __init__(self, w: LayerWeights, kind: str = "exact"):
        self.attn_norm, self.mlp_norm, self.bqkv = w.attn_norm, w.mlp_norm, w.bqkv
        self.wqkv, self.wo = _packed(w.wqkv, kind), _packed(w.wo, kind)
        self.w_gate_up, self.w_down = _packed(w.w_gate_up, kind), _packed(w.w_down, kind)

    @property
    def linears(self) -> tuple[LinearFn, ...]:
        return (self.wqkv, self.wo, self.w_gate_up, self.w_down)


_packing = threading.Lock()
_packs: weakref.WeakValueDictionary[tuple[int, str], LinearFn] = weakref.WeakValueDictionary()
"""Packed linears by (id of their weight tensor, kind), held weakly: runners over the same
loaded weights (a process serving several decoders from one model, as the tests and
benches do) share one packed copy instead of each packing its own (for the built-in
model about 2 CPU-seconds and 650 MB per runner, exact and fp16 together). Packed
linears are read-only, so any thread may use a shared one."""


def _packed(weight: torch.Tensor, kind: str) -> LinearFn:
    """`weight` ([out, in] fp32) packed as `kind` ("exact": the exact `Linear`; "int8",
    "fp16", "bf16": the drafter's copy), made once while both it and a holder live. The
    entry is dropped when `weight` is freed, before its id can name another tensor."""
    key = (id(weight), kind)
    with _packing:
        linear = _packs.get(key)
        if linear is None:
            linear = Linear(weight) if kind == "exact" else low_precision_linear(weight, kind)
            _packs[key] = linear
            weakref.finalize(weight, _packs.pop, key, None)
        return linear


@dataclass(frozen=True, slots=True)
class _Linears:
    """The linear layers one forward computes with; `nbytes`: bytes they hold of their own
    (0 when they are the exact weights)."""

    layers: Sequence[_PackedLayer]
    lm_head: LinearFn
    nbytes: int = 0


def _picked_rows(which: Logits, start: int, end: int) -> torch.Tensor:
    if which == "all":
        return torch.arange(start, end)
    if which == "last":
        return torch.tensor([end - 1])
    return torch.empty(0, dtype=torch.long)


def storage_bytes(weights: ModelWeights, linears) -> int:
    """Bytes of the weights' tensors and the packed `linears`' weights, each storage once."""
    seen: dict[object, int] = {}

    def count(t: torch.Tensor) -> None:
        if t.numel():
            try:
                key: object = t.data_ptr()
            except RuntimeError:  # an opaque (oneDNN-packed) tensor: its own storage
                key = ("opaque", id(t))
            seen[key] = t.numel() * t.element_size()

    for t in (weights.embed, weights.final_norm, weights.lm_head):
        count(t)
    for layer in weights.layers:
        for t in layer.tensors():
            count(t)
    for linear in linears:
        count(linear.weight)
    return sum(seen.values())
