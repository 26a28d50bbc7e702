/* Paged decode attention for the CPU: read each sequence's K/V once, in place, through its block table.
 *
 * Why this exists: the torch path (minivllm/model/attention.py, the oracle) gathers every
 * decoding sequence's blocks into a padded [B, kv_heads, L, D] copy, for K and for V, in every
 * layer of every step, and then runs two batched matmuls on it.  On a CPU that copy *is* the
 * cost: the cache is read, written to a temporary, and read again.  This kernel walks the
 * block table instead and keeps a running ("online") softmax, so nothing of size L is ever
 * written.  It is the same algorithm as the Triton decode kernel
 * (minivllm/model/kernels/decode.py), written for two to sixteen CPU cores.
 *
 * One walk = one query head of one sequence, keeping its running sum `acc[D]`, max `m` and
 * normaliser `l` in registers.  The G query heads that share a KV head (grouped-query attention)
 * walk the same blocks one after another on one thread (see paged_decode_f32), so the second and
 * later walks hit the core's cache and memory traffic stays one read of K/V.  An earlier version
 * walked the blocks once for all G heads with `acc[G][D]` in memory; it measured ~3x slower.
 *
 * Per block of BS tokens, three short loops that the compiler vectorises:
 *   scores  s[t] = q . k_t * scale                  (a dot product per token)
 *   softmax m' = max(m, max s); p_t = exp(s_t - m'); rescale acc and l by exp(m - m')
 *   values  acc += p_t * v_t
 * The first block sets m directly, so no infinity ever appears: the kernel is built with
 * -ffast-math, which lets gcc call glibc's vector exp (libmvec) and which assumes finite values.
 *
 * Layouts (all contiguous float32 except where a stride is passed):
 *   q            [B, H, D]             one query token per sequence
 *   k/v cache    [num_blocks, BS, KVH, D]
 *   block_tables [B, table_stride]     int32 block ids; only the first ceil(len/BS) are read
 *   seq_lens     [B]                   int32 keys per sequence, the new token included (>= 1)
 *   out          [B, H, D]
 * Query head h reads KV head h / (H / KVH).
 *
 * Built on first use by minivllm/model/cpu_attention.py with `gcc -O3 -ffast-math -fopenmp`;
 * the OpenMP runtime it links is the one torch already loaded (same soname), so both share
 * one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_BLOCK 256
#define MAX_DIM 512

/* Attention of one query head over its sequence's blocks.  `D` is a compile-time constant at
 * the common call sites (64, 128), which lets gcc keep acc[] in vector registers. */
static inline __attribute__((always_inline)) void one_head(
    const float *qh, const float *k_head, const float *v_head, const int32_t *table, int64_t len,
    int64_t BS, int64_t D, int64_t token_stride, int64_t block_stride, float scale, float *o) {
    float acc[MAX_DIM], s[MAX_BLOCK];
    float m = 0.0f, l = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t start = 0; start < len; start += BS) {
        /* widen before multiplying: block id * block_stride overflows int32 on big caches */
        const int64_t block = (int64_t)table[start / BS];
        const int64_t n = len - start < BS ? len - start : BS;
        const float *kb = k_head + block * block_stride;
        const float *vb = v_head + block * block_stride;
        for (int64_t t = 0; t < n; ++t) {
            const float *krow = kb + t * token_stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * krow[d];
            s[t] = dot * scale;
        }
        float m_new = start == 0 ? s[0] : m;
        for (int64_t t = 0; t < n; ++t) m_new = s[t] > m_new ? s[t] : m_new;
        const float correction = start == 0 ? 0.0f : expf(m - m_new);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            s[t] = expf(s[t] - m_new);
            sum += s[t];
        }
        l = l * correction + sum;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
        for (int64_t t = 0; t < n; ++t) {
            const float *vrow = vb + t * token_stride;
            const float p = s[t];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) acc[d] += p * vrow[d];
        }
        m = m_new;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale) {
    if (BS > MAX_BLOCK || D > MAX_DIM || KVH < 1 || H % KVH != 0) return 1;
    const int64_t G = H / KVH, token_stride = KVH * D, block_stride = BS * KVH * D;
    /* A task is a run of consecutive query heads of one sequence, walked one after another on one
     * thread: heads that share a KV head (grouped-query attention) sit next to each other, so the first
     * walk brings the K/V blocks into this core's cache and the others read them there; K/V crosses the
     * memory bus once.  (One task per query head ran the G heads of a KV head on different cores at
     * once, each reading K/V from memory: three times the traffic for SmolLM2.)  The run is the whole
     * sequence when there are enough sequences to keep every thread busy -- each block is then read
     * whole, front to back -- else one KV head's group, else single heads. */
    const int64_t threads = omp_get_max_threads();
    const int64_t per = B >= 2 * threads ? H : (B * KVH >= 2 * threads ? G : 1);
    const int64_t runs = H / per;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * runs; ++task) {
        const int64_t b = task / runs, first = (task % runs) * per;
        const int32_t *table = block_tables + b * table_stride;
        for (int64_t h = first; h < first + per; ++h) {
            const float *kh = k_cache + (h / G) * D, *vh = v_cache + (h / G) * D;
            const float *qh = q + (b * H + h) * D;
            float *o = out + (b * H + h) * D;
            if (D == 64)
                one_head(qh, kh, vh, table, seq_lens[b], BS, 64, token_stride, block_stride, scale, o);
            else if (D == 128)
                one_head(qh, kh, vh, table, seq_lens[b], BS, 128, token_stride, block_stride, scale, o);
            else
                one_head(qh, kh, vh, table, seq_lens[b], BS, D, token_stride, block_stride, scale, o);
        }
    }
    return 0;
}
