// Decode attention over Baton's paged KV cache, for CPUs.
//
// One query token per request (decode), every head of a KV-head group together, reading the
// keys and values straight from their blocks: each byte of the context is read once, where a
// gather-then-SDPA in torch copies it first. Online softmax, one rescale per block.
// A sliding window is a start position per request: blocks before it are never read (the KV
// cache manager may have given them back). Soft-capping (softcap > 0) maps each scaled score s
// to softcap * tanh(s / softcap).
//
// Layout: kv_layer points at kv_cache[0, layer, 0, 0, 0, 0] of
// [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; strides are in elements.
// The cache is float32 (paged_decode_attention_f32) or bfloat16 (paged_decode_attention_bf16,
// each value widened to float32 as it is loaded: exact, and half the bytes read); q, out and
// all arithmetic are float32 in both.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

static inline __attribute__((always_inline)) void decode_one(
    const float *q, const void *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int64_t item, const int group, const int bf16);

// The cache's element i as float32; `bf16` is a constant in each entry point, so the branch
// is gone after inlining.
static inline __attribute__((always_inline)) float load(const void *kv, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)kv)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)kv)[i];
}

// The two entry points, one per cache dtype:
//   q             [batch, num_heads, head_dim] contiguous float32
//   kv_layer      see above
//   stride_block  elements between blocks; stride_kv: between K and V of one block
//   block_tables  [batch, bt_stride]; seq_lens [batch]
//   starts        [batch] first key position attended, or NULL: 0
//   softcap       <= 0: none
//   out           [batch, num_heads, head_dim] contiguous float32
#define DEFINE_ENTRY(NAME, BF16)                                                                 \
    void NAME(const float *q, const void *kv_layer, int64_t stride_block, int64_t stride_kv,     \
              const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,           \
              const int32_t *starts, int batch, int num_heads, int num_kv_heads, int head_dim,   \
              int block_size, float scale, float softcap, float *out, int num_threads) {         \
        const int group = num_heads / num_kv_heads;                                              \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                \
        for (int64_t item = 0; item < (int64_t)batch * num_kv_heads; ++item) {                   \
            /* Constant head_dim and group for the common shapes let the compiler unroll and     \
               vectorize the inner loops. */                                                     \
            if (head_dim == 32 && group == 2) CALL(32, 2, BF16);                                 \
            else if (head_dim == 64 && group == 2) CALL(64, 2, BF16);                            \
            else if (head_dim == 64 && group == 3) CALL(64, 3, BF16);                            \
            else if (head_dim == 64 && group == 4) CALL(64, 4, BF16);                            \
            else if (head_dim == 128 && group == 4) CALL(128, 4, BF16);                          \
            else if (head_dim == 128 && group == 8) CALL(128, 8, BF16);                          \
            else if (head_dim == 128 && group == 1) CALL(128, 1, BF16);                          \
            else if (head_dim == 16 && group == 2) CALL(16, 2, BF16);                            \
            else CALL(head_dim, group, BF16);                                                    \
        }                                                                                        \
    }
#define CALL(HD, G, BF16)                                                                        \
    decode_one(q, kv_layer, stride_block, stride_kv, block_tables, bt_stride, seq_lens, starts,  \
               num_heads, num_kv_heads, HD, block_size, scale, softcap, out, item, G, BF16)

DEFINE_ENTRY(paged_decode_attention_f32, 0)
DEFINE_ENTRY(paged_decode_attention_bf16, 1)

static inline __attribute__((always_inline)) void decode_one(
    const float *q, const void *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int64_t item, const int group, const int bf16) {
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
        const int64_t k_base = block_id * stride_block + (int64_t)h * head_dim;
        const int64_t v_base = k_base + stride_kv;
        const int n = (seq_len - blk * block_size) < block_size ? (seq_len - blk * block_size)
                                                                : block_size;
        // Slots [t0, n) of this block are in the window (t0 > 0 only in its first block).
        const int t0 = blk * block_size < start ? start - blk * block_size : 0;
        // Each key and value row is loaded once for the whole group of query heads.
        for (int t = t0; t < n; ++t) {
            const int64_t k = k_base + t * stride_tok;
            for (int g = 0; g < group; ++g) {
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) dot += qs[g][d] * load(kv_layer, k + d, bf16);
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
            const int64_t v = v_base + t * stride_tok;
            for (int g = 0; g < group; ++g) {
                const float p = s[g][t];
                for (int d = 0; d < head_dim; ++d) acc[g][d] += p * load(kv_layer, v + d, bf16);
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        float *o = out + ((int64_t)b * num_heads + h * group + g) * head_dim;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < head_dim; ++d) o[d] = acc[g][d] * inv;
    }
}
