"""The example's byte tokenizer, shipped corpus and resumable sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data import DEFAULT_CORPUS, ByteTokenizer, TokenWindows, batch_iterator, load_tokens


def test_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "In the beginning — ünïcode\n"
    ids = tok.tokenize(text)
    assert ids.max() < tok.vocab_size
    assert tok.detokenize(ids) == text


def test_shipped_corpus_is_real_text():
    tokens = load_tokens(None, mock=False, seq_length=64, seed=0)
    assert len(tokens) > 300_000
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        assert f.readline().startswith("In the beginning God created the heaven and the earth.")


def test_windows_are_a_seeded_permutation_per_epoch():
    tokens = np.arange(1 + 10 * 4)
    w = TokenWindows(tokens, seq_length=4, seed=3)
    epoch0 = [int(w[i][0]) for i in range(10)]
    assert sorted(epoch0) == list(range(0, 40, 4))  # each window once
    epoch1 = [int(w[10 + i][0]) for i in range(10)]
    assert sorted(epoch1) == sorted(epoch0) and epoch1 != epoch0
    assert [int(TokenWindows(tokens, 4, 3)[i][0]) for i in range(10)] == epoch0
    assert all(len(w[i]) == 5 for i in range(20))


def test_too_short_corpus_is_refused():
    with pytest.raises(ValueError, match="fewer than one sample"):
        TokenWindows(np.arange(4), seq_length=8, seed=0)


def test_resumed_iterator_continues_exactly():
    w = TokenWindows(np.arange(1000), seq_length=8, seed=0)
    mbs, dp = 2, 2
    straight = batch_iterator(w, 0, mbs, data_parallel_rank=1, data_parallel_size=dp)
    batches = [next(straight) for _ in range(5)]
    resumed = batch_iterator(w, 3 * mbs * dp, mbs, data_parallel_rank=1, data_parallel_size=dp)
    for expected in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_data_parallel_ranks_see_disjoint_samples():
    w = TokenWindows(np.arange(1000), seq_length=8, seed=0)
    b0 = next(batch_iterator(w, 0, 2, 0, 2))
    b1 = next(batch_iterator(w, 0, 2, 1, 2))
    assert not torch.equal(b0["tokens"], b1["tokens"])
    assert torch.equal(b0["labels"][:, :-1], b0["tokens"][:, 1:])
