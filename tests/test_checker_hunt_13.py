"""Lab checkers (labs 1-3) against answers their planted bugs do not cover: a wrong ``match_prefix`` that the
visible checker and the grader's hidden cases both passed.  Each answer is written out here; the oracle is the
exercise's text ("its ``parent`` must be the previous key") and, for the one that edits the index, what it does
inside the lab's own :class:`LearnerHashCache` (a block nobody holds that never returns to the pool).

Correct answers written another way (numpy, dicts for refcounts, sha256 or nested-tuple keys, a whole-prefix hash,
``sorted()`` or a loop for the victim, the end-of-chunk test for prefill) were tried as well and pass every lab 1-3
checker, visible and hidden; they are not pinned here."""

from __future__ import annotations

import contextlib
import io

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.learner import IndexEntry, LearnerHashCache
from minivllm.labs import check_lab03


def _quiet(check, fn):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = check(fn)
    return result, out.getvalue()


def _chain(token_ids, block_size, salt=None):
    """A correct chained hash, written here (not the checker's): keys are the nested tuples themselves."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = (parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt if i == 0 else None)
        keys.append(parent)
    return keys


# -- lab 3: which parent counts ---------------------------------------------------------------------------


def _match_any_cached_parent(token_ids, index, block_size, hasher, salt=None):
    """Validates the tokens, and the parent only as "None for the first block, else some cached key": reads
    "validate the chain" as "the parent must exist", not "the parent must be the previous key"."""
    out = []
    for i, key in enumerate(hasher(token_ids[:-1], block_size, salt)):
        entry = index.get(key)
        if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break
        if (entry.parent is not None) if i == 0 else (entry.parent not in index):
            break
        out.append(entry.block_id)
    return out


def test_a_match_that_takes_any_cached_key_as_the_parent_fails_the_checker():
    """Every forged parent in the checker and the hidden cases is a string no index holds ("someone else",
    "forged"), so a parent test of "is it cached?" passed them all (the hidden cases still do: the visible case
    below is what stops it).  Here block 2's entry names block 0's key: cached, but not the previous
    key, so by rule 3 the match stops after block 1."""
    bs, prompt = 4, list(range(10, 22)) + [1]
    k0, k1, k2 = _chain(prompt[:-1], bs)
    index = {k0: IndexEntry(7, tuple(prompt[0:4]), None), k1: IndexEntry(3, tuple(prompt[4:8]), k0),
             k2: IndexEntry(9, tuple(prompt[8:12]), k0)}  # k2's parent should be k1
    assert _match_any_cached_parent(prompt, index, bs, _chain) == [7, 3, 9]  # the rule says [7, 3]
    result, text = _quiet(check_lab03.check_match_prefix, _match_any_cached_parent)
    assert not result, "the learner would see a pass for a chain check that trusts any cached key"
    assert "PREVIOUS block's key" in text


# -- lab 3: a matcher that cleans up a collision ------------------------------------------------------------


def _match_dropping_stale(token_ids, index, block_size, hasher, salt=None):
    """Right hits, but deletes an entry that fails validation ("it is stale anyway")."""
    out, parent = [], None
    for i, key in enumerate(hasher(token_ids[:-1], block_size, salt)):
        entry = index.get(key)
        if entry is None:
            break
        if entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]) or entry.parent != parent:
            del index[key]
            break
        out.append(entry.block_id)
        parent = key
    return out


def _summing_hash(token_ids, block_size, salt=None):
    """A chained hash of each block's *sum*: [1, 2] and [2, 1] collide, so validation has work to do."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = (parent, sum(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(parent)
    return keys


def _blocks_left_after_reset(matcher) -> int:
    """Two colliding one-block prompts through the lab's LearnerHashCache, then a reset: free blocks left."""
    pool = BlockPool(8)
    cache = LearnerHashCache(pool, 2, _summing_hash, matcher, check_lab03._ref_picker)
    for prompt in ([1, 2, 9], [2, 1, 9]):
        hits = cache.match(prompt[:-1])
        ids = hits or pool.allocate_many(1)
        for b in hits:
            pool.incref(b)
        cache.insert(prompt[:2], ids)
        for b in ids:
            pool.decref(b)
    cache.reset()
    assert cache.num_cached_blocks == 0
    return pool.num_free


def test_a_match_that_deletes_a_colliding_entry_fails_the_checker():
    """The cache holds one pool reference per index entry and drops it only when it evicts the entry; a matcher
    that deletes the entry itself leaves that reference held by nobody.  Oracle: the lab's own cache, reset
    with nothing locked, gets every block back with a read-only matcher and loses one with this one."""
    def read_only(token_ids, index, block_size, hasher, salt=None):
        return _match_dropping_stale(token_ids, dict(index), block_size, hasher, salt)

    assert _blocks_left_after_reset(read_only) == 8
    assert _blocks_left_after_reset(_match_dropping_stale) == 7  # a leaked block
    result, text = _quiet(check_lab03.check_match_prefix, _match_dropping_stale)
    assert not result, "the learner would see a pass for a matcher that leaks pool blocks"
    assert "the index is only read" in text
    assert check_lab03.check_match_prefix(read_only)  # the same hits, leaving the index alone, still pass
    assert not check_lab03.hidden_match_prefix(_match_dropping_stale, 0)


# -- lab 3: a block's tokens as one string of digits --------------------------------------------------------


def _digits_joined(token_ids, block_size, salt=None):
    """A chained hash of each block's tokens joined into one string ("".join(map(str, block))): chained, salted
    on the first key, order-sensitive -- and blind to where one token ends and the next begins."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        text = "".join(map(str, token_ids[i * block_size:(i + 1) * block_size]))
        parent = hash((parent, text, salt if i == 0 else None))
        keys.append(parent)
    return keys


def test_a_hash_of_the_joined_digits_fails_visible_and_hidden():
    # the exercise's rule (a key per full block identifies its whole prefix) by hand: 1, 23 and 12, 3 are different
    # blocks, so the right chain gives different keys; the joined digits are the same text, so this gives one key
    assert _chain([1, 23, 4, 5], 4) != _chain([12, 3, 4, 5], 4)
    assert _digits_joined([1, 23, 4, 5], 4) == _digits_joined([12, 3, 4, 5], 4)
    result, text = _quiet(check_lab03.check_block_hashes, _digits_joined)
    assert not result, text
    assert "joining their digits" in text
    assert not any(check_lab03.hidden_block_hashes(_digits_joined, seed) for seed in range(20))
    assert _quiet(check_lab03.check_block_hashes, _chain)[0]
    assert all(check_lab03.hidden_block_hashes(_chain, seed) for seed in range(20))
