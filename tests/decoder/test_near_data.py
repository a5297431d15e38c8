"""Near-data verification through the real store: shards on loopback compute attention
partials over the prefix's chunks, the decoder folds them; the tokens are those of
in-process full-KV decoding, token for token, and the prefix's KV never crosses the wire."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from decoder.engine import Engine, EngineConfig, Prefix, Request, prefill_prefix
from decoder.near_data import PROBE_BYTES, NearData
from decoder.sampling import SamplingParams
from decoder.store_source import StoreKVSource, kv_layout, publish_source
from prefix_store.client.link import BULK_BYTES
from tests.prefix_store.conftest import Store
from tests.references import full_kv_tokens

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it

NEW_TOKENS = 20
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)


@pytest.fixture
def shards(redis_server, metadata, tmp_path):
    metadata.set_replication(2)
    store = Store(redis_server.url, tmp_path)
    for i in range(3):
        store.start(f"shard-{i}")
    yield store
    store.close()


@pytest.fixture(scope="module")
def prompts(builtin_model):
    source = builtin_model.encode(inspect.getsource(textwrap))
    return [source[:700], source[300:1000]]  # 691- and 691-token prefixes: 2 full chunks each


def full_kv(builtin_model, builtin_runner, prompt, sampling) -> list[int]:
    return full_kv_tokens(builtin_runner, builtin_model, prompt, NEW_TOKENS, sampling)


def one_chunk(stats) -> float:
    """Bytes of one 256-token chunk of the prefix (all layers)."""
    return stats["full_bytes"] * 256 / stats["prefix_tokens"]


_prefills: dict[tuple[int, ...], Prefix] = {}


def published(builtin_model, builtin_runner, client, prompt) -> Prefix:
    """`prompt` less its last 9 tokens, published through `client` (from one exact prefill
    per prompt in this module), as a prefix over the store."""
    key = tuple(prompt)
    if key not in _prefills:
        _prefills[key] = prefill_prefix(builtin_runner, prompt[:-9], observe=128)
    local = _prefills[key]
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    publish_source(client, local.tokens, local.source, layout)
    cached = client.lookup(prompt, layout)
    assert cached.tokens == len(local.tokens)
    observed = [q.clone() for q in local.observed] if local.observed is not None else None
    return Prefix(list(local.tokens), StoreKVSource(client, cached), observed)


def greedy_requests(builtin_model, builtin_runner, client, prompts) -> list[Request]:
    """One greedy request per prompt, over the prompt's prefix `published` through `client`."""
    prefixes = [published(builtin_model, builtin_runner, client, p) for p in prompts]
    return [
        Request(prefix, p[len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        for prefix, p in zip(prefixes, prompts, strict=True)
    ]


def engine(builtin_model, builtin_runner, compressor="snapkv:budget=0.125", **config) -> Engine:
    config.setdefault("horizon", 4)
    config.setdefault("resident", False)  # a resident copy would be used before either
    config.setdefault("placement", "near")  # `auto` may pull on loopback: measured cheaper
    return Engine(
        builtin_runner,
        EngineConfig(mode="vericache", compressor=compressor, **config),
        builtin_model.eos_token_ids,
    )


@pytest.mark.parametrize(
    "sampling, compressor",
    [
        (GREEDY, "snapkv:budget=0.125"),
        (SAMPLED, "kivi:bits=2"),
        (GREEDY, "streamingllm:sink=4,window=124"),
    ],
    ids=["greedy-snapkv", "sampled-kivi", "greedy-streaming"],
)
def test_near_data_decoding_is_token_for_token_full_kv(
    sampling, compressor, builtin_model, builtin_runner, shards, metadata, prompts
):
    """Two requests over one shared prefix and one over a private one, one pass each round."""
    want = [full_kv(builtin_model, builtin_runner, p, sampling) for p in prompts]
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        shared = published(builtin_model, builtin_runner, client, prompts[0])
        private = published(builtin_model, builtin_runner, client, prompts[1])
        requests = [
            Request(shared, prompts[0][len(shared.tokens) :], NEW_TOKENS, sampling),
            Request(shared, prompts[0][len(shared.tokens) :], NEW_TOKENS, sampling),
            Request(private, prompts[1][len(private.tokens) :], NEW_TOKENS, sampling),
        ]
        results = engine(builtin_model, builtin_runner, compressor).run(requests)
    assert [r.tokens for r in results] == [want[0], want[0], want[1]]
    for r in results:
        assert r.stats["near_passes"] > 0 and r.stats["near_bytes"] > 0
        # the prefix's full KV never crossed the wire: only its last, partial chunk did, once
        assert r.stats["pulled_bytes"] <= one_chunk(r.stats)
        # queries out and partials back: far below the prefix's bytes per pass
        assert r.stats["near_bytes"] / r.stats["near_passes"] < r.stats["full_bytes"] / 10


def test_auto_placement_measures_both_and_stays_identical(
    builtin_model, builtin_runner, shards, metadata, prompts
):
    """`auto` starts near-data and then goes by measured costs: whatever it picks per pass,
    every pass is exact."""
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        prefix = published(builtin_model, builtin_runner, client, prompts[0])
        request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner, placement="auto").run([request])[0]
    assert result.tokens == want
    assert result.stats["near_passes"] >= 1


def test_pull_placement_never_attends_remotely(
    builtin_model, builtin_runner, shards, metadata, prompts
):
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        prefix = published(builtin_model, builtin_runner, client, prompts[0])
        request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner, placement="pull").run([request])[0]
    assert result.tokens == want
    assert result.stats["near_passes"] == 0 and result.stats["pulled_bytes"] > 0


