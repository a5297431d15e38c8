"""Our runner computes the same model as `transformers`: greedy continuations agree."""

from __future__ import annotations

import pytest
import torch

from decoder.generate import generate_full
from decoder.runner import SeqInput

NEW_TOKENS = 32
PROMPTS = [  # (text, wrap in the chat template)
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
    ("import json\n\nwith open('config.json') as f:\n    config = ", False),
    ("The history of the printing press begins in", False),
    ("Once upon a time, in a village by the sea, there lived", False),
    ("Write a SQL query that returns the ten most recent orders.", True),
    ("What is 17 multiplied by 23? Explain step by step.", True),
    ("Translate to French: The weather is nice today.", True),
    ("List three uses of a hash map, as a JSON array of strings.", True),
]
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def hf_model(builtin_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(builtin_model.path), dtype=torch.float32)
    return model.eval()


def test_greedy_continuations_match_transformers(builtin_model, builtin_runner, hf_model):
    prompts = [builtin_model.encode(text, chat=chat) for text, chat in PROMPTS]
    eos = builtin_model.eos_token_ids
    ours = generate_full(builtin_runner, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=eos)
    exact = 0
    for prompt, result in zip(prompts, ours, strict=True):
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
        theirs = out.sequences[0, len(prompt) :].tolist()
        if theirs == result.tokens:
            exact += 1
            continue
        step = _first_difference(result.tokens, theirs)
        a, b = result.tokens[step], theirs[step]
        our_logits = _our_logits(builtin_runner, prompt + result.tokens[:step])
        hf_logits = out.scores[step][0]
        gap = min(
            abs(float(our_logits[a] - our_logits[b])), abs(float(hf_logits[a] - hf_logits[b]))
        )
        assert gap <= NEAR_TIE, (
            f"prompt {prompt[:8]}...: step {step} differs (ours {a}, transformers {b}) "
            f"without a near-tie: logit gap {gap:.2e}"
        )
    print(f"{exact}/{len(PROMPTS)} prompts matched transformers exactly")
    assert exact >= 7, f"only {exact} of {len(PROMPTS)} prompts matched transformers exactly"


def _first_difference(ours: list[int], theirs: list[int]) -> int:
    """Index of the first differing token (one stopping at EOS early counts as differing)."""
    pairs = zip(ours, theirs, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))


def _our_logits(runner, tokens: list[int]) -> torch.Tensor:
    cache = runner.new_cache()
    return runner.forward([SeqInput.extend(cache, tokens)])[0][-1]
