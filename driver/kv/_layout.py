"""Geometry of a batch's KV cache: how many bytes a token, a chunk and a layer take.

The unit of residency on the accelerator is a *layer frame* (one layer of the whole batch, laid
out ``(2, batch, kv_heads, capacity, head_dim)`` so attention gets a zero-copy view), because
attention for layer ``l`` needs all of layer ``l`` and nothing else. The unit of storage on the
device is a *chunk*: ``block_tokens`` tokens of one *piece* — the K or the V of one kv head of
one sequence in one layer — which is exactly a contiguous run of the frame. A piece's chunks
are allocated together, so a piece of a layer moves as one extent straight between the media
and the frame: ``2 x kv_heads`` descriptors per sequence per layer, no staging copy, no
reshuffle (vLLM's lesson: per-transfer overhead dominates small copies).
"""
from __future__ import annotations

from dataclasses import dataclass

from emulator.spec.errors import ConfigError

__all__ = ["BudgetTooSmall", "KVLayout"]


class BudgetTooSmall(ConfigError):
    """The HBM budget cannot hold the working set (the layer computing and the one loading).

    When it is raised (the KV shape, batch x kv heads x head dim x dtype, first reaches the cache
    with the first layer of the first forward: transformers gives a cache nothing before that):

    * with ``max_seq_len``: at the first forward (the prefill), at its first layer, before any KV
      is stored or any token produced, for ``max_seq_len`` tokens;
    * without: at the prefill, for the prompt, before any token is produced; and again whenever
      the sequences outgrow what the budget holds, which can only be found then, after tokens were
      produced (``detail`` says which, and how to have it found at the prefill).
    """

    def __init__(self, budget: int, minimum: int, batch: int, seq_len: int, detail: str = "") -> None:
        self.budget = budget
        self.minimum = minimum
        self.batch = batch
        self.seq_len = seq_len
        super().__init__(
            f"hbm_budget_bytes={budget} is below the working set of {minimum} bytes "
            f"(two layers of KV for batch {batch} x {seq_len} tokens: the layer computing and the "
            f"one loading); {detail + '; ' if detail else ''}raise hbm_budget_bytes to at least {minimum}")


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Shape of one batch's KV; all sizes in bytes."""

    batch: int
    kv_heads: int
    head_dim: int
    itemsize: int
    block_tokens: int

    def __post_init__(self) -> None:
        for name in ("batch", "kv_heads", "head_dim", "itemsize", "block_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def token_bytes(self) -> int:
        """K and V of one token of one sequence in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def pieces(self) -> int:
        """K and V of every kv head: the runs one sequence's layer is made of."""
        return 2 * self.kv_heads

    @property
    def piece_token_bytes(self) -> int:
        """One token of one piece (one head's K or V)."""
        return self.head_dim * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """One device chunk: ``block_tokens`` tokens of one piece."""
        return self.block_tokens * self.piece_token_bytes

    def image_offset(self, piece: int, row: int, token: int, capacity: int) -> int:
        """Byte offset of ``token`` of (``piece``, ``row``) in a frame-ordered image of
        ``capacity`` tokens: ``(2, batch, kv_heads, capacity, head_dim)``."""
        kv, head = divmod(piece, self.kv_heads)
        return (((kv * self.batch + row) * self.kv_heads + head) * capacity + token) * self.piece_token_bytes

    def blocks(self, seq_len: int) -> int:
        """Chunks per sequence per layer for ``seq_len`` tokens (the last may be partial)."""
        return -(-seq_len // self.block_tokens)

    def frame_bytes(self, capacity_tokens: int) -> int:
        """One layer frame on the accelerator holding ``capacity_tokens`` per sequence."""
        return self.batch * capacity_tokens * self.token_bytes

    def min_budget(self, seq_len: int) -> int:
        """The working set: two frames of ``seq_len`` tokens (computing + loading)."""
        return 2 * self.frame_bytes(seq_len)

    def max_capacity(self, budget: int) -> int:
        """Largest per-sequence token capacity for which two frames fit ``budget``."""
        return budget // (2 * self.batch * self.token_bytes)
