// Decode attention over Baton's paged KV cache, for CPUs.
//
// One query token per request (decode), every head of a KV-head group together, reading the
// keys and values straight from their blocks: each byte of the context is read once, where a
// gather-then-SDPA in torch copies it first. Online softmax, one rescale per block.
// A sliding window is a start position per request: blocks before it are never read (the KV
// cache manager may have given them back). Soft-capping (softcap > 0) maps each scaled score s
// to softcap * tanh(s / softcap).
//
// Layout (float32): kv_layer points at kv_cache[0, layer, 0, 0, 0, 0] of
// [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; strides are in elements.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

static inline __attribute__((always_inline)) void decode_one(
    const float *q, const float *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int64_t item, const int group);

void paged_decode_attention_f32(
    const float *q,             // [batch, num_heads, head_dim] contiguous
    const float *kv_layer,      // see above
    int64_t stride_block,       // elements between blocks
    int64_t stride_kv,          // elements between K and V of one block
    const int32_t *block_tables,  // [batch, bt_stride]
    int64_t bt_stride,
    const int32_t *seq_lens,    // [batch]
    const int32_t *starts,      // [batch] first key position attended, or NULL: 0
    int batch, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale,
    float softcap,              // <= 0: none
    float *out,                 // [batch, num_heads, head_dim] contiguous
    int num_threads) {
    const int group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < (int64_t)batch * num_kv_heads; ++item) {
        // Constant head_dim and group for the common shapes let the compiler unroll and
        // vectorize the inner loops.
#define CALL(HD, G) decode_one(q, kv_layer, stride_block, stride_kv, block_tables, bt_stride, \
                               seq_lens, starts, num_heads, num_kv_heads, HD, block_size, \
                               scale, softcap, out, item, G)
        if (head_dim == 32 && group == 2) CALL(32, 2);
        else if (head_dim == 64 && group == 2) CALL(64, 2);
        else if (head_dim == 64 && group == 4) CALL(64, 4);
        else if (head_dim == 128 && group == 4) CALL(128, 4);
        else if (head_dim == 128 && group == 8) CALL(128, 8);
        else if (head_dim == 128 && group == 1) CALL(128, 1);
        else if (head_dim == 16 && group == 2) CALL(16, 2);
        else CALL(head_dim, group);
#undef CALL
    }
}

static inline __attribute__((always_inline)) void decode_one(
    const float *q, const float *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int64_t item, const int group) {
    const int64_t stride_tok = (int64_t)num_kv_heads * head_dim;
    const int b = (int)(item / num_kv_heads);
    const int h = (int)(item % num_kv_heads);
    const int seq_len = seq_lens[b];
    const int start = starts ? starts[b] : 0;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], qs[MAX_GROUP][MAX_HEAD_DIM];
    float s[MAX_GROUP][MAX_BLOCK];
    for (int g = 0; g < group; ++g) {
        const float *qg = q + ((int64_t)b * num_heads + h * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) qs[g][d] = qg[d] * scale;
        memset(acc[g], 0, sizeof(float) * head_dim);
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int blk = start / block_size; blk < num_blocks; ++blk) {
        const int64_t block_id = block_tables[(int64_t)b * bt_stride + blk];
        const float *k_base = kv_layer + block_id * stride_block + (int64_t)h * head_dim;
        const float *v_base = k_base + stride_kv;
        const int n = (seq_len - blk * block_size) < block_size ? (seq_len - blk * block_size)
                                                                : block_size;
        // Slots [t0, n) of this block are in the window (t0 > 0 only in its first block).
        const int t0 = blk * block_size < start ? start - blk * block_size : 0;
        // Each key and value row is loaded once for the whole group of query heads.
        for (int t = t0; t < n; ++t) {
            const float *k = k_base + t * stride_tok;
            for (int g = 0; g < group; ++g) {
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) dot += qs[g][d] * k[d];
                s[g][t] = dot;
            }
        }
        if (softcap > 0.0f) {
            for (int g = 0; g < group; ++g)
                for (int t = t0; t < n; ++t) s[g][t] = softcap * tanhf(s[g][t] * inv_cap);
        }
        for (int g = 0; g < group; ++g) {
            float block_max = m[g];
            for (int t = t0; t < n; ++t) block_max = s[g][t] > block_max ? s[g][t] : block_max;
            const float correction = expf(m[g] - block_max);
            float sum = 0.0f;
            for (int t = t0; t < n; ++t) {
                s[g][t] = expf(s[g][t] - block_max);
                sum += s[g][t];
            }
            l[g] = l[g] * correction + sum;
            for (int d = 0; d < head_dim; ++d) acc[g][d] *= correction;
            m[g] = block_max;
        }
        for (int t = t0; t < n; ++t) {
            const float *v = v_base + t * stride_tok;
            for (int g = 0; g < group; ++g) {
                const float p = s[g][t];
                for (int d = 0; d < head_dim; ++d) acc[g][d] += p * v[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        float *o = out + ((int64_t)b * num_heads + h * group + g) * head_dim;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < head_dim; ++d) o[d] = acc[g][d] * inv;
    }
}