@pytest.mark.parametrize(
    "placement, payback, held",
    [("pull", None, True), ("near", 10**6, True), ("near", 0, False)],
    ids=["pull", "near-copy-pays", "near-copy-never-pays"],
)
def test_remote_prefixes_are_held_as_full_kv_holds_them_where_a_copy_pays(
    placement, payback, held, builtin_model, builtin_runner, shards, metadata, prompts,
    monkeypatch,
):  # fmt: skip
    """Two distinct store prefixes, drafting, resident copies allowed, a budget for one
    request held as full KV. Where its passes would pull, or attend near the data while a
    copy here pays back its read (`PAYBACK_PASSES`), each prefix is read once and held
    while its request drafts and verifies against it, and the other request waits for
    room, as full-KV decoding would serve them, instead of being admitted on its compressed
    copy to pull its prefix, or wait on the shards, for every pass. Where the copy never
    pays, both are admitted at once and verify near the data."""
    if payback is not None:
        monkeypatch.setattr("decoder.engine.residency.PAYBACK_PASSES", payback)
    want = [full_kv(builtin_model, builtin_runner, p, GREEDY) for p in prompts]
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        requests = greedy_requests(builtin_model, builtin_runner, client, prompts)
        probe = engine(builtin_model, builtin_runner, placement="pull", resident=True)
        probe.run(requests[:1])
        one = probe.budget.peak
        served = engine(
            builtin_model, builtin_runner, placement=placement, resident=True,
            kv_budget=one * 3 // 2,
        )  # fmt: skip
        results = served.run(requests)
    assert [r.tokens for r in results] == want
    assert all(r.stats["verifications"] > 1 and r.stats["drafted"] > 0 for r in results)
    assert [r.stats["resident_prefix"] for r in results] == [held, held]
    first, later = sorted((r.stats for r in results), key=lambda s: s["queue_s"])
    # held: the later request waited for room until the first was served
    assert (later["queue_s"] >= first["decode_s"]) is held
    if held:
        pulled = [r.stats["pulled_bytes"] for r in results]
        assert pulled == [r.stats["full_bytes"] for r in results]  # once, no near-data head
        assert all(r.stats["near_passes"] == 0 for r in results)
    else:
        assert all(r.stats["near_passes"] > 0 for r in results)


def test_under_a_budget_full_kv_fills_requests_are_served_as_full_kv_serves_them(
    builtin_model, builtin_runner, shards, metadata, prompts
):
    """Two distinct store prefixes whose passes would pull, the automatic horizon, and a
    budget that full-KV decoding fills with both requests: VeriCache admits both at once,
    charged no more than full KV (their resident copies and exact tails), and with no room
    left for drafting buffers they take exact steps (policy reason `room`), building no
    compressed prefix: served as full KV serves them. With room, the same requests draft."""
    want = [full_kv(builtin_model, builtin_runner, p, GREEDY) for p in prompts]
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        requests = greedy_requests(builtin_model, builtin_runner, client, prompts)
        full = Engine(builtin_runner, EngineConfig(mode="full"), builtin_model.eos_token_ids)
        assert [r.tokens for r in full.run(requests)] == want
        fills = full.budget.peak
        for request in requests:
            request.prefix.artifacts.clear()
        tight = engine(
            builtin_model, builtin_runner, placement="pull", resident=True, horizon=None,
            kv_budget=fills,
        )  # fmt: skip
        results = tight.run(requests)
        roomy = engine(builtin_model, builtin_runner, placement="pull", resident=True)
        drafted = roomy.run(requests)
    assert [r.tokens for r in results] == want == [r.tokens for r in drafted]
    first, later = sorted((r.stats for r in results), key=lambda s: s["queue_s"])
    assert later["queue_s"] < first["decode_s"]  # admitted together, as full KV admits them
    assert tight.budget.peak <= fills
    for r in results:
        assert r.stats["drafted"] == 0 and r.stats["resident_prefix"]
        assert r.stats["policy"].get("room", 0) > 0 and "compressor" not in r.stats
    assert all(r.stats["drafted"] > 0 and "compressor" in r.stats for r in drafted)


