"""Checkers for lab 3 (prefix caching): chained block hashes, prefix match, eviction choice.

The learner's functions run inside :class:`~minivllm.kv.prefix.learner.LearnerHashCache`
(in ``kv/``, which alone changes refcounts), so they serve the same replays as the
engine's own caches.  The module ends with the lab's registration (:data:`LAB`,
see :mod:`minivllm.labs.registry`).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.learner import IndexEntry, LearnerHashCache
from minivllm.labs.checkers import Case, CheckResult, run_checks, wrong_container
from minivllm.labs.registry import Exercise, Lab


def build_index(hasher, token_ids: Sequence[int], block_ids: Sequence[int], block_size: int,
                salt: str | None = None, index: dict | None = None) -> dict:
    """Index the full blocks of ``token_ids`` under ``block_ids`` with ``hasher``'s keys.

    A key already in ``index`` keeps its entry (``setdefault``), as the learner's cache keeps the first block
    cached under a key: indexes built from several prompts then match what a replay would have cached."""
    index = {} if index is None else index
    keys = hasher(token_ids, block_size, salt)
    parent = None
    for i, (k, b) in enumerate(zip(keys, block_ids)):
        index.setdefault(k, IndexEntry(b, tuple(token_ids[i * block_size:(i + 1) * block_size]), parent))
        parent = k
    return index


# -- exercise 1: chained block hashes ----------------------------------------------------


def check_block_hashes(fn) -> CheckResult:
    """Check ``fn(token_ids, block_size, salt=None) -> list of keys`` by its properties."""
    P = list(range(100, 132))  # two blocks of 16
    Q, R = list(range(200, 216)), list(range(300, 316))

    cases = [
        Case("fewer tokens than one block", lambda f: f(list(range(10)), 16), [],
             "only FULL blocks get a key: a partial block is still being written"),
        Case("two full blocks and a tail give two keys", lambda f: len(f(P + [1, 2, 3], 16)), 2,
             "use len(token_ids) // block_size blocks, dropping the tail"),
        Case("the same tokens give the same keys", lambda f: f(P, 16) == f(list(P), 16), True,
             "don't mix in anything random or per-call (id(), time, a counter)"),
        Case("the partial tail does not change the keys", lambda f: f(P + [7, 8], 16) == f(P, 16), True,
             "ignore tokens after the last full block"),
        Case("a shared prefix shares its leading keys", lambda f: (lambda a, b: (a[:2] == b[:2], a[2] != b[2]))(
            f(P + Q, 16), f(P + R, 16)), (True, True), "block i's key may depend only on tokens 0 .. end of block i"),
        Case("the same block after a different prefix gets a different key",
             lambda f: f(P[:16] + Q, 16)[1] != f(P[16:] + Q, 16)[1], True,
             "chain: key_i = hash((key_{i-1}, tokens_i)) -- KV depends on every earlier token"),
        Case("identical blocks at positions 0 and 1 differ", lambda f: len(set(f([5] * 32, 16))), 2,
             "without the parent key in the hash, two equal blocks collide"),
        Case("one block repeated four times gives four different keys", lambda f: len(set(f([5] * 64, 16))), 4,
             "chain by hashing the pair: key_i = hash((key_{i-1}, tokens_i)). Combining two hashes with ^ cancels a "
             "repeated block (k ^ h ^ h == k), so block 2 gets block 0's key"),
        Case("the same two blocks in the other order: another second key",
             lambda f: f(Q + R, 16)[1] != f(R + Q, 16)[1], True,
             "order matters: Q then R and R then Q are different prefixes with different KV. ^ and + are commutative "
             "(h(Q) ^ h(R) == h(R) ^ h(Q)); hash the tuple (parent key, block tokens) instead"),
        Case("one token changed mid-block changes that key and every later one",
             lambda f: [x != y for x, y in zip(f(P + Q, 16), f(P[:23] + [999] + P[24:] + Q, 16))], [False, True, True],
             "hash ALL of the block's tokens (the whole tuple of 16), not its first token or a summary of it: "
             "two blocks share KV only if every token is the same"),
        Case("a block's last token is part of its key",
             lambda f: [x != y for x, y in zip(f(P, 16), f(P[:15] + [999] + P[16:], 16))], [True, True],
             "two blocks that differ only in their 16th token are different blocks: key 0 and every key after it "
             "must change. Check where your slice of block i ends: it must include the block's last token"),
        Case("the same tokens in another order are another block",
             lambda f: f(P[:16], 16) != f(P[15::-1], 16), True,
             "a sum or a set forgets the order; KV depends on it: hash the tokens as a tuple"),
        Case("tokens 1, 23 and 12, 3 are another block", lambda f: f([1, 23] * 8, 16) != f([12, 3] * 8, 16), True,
             "hash the tuple of token ids itself: joining their digits into one string ('123...') makes 1, 23 and "
             "12, 3 the same text, so two different blocks share a key"),
        Case("a salt changes every key", lambda f: (lambda s, u: all(x != y for x, y in zip(s, u)))(
            f(P + Q, 16, salt="alice"), f(P + Q, 16)), True,
             "mix the salt into the FIRST key; chaining carries it to all later keys"),
        Case("a salted prompt has one key per full block of its own tokens",
             lambda f: (len(f(P + Q[:15], 16, salt="alice")),
                        f(P, 16, salt="alice")[0] != f(P[:15] + [999] + P[16:], 16, salt="alice")[0]), (2, True),
             "47 tokens with a salt: still 2 keys, and key 0 still covers all 16 tokens of block 0 (here its last "
             "token changes, so key 0 must too). The salt is not a token: putting it in front of the prompt shifts "
             "every block by one. Mix it into the first key instead"),
        Case("the same salt gives the same keys", lambda f: f(P, 16, salt="alice") == f(P, 16, salt="alice"), True,
             "the salt must be used deterministically"),
    ]
    return run_checks("block_hashes", fn, cases)


# -- exercise 2: prefix match ------------------------------------------------------------


def check_match_prefix(fn, hasher: Callable | None = None) -> CheckResult:
    """Check ``fn(token_ids, index, block_size, hasher, salt=None) -> list[block ids]``.

    ``hasher`` defaults to the checker's own correct chained hash, so this
    checker judges the matching alone (whether or not exercise 1 passes).
    """
    hasher = hasher or _ref_hasher
    bs = 4
    A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # three blocks
    idx = build_index(hasher, A, [7, 3, 9], bs)

    def forged_tokens(f):
        keys = hasher(A, bs)
        bad = {keys[0]: IndexEntry(7, (99, 99, 99, 99), None)}  # right key, other tokens: a collision
        return f(A + [1], bad, bs, hasher)

    def forged_parent(f):
        keys = hasher(A, bs)
        bad = {keys[0]: IndexEntry(7, tuple(A[:4]), None), keys[1]: IndexEntry(3, tuple(A[4:8]), "someone else")}
        return f(A + [1], bad, bs, hasher)

    def forged_middle(f):  # block 1 collides, block 2's entry is genuine: nothing after the collision counts
        keys = hasher(A, bs)
        bad = dict(idx)
        bad[keys[1]] = IndexEntry(3, (99, 99, 99, 99), keys[0])
        return f(A + [1], bad, bs, hasher)

    def forged_middle_parent(f):  # block 1's parent is forged, block 2's entry is genuine: stop at block 1
        keys = hasher(A, bs)
        bad = dict(idx)
        bad[keys[1]] = IndexEntry(3, tuple(A[4:8]), "someone else")
        return f(A + [1], bad, bs, hasher)

    def parent_elsewhere(f):  # block 2's entry names a real cached key as parent, but not block 1's
        keys = hasher(A, bs)
        bad = dict(idx)
        bad[keys[2]] = IndexEntry(9, tuple(A[8:12]), keys[0])
        return f(A + [1], bad, bs, hasher)

    def index_untouched(f):  # entries the matcher must skip, not clean up: the cache owns them
        keys = hasher(A, bs)
        for forged in (IndexEntry(3, (99, 99, 99, 99), keys[0]), IndexEntry(3, tuple(A[4:8]), "someone else")):
            bad = dict(idx)
            bad[keys[1]] = forged
            before = dict(bad)
            f(A + [1], bad, bs, hasher)
            if bad != before:
                return False
        return True

    def first_with_parent(f):  # the first block's entry claims a parent: it belongs to a longer chain
        keys = hasher(A, bs)
        return f(A + [1], {keys[0]: IndexEntry(7, tuple(A[:4]), "a parent")}, bs, hasher)

    def gap(f):
        keys = hasher(A, bs)
        holey = {k: v for k, v in idx.items() if k != keys[1]}
        return f(A + [1], holey, bs, hasher)

    def prompt_untouched(f):
        prompt = A + [1]
        f(prompt, idx, bs, hasher)
        return prompt == A + [1]

    salted = build_index(hasher, A, [7, 3, 9], bs, salt="alice")
    cases = [
        Case("empty index", lambda f: f(A + [1], {}, bs, hasher), [], "nothing cached: no hit"),
        Case("a longer prompt hits every cached block", lambda f: f(A + [1, 2], idx, bs, hasher), [7, 3, 9],
             "walk the keys in order and collect each entry's block_id"),
        Case("an exactly cached prompt keeps its last token", lambda f: f(list(A), idx, bs, hasher), [7, 3],
             "match token_ids[:-1]: the last prompt token must run through the model to produce logits"),
        Case("the prompt is only read", prompt_untouched, True,
             "work on token_ids[:-1], a new list: pop() or del changes the caller's prompt, whose last token the "
             "engine still has to compute"),
        Case("a prompt one token into a new block", lambda f: f(A[:9], idx, bs, hasher), [7, 3],
             "8 matchable tokens = 2 full blocks"),
        Case("a different second block stops the match", lambda f: f(A[:4] + [0, 0, 0, 0] + A[8:] + [1], idx, bs, hasher),
             [7], "stop at the first block whose key is not in the index"),
        Case("stop at the first miss even if later keys exist", gap, [7],
             "break at a miss: a later block's KV is useless without the blocks before it"),
        Case("a key collision is a miss", forged_tokens, [],
             "validate: the entry's tokens must equal this block's tokens, or its KV belongs to another prompt"),
        Case("an entry with another parent is a miss", forged_parent, [7],
             "validate the chain too: entry.parent must be the previous block's key (None for the first)"),
        Case("after a collision, stop -- even where a later entry is genuine", forged_middle, [7],
             "a mismatch ends the match (break, not continue): block 2's KV was computed after the real block 1"),
        Case("after a wrong parent, stop -- even where a later entry is genuine", forged_middle_parent, [7],
             "a wrong parent ends the match too (break, not continue): block 1's cached KV belongs to another "
             "prefix, so nothing after it can be reused"),
        Case("an entry whose parent is another cached key is a miss", parent_elsewhere, [7, 3],
             "compare entry.parent with the PREVIOUS block's key exactly; being some cached key (or one of this "
             "prompt's earlier keys) is not enough"),
        Case("the index is only read", index_untouched, True,
             "don't delete or change entries, even a colliding one: the cache holds a pool reference for every "
             "entry, and one removed behind its back is never freed"),
        Case("the first block's entry must have no parent", first_with_parent, [],
             "check the parent of block 0 as well: it must be None"),
        Case("a salted prefix needs the same salt", lambda f: (f(A + [1], salted, bs, hasher),
                                                               f(A + [1], salted, bs, hasher, salt="alice")),
             ([], [7, 3, 9]), "pass salt on to hasher(token_ids[:-1], block_size, salt)"),
    ]
    return run_checks("match_prefix", fn, cases)


# -- exercise 3: eviction choice ---------------------------------------------------------


def _node(i, t, locks=0, children=0):
    return {"id": i, "last_access": t, "locks": locks, "children": children}


def check_pick_victim(fn, hasher: Callable | None = None, matcher: Callable | None = None) -> CheckResult:
    """Check ``fn(nodes) -> id or None``: the least recently used unlocked leaf."""
    def replay(cache_of):
        from minivllm.labs.workloads import multi_turn_workload, replay_prefix_cache

        pool = BlockPool(32)
        cache = cache_of(pool)
        recs = replay_prefix_cache(cache, pool, multi_turn_workload(4, 4, seed=1))
        return [r["hit_tokens"] for r in recs], pool.num_free + cache.num_cached_blocks

    def replay_case(f):
        return replay(lambda pool: LearnerHashCache(pool, 16, hasher or _ref_hasher, matcher or _ref_matcher, f))

    from minivllm.kv.prefix.hash_index import HashIndex

    expected_replay = replay(lambda pool: HashIndex(pool, 16))

    def nodes_untouched(f):
        nodes = [_node("a", 5), _node("b", 2, locks=1), _node("c", 9)]
        before = [dict(n) for n in nodes]
        f(nodes)
        return nodes == before

    cases = [
        Case("nothing cached", lambda f: f([]), None, "return None when there is no candidate"),
        Case("one unlocked leaf", lambda f: f([_node("a", 5)]), "a", "a leaf nobody uses can go"),
        Case("least recently used first", lambda f: f([_node("a", 5), _node("b", 2), _node("c", 9)]), "b",
             "pick the SMALLEST last_access (LRU), not the largest"),
        Case("a locked leaf stays, however old", lambda f: f([_node("a", 1, locks=1), _node("b", 4)]), "b",
             "locks > 0 means a running request reads this block: evicting it corrupts that request"),
        Case("an inner node stays while it has children", lambda f: f([_node("a", 1, children=2), _node("b", 4)]), "b",
             "evict leaves only, or a cached block would lose the prefix it depends on"),
        Case("no unlocked leaf: no victim, even with a free inner node",
             lambda f: f([_node("a", 1, children=1), _node("b", 2, locks=1)]), None,
             "a node with children is never a victim, however few children it has: here the only unlocked node is "
             "inner and the only leaf is locked, so nothing can go"),
        Case("everything locked: no victim", lambda f: f([_node("a", 1, locks=2), _node("b", 2, locks=1)]), None,
             "return None instead of a locked node; the engine will preempt instead"),
        Case("ties go to the first listed", lambda f: f([_node("b", 3), _node("a", 3)]), "b",
             "use a stable choice (min keeps the first of equal keys) -- the first in the list, not the smallest id"),
        Case("the list of candidates is only read", nodes_untouched, True,
             "don't sort or remove from the list the cache passes you (sorted() and min() make no changes)"),
        Case("multi-turn replay on a 32-block pool evicts like the engine's HashIndex", replay_case, expected_replay,
             "the replay evicts through your function; compare the cases above",
             show_expected=f"hit tokens {expected_replay[0]}, every block accounted for"),
    ]
    return run_checks("pick_victim", fn, cases)


# The checkers' own correct versions (what the engine's HashIndex does, in the learner's
# signatures).  Private on purpose: the notebook's fallback is the engine's HashIndex itself.
def _ref_hasher(token_ids, block_size, salt=None):
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash((parent, block, salt if i == 0 else None))
        keys.append(parent)
    return keys


def _ref_matcher(token_ids, index, block_size, hasher, salt=None):
    out, parent = [], None
    for i, k in enumerate(hasher(token_ids[:-1], block_size, salt)):
        e = index.get(k)
        if e is None or e.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]) or e.parent != parent:
            break
        out.append(e.block_id)
        parent = k
    return out


def _ref_picker(nodes):
    free = [n for n in nodes if n["locks"] == 0 and n["children"] == 0]
    return min(free, key=lambda n: n["last_access"])["id"] if free else None


# -- hidden cases (the grader's, seeded at grading time) ---------------------------------


def _random_prompts(rng: random.Random, bs: int) -> list[list[int]]:
    """Prompts that share prefixes of random lengths, repeat blocks and end in partial blocks."""
    stems = [[rng.randrange(10, 40) for _ in range(rng.randint(0, 4 * bs))] for _ in range(3)]
    out = []
    for _ in range(rng.randint(4, 9)):
        p = list(rng.choice(stems)) + [rng.randrange(10, 40) for _ in range(rng.randint(0, 3 * bs))]
        if rng.random() < 0.3:
            p = p + p[:bs]  # the same block again, later in the prompt
        out.append(p)
    return out


def _replay_hits(cache_of, seed: int) -> tuple:
    from minivllm.labs.workloads import multi_turn_workload, replay_prefix_cache

    pool = BlockPool(32)
    cache = cache_of(pool)
    recs = replay_prefix_cache(cache, pool, multi_turn_workload(4, 4, seed=seed))
    return [r["hit_tokens"] for r in recs], pool.num_free + cache.num_cached_blocks


def hidden_block_hashes(fn, seed: int) -> CheckResult:
    """Random prompts (shared prefixes, repeated blocks, salts): which keys are equal must match the
    engine's chained hash exactly -- equal where the engine's are equal, different where they differ."""
    rng = random.Random(seed)

    def equalities(f, trial, bs, prompts, salts):
        mine = [f(list(p), bs, s) if s else f(list(p), bs) for p, s in zip(prompts, salts)]
        ref = [_ref_hasher(p, bs, s) for p, s in zip(prompts, salts)]
        for keys in mine:  # the signature's container, as in the visible cases
            if (bad := wrong_container(keys, list, f"trial {trial}")) is not None:
                return bad
        if [len(k) for k in mine] != [len(k) for k in ref]:
            return f"trial {trial}: wrong number of keys"
        flat_m = [k for ks in mine for k in ks]
        flat_r = [k for ks in ref for k in ks]
        for i in range(len(flat_r)):
            for j in range(i + 1, len(flat_r)):
                if (flat_m[i] == flat_m[j]) != (flat_r[i] == flat_r[j]):
                    return f"trial {trial}: keys equal where they must differ, or the other way round"
        return None

    def same_equalities(f):
        for trial in range(20):
            bs = rng.choice([2, 3, 4, 8])
            prompts = _random_prompts(rng, bs)
            salts = [rng.choice([None, None, "a", "b"]) for _ in prompts]
            if (bad := equalities(f, trial, bs, prompts, salts)) is not None:
                return bad
        return "all 20 trials match"

    def reordered(f):  # the same blocks in other orders and repeated: order and position must show in the keys
        for trial in range(10):
            bs = rng.choice([2, 3, 4, 8])
            x, y, z = ([rng.randrange(1000) for _ in range(bs)] for _ in range(3))
            prompts = [x + y, y + x, x * 4, x + y + x + y, y + x + y + x, x + z + y, z + x + y, x + y + z, y + x + z]
            salt = rng.choice([None, "a"])
            if (bad := equalities(f, trial, bs, prompts, [salt] * len(prompts))) is not None:
                return bad
        return "all 10 trials match"

    def run_together(f):  # random tokens of 1-3 digits rarely spell the same digits: these always do
        bs = rng.choice([2, 4, 8])
        x, y = [1, 23] * (bs // 2), [12, 3] * (bs // 2)
        return equalities(f, "digits", bs, [x, y, x + y, y + x, x + x], [None] * 5) or "keys as the engine's"

    return run_checks("block_hashes (hidden)", fn, [
        Case("blocks whose digits run together: the same equal and different keys as the engine", run_together,
             "keys as the engine's"),
        Case("20 random prompt sets: the same equal and different keys as the engine", same_equalities,
             "all 20 trials match"),
        Case("10 sets of reordered and repeated blocks: the same equal and different keys as the engine", reordered,
             "all 10 trials match"),
    ], verbose=False)


def hidden_match_prefix(fn, seed: int) -> CheckResult:
    """Random indexes (with forged collisions) and queries vs the checker's reference match, and a random
    multi-turn replay whose hits must equal the engine's :class:`HashIndex`."""
    from minivllm.kv.prefix.hash_index import HashIndex

    rng = random.Random(seed)

    def random_queries(f):
        for trial in range(30):
            bs = rng.choice([2, 4, 8])
            prompts = _random_prompts(rng, bs)
            salt = rng.choice([None, "t"])
            index: dict = {}
            next_block = 0
            for p in prompts[: len(prompts) // 2]:
                n = len(p) // bs
                build_index(_ref_hasher, p, list(range(next_block, next_block + n)), bs, salt, index)
                next_block += n
            for key in list(index)[: rng.randint(0, 2)]:  # forge: right key, other tokens or parent
                e = index[key]
                index[key] = e._replace(tokens=tuple(t + 1 for t in e.tokens)) if rng.random() < 0.5 \
                    else e._replace(parent="forged")
            for q in prompts:
                q = q + [rng.randrange(10, 40) for _ in range(rng.randint(0, bs))]
                s = rng.choice([salt, salt, None if salt else "t"])
                given = dict(index)
                got = f(list(q), given, bs, _ref_hasher, s) if s else f(list(q), given, bs, _ref_hasher)
                if (bad := wrong_container(got, list, f"trial {trial}")) is not None:  # as in the visible cases
                    return bad
                if given != index:
                    return f"trial {trial} changed the index"
                if got != _ref_matcher(q, index, bs, _ref_hasher, s):
                    return f"trial {trial} differs"
        return "all 30 trials match"

    replay_seed = rng.randrange(1 << 30)
    expected = _replay_hits(lambda pool: HashIndex(pool, 16), replay_seed)

    def replay(f):
        return _replay_hits(lambda pool: LearnerHashCache(pool, 16, _ref_hasher, f, _ref_picker), replay_seed)

    return run_checks("match_prefix (hidden)", fn, [
        Case("30 random indexes and queries", random_queries, "all 30 trials match"),
        Case("a random multi-turn replay hits like the engine's HashIndex", replay, expected),
    ], verbose=False)


def hidden_pick_victim(fn, seed: int) -> CheckResult:
    """Random node lists vs the LRU-leaf rule, and a random multi-turn replay on a small pool that must evict
    like the engine's :class:`HashIndex`."""
    from minivllm.kv.prefix.hash_index import HashIndex

    rng = random.Random(seed)

    def random_nodes(f):
        for trial in range(200):
            ids = [f"n{i}" for i in range(rng.randint(0, 7))]
            rng.shuffle(ids)  # list order is not id order: a tie goes to the first listed
            nodes = [_node(i, rng.randint(0, 6), locks=rng.choice([0, 0, 0, 1, 2]),
                           children=rng.choice([0, 0, 1, 3])) for i in ids]
            if f([dict(n) for n in nodes]) != _ref_picker(nodes):
                return f"list {trial} differs"
        return "all 200 match"

    replay_seed = rng.randrange(1 << 30)
    expected = _replay_hits(lambda pool: HashIndex(pool, 16), replay_seed)

    def replay(f):
        return _replay_hits(lambda pool: LearnerHashCache(pool, 16, _ref_hasher, _ref_matcher, f), replay_seed)

    return run_checks("pick_victim (hidden)", fn, [
        Case("200 random node lists", random_nodes, "all 200 match"),
        Case("a random multi-turn replay evicts like the engine's HashIndex", replay, expected),
    ], verbose=False)


# -- quiz answers (``"compute": "minivllm.labs.check_lab03:<name>"`` in quizzes/lab03.json) ----


def quiz_system_prompt_hit_tokens() -> int:
    """Tokens served from cache for the 2nd request sharing a 100-token system prompt (block 16)."""
    from minivllm.kv.prefix.radix import RadixCache
    from minivllm.labs.workloads import replay_prefix_cache

    system = list(range(100, 200))
    prompts = [system + [7, 8, 9], system + [5, 6]]
    pool = BlockPool(64)
    recs = replay_prefix_cache(RadixCache(pool, 16), pool, prompts, block_size=16)
    return recs[1]["hit_tokens"]


def quiz_exact_repeat_hit_tokens() -> int:
    """Hit tokens when a 64-token prompt is sent twice (block 16): the lookup leaves out the last token, so the
    whole 4th block is recomputed (48 hits, not 63)."""
    from minivllm.kv.prefix.radix import RadixCache
    from minivllm.labs.workloads import replay_prefix_cache

    prompt = list(range(300, 364))
    pool = BlockPool(64)
    recs = replay_prefix_cache(RadixCache(pool, 16), pool, [prompt, prompt], block_size=16)
    return recs[1]["hit_tokens"]


# -- the registration ---------------------------------------------------------------------

LAB = Lab(3, "lab03_prefix_caching", "Prefix caching", widgets=("next step", "run to end"), exercises=(
    Exercise("block_hashes", "block_hashes", check_block_hashes, points=1, hidden=hidden_block_hashes, mutants=(
        ("no chaining", "parent = hash((parent, block, salt if i == 0 else None))",
         "parent = hash((block, salt if i == 0 else None))"),
        ("partial tail block hashed", "range(len(token_ids) // block_size)", "range(-(-len(token_ids) // block_size))"),
        ("salt ignored", "salt if i == 0 else None", "None"),
        ("last full block dropped", "range(len(token_ids) // block_size)", "range(len(token_ids) // block_size - 1)"),
        ("key depends on the list object", "hash((parent, block, salt if i == 0 else None))",
         "hash((parent, block, salt if i == 0 else None, id(token_ids)))"),
        ("returns unchained keys", "keys.append(parent)", "keys.append(hash(block))"),
        ("hashes the block's first token only", "parent = hash((parent, block, salt if i == 0 else None))",
         "parent = hash((parent, block[0], salt if i == 0 else None))"),
        ("hashes the block's sum", "parent = hash((parent, block, salt if i == 0 else None))",
         "parent = hash((parent, sum(block), salt if i == 0 else None))"),
        # chaining carries a first-key salt to every key; a salt in the last key changes only that one: kills a
        # salt case that accepts *some* changed key instead of every one
        ("salt mixed into the last key only", "salt if i == 0 else None",
         "salt if i == len(token_ids) // block_size - 1 else None"),
    )),
    Exercise("match_prefix", "match_prefix", check_match_prefix, points=2, hidden=hidden_match_prefix, mutants=(
        ("matches the last token too", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids, block_size, salt)"),
        ("skips a miss instead of stopping",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):\n            break",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):\n"
         "            parent = key\n            continue"),
        ("no token validation (trusts the key)",
         "if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):",
         "if entry is None:"),
        ("no parent validation", "if entry.parent != parent:", "if False:"),
        ("salt dropped", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids[:-1], block_size)"),
        ("drops two tokens", "hasher(token_ids[:-1], block_size, salt)", "hasher(token_ids[:-2], block_size, salt)"),
        # the forged parents above are strings no index holds: kills a case that never names a cached key
        ("parent only checked to be cached", "if entry.parent != parent:",
         "if (entry.parent is not None) if i == 0 else (entry.parent not in index):"),
        # the cache holds a pool reference per entry, dropped only when it evicts: these leak a block
        ("deletes a colliding entry",
         "!= tuple(token_ids[i * block_size:(i + 1) * block_size]):\n            break",
         "!= tuple(token_ids[i * block_size:(i + 1) * block_size]):\n            if entry is not None:\n"
         "                del index[key]\n            break"),
        ("deletes an entry with a wrong parent", "if entry.parent != parent:\n            break",
         "if entry.parent != parent:\n            del index[key]\n            break"),
        ("drops the last token in place", "for i, key in enumerate(hasher(token_ids[:-1], block_size, salt)):",
         "token_ids.pop()\n    for i, key in enumerate(hasher(token_ids, block_size, salt)):"),
    )),
    Exercise("pick_victim", "pick_victim", check_pick_victim, points=1, hidden=hidden_pick_victim, mutants=(
        ("evicts a locked node", 'n["locks"] == 0 and n["children"] == 0', 'n["children"] == 0'),
        ("evicts an inner node", 'n["locks"] == 0 and n["children"] == 0', 'n["locks"] == 0'),
        ("most recently used", "min(candidates", "max(candidates"),
        ("never gives up", "return None", 'return nodes[0]["id"] if nodes else None'),
        ("ties go to the last", "min(candidates, key", "min(list(reversed(candidates)), key"),
        ("first candidate, not LRU", 'min(candidates, key=lambda n: n["last_access"])["id"]', 'candidates[0]["id"]'),
        ("sorts the caller's list", "    candidates = [n for n in nodes",
         '    nodes.sort(key=lambda n: n["last_access"])\n    candidates = [n for n in nodes'),
    )),
))
