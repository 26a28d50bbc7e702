"""A lab 2 learner's block pool, as the lab asks for it: the five members ``num_free``, ``allocate``, ``incref``,
``decref`` and ``refcount``, with its own bookkeeping -- the engine builds the rest of its pool interface on top
(:class:`~minivllm.kv.block_pool.PoolAdapter`, or ``install_pool``'s wrapping).

One definition for the tests that stand in for a learner.  The free-list order is the parameter that matters:
``lifo=False`` hands blocks out in the engine's own :class:`~minivllm.kv.block_pool.BlockPool` order (lowest id
first, a freed block to the back), so a test can ask both pools for the same ids; ``lifo=True`` hands the most
recently freed block out first, so a test can show the engine does not depend on the engine pool's order."""
from __future__ import annotations

from minivllm.kv.block_pool import OutOfBlocksError


class LearnersPool:
    def __init__(self, num_blocks: int, lifo: bool = False) -> None:
        # LIFO keeps the next block at the end of a stack; FIFO at the front of a queue (lowest id first)
        self.free = list(range(num_blocks - 1, -1, -1)) if lifo else list(range(num_blocks))
        self.lifo = lifo
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocksError("no free block")
        block = self.free.pop() if self.lifo else self.free.pop(0)
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.refs[block] == 0:
            raise ValueError(f"block {block} is free")
        self.refs[block] += 1

    def decref(self, block: int) -> bool:
        if self.refs[block] == 0:
            raise ValueError(f"block {block} is free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)
            return True
        return False

    def refcount(self, block: int) -> int:
        return self.refs[block]
