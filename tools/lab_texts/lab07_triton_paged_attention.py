CELLS = [
("md", r"""
# Lab 7 — Triton paged attention: from the torch oracle to a kernel

**Goals.** After this lab you can

1. follow one decode query through a paged KV cache: logical position → block table → a physical block anywhere in
   the pool → a slot inside it;
2. write the block-table gather in torch (✏️ exercise 1) and build a trustworthy oracle on it;
3. write the inner loop of a Triton decode kernel — load one KV block through the table, fold it into an **online
   softmax** with a running max and a running sum, map query heads to KV heads (GQA) — and prove it correct in
   Triton's CPU interpreter against the oracle (✏️ exercise 2);
4. say why decode attention is **memory-bound**, what "achieved bandwidth" means, and where the block size trades
   memory waste against kernel efficiency;
5. count the operations an eager step launches, measure what issuing one costs, and explain why on a GPU a small
   model's decode step is **launch-bound** until fusion or a CUDA graph takes the host out of the loop.

**Time:** 6 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 60–90 minutes to work through. Triton's interpreter executes kernels in numpy, so
every shape here is tiny; section 4 loads the bundled model. On a machine with a CUDA GPU the same
notebook compiles the kernels and sections 3 and 4 measure them; on a CPU those cells say what they would show and
quote a measurement of the engine's kernel. Exercises are marked ✏️; until your checker passes, later cells use
the engine's own code.
"""),
("code", r"""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: Triton reads it when a kernel is decorated

import time

import triton
import triton.language as tl

from minivllm.labs import choose
from minivllm.labs.check_lab07 import (WalkStepper, check_decode_kernel, check_gather_kv, engine_decode,
                                       engine_gather_kv, kv_bytes, launch_decode, make_big, make_paged,
                                       reference_decode)
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz

DEVICE = "cuda" if ON_GPU else "cpu"
print("kernels run", "compiled on " + torch.cuda.get_device_name() if ON_GPU else "in Triton's CPU interpreter")
""", ["setup"]),
("md", r"""
## 1. The picture: one query walks over scattered blocks

Lab 2 built the paged cache: K and V of each layer are pools of fixed-size blocks,
`[num_blocks, block_size, kv_heads, head_dim]`, and each sequence owns a **block table** — logical block `j` of the
sequence lives in physical block `block_table[j]`. Token `p` is in block `block_table[p // block_size]` at slot
`p % block_size`. Nothing says the blocks are adjacent or in order.

```
 block table of seq 0        the pool (physical blocks)              one decode query of seq 0
 ┌─────────┐                ┌───┬───┬───┬───┬───┬───┬───┬───┐
 │ 0 ->  1 │ ─────────────▶ │   │ ■ │ ■ │ ■ │   │   │   │   │       q · k for every cached token,
 │ 1 ->  3 │ ────────┐      └───┴───┴─▲─┴─▲─┴───┴───┴───┴───┘       softmax, weighted sum of v —
 │ 2 ->  2 │ ──────┐ └────────────────┼───┘                          block 0, then 1, then 2:
 │ 3: pad  │       └──────────────────┘                              the order of the TABLE, not the pool
 └─────────┘   the last block is partly filled: slots past the sequence's length hold garbage (here: NaN)
```

A decode step has **one** new query token per sequence. Its attention reads every cached K and V of that sequence
once and does about one multiply-add per element read, per query head — almost no arithmetic per byte. That makes decode attention
*memory-bound*: a good kernel is one that streams K and V at close to the memory's bandwidth, wherever the blocks
are. Below, the real thing: three sequences (40, 17 and 5 tokens, 16-token blocks) in a pool whose blocks were
handed out in random order. Left: sequence 0's table and where its blocks sit. Right: the scores of one query
against its 40 keys. Click **next block** to walk the query over its blocks the way a kernel does: each click
looks up the next table entry (outlined in red), reads that block's scores (16, or 8 in the partly filled last
block), and updates the running maximum
`m` and the running sum `l` of `exp(score - m)`.
"""),
("code", r"""
demo = make_paged([40, 17, 5], kv_heads=1, group=3, head_dim=16, q_scale=1.5, seed=26)
print("block tables (int32, padded with a spare block):\n", demo["block_tables"])
last_block = int(demo["block_tables"][0, 2])
print("unused slots of seq 0's last block are NaN:", torch.isnan(demo["k_cache"][last_block, 8:]).all().item())
walk = WalkStepper(demo, seq=0)
walk.show()   # in Jupyter: buttons; elsewhere: the picture before the first block
"""),
("md", r"""
The same walk as numbers, block by block:
"""),
("code", r"""
for t in walk.trace:
    print(f"after block {t['block'] + 1}: largest score in the block {t['chunk_max']:5.2f} -> m = {t['max']:5.2f}, "
          f"l = {t['sum']:5.2f}")
"""),
("md", r"""
The running max only ever goes up, and a kernel that reads the keys block by block does not know the true maximum
until the end. Look at `l` after block 3: it *shrank*, although block 3 added 8 positive terms. The third block
raised `m` by about 2.2, so the sum of the first two blocks was re-expressed relative to the new max — multiplied
by `exp(old m - new m)` ≈ 0.11 — before the new terms were added. Section 2 turns that into an algorithm. First,
the torch version.

## ✏️ Exercise 1 — the block-table gather

Write `gather_kv(cache, block_table, kv_len)`: the first `kv_len` tokens of one sequence, in logical order, as a
contiguous `[kv_len, kv_heads, head_dim]` tensor. `cache` is one pool (`[num_blocks, block_size, kv_heads,
head_dim]`), `block_table` that sequence's row of the table (int32, possibly padded). Read the block size from the
cache. Do not read past `kv_len`: the checker fills every slot after it with NaN.

<details><summary>Hint 1</summary>

How many of the table's entries does the sequence use? A partly filled last block still counts as a block.
</details>
<details><summary>Hint 2</summary>

Indexing a tensor with a tensor of indices (`cache[ids]`) gathers whole blocks at once, in the order of `ids`.
Torch wants `long` indices to be safe.
</details>
<details><summary>Hint 3</summary>

After the gather you hold `[blocks, block_size, kv_heads, head_dim]`. Which two dimensions must merge so that
token `p` ends up at row `p`, and what do you cut off at the end?
</details>
"""),
("code", r"""
def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    '''The first kv_len tokens of one sequence, [kv_len, kv_heads, head_dim], gathered through its block table.'''
    block_size = cache.shape[1]
    # TODO: gather the blocks the sequence uses, in table order, then lay them out token by token
    #   and keep exactly kv_len tokens
    ### BEGIN SOLUTION
    num_blocks = -(-kv_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:kv_len]
    ### END SOLUTION
""", ["exercise:gather_kv"]),
("code", r"""
gather_check = check_gather_kv(gather_kv)
gather = choose(gather_check, gather_kv, engine_gather_kv, "gather_kv")
"""),
("md", r"""
### The oracle

With a gather, decode attention in torch is a few lines. **GQA** (grouped-query attention): SmolLM2 has 9 query
heads but only 3 KV heads; query heads `0..2` share KV head 0, `3..5` KV head 1, and so on — `repeat_interleave`
copies each KV head for its group. Everything is computed in fp32. This is slow and copies everything it reads,
but it is easy to trust, and we check it against the engine's own torch reference
(`minivllm.model.attention.paged_attention_reference`, which pads and masks a whole batch at once instead of looping).
"""),
("code", r"""
def decode_oracle(q, k_cache, v_cache, block_tables, seq_lens, scale):
    '''One decode query per sequence, q: [batch, q_heads, D] -> [batch, q_heads, D] in fp32.'''
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        k = gather(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)   # [n, q_heads, D]
        v = gather(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


gqa = make_paged([1, 15, 16, 17, 40], kv_heads=3, group=3, head_dim=16, seed=12)   # SmolLM2's 9:3 heads
args = [gqa[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
mine, engine = decode_oracle(*args), reference_decode(*args)
print("NaN in the oracle's output:", torch.isnan(mine).any().item())
diff = (mine - engine).abs().max().item()   # fp32 rounding: a few 1e-7, and not the same on every machine
print("max |oracle - engine reference|", "< 1e-6" if diff < 1e-6 else f"= {diff:.1e}")
"""),
("md", r"""
### What the oracle costs: a copy of everything it reads

The gather *materialises* each sequence's K and V as a new contiguous tensor before attention even starts. A
decode step reads every byte of K and V once anyway; the oracle also writes them all again and reads them back.
Measured on this machine, for 16 sequences of 1,024 tokens (SmolLM2's 3 KV heads × 64 dims, fp32): the gather
alone, against attention (`scaled_dot_product_attention`) on K/V that are already contiguous.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
def best_ms(fn, repeat=7):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


big = make_big(16, 1024, dtype=torch.float32)
B, L, KVH, D = 16, 1024, 3, 64
ids = big["block_tables"].long().reshape(-1)          # every block of every sequence, in table order
gather_all = lambda: (big["k_cache"].index_select(0, ids), big["v_cache"].index_select(0, ids))
k_flat = big["k_cache"].index_select(0, ids).view(B, L, KVH, D).transpose(1, 2).contiguous()   # [B, kv_heads, L, D]
v_flat = big["v_cache"].index_select(0, ids).view(B, L, KVH, D).transpose(1, 2).contiguous()
q4 = big["q"].unsqueeze(2)                                                                      # [B, 9, 1, D]
t_gather = best_ms(gather_all)
t_copy = best_ms(lambda: (big["k_cache"].clone(), big["v_cache"].clone()))
t_attn = best_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k_flat, v_flat, scale=big["scale"],
                                                                           enable_gqa=True))
print(f"K+V read by one decode step: {kv_bytes(big) / 1e6:.1f} MB")
print(f"gather through the table:          {t_gather:6.2f} ms")
print(f"plain copy of the same bytes:      {t_copy:6.2f} ms")
print(f"attention on contiguous K/V:       {t_attn:6.2f} ms   -> gather / attention = {t_gather / t_attn:.1f}")
"""),
("md", r"""
The gather costs about what a plain copy of the same bytes costs, and the same order as the attention over them
(between about half and one and a half times on the 2-core machine this lab was written on; CPU timings are noisy
on a shared machine: rerun the cell and compare the ratios). Decode attention and a
copy are both dominated by moving the same bytes, so the oracle pays for its memory traffic twice. A paged kernel
avoids it by reading each block **where it is**, through the table, straight into registers. That is the kernel you write next.

## 2. From the oracle to a kernel: online softmax

A Triton kernel is a function that runs once per **program** of a grid; here the grid is (sequence, query head),
and one program computes one row of the output. It cannot hold all of a long sequence's scores at once, so it
walks the sequence **one KV block at a time** and keeps three numbers' worth of state:

* `m_i` — the largest score seen so far (the running max),
* `l_i` — the sum of `exp(score - m_i)` over the keys seen so far (the running denominator),
* `acc` — the sum of `exp(score - m_i) * v` over the same keys, a `[head_dim]` vector.

When a new block raises the max from `m_i` to `m_new`, everything summed so far was weighted relative to the old
max; multiplying it by `exp(m_i - m_new)` re-expresses it relative to the new one. At the end `acc / l_i` is
exactly the softmax-weighted sum — the same number the oracle computes, without ever storing the scores. Why
subtract the max at all? `exp` of a float32 overflows above about 88; scores of a few hundred are not unusual.

```
 for each logical block b of this sequence:           ┌ table[seq, b] ─▶ physical block id (int32!)
     block = physical block of b  ────────────────────┘   widen it to int64 before multiplying by a stride
     k, v  = [PAGE_SIZE, HEAD_DIM] tiles of that block, masked: slots at or past seq_len are not tokens
     s     = q · k  * scale          (masked slots: -inf, so exp gives 0)
     fold s, v into (m_i, l_i, acc)  ← online softmax
 out = acc / l_i
```

`launch_decode` (in `check_lab07.py`) does the bookkeeping: it computes strides, the grid and the constants, then
launches your function. You receive pointers and strides in **elements**; `HEAD_DIM` and `PAGE_SIZE` are powers
of two; `head_dim` is contiguous (stride 1); K and V have the same strides, so one offset computation serves both.
The cell already loads `q` and `seq_len` and sets up the state; you write the GQA mapping and the loop.

## ✏️ Exercise 2 — the decode kernel's inner loop

Two regions: which KV head this program's query head reads, and the loop over the sequence's KV blocks. Triton
basics you need: `tl.load(pointers, mask=..., other=...)` reads a whole tile of addresses (a pointer plus a tensor
of offsets), and masked lanes read `other` instead of memory; `tl.sum(x, axis)`, `tl.max(x, axis)`, `tl.exp`,
`tl.maximum`, `tl.where(cond, a, b)`; `x[:, None]` and `x[None, :]` broadcast like numpy; `tl.cdiv(a, b)` is
ceiling division; `.to(tl.int64)` converts.

<details><summary>Hint 1 — the GQA mapping</summary>

`GROUP` consecutive query heads share one KV head. Write out heads 0..5 for `GROUP = 3` and the KV head each one
must read.
</details>
<details><summary>Hint 2 — addresses</summary>

A stride is the distance, in elements, between neighbours along one dimension: consecutive blocks are
`stride_kv_block` apart, consecutive slots `stride_kv_token`, consecutive KV heads `stride_kv_head`, consecutive
dims 1. Add up the four contributions as a `[PAGE_SIZE, HEAD_DIM]` tile, built from `offsets[:, None]` and
`dims[None, :]`. The block id comes from the table: this sequence's row starts at `seq * stride_table_seq`.
In a pool of a few million blocks, `block * stride_kv_block` no longer fits in 32 bits.
</details>
<details><summary>Hint 3 — masking</summary>

Logical token of slot `i` in block `b` is `b * PAGE_SIZE + i`. It exists only if it is below `seq_len`. Use that
mask twice: on the loads (so garbage is never read) and on the scores (so masked slots get weight exactly 0).
</details>
<details><summary>Hint 4 — the online softmax update, by numbers</summary>

A worked example (not a checker case). After some blocks the state is `m_i = 2.0`, `l_i = 1.5`; the next block's
unmasked scores are `[1.0, 3.0]`. The max becomes 3.0. Everything in `l_i` was weighted relative to 2.0, so it
shrinks by a factor of e^(2.0 − 3.0) ≈ 0.368, to 0.552. The new scores weigh e^(1.0 − 3.0) ≈ 0.135 and
e^(3.0 − 3.0) = 1 relative to 3.0, so `l_i` becomes 0.552 + 0.135 + 1 = 1.687. `acc` goes through the same two
moves, each weight multiplying its row of `v`. On the very first block the old max is −inf: what factor does the
old (empty) state get then?
</details>
"""),
("code", r"""
@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, out_ptr, scale,
                  stride_q_seq, stride_q_head, stride_kv_block, stride_kv_token, stride_kv_head,
                  stride_table_seq, stride_out_seq, stride_out_head,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    '''One program = one (sequence, query head): attend to the sequence's cached tokens, one KV block at a time.'''
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)        # the head_dim lanes
    offsets = tl.arange(0, PAGE_SIZE)    # the slots of one KV block
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + dims).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    # TODO: the KV head this query head reads (GQA: GROUP consecutive query heads share one)
    ### BEGIN SOLUTION
    kv_head = head // GROUP
    ### END SOLUTION
    m_i = float("-inf")                              # running max of the scores
    l_i = 0.0                                        # running sum of exp(score - m_i)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)     # running sum of exp(score - m_i) * v
    # TODO: loop over this sequence's KV blocks: look the block up in the table, load its K and V tiles (masked),
    #   score them against q, and fold them into m_i, l_i and acc (online softmax)
    ### BEGIN SOLUTION
    for b in range(0, tl.cdiv(seq_len, PAGE_SIZE)):
        block = tl.load(table_ptr + seq * stride_table_seq + b).to(tl.int64)
        tokens = b * PAGE_SIZE + offsets
        valid = tokens < seq_len
        slots = block * stride_kv_block + offsets[:, None] * stride_kv_token + kv_head * stride_kv_head + dims[None, :]
        k = tl.load(k_ptr + slots, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + slots, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    ### END SOLUTION
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, acc / l_i)
""", ["exercise:decode_kernel"]),
("code", r"""
kernel_check = check_decode_kernel(decode_kernel)
my_decode = lambda q, k, v, tables, lens, scale: launch_decode(decode_kernel, q, k, v, tables, lens, scale)
decode = choose(kernel_check, my_decode, engine_decode, "decode kernel")
"""),
("md", r"""
Every case above poisons what a correct kernel must not touch: the slots after each sequence's last token, the
spare blocks, the table's padding column and the output buffer are NaN before the launch. A kernel that reads one
slot too many or skips a store does not produce a slightly wrong number, it produces NaN. The last case places the
blocks 2³² elements into a pool: that is a sparse 8 GiB mapping on a CPU (only the pages touched exist), and a
block offset computed in 32 bits wraps around to block 0 — which holds NaN.

### Yours and the engine's, side by side

The engine's decode kernel (`minivllm/model/kernels/decode.py`) computes the same thing with two refinements
you can now read: one program handles a whole GQA group (the group's query vectors form a tile, so each K/V tile
is loaded **once per group** instead of once per query head, and `tl.dot` can use tensor cores), and it splits
long sequences across several programs ("flash-decoding"), merging their partial results with the same max-
rescaling you just wrote. Both must agree with the oracle on a ragged batch:
"""),
("code", r"""
ragged = make_paged([1, 15, 16, 17, 33, 64], kv_heads=3, group=3, head_dim=16, share_first=True, seed=13,
                    device=DEVICE)
args = [ragged[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
oracle = reference_decode(*args)
for name, fn in (("your kernel (or the fallback)", decode), ("engine kernel", engine_decode)):
    got = fn(*args)
    err = (got.float() - oracle).abs().max().item()   # rounding alone stays below 1e-6; a bug shows its size
    print(f"{name:30s} max |error| {'< 1e-6' if err < 1e-6 else f'{err:.1e}'}, all finite: "
          f"{torch.isfinite(got).all().item()}")
"""),
("md", r"""
## 3. On a GPU: bandwidth, SDPA, and the block size

The interpreter runs programs one after another in numpy, so its timings say nothing about a GPU. On a CUDA
machine the next three cells measure, for a SmolLM2-shaped decode step (9 query heads over 3 KV heads, head_dim
64, bf16) with 256 sequences of 4,096 tokens (805 MB of K/V, far above the H200's 50 MB of L2 cache):

1. **achieved bandwidth** = bytes of K and V read / kernel time, against a plain device-to-device copy of the same
   number of bytes (read + written) — the practical ceiling;
2. time against PyTorch's `scaled_dot_product_attention` on **contiguous** K/V (no paging, no table): what paging
   costs;
3. the **block-size trade-off**: small blocks waste less memory (half a block per sequence, lab 2) but give your
   kernel shorter loads and more table lookups per token.

The engine's kernel reads K/V through a tile of 64 tokens whatever the page size; yours loops over pages.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (GPU timings)
if ON_GPU:
    from triton.testing import do_bench

    big = make_big(256, 4096, device="cuda")
    args = [big[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
    nbytes = kv_bytes(big)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * nbytes / (do_bench(lambda: dst.copy_(src)) * 1e-3)
    print(f"K+V per step: {nbytes / 1e9:.2f} GB; device copy: {copy_bw / 1e12:.2f} TB/s (read + write)")
    for name, fn in (("your kernel (or the fallback)", decode), ("engine kernel", engine_decode)):
        ms = do_bench(lambda: fn(*args))
        bw = nbytes / (ms * 1e-3)
        print(f"{name:30s} {ms:7.3f} ms  {bw / 1e12:5.2f} TB/s = {100 * bw / copy_bw:4.1f}% of the copy")
else:
    print("On a CUDA GPU this cell prints the copy bandwidth and, for your kernel and the engine's, the time per\n"
          "decode step and the achieved bandwidth as a share of the copy.\n"
          "Measured for the engine's kernel on an NVIDIA H200 (benchmarks/results/2026-11-30_nvidia-h200_attention.txt):\n"
          "  copy 4.30 TB/s; this shape (SmolLM2, batch 256 x 4k): 0.212 ms = 3.79 TB/s = 88% of the copy;\n"
          "  with only 64 x 4k (201 MB) the same kernel reached 2.83 TB/s = 66%: too little work to hide latency.\n"
          "How close to the fp32 oracle each dtype must come (the largest absolute error of any output number):\n"
          "  fp32 2e-4, fp16 1e-2, bf16 1.5e-2. bf16 keeps 8 significant bits, so neighbouring bf16 numbers lie\n"
          "  1/128 of a power of two apart: 0.0078 between 1 and 2, 0.0156 between 2 and 4. Rounding the answer to\n"
          "  bf16 alone can cost half a step, and the kernel rounds along the way too. On the H200 the engine's\n"
          "  kernel came within 7.8e-3 in bf16 on both shapes in one run (..._attention_run2.txt); in the other, one\n"
          "  Llama-8B number was off by 1.56e-2 (one step of a value between 2 and 4, or two between 1 and 2), just\n"
          "  past 1.5e-2: in bf16 a fixed absolute tolerance is tight for large outputs; a relative one scales.\n"
          "Your kernel reads K/V once per QUERY head (3x the engine's traffic for SmolLM2) and uses no tensor cores;\n"
          "expect it several times slower.")
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (GPU timings)
if ON_GPU:
    B, L, KVH, D = 256, 4096, 3, 64
    table = big["block_tables"].long()
    k_flat = big["k_cache"][table].reshape(B, L, KVH, D).transpose(1, 2).contiguous()   # [B, kv_heads, L, D]
    v_flat = big["v_cache"][table].reshape(B, L, KVH, D).transpose(1, 2).contiguous()
    q4 = big["q"].unsqueeze(2)                                                          # [B, 9, 1, D]
    t_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k_flat, v_flat, scale=big["scale"], enable_gqa=True))
    for name, fn in (("your kernel (or the fallback)", decode), ("engine kernel", engine_decode)):
        print(f"{name:30s} {do_bench(lambda: fn(*args)) / t_sdpa:5.2f}x SDPA's time on contiguous K/V "
              f"({t_sdpa:.3f} ms)")
else:
    print("On a CUDA GPU this cell compares both kernels with torch's scaled_dot_product_attention on the same\n"
          "K/V laid out contiguously (no block table).\n"
          "Measured for the engine's kernel on an H200: this shape (SmolLM2, batch 256 x 4k) 1.07x SDPA's time\n"
          "(0.212 vs 0.199 ms), Llama-8B shape batch 64 x 4k 1.11x: paging through a table costs 7-11% here;\n"
          "the PagedAttention paper reported its paged kernel 20-26% slower than a contiguous one.")
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (GPU timings)
PAGES = [8, 16, 32, 64, 128]
lens = torch.randint(100, 4096, (64,), generator=torch.Generator().manual_seed(0))
print(f"{'page':>5s} {'waste (slots)':>14s} {'waste %':>8s}" + ("   your ms  engine ms" if ON_GPU else ""))
for page in PAGES:
    waste = int(sum((-(-int(n) // page)) * page - int(n) for n in lens))
    line = f"{page:5d} {waste:14d} {100 * waste / int(lens.sum()):7.2f}%"
    if ON_GPU:
        case = make_big(64, 4096, page=page, device="cuda")
        case["seq_lens"] = lens.to(torch.int32).cuda()
        a = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
        line += f"   {do_bench(lambda: decode(*a)):7.3f}  {do_bench(lambda: engine_decode(*a)):9.3f}"
    print(line)
if not ON_GPU:
    print("\nThe waste column is exact (it is arithmetic on 64 random lengths): about half a block per sequence.\n"
          "On a CUDA GPU two more columns time both kernels per page size. What to look for: your kernel loads one\n"
          "page per loop iteration, so 8-token pages mean 8-row loads and a table lookup every 8 tokens (slow),\n"
          "while large pages waste memory that could hold other sequences' KV. The engine's kernel decouples its\n"
          "tile (64 tokens) from the page size, so its time should barely move. Only the waste column is measured\n"
          "here; no GPU run of the timing columns is kept with the course, so those two sentences are predictions\n"
          "for you to test.")
"""),
("md", r"""
## 4. What the kernel cannot fix: launches, fusion and CUDA graphs

The engine's kernel reads K/V near the copy's speed (88% of it on an H200). Is a decode step now as fast as its
bytes allow? Not in an engine that runs the model *eagerly*, operation by operation from Python. The host issues
every operation of every layer — the projections, the norms, RoPE, attention, the residual adds — one at a time:
Python, PyTorch's dispatcher, the driver's launch call. The GPU runs each kernel asynchronously, but it cannot start
a kernel the host has not issued yet. When a kernel's own work is shorter than the host's time to issue the next
one, the GPU waits:

```
 eager decode step (one layer of ~30 operations, then the next layer ...)
 host  |norm|qkv|rope|attn| o |add|norm|gate_up|act|down|add|norm|qkv| ...     every box: ~15 µs of host
 GPU     ▌    ▌   ▌    ▌    ▌   ▌   ▌     ▌     ▌    ▌   ▌    ▌   ▌          every bar: ~1-2 µs of work
                                                          -> step time = operations x host time per launch

 the same step, captured once as a CUDA graph and replayed
 host  |replay|
 GPU    ▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌▌   kernels back to back: step time = the device's work
```

Three cures, and the engine uses all of them where it can: **fusion** (fewer, bigger operations: the engine computes
q, k and v with one stacked projection, `qkv_proj`, and gate and up with one, `gate_up_proj`; RoPE rotates q and k
in one pass; FlashAttention-style kernels like yours fuse the scores, the softmax and the weighted sum into one
launch that never writes the scores out), **CUDA graphs** (record a whole decode step once, replay it with a single
launch: `minivllm/model/cuda_graphs.py`), and compilers that do both (`torch.compile`). First, count what an eager
step issues. The model's operations are the same on every device, so the CPU can tell us the GPU's number of launches
(the Triton attention kernel aside), less one CPU-only detail: a decode step pads each projection's input to at least
four rows for oneDNN (`new_zeros` and `cat`, two operations per projection; `ONEDNN_MIN_ROWS` in
`minivllm/model/llama.py`), which a GPU does not do:
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (counts depend on the machine's CPU kernels: e.g. oneDNN's row padding adds operations)
from minivllm import LLM, SamplingParams
from minivllm.labs.check_lab07 import H200_LLAMA1B, op_floor_us, step_operations

llm = LLM(max_model_len=256, enforce_eager=True)   # the bundled SmolLM2-135M, 30 layers; eager on every device:
# a CUDA-graph replay dispatches no operation to count (and the step timed below is the eager one it describes)
layers = len(llm.engine.model_runner.model.model.layers)
ops = step_operations(llm.engine)
for kind, c in ops.items():
    top = ", ".join(f"{name} {k}" for name, k in c.names.most_common(6))
    print(f"{kind:6s} step: {c.n:5d} tensor operations = {c.n / layers:4.1f} per layer   ({top}, ...)")
"""),
("md", r"""
About a thousand operations per step, three dozen per layer. Take away the padding (`new_zeros` 120, `cat` 120) and a
GPU's eager decode step issues 880, about 29 per layer — each a launch. What does one cost? Time the
cheapest operation there is, an elementwise add, on one core, on tensors from 64 numbers to a million:
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
import matplotlib.pyplot as plt

SIZES = [2 ** k for k in range(6, 21, 2)]
floor_us = op_floor_us(SIZES)
fig, ax = plt.subplots(figsize=(6, 3))
ax.loglog(SIZES, floor_us, "o-", color="#4e79a7", label="one add on this CPU (one core)")
ax.loglog(SIZES, [3 * 4 * n / 20e9 * 1e6 for n in SIZES], ":", color="#888888", label="its bytes at 20 GB/s")
ax.axvspan(64, 576 * 16, color="#f28e2b", alpha=0.15, label="a decode step's activations (1-16 tokens)")
ax.set_xlabel("numbers per tensor"); ax.set_ylabel("µs per operation"); ax.legend(fontsize=7)
plt.show()
FLOOR_US = floor_us[0]
for n, us in zip(SIZES, floor_us):
    print(f"{n:8d} numbers: {us:7.2f} µs  ({3 * 4 * n / (us * 1e-6) / 1e9:6.1f} GB/s moved)")
"""),
("md", r"""
Below a few thousand numbers the time no longer falls with the size: what is left is the fixed cost of issuing
an operation. A decode step's activations (one row per sequence, a few hundred to a few thousand numbers each) sit on
that floor, so every operation of a small-batch decode step costs its fixed cost and little else. Now put the two
measurements together and compare them with the step itself, on this CPU and on a GPU:
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
import statistics

from minivllm.labs import at_scale

eng = llm.engine
eng.add_request({"prompt_token_ids": list(range(100, 164))}, SamplingParams(max_tokens=24, ignore_eos=True),
                request_id="decode-timing")
eng.step()                                  # the prompt
times = []
while eng.has_unfinished_requests():
    t0 = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t0)
cpu_step_ms = 1e3 * statistics.median(times[2:])   # on a GPU: this GPU's eager step (the engine is eager, cell above)
cpu_host_ms = ops["decode"].n * FLOOR_US / 1e3     # FLOOR_US was timed on the CPU: the split below is the CPU's only
per_launch_us = 1e3 * H200_LLAMA1B["eager_64_ms"] / H200_LLAMA1B["launches_per_eager_step"]
if ON_GPU:   # the device's share from the roofline of the nearest preset, as for the H200 rows
    gpu_preset = "h100" if "H100" in torch.cuda.get_device_name() else "h200"
    here = ("this GPU: SmolLM2 decode, eager (measured)", cpu_step_ms,
            1e3 * at_scale.device_s([(64, 1, True)], "smollm2-135m", gpu_preset))
else:
    here = ("this CPU: SmolLM2 decode, eager (measured)", cpu_step_ms, cpu_step_ms - cpu_host_ms)
rows = [  # (what, step ms, of which the device's work at the roofs, ms)
    here,
    ("H200: Llama-1B 64-token prompt, eager (measured)", H200_LLAMA1B["eager_64_ms"],
     1e3 * at_scale.device_s([(0, 64, True)], "llama-3.2-1b", "h200")),
    ("H200: Llama-1B 512-token prompt, eager (measured)", H200_LLAMA1B["eager_512_ms"],
     1e3 * at_scale.device_s([(0, 512, True)], "llama-3.2-1b", "h200")),
    ("H200: Llama-1B decode, CUDA graph (measured)", H200_LLAMA1B["graph_decode_ms"],
     1e3 * at_scale.device_s([(64, 1, True)], "llama-3.2-1b", "h200")),
    ("H200: SmolLM2 decode, eager (predicted)", ops["decode"].n * per_launch_us / 1e3,
     1e3 * at_scale.device_s([(64, 1, True)], "smollm2-135m", "h200")),
]
fig, ax = plt.subplots(figsize=(8, 2.8))
for i, (what, total, device) in enumerate(rows):
    device = min(device, total)
    ax.barh(i, device, color="#4e79a7", label="device work (GPU: roofline; CPU: the rest)" if i == 0 else None)
    ax.barh(i, total - device, left=device, color="#f28e2b", label="host: issuing operations (GPU: all the rest)" if i == 0 else None)
ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7); ax.invert_yaxis()
ax.set_xlabel("ms per step"); ax.legend(fontsize=7, loc="lower right")
plt.show()
if ON_GPU:
    print(f"this GPU: {ops['decode'].n} operations in a {cpu_step_ms:.2f} ms eager decode step = "
          f"{1e3 * cpu_step_ms / ops['decode'].n:.1f} µs per operation, device work included")
else:
    print(f"this CPU: {ops['decode'].n} operations x {FLOOR_US:.1f} µs = {cpu_host_ms:.1f} ms of issuing, "
          f"{100 * cpu_host_ms / cpu_step_ms:.0f}% of a {cpu_step_ms:.1f} ms decode step")
print(f"H200, eager: {H200_LLAMA1B['launches_per_eager_step']} launches in {H200_LLAMA1B['eager_64_ms']} ms "
      f"= {per_launch_us:.1f} µs of host per launch; 64 or 512 prompt tokens: "
      f"{H200_LLAMA1B['eager_64_ms']} vs {H200_LLAMA1B['eager_512_ms']} ms")
for what, total, device in rows:
    print(f"{what:52s} {total:7.2f} ms, device work {device:6.2f} ms -> {total / device:5.1f}x the device's time")
"""),
("md", r"""
Read the bars from the top (on a GPU the top bar is your GPU's own eager step, its device work from the roofline of
the H100 or H200 preset; the sentences below read the CPU run stored with the course). On **this CPU** issuing
operations is at most a few percent of a decode step: the step reads the model's weights from DRAM at tens of GB/s,
and that dwarfs a microsecond per operation. On the **H200** the same weights take microseconds to read (4.8 TB/s),
so the roles swap. An eager step of Llama-3.2-1B costs about 11 ms whether it carries 64 or 512 prompt tokens — eight
times the prompt, the same time — because 700 launches at ~15 µs of host each *are* the step; the GPU's own work, by
the roofline, is 0.6–1.5 ms. The same model's decode step replayed as a CUDA graph took 2.5 ms, scheduling and
sampling included: one launch instead of hundreds. And the bundled 135M model on that GPU, eager, would spend about
14 ms launching (880 launches; the bar above multiplies all 1,120 of the CPU's operations, padding included, and says
17 ms) for 0.07 ms of work. That is the last line of Lesson 06, the serving lesson this course is built on — *launch
overhead can dominate a decode step* — in numbers: on a GPU a small model's decode step is not memory-bound or
compute-bound but **launch-bound**, until graphs or fusion take the host out of the loop.

Why only decode steps are graphed here: a graph replays fixed kernels on fixed addresses. Everything that changes
per step — token ids, positions, block tables, sequence lengths — must be copied into device tensors the graph
captured, and the batch is padded to one of a few captured sizes (`minivllm/model/cuda_graphs.py`). A step that
carries prompt tokens has a shape that changes with every chunk, so this engine runs it eagerly; vLLM captures
such steps piecewise (graphs around the attention call), which is where these 11 ms would go next.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (GPU timings)
if ON_GPU:
    for eager in (True, False):
        gpu_llm = LLM(max_model_len=256, enforce_eager=eager)
        e = gpu_llm.engine
        e.add_request({"prompt_token_ids": list(range(100, 164))}, SamplingParams(max_tokens=40, ignore_eos=True),
                      request_id="graph-timing")
        e.step()
        ts = []
        while e.has_unfinished_requests():
            torch.cuda.synchronize(); t0 = time.perf_counter(); e.step(); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        print(f"enforce_eager={eager!s:5s}: decode step p50 {1e3 * statistics.median(ts[4:]):.2f} ms")
else:
    print("On a CUDA GPU this cell times the bundled model's decode step with CUDA graphs off (enforce_eager=True)\n"
          "and on. Expect the eager step near the 'predicted' bar above and the graphed one a few times faster;\n"
          "on a CPU the engine has no graphs (enforce_eager has no effect) and the step is bound by the weights.")
"""),
("md", r"""
## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
The last two questions come from labs 2 and 4.
"""),
("code", r"""
show_quiz(7)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(7)
"""),
("code", r"""
print_answers(7)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* How a decode query finds its keys: logical position → `block_table[p // block_size]` → slot `p % block_size`,
  and why the blocks' physical order does not matter as long as the table's order is followed.
* Why a torch gather makes a good oracle and a bad kernel (it copies every byte it reads), and why NaN-poisoned
  caches make a kernel test catch out-of-bounds reads instead of hiding them as rounding noise.
* The online softmax: what `m_i`, `l_i` and `acc` hold, why the old state is multiplied by `exp(m_old - m_new)`,
  and why subtracting the max is not optional in float32.
* GQA in a kernel (`kv_head = head // group`), and why reading K/V once per *group* rather than per query head
  matters for a memory-bound kernel.
* Why block offsets must be computed in int64, and why decode attention is judged by achieved bandwidth against a
  copy rather than by FLOP/s.
* The block-size trade-off: memory waste (half a block per sequence) against per-block overhead in the kernel.
* Why an eager decode step on a GPU costs "operations × host time per launch" rather than its bytes, what fusion
  (stacked projections, one-pass RoPE, a fused attention kernel) and a CUDA graph each remove, and why a step that
  carries prompt tokens is harder to graph than a decode step.

## Go further

* **One program per group.** Change your kernel so that one program handles all `GROUP` query heads of a KV head:
  load the group's queries as a `[GROUP_PAD, HEAD_DIM]` tile (pad to 16 rows), keep `m_i` and `l_i` as vectors and
  `acc` as a tile, and use `tl.dot`. Check it with `check_decode_kernel` (the launch grid becomes (batch,
  kv_heads): write your own launcher), then measure the bytes it reads against yours on a GPU.
* **Which values must live on the device?** Read `minivllm/model/cuda_graphs.py`: for each input of a decode step
  (token ids, positions, block tables, sequence lengths, slot mapping), find the static tensor the graph captured
  and where each step copies into it. Why are batches padded to a few captured sizes, and what does a batch of 5
  cost when the nearest graph holds 8? `python -m minivllm.bench host_overhead` measures the host side that stays
  outside the graph: scheduling, input preparation, sampling.
* **Compiled once, or once per step?** Triton compiles a separate binary for each combination of `tl.constexpr`
  values *and* of "specialisations" of the plain arguments: an integer equal to 1 or divisible by 16, a pointer
  aligned to 16 bytes. Find the arguments of the engine's decode kernel that change from step to step (the
  block table's width is one) and read how `minivllm/model/kernels/decode.py` keeps them from multiplying the
  binaries (`do_not_specialize`); `test_step_varying_arguments_are_not_specialised` in
  `tests/test_triton_attention.py` checks it in the interpreter. Pointers can vary too. On a GPU the engine
  packs each step's integer arrays into one staging buffer and hands the kernels views into it; packed end to
  end, `seq_lens` began `4 * (batch + 1)` bytes in, 16-byte aligned for one batch size in four, so a batch
  size with a new alignment compiled a fresh kernel binary in the middle of serving, and a compile holds up its
  step for hundreds of milliseconds. An H200 run with that layout
  (`benchmarks/results/2026-11-30_nvidia-h200_gc_probe.json`) shows such steps: 413, 1,002 and 407 ms among prompt
  steps of 12–31 ms in its first runs, none above 25 ms in its later ones, since a compiled binary is reused (the
  garbage collector's pauses there were at most 2.3 ms: not the cause). Read how
  `BatchPreparer._upload` in `minivllm/model/runner.py` lays the arrays out now.
* **Decouple the tile from the page.** Make the loop run over tiles of `BLOCK_N` tokens that may span several
  pages (look the page up per token, as `minivllm/model/kernels/tiles.py` does) and repeat the block-size sweep.
* **Split-KV.** With batch 1 and a 32k context, your grid has 9 programs for 132 SMs. Split each sequence into `S`
  parts, write each part's `acc / l_i` and its log-sum-exp, and merge them in a second kernel; check that `S = 1`
  and `S = 16` each pass the oracle comparison of `check_decode_kernel`'s cases. Do not expect them to agree bit
  for bit with each other: splitting changes the order in which the partial sums are added, and floating-point
  addition is not associative, so the last bits differ.
"""),
]
