CELLS = [
("md", r"""
# Lab 2 — The paged KV cache

**Goals.** After this lab you can

1. write the block pool every KV cache allocation goes through (free list + reference counts) and run the real engine on it;
2. map any token to its physical KV slot through a block table (*slot mapping*);
3. measure how much memory max-length reservation wastes compared with paging, and pick a block size;
4. explain copy-on-write: how two sequences share blocks safely.

**Time:** 6 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 30–60 minutes to work through.
Exercises are marked ✏️: fill in the function, run the checker below it. Stuck? Later cells use the engine's own
implementation until your checker passes, so you can keep going.
"""),
("code", r"""
import matplotlib.pyplot as plt
import torch

from minivllm import SamplingParams
from minivllm.kv.block_pool import BlockPool, OutOfBlocksError
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.labs import choose, widgets, workloads
from minivllm.labs.check_lab02 import as_engine_pool, check_block_pool, check_paged_slots, check_slot_mapping, install_pool
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.request import Request

ON_GPU = torch.cuda.is_available()  # the real-model cell uses the GPU when there is one
%matplotlib inline
""", ["setup"]),
("md", r"""
## 1. The picture: KV memory as pages

Every token a request has seen leaves a key and a value vector in every layer: the **KV cache**. It grows by one
token per decode step, and nobody knows in advance how long a request will run. Early servers reserved one
contiguous region of `max_model_len` tokens per request — most of it never used.

A paged KV cache cuts memory into **blocks** of `block_size` tokens (the operating-system idea of pages). Each request
keeps a **block table**: logical block *i* of the request lives in physical block `table[i]`, anywhere in the pool.

```
request A (10 tokens, block_size 4)        physical block pool
 logical block:   0     1     2             ┌────┬────┬────┬────┬────┬────┐
 tokens:        0..3  4..7  8,9             │ A0 │    │ B0 │ A1 │ A2 │    │ ...
 block table:  [ 0  ,  3  ,  4 ]  ───────►  └────┴────┴────┴────┴────┴────┘
                                              0    1    2    3    4    5
```

A request holds whole blocks, only as many as its tokens need (`ceil(tokens / block_size)`), so the only waste is
the unused tail of its last block. The same picture drawn from a real engine state (by `tools/make_figures.py`):

![block tables of three running requests and the pool they map into](../figures/block_table.png)

All blocks come from one **block pool**: a free list and a reference count per block. Why counts? A block can sit
in several block tables at once (two samples of one prompt, or many requests sharing a cached system prompt);
it may only return to the free list when its last holder lets go.
"""),
("md", r"""
## ✏️ Exercise 1 — the block pool

Write `MyBlockPool(num_blocks)` with five members. The engine will run on it (cell after the checker), so the rules
are the engine's:

| member | rule |
|---|---|
| `num_free` | number of blocks on the free list (a property) |
| `refcount(b)` | holders of block `b` (0 = free) |
| `allocate()` | take the block at the **front** of the free list, count 1; `OutOfBlocksError` if none |
| `incref(b)` | one more holder; `ValueError` if `b` is free |
| `decref(b)` | one holder fewer; `ValueError` if already free (double free); at 0 the block goes to the **back** of the free list and `decref` returns `True`, else `False` |

<details><summary>Hint 1</summary>

Two pieces of state: the free list, whose *order* matters (blocks leave at the front and return at the back), and
one count per block. A count of 0 and "on the free list" must always agree.
</details>
<details><summary>Hint 2</summary>

`collections.deque` takes from the front (`popleft()`) and adds at the back (`append()`) in constant time; a
list's `pop(0)` shifts every element.
</details>
<details><summary>Hint 3</summary>

`incref` and `decref` both look at the count *before* changing it: 0 means the block is free, and touching a free
block is the caller's bug, so refuse it. `decref`'s return value answers "did this drop free the block?".
</details>

**Why FIFO?** Not for caching. (vLLM's free queue doubles as its prefix cache's LRU list, so there a freed block
keeps its KV and the order decides what is forgotten first.) In minivllm the prefix cache holds its **own**
reference on every block it indexes, so a block on the free list is never cached and its contents are garbage:
any order would be correct. FIFO is an arbitrary but **deterministic** choice, and that is what it buys: the block
ids the engine hands out are a pure function of the allocate/free history, so runs, step logs and pictures are
reproducible, and the checker can run the engine on your pool and compare it with the engine's own, step by step.
"""),
("code", r"""
from collections import deque


class MyBlockPool:
    '''A fixed set of KV blocks: a FIFO free list and a reference count per block.'''

    def __init__(self, num_blocks: int):
        # TODO: a free list holding 0 .. num_blocks-1 in order, and a count of 0 per block
        ### BEGIN SOLUTION
        self.free = deque(range(num_blocks))
        self.counts = [0] * num_blocks
        ### END SOLUTION

    @property
    def num_free(self) -> int:
        # TODO: the length of the free list
        ### BEGIN SOLUTION
        return len(self.free)
        ### END SOLUTION

    def refcount(self, block_id: int) -> int:
        # TODO: the count of block_id
        ### BEGIN SOLUTION
        return self.counts[block_id]
        ### END SOLUTION

    def allocate(self) -> int:
        # TODO: pop the FRONT of the free list, set its count to 1, return it;
        #   OutOfBlocksError when the free list is empty
        ### BEGIN SOLUTION
        if not self.free:
            raise OutOfBlocksError("no free KV blocks")
        block_id = self.free.popleft()
        self.counts[block_id] = 1
        return block_id
        ### END SOLUTION

    def incref(self, block_id: int) -> None:
        # TODO: add a holder; raise ValueError if the block is free
        ### BEGIN SOLUTION
        if self.counts[block_id] <= 0:
            raise ValueError(f"incref on free block {block_id}")
        self.counts[block_id] += 1
        ### END SOLUTION

    def decref(self, block_id: int) -> bool:
        # TODO: drop a holder (ValueError if the block is already free); when the count reaches 0,
        #   append the block to the BACK of the free list and return True; otherwise return False
        ### BEGIN SOLUTION
        if self.counts[block_id] <= 0:
            raise ValueError(f"decref on free block {block_id} (double free)")
        self.counts[block_id] -= 1
        if self.counts[block_id] == 0:
            self.free.append(block_id)
            return True
        return False
        ### END SOLUTION
""", ["exercise:block_pool"]),
("code", r"""
pool_check = check_block_pool(MyBlockPool)
Pool = choose(pool_check, MyBlockPool, BlockPool, "block pool")
"""),
("md", r"""
## 2. Watch the engine allocate

The engine below is the real `LLMEngine` — scheduler, KV cache manager, preemption — running on **your** pool
(`install_pool`). Only the forward pass is simulated (`SimulatedExecutor`, a virtual clock), so it is instant.
Five requests, a 48-block pool of 4-token blocks, at most 4 running at once, 24 tokens per step.

Each colour is one request's block table. Watch tables grow one block at a time as decode crosses block
boundaries, and blocks return to the pool when a request finishes.
"""),
("code", r"""
def small_engine(pool_cls, num_blocks=48):
    engine = workloads.sim_engine(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=24, model_max_len=96)
    install_pool(engine, as_engine_pool(pool_cls, num_blocks))
    requests = workloads.random_requests(5, seed=7, prompt_range=(6, 30), output_range=(4, 20))
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}")
    return engine, {f"r{i}": len(p) for i, (p, _) in enumerate(requests)}


engine, prompt_lens = small_engine(Pool)
for _ in range(3):
    engine.step()
widgets.draw_block_pool(engine.pool, widgets.block_owners(engine), title="after 3 steps")
plt.show()
print(widgets.describe_block_pool(engine.pool, widgets.block_owners(engine)))
"""),
("md", r"""
Step through the rest yourself (in Jupyter the buttons redraw the pool; elsewhere you see the current state). The
widget steps its own engine, built like `engine` and at the same step, so the cells below cannot run it ahead of you.
"""),
("code", r"""
def pool_stepper(engine):
    return widgets.Stepper(engine, draw=lambda e, ax: widgets.draw_block_pool(e.pool, widgets.block_owners(e), ax=ax),
                           describe=lambda e: widgets.describe_step(e.step_log[-1], prompt_lens))


stepper = pool_stepper(small_engine(Pool)[0])   # the widget's own engine ...
stepper.step(3)                                  # ... at the step `engine` is at
stepper.show()
"""),
("code", r"""
walk = pool_stepper(engine)          # the same thing without buttons, on `engine`
print(walk.step(5))                  # five more steps
rest = walk.step(10_000).splitlines()
print(f"... {len(rest) - 1} more steps to the end")
print("free blocks at the end:", engine.pool.num_free, "of", engine.pool.num_blocks)
"""),
("md", r"""
## 3. Sharing and copy-on-write

Two samples of one prompt (or two requests with a cached prefix) can point at the *same* physical blocks: the
prompt's KV is identical, so it is computed and stored once. `KVCacheManager.fork` does that by `incref`-ing the
parent's prompt blocks: all those that hold the first `prompt_len - 1` tokens, since the child recomputes the last
prompt token to get its own logits. The picture shows refcounts `×2`.

The catch is the last, partly filled block: both samples want to write their *own* next token into it. Before a
request writes into a block someone else holds, the manager **copies** it into a private block
(`copy_on_write`) and asks the executor to copy the KV contents. Full blocks are never written again, so they stay
shared forever.
"""),
("code", r"""
kv = KVCacheManager(as_engine_pool(Pool, 12), block_size=4)
parent = Request("parent", list(range(10, 20)), SamplingParams(), 0.0)   # 10 tokens = 2.5 blocks
assert kv.allocate_slots(parent, 10)
parent.num_computed_tokens = 10
child = Request("child", list(range(10, 20)), SamplingParams(), 0.0)
kv.fork(parent, child)

fig, axes = plt.subplots(1, 2, figsize=(11, 1.8))
widgets.draw_block_pool(kv.pool, {"parent": parent.block_ids, "child": child.block_ids}, cols=12, ax=axes[0],
                        title="after fork: 3 shared blocks")
# fork left the child's last prompt token (position 9) uncomputed, so the child gets its own logits from it; its
# KV lands in the shared, partly filled last block, so making room for that one token copies the block first
assert kv.allocate_slots(child, 1)
widgets.draw_block_pool(kv.pool, {"parent": parent.block_ids, "child": child.block_ids}, cols=12, ax=axes[1],
                        title="child writes: last block copied")
plt.show()
print("parent table:", parent.block_ids, " child table:", child.block_ids)
print("copies the executor must do (src, dst):", kv.take_block_moves().copies)
"""),
("md", r"""
## ✏️ Exercise 2 — slot mapping

The attention kernel writes each new token's K and V into one **slot** of the flat cache: slot
`= physical_block * block_size + offset`. Given a request's block table, the position of its first new token
(`start`) and how many tokens it runs this step, return the slot of every one of them.

This is exactly what the model runner computes for every step (`minivllm/model/runner.py`); the last checker case
compares your function with it on a real batch.

<details><summary>Hint 1</summary>

Work one position `p` at a time, for `p` from `start` to `start + num_tokens - 1`. Two questions per position:
which *logical* block of the request holds it, and where inside that block it sits.
</details>
<details><summary>Hint 2</summary>

Watch the units. A position counts tokens of *this request*; the block table is indexed by blocks of this request;
a slot counts tokens of the *whole pool*. Going from a position to a logical block is a change from tokens to whole
blocks: which integer operation does that, and which one gives what is left over? Only the block table knows
which physical block a logical one is.
</details>
<details><summary>Hint 3</summary>

A worked example (not a checker case): `block_size` 4, block table `[3, 8]`, positions 5 and 6. Position 5 lies in
the request's second block (its positions 4–7), one token in. That block is physical block 8, which owns slots
32–35 of the pool, so position 5 is slot 33 and position 6 is slot 34.
</details>
"""),
("code", r"""
def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    '''Physical KV slot of positions start .. start+num_tokens-1 of one request.'''
    # TODO: one slot per position start .. start+num_tokens-1 -- see the hints above
    ### BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]
    ### END SOLUTION
""", ["exercise:slot_mapping"]),
("code", r"""
slot_check = check_slot_mapping(slot_mapping)
"""),
("md", r"""
## 4. Fragmentation: how much reserved memory holds real tokens?

Below: 2,000 request lengths (prompt + output) with the long tail of chat traffic — median ~330 tokens, a few
up to `max_model_len` = 2048. A server that reserves a contiguous `max_model_len` region per request keeps only a
small fraction of that memory as real KV state. The PagedAttention paper measured **20.4–38.2 %** for earlier
systems; paging wastes only the tail of each request's last block.

## ✏️ Exercise 3 — slots reserved with paging

`paged_slots(seq_lens, block_size)`: the total number of KV slots (tokens of capacity) that paging reserves for
these sequences — each gets whole blocks, as few as hold its tokens.

<details><summary>Hint 1</summary>

Per sequence, two numbers matter: how many blocks it holds and how many slots a block has. A 1-token sequence
still holds one whole block; a sequence of exactly `block_size` tokens holds one, not two.
</details>
<details><summary>Hint 2</summary>

Count blocks first, then turn blocks into slots. Plain `//` rounds *down*: for which lengths does it count one
block too few? Try lengths `block_size - 1`, `block_size` and `block_size + 1` by hand, then find integer
arithmetic (no floats, no `math`) that gets all three right.
</details>
<details><summary>Hint 3</summary>

A worked example (not a checker case): `block_size` 8, lengths `[5, 8, 9, 20]`. 5 tokens hold 1 block, 8 hold 1,
9 hold 2, 20 hold 3: 7 blocks, so 56 slots reserved for 42 tokens.
</details>
"""),
("code", r"""
def paged_slots(seq_lens: list[int], block_size: int) -> int:
    '''KV slots reserved when each sequence holds as few whole blocks as fit its tokens.'''
    # TODO: total slots paging reserves for these sequences -- see the hints above
    ### BEGIN SOLUTION
    return sum(-(-n // block_size) * block_size for n in seq_lens)
    ### END SOLUTION
""", ["exercise:paged_slots"]),
("code", r"""
paged_check = check_paged_slots(paged_slots)
reserved_paged = choose(paged_check, paged_slots, workloads.reserved_slots_paged, "paged_slots")
"""),
("code", r"""
MAX_LEN = 2048
lens = workloads.lengths_sample(2000, seed=0, max_len=MAX_LEN)
tokens = sum(lens)
contiguous = workloads.reserved_slots_contiguous(lens, MAX_LEN)
paged = reserved_paged(lens, 16)
print(f"{len(lens)} requests, {tokens} tokens of real KV state")
print(f"contiguous max-length reservation: {tokens / contiguous:6.1%} of reserved slots hold a token")
print(f"paged, 16-token blocks:            {tokens / paged:6.1%}  (waste {1 - tokens / paged:.1%})")

plt.figure(figsize=(7, 2.4))
plt.hist(lens, bins=64, color="#4e79a7")
plt.axvline(MAX_LEN, color="#d62728", ls="--", label="max_model_len: what contiguous reserves")
plt.xlabel("sequence length (tokens)"); plt.ylabel("requests"); plt.legend(fontsize=8)
plt.show()
"""),
("md", r"""
### Where paging's waste goes: half a block per sequence

Paging wastes only the empty tail of each sequence's last block. If lengths end anywhere, that tail is equally
likely to be 0, 1, ..., `block_size − 1` slots, so the expected waste is about **half a block per sequence**
(`(block_size − 1) / 2`). Measured on the same 2,000 lengths:
"""),
("code", r"""
for b in (4, 16, 64, 256):
    per_seq = (reserved_paged(lens, b) - tokens) / len(lens)
    print(f"block_size {b:3d}: {per_seq:6.1f} empty slots per sequence (half a block = {(b - 1) / 2:5.1f}), "
          f"{1 - tokens / reserved_paged(lens, b):5.1%} of reserved memory")
"""),
("md", r"""
The waste per sequence grows linearly with the block size and does not depend on `max_model_len` at all; as a
share of memory it stays small while sequences are much longer than a block. With thousands of sequences in
flight it adds up — but to blocks, not to whole reservations.

### Measured on the engine: what the waste costs in throughput

Reserving `max_model_len` per request *is* paging with one giant block: `block_size = 2048`. So the same engine can
run both designs on the same KV budget (16,384 token slots) and the same 64 requests. The executor models a GPU:
a fixed 15 ms per step, plus a little per token and (its default `per_context_token_s`) per KV token read, so a
decode step of 30 sequences costs about 2.6 times one of a single sequence while producing 30 tokens (decode is
memory-bound, see lab 1): more requests in the batch means more tokens per second.
"""),
("code", r"""
from minivllm.sim.executor import SimulatedExecutor

requests = workloads.random_requests(64, seed=0, prompt_range=(16, 512), output_range=(16, 256))
KV_SLOTS = 16_384
rows = []
for block_size in (2048, 16):
    eng = workloads.sim_engine(num_blocks=KV_SLOTS // block_size, block_size=block_size, max_num_seqs=64,
                               max_num_batched_tokens=1024, model_max_len=2048,
                               executor=SimulatedExecutor(fixed_overhead_s=0.015, per_token_s=0.00002))
    install_pool(eng, as_engine_pool(Pool, KV_SLOTS // block_size))
    finals = workloads.run_engine(eng, requests)
    batch = sum(e["running"] for e in eng.step_log) / len(eng.step_log)
    rows.append((block_size, workloads.throughput(finals, eng), batch))
    print(f"block_size {block_size:5d}: {rows[-1][1]:7.1f} tokens/s, {batch:5.1f} requests running on average")
print(f"paging serves {rows[1][1] / rows[0][1]:.1f}x the throughput on the same memory")
"""),
("md", r"""
### The block-size trade-off

Small blocks waste less (only the last block's tail), but a request needs more of them: longer block tables, more
entries for the attention kernel to read, more allocator calls. Large blocks approach contiguous reservation.
vLLM's default is 16.
"""),
("code", r"""
sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
waste = [1 - tokens / reserved_paged(lens, b) for b in sizes]
table = [reserved_paged(lens, b) / b / len(lens) for b in sizes]   # your exercise 3: slots / block_size = blocks
fig, ax = plt.subplots(figsize=(7, 2.8))
ax.plot(sizes, [100 * w for w in waste], "o-", color="#d62728", label="memory wasted (%)")
ax.set_xscale("log", base=2); ax.set_xlabel("block_size (tokens)"); ax.set_ylabel("wasted %")
ax2 = ax.twinx()
ax2.plot(sizes, table, "s-", color="#4e79a7", label="blocks per request")
ax2.set_yscale("log"); ax2.set_ylabel("block-table entries")
fig.legend(loc="upper center", fontsize=8, ncol=2)
plt.show()
for b, w, t in zip(sizes, waste, table):
    if b in (1, 16, 256, 2048):
        print(f"block_size {b:5d}: {w:6.1%} wasted, {t:7.1f} blocks per request")
"""),
("md", r"""
### The time side, measured on this machine

Waste and table length can be counted; what a small block costs in time has to be measured. The engine's CPU decode
kernel (`minivllm/model/csrc/paged_decode.c`) reads each sequence's K and V block by block, following the block table.
`paged_decode_step(b)` times one decode step's attention (32 sequences of 1,024 tokens, SmolLM2-135M's heads) with the
same K/V laid out in blocks of `b` tokens. The blocks are scattered over the pool the way a pool that has served for a
while scatters them. Lab 7 times the GPU kernel the same way.

The engine compiles that kernel the first time it is needed (once, then cached). Without a C compiler, `paged_decode_step` falls back to the
engine's torch reference path, which first gathers every block of every sequence into one contiguous copy and then
attends over that copy: it measures the gather, not a kernel walking the table, so its times are several times
higher and need not show the shape described below. The plot's title names the reader that ran.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (times depend on the machine)
from minivllm.labs.check_lab02 import paged_decode_step

TIME_SIZES = [1, 2, 4, 8, 16, 32, 64, 256]
step_ms = {}
for b in TIME_SIZES:
    step_ms[b], _, reader = paged_decode_step(b)
fig, ax = plt.subplots(figsize=(7, 2.8))
ax.plot(TIME_SIZES, [step_ms[b] for b in TIME_SIZES], "o-")
ax.set_xscale("log", base=2); ax.set_xticks(TIME_SIZES, [str(b) for b in TIME_SIZES]); ax.set_ylim(0, None)
ax.set(xlabel="block_size (tokens)", ylabel="ms per step (attention)",
       title=f"one decode step, 32 sequences x 1,024 tokens: {reader}")
plt.show()
for b in (1, 16, 256):
    print(f"block_size {b:4d}: {step_ms[b]:5.2f} ms, {1024 // b:5d} table entries per sequence")
"""),
("md", r"""
Read the curve for its shape. With the C kernel, it falls steeply from 1-token blocks to 16-token ones (several
times faster on a quiet machine), and from 16 on it is roughly flat. The points go up and down by a few milliseconds from one size to the
next and from one run to the next (in one run 4 can come out slower than 2, in another 256 slower than 32): treat
such a bump as noise until a rerun repeats it.

Why the steep part? Attention reads the same bytes at every block size; what changes is how many blocks it reads
them in. The kernel pays a fixed cost per block (read the table entry, find the block, start the reads), so 1,024
one-token blocks per sequence pay it 1,024 times, 16-token blocks 64 times. And a memory prefetcher streams the
next bytes ahead of the reads only while the reads run on in order: a one-token block is a few hundred bytes at a
random place in the pool, so every block starts a fresh miss. Past 16 tokens per block the per-block costs are a
small share of the step, so bigger blocks buy little more time, while the waste in the plot above keeps growing.
That is why 16 is a common default: most of the speed of big blocks, little of their waste.

How to read the noise: these are milliseconds on a CPU that other programs share, and a busy moment can slow every
size, not all of them by the same factor. So compare sizes within one run, as ratios, and rerun the cell before you
believe a bump: the steep rise below 16 comes back every time, a wiggle above 16 need not.
"""),
("md", r"""
## 5. Your pool behind the real model

The same `install_pool` works for the real engine with the bundled SmolLM2-135M: the model's attention reads and
writes exactly the blocks your pool hands out. (On a GPU this runs on CUDA without changes.)
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (generated text and timing depend on the hardware)
from minivllm import LLM

llm = LLM(num_gpu_blocks_override=64, max_model_len=256, block_size=16)
install_pool(llm.engine, as_engine_pool(Pool, 64))
for prompt in ["The capital of France is", "Paging in operating systems means"]:
    llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12))
for _ in range(4):
    llm.engine.step()
owners = widgets.block_owners(llm.engine)
widgets.draw_block_pool(llm.engine.pool, owners, title="the real engine, mid-generation")
plt.show()
texts = {}
while llm.engine.has_unfinished_requests():
    for out in llm.engine.step():
        if out.finished:
            texts[out.request_id] = out.outputs[0].text
print(texts, "| device:", llm.engine.config.device, "| free blocks:", llm.engine.pool.num_free)
"""),
("md", r"""
## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
The last question comes back from lab 1.
"""),
("code", r"""
show_quiz(2)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(2)
"""),
("code", r"""
print_answers(2)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* What problem paging solves (reservation waste and fragmentation) and what it costs (block tables, a gather in the
  attention kernel, a little tail waste).
* The block pool's rules — free list, refcounts, double free — and why a block returns to the free list only when
  its last holder lets go; why the free-list order does not matter for caching in minivllm but makes runs
  reproducible.
* How a token's position becomes a physical slot through the block table.
* Why paging wastes about half a block per sequence, how that grows with `block_size`, and what a bigger block buys
  instead (fewer table entries, fewer allocations, and a faster attention kernel: measured, several times faster
  at 16 tokens than at 1 on this machine's CPU kernel), and how to tell that trend from a shared machine's noise
  (ratios within one run, a rerun before believing a bump).
* Why less waste means more throughput on the same memory (a bigger batch; lab 1's memory-bound decode).
* Copy-on-write: when a shared block must become private, and why full blocks never need to.

## Go further

The block size trades tail waste against table length. Run the throughput experiment of section 4 with
`block_size` 4, 16, 64 and 256 on the same 16,384 KV slots, and add a cost per block-table entry to the simulated
executor (`per_context_token_s` is per token; model a table read as, say, 2 µs per block per sequence per step).
Where is the throughput optimum, and how does it move when requests are short (`output_range=(4, 16)`) or long?
Compare with vLLM's default of 16 and explain the difference you find.
"""),
]