def test_two_tenants_each_see_only_their_own_prefix(
    builtin_model, builtin_runner, shards, metadata, prompts
):
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    tokens = [metadata.add_tenant("alice"), metadata.add_tenant("bob")]
    got = []
    for token in tokens:
        with shards.client(token) as client:
            prefix = published(builtin_model, builtin_runner, client, prompts[0])
            request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
            result = engine(builtin_model, builtin_runner).run([request])[0]
            got.append(result.tokens)
            assert result.stats["near_passes"] > 0
    assert got == [want, want]


def test_a_kernel_mismatch_pulls_instead_and_stays_identical(
    builtin_model, builtin_runner, shards, metadata, prompts, monkeypatch
):
    """A decoder whose kernel fingerprint the shards do not run never offloads to them."""
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    monkeypatch.setattr("decoder.near_data.kernel_fingerprint", lambda: "f" * 24)
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        prefix = published(builtin_model, builtin_runner, client, prompts[0])
        request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner).run([request])[0]
    assert result.tokens == want
    assert result.stats["near_passes"] == 0 and result.stats["pulled_bytes"] > 0
    assert "another attention kernel" in prefix.source.near_refused


def test_a_shard_stopped_mid_pass_is_replaced_by_a_replica(
    builtin_model, builtin_runner, shards, metadata, prompts, monkeypatch
):
    """At layer 12 of the third near-data pass one shard serving the pass stops; its chunks
    are attended on their replica and the pass completes, identical."""
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    begin = NearData.begin_pass
    passes = []

    def begin_and_stop_a_shard(near):
        rp = begin(near)
        passes.append(rp)
        partials = rp.partials

        def partials_then_stop(layer, q):
            if len(passes) == 3 and layer == 12 and len(shards.servers) == 3:
                serving = {link.part.shard_id for link in rp._session._links}
                shards.stop(sorted(serving)[0], grace_s=0)
            return partials(layer, q)

        rp.partials = partials_then_stop
        return rp

    monkeypatch.setattr(NearData, "begin_pass", begin_and_stop_a_shard)
    token = metadata.add_tenant("decoder")
    with shards.client(token, quarantine_s=60.0) as client:
        prefix = published(builtin_model, builtin_runner, client, prompts[0])
        request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner).run([request])[0]
    assert len(shards.servers) == 2  # the stop happened mid-pass
    assert result.tokens == want
    assert result.stats["pulled_bytes"] <= one_chunk(result.stats)
    assert result.stats["near_passes"] >= 3
    assert result.stats["near_retries"] == 0  # the replica answered: no pass was redone


def test_no_replica_left_falls_back_to_pulling_then_recomputing(
    builtin_model, builtin_runner, redis_server, metadata, tmp_path, prompts, monkeypatch
):
    """One shard, stopped mid-pass: the pass is undone, the prefix recomputed here (nothing
    left to pull from), and the output is still identical."""
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    store = Store(redis_server.url, tmp_path)
    store.start("only")
    begin = NearData.begin_pass

    def begin_and_stop(near):
        rp = begin(near)
        partials = rp.partials

        def partials_then_stop(layer, q):
            if layer == 5 and store.servers:
                store.stop("only", grace_s=0)
            return partials(layer, q)

        rp.partials = partials_then_stop
        return rp

    monkeypatch.setattr(NearData, "begin_pass", begin_and_stop)
    token = metadata.add_tenant("decoder")
    try:
        with store.client(token, retries=1, timeout_s=3.0) as client:
            prefix = published(builtin_model, builtin_runner, client, prompts[0])
            request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
            result = engine(builtin_model, builtin_runner).run([request])[0]
    finally:
        store.close()
    assert result.tokens == want
    assert result.stats["recomputed"]
    assert result.stats["near_retries"] == 1  # the one near-data pass undone, then redone


