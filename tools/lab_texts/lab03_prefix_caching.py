CELLS = [
("md", r"""
# Lab 3 — Prefix caching

**Goals.** After this lab you can

1. explain why the KV of a shared prompt prefix can be reused, and why only whole blocks are;
2. build the block-hash index vLLM uses (✏️ chained hashes, ✏️ prefix match with validation) and compare it with
   SGLang's radix tree;
3. measure hit rates on system-prompt, multi-turn, RAG and agent workloads;
4. choose what to evict (✏️ LRU leaf, never a locked one) and protect a tenant with a quota;
5. show the cross-tenant timing leak (vLLM CVE-2025-46570, arXiv 2411.18191) and close it with a salt.

**Time:** 5 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 45–60 minutes to work through. Everything here runs the
engine's own prefix caches (`minivllm/kv/prefix/radix.py`, `minivllm/kv/prefix/hash_index.py`) on the engine's `BlockPool`, admitting requests the
way the engine does; TTFTs come from the engine's simulated cost model, except in section 5, which measures a hit
and a miss on the real engine.
"""),
("code", r"""
import matplotlib.pyplot as plt
import torch

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.hash_index import HashIndex
from minivllm.labs import widgets, workloads
from minivllm.labs.check_lab03 import LearnerHashCache, check_block_hashes, check_match_prefix, check_pick_victim
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.kv.prefix.radix import RadixCache

BLOCK = 16
%matplotlib inline
""", ["setup"]),
("md", r"""
## 1. The picture: the same prefix, computed once

A token's K and V depend on that token **and every token before it**. So two prompts that start with the same
tokens have identical KV for that shared beginning — a system prompt, few-shot examples, the earlier turns of a
chat. A prefix cache keeps those KV blocks after a request finishes and hands them to the next request with the
same beginning: its prefill skips them, so its **TTFT** drops. Lesson 06 — the lesson this course is built on, whose
mechanisms and numbers the labs measure — gives the standard example: an assistant whose every request starts with
the same 3,000-token system prompt. Without a cache, every request prefills all 3,000 tokens; with one,
only the first does, and each later request computes just the few tokens past the last full block plus its question.

Sharing is block-granular: only *full* blocks are cached (a partial block is still being written). Two data
structures find "the longest cached prefix":

```
 radix tree (SGLang's RadixAttention)         chained block-hash index (vLLM)
 root                                          key0 = hash(None, tokens[0:16],  salt)
  └─ [sys0 sys1 sys2]   ← one edge, 3 blocks   key1 = hash(key0, tokens[16:32])
       ├─ [userA0]                             key2 = hash(key1, tokens[32:48])
       └─ [userB0 userB1]                      index: {key -> (block id, tokens, parent key)}
 walk down while blocks match; a new prompt    one dict lookup per block; stop at the first miss
 leaving an edge midway splits it              (each block is its own entry, no splitting)
```

A real tree from the engine's `RadixCache` (three chats sharing a system prompt; drawn by `tools/make_figures.py`):

![radix tree](../figures/radix_tree.png)

Both structures keep **one pool reference** per
cached block, so a cached block outlives its request, and a block some running request uses (refcount > 1) is
*locked* — never evicted.
"""),
("md", r"""
## ✏️ Exercise 1 — chained block hashes

`block_hashes(token_ids, block_size, salt=None)`: one key per **full** block, where key *i* depends on block *i*'s
tokens and on key *i−1* (so it identifies the whole prefix up to block *i*), and the salt enters the **first** key
only (the chain carries it on). Any hashable key works — Python's `hash` of a tuple is fine.

<details><summary>Hint 1</summary>

How many keys? One per *full* block: the tokens after the last full block get none.
</details>
<details><summary>Hint 2</summary>

Key *i* must change whenever anything in blocks 0 to *i* changes, but the rule above builds it from block *i*'s
tokens and key *i−1* only. Why is that enough? Which value already stands for everything before block *i*?
</details>
<details><summary>Hint 3</summary>

Carry that value from block to block as you walk them. Two details remain: what stands in for it before the first
block (any fixed value works, as long as every call uses the same one), and where the salt goes. A list cannot be
hashed; a tuple can.
</details>
<details><summary>Hint 4</summary>

Check yourself on an example (not a checker case): `block_size` 3, tokens `[4, 4, 7, 1, 2, 9, 5]`. How many keys
do you get, and does token 5 take part in any of them? Change the salt: which keys change, and why must all of
them? Change only the fourth token: which keys change? After you pass, compare with the engine's `HashIndex._key`
(`minivllm/kv/prefix/hash_index.py`).
</details>
"""),
("code", r"""
def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list:
    '''One chained key per full block; each key identifies its whole prefix, and the salt enters the first only.'''
    # TODO: one chained key per full block -- see the hints above
    ### BEGIN SOLUTION
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash((parent, block, salt if i == 0 else None))
        keys.append(parent)
    return keys
    ### END SOLUTION
""", ["exercise:block_hashes"]),
("code", r"""
hash_check = check_block_hashes(block_hashes)
"""),
("md", r"""
## ✏️ Exercise 2 — the longest cached prefix

`match_prefix(token_ids, index, block_size, hasher, salt=None)` returns the block ids of the longest cached prefix.
`index` maps a key to an `IndexEntry(block_id, tokens, parent)`. Three rules:

1. look up `token_ids[:-1]`: even a fully cached prompt must run its **last** token through the model to get logits;
2. stop at the **first miss** — a later block is useless without the ones before it;
3. **validate** every hit: the entry's `tokens` must equal this block's tokens and its `parent` must be the previous
   key (`None` for the first). Two different prefixes *can* hash to one key; serving the stored block then would
   feed the model another prompt's KV.

The checker judges your matching with its own correct `hasher`, so this exercise does not depend on exercise 1.

<details><summary>Hint 1</summary>

Rules 1 and 2 already shape the loop: which tokens do you give `hasher`, and what ends the walk? Write that
much first, without validation, and see which checker case fails.
</details>
<details><summary>Hint 2</summary>

Rule 3 compares what the entry stores with what *this* prompt has at that block. One of the two comparisons
needs something from the previous iteration: what must you remember as you walk, and what is it before the first
block?
</details>
<details><summary>Hint 3</summary>

If your matcher never hits, not even a prompt that was just cached, print both sides of your token comparison:
`entry.tokens` is a tuple, a slice of `token_ids` is a list, and a tuple never equals a list.
</details>
<details><summary>Hint 4</summary>

After you pass: compare with the engine's `HashIndex._lookup` and `_walk` (`minivllm/kv/prefix/hash_index.py`), which
also check the namespace.
</details>
"""),
("code", r"""
def match_prefix(token_ids: list[int], index: dict, block_size: int, hasher, salt: str | None = None) -> list[int]:
    '''Block ids of the longest validated, cached, block-aligned prefix of token_ids[:-1].'''
    # TODO: block ids of the longest validated cached prefix -- see the hints above
    ### BEGIN SOLUTION
    out, parent = [], None
    for i, key in enumerate(hasher(token_ids[:-1], block_size, salt)):
        entry = index.get(key)
        if entry is None or entry.tokens != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break
        if entry.parent != parent:
            break
        out.append(entry.block_id)
        parent = key
    return out
    ### END SOLUTION
""", ["exercise:match_prefix"]),
("code", r"""
match_check = check_match_prefix(match_prefix)


def yours_or_engine(pool, hasher=None, picker=None):
    # your hash index once exercises 1 and 2 pass; until then the engine's HashIndex (minivllm/kv/prefix/hash_index.py)
    if hash_check and match_check:
        return LearnerHashCache(pool, BLOCK, hasher or block_hashes, match_prefix, picker)
    return HashIndex(pool, BLOCK)


print("section 2 replays", "your functions" if hash_check and match_check else "the engine's HashIndex")
"""),
("md", r"""
## 2. Hit rates on four workloads

`LearnerHashCache` assembles your two functions into a prefix cache with the engine's methods (`match`, `insert`,
`evict`). Each workload is replayed the way the engine admits requests: look up, take references on the hits,
allocate the rest, insert the full blocks, finish. The hit rate is counted in tokens: hit tokens over the tokens
a lookup can match, each prompt less its last token. (vLLM's `prefix_cache_hits / prefix_cache_queries`, and the
engine's `prefix_cache_hit_rate`, divide by the whole prompt, so they read a little lower.)

* **system prompt**: 40 requests = one 256-token system prompt + a short question;
* **multi-turn**: 8 chats × 5 turns, each turn's prompt = the whole history so far (interleaved);
* **RAG**: instruction + 3 retrieved documents (popular ones repeat, in varying order) + question;
* **agent**: 4 agents × 6 sequential calls sharing a 384-token system prompt (instructions and tool definitions);
  each call's prompt = the previous call's prompt + the model's tool call + the tool's result (interleaved);
* **unique prompts**: 40 one-off prompts that share nothing — the baseline.
"""),
("code", r"""
WORKLOADS = {"system prompt": workloads.system_prompt_workload(40),
             "multi-turn": workloads.multi_turn_workload(8, 5),
             "RAG": workloads.rag_workload(40),
             "agent": workloads.agent_workload(4, 6),
             "unique": [p for p, _ in workloads.random_requests(40, seed=3, prompt_range=(64, 400))]}
MINE = "yours (hash index)" if hash_check and match_check else "engine, for yours"   # who fills row 1
CACHES = {MINE: yours_or_engine,
          "engine HashIndex": lambda pool: HashIndex(pool, BLOCK),
          "engine RadixCache": lambda pool: RadixCache(pool, BLOCK)}
print(f"{'':20s}" + "".join(f"{w:>15s}" for w in WORKLOADS))
for cname, make in CACHES.items():
    rates = []
    for prompts in WORKLOADS.values():
        pool = BlockPool(1024)
        rates.append(workloads.hit_rate(workloads.replay_prefix_cache(make(pool), pool, prompts)))
    print(f"{cname:20s}" + "".join(f"{r:15.1%}" for r in rates))
"""),
("md", r"""
Same numbers for all three: they cache the same blocks; they differ in *how* they find them. The system prompt
hits most (everybody shares 256 tokens); multi-turn hits the history; RAG only hits where the same documents come in
the same order. The agent hits nearly as much as the system prompt, for another reason: besides the shared system prompt,
each call re-sends the whole run so far, a moment after the last call cached it. Unique prompts hit **0 %**: a block's key covers every token before it, so nothing is shared, and
turning the cache on only adds lookup and bookkeeping. Measure your own traffic before expecting a win.

Why not 100 % for the system prompt? The first request has nothing to hit, and every request's question is new,
so its tokens are always computed. (Had the system prompt been, say, 250 tokens, its last 10 tokens would share a
block with the question: that block differs per request, so those 10 tokens would miss too. Here 256 = 16 × 16
blocks, so the system prompt ends exactly on a block boundary and all of it hits.)

An agent's prompt grows with every call, but what it computes per call does not: only the new tool call and
result, plus the tokens of the previous prompt's last, partly filled block. So its hit rate climbs as the run goes on
(not strictly: a long tool result adds more new tokens):
"""),
("code", r"""
calls = workloads.agent_workload(4, 6)
pool = BlockPool(1024)
records = workloads.replay_prefix_cache(RadixCache(pool, BLOCK), pool, calls)
for k in range(6):                        # calls are interleaved: the k-th call of each of the 4 agents
    batch = records[4 * k:4 * k + 4]
    computed = sum(r["prompt_tokens"] - r["hit_tokens"] for r in batch) / 4
    print(f"call {k + 1}: prompt {sum(r['prompt_tokens'] for r in batch) / 4:6.0f} tokens, "
          f"computed {computed:4.0f}, hit rate {workloads.hit_rate(batch):5.1%}")
"""),
("md", r"""
The first call pays for the task (and, for the first agent, the system prompt); every later call computes about
the same hundred-odd tokens while its prompt keeps growing. Without a cache each call would prefill the whole run
again, so an agent's total prefill grows with the square of its number of calls; with one, linearly.

## 3. The radix tree, step by step

A radix tree stores each shared beginning once. Below, three chats that share a 48-token system prompt send their
turns one per step.
Watch edges split when a new turn leaves an old edge, and the path of the request currently running outlined in red
(**locked**: its blocks have refcount > 1, eviction must skip them).
"""),
("code", r"""
pool = BlockPool(256)
tree = RadixCache(pool, BLOCK)
replay = workloads.PrefixReplay(tree, pool, workloads.shared_system_chats(3, 3, seed=2))
for _ in range(5):
    replay.step()
widgets.draw_radix_tree(tree, title="radix tree after 5 requests (red = locked by the running request)")
plt.show()
print(widgets.describe_radix_tree(tree))
print("hits per request (tokens):", [r["hit_tokens"] for r in replay.records])
"""),
("md", r"""
Click **next step** to send the next turn. The widget replays the same chats on its own tree, from the same five
requests, so the cells below (which finish `replay`) cannot run it ahead of you.
"""),
("code", r"""
def chat_replay(steps):
    pool = BlockPool(256)
    replay = workloads.PrefixReplay(RadixCache(pool, BLOCK), pool, workloads.shared_system_chats(3, 3, seed=2))
    for _ in range(steps):
        replay.step()
    return replay


stepper = widgets.Stepper(chat_replay(5), draw=lambda r, ax: widgets.draw_radix_tree(r.cache, ax=ax),
                          describe=lambda r: str(r.records[-1]), figsize=(11, 3.5))
stepper.show()
"""),
("code", r"""
walk = widgets.Stepper(replay, draw=None, describe=lambda r: str(r.records[-1]))   # text only, on `replay`
print(walk.step(10_000))          # "no work left": no prompt is left to send, but the last one is still running
evicted = tree.evict(10_000)     # evict everything evictable: the locked path survives
print(f"evicted {evicted} blocks; {tree.num_cached_blocks} stay cached, locked by request "
      f"{replay.records[-1]['request']}, which the replay finishes only when it sends another prompt")
print(widgets.describe_radix_tree(tree))
"""),
("md", r"""
## ✏️ Exercise 3 — what to evict

When the pool runs dry the cache frees blocks nobody uses. `pick_victim(nodes)` gets one dict per cached entry —
`{"id", "last_access", "locks", "children"}` — and returns the id to evict, or `None`:

* never a **locked** entry (`locks > 0`: a running request reads it — evicting it would corrupt that request);
* only **leaves** (`children == 0`): a cached block without its prefix is useless;
* among those, the **least recently used** (smallest `last_access`); ties to the first listed.

The last checker case runs your function inside `LearnerHashCache` on a 32-block pool and compares every hit with
the engine's `HashIndex`.

<details><summary>Hint 1</summary>

First filter, then choose: which entries may go at all? Then, among those, which one?
</details>
<details><summary>Hint 2</summary>

Choosing "the smallest by one field" is a job Python's built-ins already do; look for one that can compare the dicts
by a field you name, and check what it does with ties.
</details>
<details><summary>Hint 3</summary>

What if the filter leaves nothing (every entry locked, or none a leaf)? Decide what your function returns then,
and make sure the choosing step never sees an empty list.
</details>
"""),
("code", r"""
def pick_victim(nodes: list[dict]):
    '''Id of the least recently used unlocked leaf, or None when nothing may be evicted.'''
    # TODO: the id of the entry to evict, or None -- see the rules and hints above
    ### BEGIN SOLUTION
    candidates = [n for n in nodes if n["locks"] == 0 and n["children"] == 0]
    if not candidates:
        return None
    return min(candidates, key=lambda n: n["last_access"])["id"]
    ### END SOLUTION
""", ["exercise:pick_victim"]),
("code", r"""
victim_check = check_pick_victim(pick_victim)
picker = pick_victim if victim_check else None   # None: your cache never evicts until this passes (pools are big)
"""),
("md", r"""
### Quotas: one noisy tenant must not flush another's cache

Alice sends requests with a shared 128-token system prompt; between two of hers, Bob sends 8 long one-off prompts.
On a 64-block pool, plain LRU lets Bob's never-reused blocks push Alice's system prompt out. A per-namespace quota
(`quota_blocks`: at most that many cached blocks per tenant; over it, a tenant evicts *its own* LRU blocks first)
keeps Bob's churn inside Bob's share.
"""),
("code", r"""
import random

rng = random.Random(1)
prompts, tenants = [], []
for alice_prompt in workloads.system_prompt_workload(20, seed=2, system_len=128):
    prompts.append(alice_prompt); tenants.append("alice")
    for _ in range(8):
        prompts.append([rng.randrange(10, 900) for _ in range(rng.randint(100, 200))]); tenants.append("bob")

for quota in (None, 24):
    pool = BlockPool(64)
    cache = RadixCache(pool, BLOCK, quota_blocks=quota)
    recs = workloads.replay_prefix_cache(cache, pool, prompts, namespaces=tenants)
    alice = [r for r, t in zip(recs, tenants) if t == "alice"]
    print(f"quota {str(quota):>4s}: Alice's hit rate {workloads.hit_rate(alice):6.1%}, "
          f"evictions {cache.stats.evicted_blocks} (by quota: {cache.stats.quota_evictions})")
"""),
("md", r"""
### Stale entries and invalidation

A cache entry is a promise: *block b holds the KV of these tokens after this prefix*. It goes **stale** if block b
is reused for other tokens while the entry still points at it — a lookup would then serve garbage. minivllm makes
that impossible by ownership rather than by checks: the cache holds its own reference on every block it indexes
(so nobody can allocate it), and eviction **removes the entry first, then drops the reference**. Watch it on the
engine's `HashIndex`:
"""),
("code", r"""
pool = BlockPool(8)
cache = HashIndex(pool, BLOCK)
doc = list(range(100, 164))                        # 4 full blocks of tokens
blocks = [pool.allocate() for _ in range(4)]       # a request computes their KV into 4 blocks
cache.insert(doc, blocks)                          # the cache takes its own reference on each
for b in blocks:
    pool.decref(b)                                 # the request finishes
print("cached:", cache.match(doc), "refcounts", [pool.refcount(b) for b in blocks], "| free blocks:", pool.num_free)
print("evicted", cache.evict(8), "blocks | free blocks:", pool.num_free)
reused = [pool.allocate() for _ in range(pool.num_free)]   # every block now belongs to someone else
print("blocks reused by others:", sorted(reused), "| lookup of the same tokens now:", cache.match(doc))
"""),
("md", r"""
The other source of staleness is a change of *what the KV means*: new model weights, another dtype or RoPE
scaling. The key does not include those, so a serving stack invalidates the whole cache on such a change (in
minivllm a cache lives and dies with its engine). Hash collisions, the last way to serve the wrong KV, are next.

## 4. Validation: what a hash collision would do

Make collisions common on purpose with a hash of only 3 bits (8 possible keys). Your validated matcher turns
a collision into a miss; a matcher that trusts the key would hand a request **blocks computed for other tokens** —
the model would silently attend to someone else's text.
"""),
("code", r"""
def weak(token_ids, block_size, salt=None):
    '''A deliberately awful hash: 3 bits of (block index + sum of the block's tokens).'''
    n = len(token_ids) // block_size
    return [(i + sum(token_ids[i * block_size:(i + 1) * block_size])) % 8 for i in range(n)]


def trusting_match(token_ids, index, block_size, hasher, salt=None):   # no validation: do not do this
    out = []
    for key in hasher(token_ids[:-1], block_size, salt):
        if key not in index:
            break
        out.append(index[key].block_id)
    return out


def stored_tokens(cache, block_id):
    # the tokens a cached block was computed for (your cache's index, or the engine's HashIndex)
    if isinstance(cache, HashIndex):
        return cache._entry_of_block[block_id].token_ids
    return next(e.tokens for e in cache.index.values() if e.block_id == block_id)


def weak_engine_hash(key):   # the same 3 bits for the engine's HashIndex, whose hash_fn sees (parent, tokens, salt)
    return hash(key) % 8


prompts = workloads.rag_workload(40, seed=3)
# The namespace the replay's requests cache under: the engine's (tenant, cache salt), tenant "default", no salt
# (KVCacheManager.namespace). The engine's HashIndex hashes and validates it, so a lookup must name it too.
NAMESPACE = ("default", None)
validated = (("validated (yours)", lambda pool: LearnerHashCache(pool, BLOCK, weak, match_prefix, picker))
             if match_check else ("validated (engine)", lambda pool: HashIndex(pool, BLOCK, hash_fn=weak_engine_hash)))
for name, make in [validated, ("trusting", lambda pool: LearnerHashCache(pool, BLOCK, weak, trusting_match, picker))]:
    pool = BlockPool(1024)
    cache = make(pool)
    wrong = served = 0
    for p in prompts:
        for i, b in enumerate(cache.match(p[:-1], NAMESPACE)):
            served += 1
            wrong += stored_tokens(cache, b) != tuple(p[i * BLOCK:(i + 1) * BLOCK])
        workloads.replay_prefix_cache(cache, pool, [p])
    print(f"{name:18s}: {served:4d} blocks served from cache, {wrong:4d} of them hold OTHER tokens' KV")
"""),
("md", r"""
The engine's `HashIndex` validates the same way (tokens, namespace and parent) and defaults to Python's 64-bit
`hash`; `sha256_block_hash` is the collision-resistant option when keys must be stable across processes.

## 5. Measured on the real engine: TTFT of a hit vs a miss

Everything so far used a cost model. Now the real engine with the bundled SmolLM2-135M and
`LLM(enable_prefix_caching=True)`: a 256-token "system prompt" plus a 16-token question is sent once to fill the
cache; then the same system prompt with new questions (hits) and prompts of the same length that share nothing
(misses). Wall-clock numbers vary from machine to machine; the ratio is the lesson.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
import random

from minivllm import LLM, SamplingParams

llm = LLM(enable_prefix_caching=True, max_model_len=1024, num_gpu_blocks_override=128)
rng = random.Random(0)
system_prompt = [rng.randrange(100, 5000) for _ in range(256)]
once = SamplingParams(temperature=0, max_tokens=1)
tokens = lambda n: [rng.randrange(100, 5000) for _ in range(n)]
llm.generate([{"prompt_token_ids": tokens(64)}], once)      # warm-up: the first call pays one-off costs
llm.generate([{"prompt_token_ids": system_prompt + tokens(16)}], once)   # the first request: a miss that fills the cache
trials = {"hit:  same system prompt, new question": lambda: system_prompt + tokens(16),
          "miss: a prompt that shares nothing    ": lambda: tokens(272)}
runs = {label: [] for label in trials}
for _ in range(5):              # hits and misses take turns, so a busy moment slows both alike; best of 5 each
    for label, make in trials.items():
        runs[label].append(llm.generate([{"prompt_token_ids": make()}], once)[0])
for label, outs in runs.items():
    best = min(outs, key=lambda o: o.metrics.ttft)
    print(f"{label}: 272 prompt tokens, {best.num_cached_tokens:3d} from the cache, "
          f"TTFT {best.metrics.ttft * 1000:6.1f} ms")
"""),
("md", r"""
The hit computes only the 16 new tokens, not the 256 cached ones, so its TTFT is a fraction of a miss's. A miss
with the cache on should cost about what it would with caching off (not measured here): the lookup (here the
engine's default radix tree, `prefix_cache="radix"`: a walk down its edges, one tuple comparison per block) costs
microseconds beside a 272-token prefill.

At Lesson 06's scale — its 3,000-token system prompt from section 1 — the same arithmetic on a datacenter GPU: the roofline
simulator with Llama-3-8B on the H100 preset (`minivllm.labs.at_scale`; simulated, nothing ran on an H100). A
request's first step with and without the cached prefix, and what the cache saves the GPU at 20 such requests a
second:
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
SYSTEM, QUESTION = 3000, 16
cached = SYSTEM // BLOCK * BLOCK                      # only full blocks are shared
miss = at_scale.step_s([(0, SYSTEM + QUESTION, True)])
hit = at_scale.step_s([(cached, SYSTEM + QUESTION - cached, True)])
print(f"miss: prefill all {SYSTEM + QUESTION} tokens          -> {miss * 1000:5.1f} ms to the first token")
print(f"hit:  {cached} from the cache, prefill {SYSTEM + QUESTION - cached} -> {hit * 1000:5.1f} ms to the first token")
print(f"at 20 requests/s the cache saves {20 * (miss - hit):.2f} GPU-seconds per second: without it, this prompt "
      f"alone would need {20 * miss:.1f} GPUs' worth of prefill, with it {20 * hit:.2f}")
"""),
("md", r"""
Simulated on the H100 preset: ~67 ms against ~8 ms to the first token, and without the cache the repeated system
prompt alone would keep more than one GPU busy at 20 requests a second. With the cache, the first request pays
for the 3,000 tokens and every later one reuses its blocks.

## 6. The cross-tenant timing leak, and the salt

A shared prefix cache is a side channel. Alice asks a question that starts with the service's system prompt and
continues with something private. Bob, another tenant, guesses continuations and measures his own **TTFT**: a
guess that matches what Alice sent hits her cached blocks and comes back faster. This is the attack of
arXiv 2411.18191, reported against vLLM as **CVE-2025-46570**.

The fix: a per-tenant **`cache_salt`** mixed into the first block's hash (exactly your `salt` argument), set by a
*trusted gateway* from the authenticated tenant — never by the client, or Bob could simply send Alice's salt.
Different salts never share blocks. TTFT here is the engine's simulated cost model
(`10 ms + 0.4 ms per uncached prompt token`).
"""),
("code", r"""
rng = random.Random(7)
system = [rng.randrange(10, 900) for _ in range(64)]
candidates = {f"guess {i}": [rng.randrange(10, 900) for _ in range(48)] for i in range(8)}
secret = "guess 5"                                    # what Alice really asked


def attack(salted: bool):
    pool = BlockPool(256)
    cache = yours_or_engine(pool, picker=picker)      # your hashing and matching (or the engine's HashIndex)
    ns = (lambda tenant: tenant) if salted else (lambda tenant: "")
    workloads.replay_prefix_cache(cache, pool, [system + candidates[secret] + [5, 6, 7]], namespaces=[ns("alice")])
    warm_up = system + [rng.randrange(10, 900) for _ in range(48)] + [5, 6, 7]   # Bob warms his own system prompt
    workloads.replay_prefix_cache(cache, pool, [warm_up], namespaces=[ns("bob")])
    ttft = {}
    for name, guess in candidates.items():            # Bob probes each guess
        rec = workloads.replay_prefix_cache(cache, pool, [system + guess + [5, 6, 7]], namespaces=[ns("bob")])[0]
        ttft[name] = rec["ttft"]
    return ttft


fig, axes = plt.subplots(1, 2, figsize=(11, 2.6), sharey=True)
for ax, salted in zip(axes, (False, True)):
    ttft = attack(salted)
    ax.bar(list(ttft), [1000 * t for t in ttft.values()],
           color=["#d62728" if n == secret else "#4e79a7" for n in ttft])
    ax.set_title("per-tenant salt: nothing to see" if salted else "shared cache: the secret stands out", fontsize=10)
    ax.tick_params(axis="x", labelsize=7, rotation=45)
    others = [t for n, t in ttft.items() if n != secret]
    print(f"{'salted' if salted else 'shared'}: TTFT of the secret guess {1000 * ttft[secret]:.1f} ms, "
          f"of the other guesses {1000 * min(others):.1f}-{1000 * max(others):.1f} ms")
axes[0].set_ylabel("Bob's TTFT (ms)")
plt.show()
"""),
("md", r"""
Note what the salt costs: the system prompt Alice and Bob share is no longer shared across them either (each
tenant warms its own copy). Per-tenant salts trade some hit rate for isolation; a provider can still share a public
prefix deliberately, in a namespace where leaking "someone sent the system prompt" reveals nothing.

## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
The last two questions come back from labs 2 and 1.
"""),
("code", r"""
show_quiz(3)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(3)
"""),
("code", r"""
print_answers(3)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Why a shared prefix's KV can be reused (a token's KV depends only on it and the tokens before it), why only full
  blocks are cached, and why even a fully cached prompt recomputes its last token.
* How a chained block hash identifies a whole prefix, where the salt enters, and how a radix tree finds the same
  blocks by walking edges instead.
* Which workloads hit (system prompts, multi-turn, agents, RAG in a stable order) and which do not (unique
  prompts: 0 %), and why an agent's hit rate climbs with every call.
* What a hit saves (prefill of the cached tokens: TTFT, measured on the real engine) and what it does not (queueing,
  decode).
* Why eviction takes unlocked leaves in LRU order, how a quota keeps one tenant from flushing another, and why an
  entry cannot go stale in minivllm (the cache's own reference; entry removed before the block is freed).
* Why every hit is validated (collisions cost a miss, never wrong output), and how a shared cache leaks across
  tenants through TTFT unless a trusted gateway sets a per-tenant `cache_salt`.

## Go further

LRU treats a block used once like a block used a thousand times. Write an eviction rule that also weighs how often
an entry was hit (count hits per key in a subclass of `LearnerHashCache`), for example LFU with ageing or "LRU among
entries hit at most once". Replay the quota workload and a mix of the system-prompt and RAG workloads on a pool
small enough to evict (64 blocks), and compare hit rates with plain LRU. When does your rule lose? (Think of a
popular prefix that suddenly falls out of use.)

**What does caching cost the engine per step?** A decoding request fills a block every `block_size` tokens, and the
engine offers it to the cache. If each offer inserts the request's whole prefix again (copy the tokens, cut them into
blocks, walk from the root), a request of `n` tokens pays `O(n)` per block, `O(n^2)` over its life. Measure it:
`python -m minivllm.bench host_overhead --sweep 16,300,600,900 --prefix-cache radix` (then `hash`, and `off`).
Read `PrefixCache.extend` in `minivllm/interfaces.py` and the two implementations: what lets a cache skip the walk,
and when must it fall back to `insert`? LRU seems to need every ancestor of the new block stamped with the time, which
is a walk again; the hash index stamps only the parent. Why is its eviction order still exact? (Which entries does
eviction ever read a time from, and when does an inner entry become one of them?) `tests/test_prefix_extend.py` shows
how to check such a shortcut: run the engine with and without it and compare the whole cache after every step.
"""),
]
