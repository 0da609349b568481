"""KV block allocation: a free list of fixed-size blocks with reference counts. Pure Python, no torch.

Block ids index the first dimension of every layer's KV cache tensor. A sequence's *block table* lists
its blocks in order; token ``i`` of the sequence lives in slot ``block_table[i // block_size] * block_size
+ i % block_size``.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than exist."""


class BlockManager:
    """Fixed-size KV blocks: ``allocate`` takes from the head of the free queue, ``free`` returns to its tail."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place so it holds ``num_tokens`` tokens. Raises :class:`OutOfBlocks`."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return
        if need > len(self.free_queue):
            raise OutOfBlocks(f"need {need} more KV blocks, {len(self.free_queue)} free of {self.num_blocks}")
        for _ in range(need):
            b = self.free_queue.popleft()
            self.ref_count[b] = 1
            block_table.append(b)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink ``block_table`` in place to the blocks that hold the first ``num_tokens`` tokens."""
        keep = self.blocks_needed(num_tokens)
        while len(block_table) > keep:
            self._release(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        """Release every block of ``block_table`` (last first) and empty it."""
        while block_table:
            self._release(block_table.pop())

    def _release(self, b: int) -> None:
        if self.ref_count[b] <= 0:
            raise RuntimeError(f"double free of KV block {b}")
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            self.free_queue.append(b)

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Cache slots of tokens ``start .. end-1``."""
        bs = self.block_size
        return [block_table[i // bs] * bs + i % bs for i in range(start, end)]
