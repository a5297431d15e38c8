"""The decode loop: full-KV, lossy, and VeriCache (draft/verify), with continuous batching.

A request is a cached prefix (its full KV behind a `FullKVSource`, plus the queries its
prefill observed) and at least one suffix token. Requests are submitted at any time and
admitted under the engine's KV byte budget; each `step` admits what fits, prefills the new
requests' suffixes in exact mode against the full prefix (streamed layer by layer), and
advances every request in flight by one iteration:

- `full`: the prefix's full KV is read once and kept resident, shared by every request over
  that prefix, and decoded with in exact mode one token per step (the baseline every
  lossless claim is measured against);
- `lossy`: decodes with the compressed prefix plus the tail alone, one token per step in
  the draft runner mode (what users of KV compression run today; not lossless);
- `vericache`: rounds of `x` drafted tokens (compressed prefix + tail) and one exact
  verification of `x + 1` tokens over the full prefix (streamed) + tail. The longest run
  of drafts equal to the verifier's own choices is accepted, plus the verifier's next
  token; everything after it is rolled back, and the accepted tokens' verified KV
  replaces their draft KV. Only verifier choices are ever emitted.

Scheduling (DESIGN.md section 4): requests over one prefix share its compressed copy and
verify together in one pass over one pulled copy of it; the pull of the next verification
starts (`LayerRing.begin`) before the draft step that precedes it; rounds of requests over
different prefixes are staggered so their verifications (and pulls) fall in different
iterations while passes wait on the link, and aligned into one pass while compute is the
bottleneck (one pass then reads the weights once for every request); the horizon adapts
per request, shared by the requests that verify together. When a prefix's full KV cannot
be read, the engine recomputes it locally if the budget allows, else fails the requests
over it with `Unreachable`; tokens already emitted were verified, and nothing else is.

Failures stay with the requests they belong to (`Engine.step`): an error in one request's
admission (a compressed artifact that does not fit the model fails it with
`ArtifactFormatError`), its own sampling, listener or draft tail fails that request alone; a
draft pass that fails is retried prefix by prefix, and a prefix whose drafting still fails
fails its own requests. Only a failure of a pass shared by several prefixes (a bug) fails
the requests in flight, and the engine goes on serving the queue and later requests.

Tokens are chosen by `decoder.sampling.Sampler`, keyed by output position, so the tokens
of `vericache` are exactly the tokens of `full` (greedy or seeded sampling), whatever the
batch, horizon, compressor, or where the prefix KV came from.

The package, in the order a request meets it: `request` (what callers submit and get
back), `config`, `admission` (the queue, admission under the KV budget, retirement, with the
byte arithmetic in `accounting`), `state` (per-prefix and per-request state, and the requests
in flight), `residency` (resident prefixes, local recompute, recovery), `prefix_work` (all
model work on a prefix: prefill, observe, recompute, compress), `exact` (exact passes),
`planner` (rounds and horizons), `speculative` (draft, verify, `accept_length`, rollback),
`stats`, and `engine` (the `Engine` that steps them: schedule, run, postprocess).
"""

from decoder.engine.config import ENGINE_MODES, EngineConfig, EngineMode
from decoder.engine.engine import Engine
from decoder.engine.prefix_work import prefill_prefix, split_prompt
from decoder.engine.request import Prefix, Request, Ticket, TokenListener
from decoder.engine.speculative import accept_length
from decoder.errors import Cancelled, Unreachable

__all__ = [
    "ENGINE_MODES",
    "Cancelled",
    "Engine",
    "EngineConfig",
    "EngineMode",
    "Prefix",
    "Request",
    "Ticket",
    "TokenListener",
    "Unreachable",
    "accept_length",
    "prefill_prefix",
    "split_prompt",
]
