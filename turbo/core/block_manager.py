"""KV block allocation with reference counts and prefix caching. Pure Python, no torch.

Block ids index the first dimension of every layer's KV cache tensor. A sequence's *block table* lists its
blocks in order; token ``i`` lives in slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching (as in vLLM): a *full* block is identified by the hash chain ``h_i = hash((h_{i-1}, tokens
of block i))``, so equal hashes mean equal KV content. Registered blocks stay reusable after their last
owner frees them: the free queue is LRU (freed blocks go to the tail, allocation takes the head), and a
cached block is forgotten only when it is taken from the head for new content.
"""
from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than exist."""


def block_hashes(token_ids: list[int], block_size: int, limit: int | None = None) -> list[int]:
    """Hash chain of the full blocks of ``token_ids`` (at most ``limit`` blocks)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out, parent = [], None
    for i in range(n):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class BlockManager:
    """Fixed-size KV blocks: free queue (LRU), reference counts, prefix cache of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks with no owner (some may still hold cached prefixes)."""
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether ``ensure_capacity(block_table, num_tokens)`` would succeed."""
        return self.blocks_needed(num_tokens) - len(block_table) <= len(self.free_queue)

    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict the cached prefix this block held
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
        self.ref_count[b] = 1
        return b

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place so it holds ``num_tokens`` tokens. Raises :class:`OutOfBlocks`."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return
        if need > len(self.free_queue):
            raise OutOfBlocks(f"need {need} more KV blocks, {len(self.free_queue)} free of {self.num_blocks}")
        for _ in range(need):
            block_table.append(self._take_free())

    def match_prefix(self, token_ids: list[int], block_table: list[int]) -> int:
        """Start an empty ``block_table`` with the cached blocks of ``token_ids``'s longest cached prefix.

        At least one token is left uncomputed (its logits are needed). Returns the number of cached tokens.
        """
        if block_table:
            raise ValueError("match_prefix needs an empty block table")
        if not self.enable_prefix_caching:
            return 0
        limit = (len(token_ids) - 1) // self.block_size
        for h in block_hashes(token_ids, self.block_size, limit):
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1
            block_table.append(b)
        n = len(block_table) * self.block_size
        self.hit_tokens += n
        return n

    def register_full_blocks(self, token_ids: list[int], block_table: list[int], num_computed: int) -> None:
        """Make the full, computed blocks of a sequence reusable by others (prefix cache)."""
        if not self.enable_prefix_caching:
            return
        n = min(num_computed // self.block_size, len(block_table))
        if n == 0 or self.block_hash[block_table[n - 1]] is not None:
            return
        for i, h in enumerate(block_hashes(token_ids, self.block_size, n)):
            b = block_table[i]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.cached.setdefault(h, b)

    def truncate(self, block_table: list[int], num_tokens: int) -> int:
        """Shrink ``block_table`` to the first ``num_tokens`` tokens; returns how many stay valid.

        A partly kept block that is shared or cached is dropped as well (writing into it would corrupt the
        other owners), so the result can be smaller than ``num_tokens`` (a multiple of the block size).
        """
        keep = self.blocks_needed(num_tokens)
        while len(block_table) > keep:
            self._release(block_table.pop())
        if num_tokens % self.block_size and block_table:
            last = block_table[-1]
            if self.block_hash[last] is not None or self.ref_count[last] > 1:
                self._release(block_table.pop())
                return len(block_table) * self.block_size
        return num_tokens

    def free(self, block_table: list[int]) -> None:
        """Release every block of ``block_table`` (last first, so a prefix's head is evicted last) and empty it."""
        while block_table:
            self._release(block_table.pop())

    def _release(self, b: int) -> None:
        if self.ref_count[b] <= 0:
            raise RuntimeError(f"double free of KV block {b}")
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            self.free_queue[b] = None

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Cache slots of tokens ``start .. end-1``."""
        bs = self.block_size
        return [block_table[i // bs] * bs + i % bs for i in range(start, end)]
