"""The memory manager's half of the engine: KV blocks and who holds them.

* :mod:`~minivllm.kv.block_pool` -- block ids, a free list and reference counts;
* :mod:`~minivllm.kv.kv_cache` -- the K/V tensors (device and host tier) and block moves;
* :mod:`~minivllm.kv.kv_cache_manager` -- block tables, prefix sharing, copy-on-write,
  swap: the only code outside the pool that decides a refcount changes (the prefix
  cache it owns holds its own references, taken and dropped through the pool);
* :mod:`~minivllm.kv.prefix` -- the prefix caches (radix tree, hash index) and their factory.
"""

from minivllm.kv.block_pool import BlockPool, OutOfBlocksError
from minivllm.kv.kv_cache_manager import BlockMoves, KVCacheManager, PrefixHit, blocks_for

__all__ = ["BlockMoves", "BlockPool", "KVCacheManager", "OutOfBlocksError", "PrefixHit", "blocks_for"]