def test_long_passes_are_split_into_several_queries_per_layer(
    builtin_model, builtin_runner, shards, metadata, prompts, monkeypatch
):
    """Rows beyond what one answer may carry go out in several queries per layer (here 4
    rows each): the partials are the same, and so are the tokens."""
    monkeypatch.setattr("decoder.near_data.RESPONSE_BYTES", 4 * 2 * 9 * 66 * 4)
    want = full_kv(builtin_model, builtin_runner, prompts[0], GREEDY)
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        prefix = published(builtin_model, builtin_runner, client, prompts[0])
        near = prefix.source.near_data(builtin_model.config.num_heads)
        assert near is not None and near.rows_per_query == 4
        request = Request(prefix, prompts[0][len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner, horizon=6).run([request])[0]
    assert result.tokens == want and result.stats["near_passes"] > 0


@pytest.mark.parametrize(
    "payback, resident, near", [(0, False, True), (10**6, True, False), (None, True, None)]
)
def test_a_resident_copy_is_read_only_when_its_pull_pays_back(
    payback, resident, near, builtin_model, builtin_runner, shards, metadata, prompts, monkeypatch
):
    """With near-data available, the prefix is read here once only when that pull costs at
    most PAYBACK_PASSES near-data passes' waits (measured): never at 0; at 10**6 before any
    near-data pass, since even the least a pass can wait (a round trip per layer) says so.
    At the default (None) on loopback, where a pass waits for 30 layers' round trips and the
    shards' compute on this machine's own cores, reading the prefix once pays: weighing
    the pull against the waits less the shards' compute (about nothing here) kept every
    pass near the data, slower than full KV.

    The prefix's partial last chunk is 3 tokens, whose fetch is one round trip: priced at
    its rate, the pull looked about 100 times slower than it is and never paid. The pull is
    priced at the link's bulk rate instead, which a bounded probe measured."""
    if payback is not None:
        monkeypatch.setattr("decoder.engine.residency.PAYBACK_PASSES", payback)
    prompt = prompts[0][: 2 * 256 + 3 + 9]  # published() keeps all but the last 9 tokens
    want = full_kv(builtin_model, builtin_runner, prompt, GREEDY)
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        prefix = published(builtin_model, builtin_runner, client, prompt)
        request = Request(prefix, prompt[len(prefix.tokens) :], NEW_TOKENS, GREEDY)
        result = engine(builtin_model, builtin_runner, resident=True).run([request])[0]
        rate = client.link.bandwidth
    assert result.tokens == want
    assert result.stats["resident_prefix"] is resident
    if near is not None:  # the default's choice before or after measuring depends on timings
        assert (result.stats["near_passes"] > 0) is near
    assert rate > 0, "the probe measured the link"


def test_the_link_probe_reads_a_bounded_sample_once(
    builtin_model, builtin_runner, shards, metadata, prompts
):
    """A near-data prefix whose head is a few tokens probes the link with about PROBE_BYTES
    of its full chunks (never all of them) when the client has no bulk read yet; a later
    prefix on the same client probes no more. A prefix with no partial chunk (no head to
    fetch, so no rate at all before) probes too."""
    token = metadata.add_tenant("decoder")
    with shards.client(token) as client:
        heads = builtin_model.config.num_heads
        first = published(builtin_model, builtin_runner, client, prompts[0][: 2 * 256 + 3 + 9])
        fetched = []
        real = client.fetch_layers
        client.fetch_layers = lambda *a: fetched.append(real(*a)) or fetched[-1]
        near = first.source.near_data(heads)
        near.load_head()
        assert near.head_tokens == 3 and len(fetched) == 2  # the probe, then the head
        assert BULK_BYTES <= fetched[0] <= PROBE_BYTES < first.source.nbytes
        assert near.pull_bandwidth == client.link.bandwidth > 0
        second = published(builtin_model, builtin_runner, client, prompts[1][: 2 * 256 + 3 + 9])
        second.source.near_data(heads).load_head()
        assert len(fetched) == 3  # its head only
    other = metadata.add_tenant("other")  # its own namespace: nothing cached there yet
    with shards.client(other) as fresh:  # another decoder's client: no bulk read yet
        whole = published(builtin_model, builtin_runner, fresh, prompts[1][: 2 * 256 + 9])
        near = whole.source.near_data(heads)
        near.load_head()  # no partial chunk: nothing of its own to fetch, but the probe
        assert near.head_tokens == 0 and near.pull_bandwidth == fresh.link.bandwidth > 0
