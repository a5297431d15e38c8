"""Prompt-lookup proposals, without a model."""

from __future__ import annotations

from decoder.engine.ngram import NgramProposer, NgramTable


def _proposer(prefix: list[int], own: list[int] = ()) -> NgramProposer:
    return NgramProposer(NgramTable(prefix), own)


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_gram():
    p = _proposer([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], [6, 2, 3])
    # "2 3" occurred twice in the prefix; the latest is followed by 7 8 (then the own 6 2 3).
    assert p.propose([], 4) == [7, 8, 6, 2]
    # a longer gram wins over a more recent shorter one: "1 2 3" -> 4 5
    q = _proposer([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], [1, 2, 3])
    assert q.propose([], 2) == [4, 5]


def test_the_requests_own_tokens_are_consulted_first():
    p = _proposer([5, 6, 1, 2], [5, 6, 3, 5, 6])
    assert p.propose([], 2) == [3, 5]  # own "5 6" -> 3 (later than the prefix's -> 1)


def test_drafts_extend_the_gram_being_matched():
    p = _proposer([10, 11, 12, 13, 14, 15], [99])
    assert p.propose([11, 12], 3) == [13, 14, 15]
    assert p.propose([42], 3) == []  # never seen


def test_grams_that_span_the_prefix_boundary_are_indexed():
    p = _proposer([1, 2, 3], [4, 8, 2, 3])
    # context 1 2 3 | 4 8 2 3: "3" is followed by the request's first token
    assert p.propose([3], 1) == [4]
    p.extend([4])
    assert p.propose([], 2) == [8, 2]  # "3 4" (across the boundary) -> 8 2


def test_no_proposal_from_the_gram_at_the_very_end_and_k_bounds():
    p = _proposer([1, 2, 3])
    assert p.propose([], 3) == []  # "2 3" has no earlier occurrence
    assert p.propose([1], 0) == []
    assert len(p) == 3


def test_the_prefix_table_is_shared_and_not_changed_by_requests():
    table = NgramTable([1, 2, 3, 1, 2])
    a, b = NgramProposer(table, [7]), NgramProposer(table, [3])
    a.extend([1, 2, 9])
    assert a.propose([1, 2], 1) == [9]
    assert b.propose([1, 2], 1) == [3]  # b's own context, not a's
    assert table.tokens == [1, 2, 3, 1, 2]
