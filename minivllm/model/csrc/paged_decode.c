/* Paged decode attention for the CPU: read each sequence's K/V once, in place, through its block table.
 *
 * Why this exists: the torch path (minivllm/model/attention.py, the oracle) gathers every
 * decoding sequence's blocks into a padded [B, kv_heads, L, D] copy, for K and for V, in every
 * layer of every step, and then runs two batched matmuls on it.  On a CPU that copy *is* the
 * cost: the cache is read, written to a temporary, and read again.  This kernel walks the
 * block table instead and keeps a running ("online") softmax, so K and V are read exactly once
 * and nothing of size L is ever written.  It is the same algorithm as the Triton decode kernel
 * (minivllm/model/kernels/decode.py), written for two to sixteen CPU cores.
 *
 * Layouts (all contiguous float32 except where a stride is passed):
 *   q            [B, H, D]             one query token per sequence
 *   k/v cache    [num_blocks, BS, KVH, D]
 *   block_tables [B, table_stride]     int32 block ids; only the first ceil(len/BS) are read
 *   seq_lens     [B]                   int32 keys per sequence, the new token included
 *   out          [B, H, D]
 * Query head h reads KV head h / (H / KVH) (grouped-query attention).
 *
 * Built on first use by minivllm/model/cpu_attention.py with `gcc -O3 -fopenmp`; the OpenMP
 * runtime it links is the one torch already loaded (same soname), so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 64
#define MAX_BLOCK 256
#define MAX_DIM 512

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale) {
    const int64_t G = H / KVH;
    if (G > MAX_GROUP || BS > MAX_BLOCK || D > MAX_DIM || H % KVH != 0) return 1;
    const int64_t token_stride = KVH * D;       /* floats between two tokens of one block */
    const int64_t block_stride = BS * KVH * D;  /* floats between two blocks */

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KVH; ++task) {
        const int64_t b = task / KVH, kvh = task % KVH;
        const int64_t len = seq_lens[b];
        const float *qb = q + (b * H + kvh * G) * D;  /* the G query heads sharing this KV head */
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK];
        float acc[MAX_GROUP][MAX_DIM];
        for (int64_t g = 0; g < G; ++g) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
            for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += BS) {
            /* widen before multiplying: block id * block_stride overflows int32 on big caches */
            const int64_t block = (int64_t)block_tables[b * table_stride + start / BS];
            const int64_t n = len - start < BS ? len - start : BS;
            const float *kb = k_cache + block * block_stride + kvh * D;
            const float *vb = v_cache + block * block_stride + kvh * D;
            /* scores of this block: each K row is loaded once and used by all G heads */
            for (int64_t t = 0; t < n; ++t) {
                const float *krow = kb + t * token_stride;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = qb + g * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
                    s[g][t] = dot * scale;
                }
            }
            /* online softmax: rescale what was accumulated when the running max grows */
            for (int64_t g = 0; g < G; ++g) {
                float block_max = -INFINITY;
                for (int64_t t = 0; t < n; ++t) block_max = s[g][t] > block_max ? s[g][t] : block_max;
                const float m_new = block_max > m[g] ? block_max : m[g];
                const float correction = expf(m[g] - m_new);  /* exp(-inf) = 0 on the first block */
                l[g] *= correction;
                for (int64_t d = 0; d < D; ++d) acc[g][d] *= correction;
                for (int64_t t = 0; t < n; ++t) {
                    s[g][t] = expf(s[g][t] - m_new);
                    l[g] += s[g][t];
                }
                m[g] = m_new;
            }
            for (int64_t t = 0; t < n; ++t) {
                const float *vrow = vb + t * token_stride;
                for (int64_t g = 0; g < G; ++g) {
                    const float p = s[g][t];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) acc[g][d] += p * vrow[d];
                }
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float *o = out + (b * H + kvh * G + g) * D;
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t d = 0; d < D; ++d) o[d] = acc[g][d] * inv;
        }
    }
    return 0;
}
