"""Data for the GPT example: a byte-level tokenizer, a text corpus or mock tokens, and a sampler.

The tokenizer needs no download: a token is a byte (vocabulary 256). A sample is a window of
``seq_length + 1`` tokens of the corpus; windows are visited in a seeded random order, one
permutation per epoch. The position in the data is ``consumed_samples`` (as in Megatron-LM), so a
resumed run that restores it sees exactly the batches the uninterrupted run would have seen.

Batch assignment follows Megatron-LM's ``MegatronPretrainingSampler``: each micro-batch step takes
``micro_batch_size * data_parallel_size`` consecutive samples and data-parallel rank ``r`` takes
the ``r``-th slice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

VOCAB_SIZE = 256
DEFAULT_CORPUS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "data", "kjv_genesis_exodus.txt"
)


class ByteTokenizer:
    """UTF-8 bytes as tokens; ``detokenize(tokenize(s)) == s``."""

    vocab_size = VOCAB_SIZE

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def detokenize(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class TokenWindows:
    """Samples of ``seq_length + 1`` tokens, visited in a seeded per-epoch random order."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int):
        if tokens.ndim != 1:
            raise ValueError("tokens must be one-dimensional")
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than one sample of "
                f"--seq-length {seq_length} + 1"
            )
        self._epoch = -1
        self._order: np.ndarray | None = None

    def __getitem__(self, sample: int) -> np.ndarray:
        epoch, index = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_windows)
            self._epoch = epoch
        start = int(self._order[index]) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1]


def load_tokens(data_path: str | None, mock: bool, seq_length: int, seed: int) -> np.ndarray:
    if mock:
        rng = np.random.default_rng(seed)
        return rng.integers(0, VOCAB_SIZE, size=64 * (seq_length + 1), dtype=np.int64)
    with open(data_path or DEFAULT_CORPUS, encoding="utf-8") as f:
        return ByteTokenizer().tokenize(f.read())


def batch_iterator(
    windows: TokenWindows,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches for this data-parallel rank, starting at ``consumed_samples``."""
    step = micro_batch_size * data_parallel_size
    sample = consumed_samples
    while True:
        first = sample + data_parallel_rank * micro_batch_size
        rows = np.stack([windows[first + i] for i in range(micro_batch_size)])
        rows = torch.from_numpy(rows)
        sample += step
        seq = windows.seq_length
        yield {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq, dtype=torch.float32),
            "position_ids": torch.arange(seq, dtype=torch.int64)
            .unsqueeze(0)
            .expand(micro_batch_size, seq)
            .contiguous(),
        }
