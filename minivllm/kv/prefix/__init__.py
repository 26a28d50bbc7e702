"""Prefix caches: which KV blocks already hold the longest prefix of a prompt.

Two structures answer the same question (the :class:`~minivllm.interfaces.PrefixCache`
protocol): :class:`~minivllm.kv.prefix.radix.RadixCache` (SGLang's radix tree)
and :class:`~minivllm.kv.prefix.hash_index.HashIndex` (vLLM's chained block
hashes).  Their shared pieces live in :mod:`minivllm.kv.prefix.base`; this
package's ``__init__`` is the factory, so the implementations never import it
back (no cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from minivllm.interfaces import PrefixCache
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.base import (
    PUBLIC_NAMESPACE,
    InsertResult,
    PrefixCacheStats,
    sha256_block_hash,
)
from minivllm.kv.prefix.hash_index import HashIndex, default_block_hash
from minivllm.kv.prefix.radix import RadixCache

CACHE_KINDS = ("radix", "hash")


def make_prefix_cache(
    kind: str,
    pool: BlockPool,
    block_size: int,
    quota_blocks: int | None = None,
    hash_fn: Callable[[object], Hashable] | None = None,
    quota_group: Callable[[Hashable], Hashable] | None = None,
    quota_for: Callable[[Hashable], int | None] | None = None,
) -> PrefixCache:
    """Build a prefix cache of the given ``kind`` (``"radix"`` or ``"hash"``).

    ``hash_fn`` only makes sense for the hash index; passing it for the radix
    tree is an error rather than silently ignored.  ``quota_group`` and
    ``quota_for`` turn the per-namespace quota into per-group quotas (the
    engine groups by tenant, see :mod:`minivllm.kv.prefix.base`).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if quota_blocks is not None and quota_blocks < 0:
        raise ValueError(f"quota_blocks must be >= 0 or None, got {quota_blocks}")
    if kind == "radix":
        if hash_fn is not None:
            raise ValueError("hash_fn only applies to kind='hash'")
        return RadixCache(pool, block_size, quota_blocks, quota_group=quota_group, quota_for=quota_for)
    if kind == "hash":
        return HashIndex(pool, block_size, quota_blocks, quota_group=quota_group, quota_for=quota_for,
                         hash_fn=hash_fn or default_block_hash)
    raise ValueError(f"unknown prefix cache kind {kind!r}; expected one of {CACHE_KINDS}")


__all__ = [
    "CACHE_KINDS",
    "PUBLIC_NAMESPACE",
    "HashIndex",
    "InsertResult",
    "PrefixCache",
    "PrefixCacheStats",
    "RadixCache",
    "make_prefix_cache",
    "sha256_block_hash",
]
