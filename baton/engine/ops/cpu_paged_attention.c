// Decode attention over Baton's paged KV cache, for CPUs.
//
// One query token per request (decode), reading the keys and values straight from their blocks:
// each byte of the context is read once, where a gather-then-SDPA in torch copies it first.
// Online softmax, one rescale per block. A work item is one request and a run of adjacent KV
// heads (with every query head of their groups): a block's key and value rows of those heads
// lie side by side in the cache, so an item reads each row as one contiguous stretch, which the
// memory system streams. Items carry one KV head each only where there are too few requests to
// keep the threads busy otherwise. While a block is computed, the next block's rows are
// prefetched, and the softmax's exponentials are straight-line code the compiler vectorizes
// (`exp_nonpos`) rather than a library call per score.
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

#define MAX_GROUP 16     // query heads per KV head
#define MAX_ITEM_HEADS 16 // query heads one work item carries (its state is on the stack)
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

static inline __attribute__((always_inline)) void decode_item(
    const float *q, const void *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int b, int h0, int nh, const int group,
    const int bf16);

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

// Asks for the cache lines of `bytes` bytes from p on: a hint, never a fault.
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// e^x for x <= 0 (a score less the running maximum), in straight-line code the compiler
// vectorizes, where each expf is a library call: x = n ln2 + r with |r| <= ln2/2 (ln2 in two
// parts), e^r by a degree-6 polynomial, 2^n written into the exponent. Within 1.5 ulp of e^x
// from 0 down to -87; 0 below (e^-87 is 1.6e-38 of the block's largest weight).
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
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
        int run = batch < 4 * num_threads ? 1 : MAX_ITEM_HEADS / group;                          \
        if (run > num_kv_heads) run = num_kv_heads;                                              \
        const int runs = (num_kv_heads + run - 1) / run;                                         \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                \
        for (int64_t item = 0; item < (int64_t)batch * runs; ++item) {                           \
            const int b = (int)(item / runs);                                                    \
            const int h0 = (int)(item % runs) * run;                                             \
            const int nh = num_kv_heads - h0 < run ? num_kv_heads - h0 : run;                    \
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
    decode_item(q, kv_layer, stride_block, stride_kv, block_tables, bt_stride, seq_lens, starts, \
                num_heads, num_kv_heads, HD, block_size, scale, softcap, out, b, h0, nh, G, BF16)

DEFINE_ENTRY(paged_decode_attention_f32, 0)
DEFINE_ENTRY(paged_decode_attention_bf16, 1)

// Request b, KV heads [h0, h0 + nh) and their nh * group query heads (numbered i below, from
// h0 * group on).
static inline __attribute__((always_inline)) void decode_item(
    const float *q, const void *kv_layer, int64_t stride_block, int64_t stride_kv,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int32_t *starts, int num_heads, int num_kv_heads, const int head_dim, int block_size,
    float scale, float softcap, float *out, int b, int h0, int nh, const int group,
    const int bf16) {
    const int64_t stride_tok = (int64_t)num_kv_heads * head_dim;
    const int seq_len = seq_lens[b];
    const int start = starts ? starts[b] : 0;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const int heads = nh * group;
    const int elem = bf16 ? 2 : 4;
    const int row_bytes = nh * head_dim * elem; // one token's keys (or values) of this item
    float acc[MAX_ITEM_HEADS][MAX_HEAD_DIM], qs[MAX_ITEM_HEADS][MAX_HEAD_DIM];
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS], s[MAX_ITEM_HEADS][MAX_BLOCK];
    const float *qb = q + ((int64_t)b * num_heads + (int64_t)h0 * group) * head_dim;
    for (int i = 0; i < heads; ++i) {
        for (int d = 0; d < head_dim; ++d) qs[i][d] = qb[(int64_t)i * head_dim + d] * scale;
        memset(acc[i], 0, sizeof(float) * head_dim);
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int blk = start / block_size; blk < num_blocks; ++blk) {
        const int64_t block_id = block_tables[(int64_t)b * bt_stride + blk];
        const int64_t k_base = block_id * stride_block + (int64_t)h0 * head_dim;
        const int64_t v_base = k_base + stride_kv;
        // The next block's rows of this item, fetched a row at a time as this block's rows are
        // computed (bench/cpu_attention.py: 1.1x in float32, 1.5x in bfloat16).
        const char *next = NULL;
        if (blk + 1 < num_blocks)
            next = (const char *)kv_layer +
                   (block_tables[(int64_t)b * bt_stride + blk + 1] * stride_block +
                    (int64_t)h0 * head_dim) * elem;
        const int n = (seq_len - blk * block_size) < block_size ? (seq_len - blk * block_size)
                                                                : block_size;
        // Slots [t0, n) of this block are in the window (t0 > 0 only in its first block).
        const int t0 = blk * block_size < start ? start - blk * block_size : 0;
        // Each key row (nh heads side by side) is read once for the whole item.
        for (int t = t0; t < n; ++t) {
            if (next) prefetch_row(next + t * stride_tok * elem, row_bytes);
            for (int h = 0; h < nh; ++h) {
                const int64_t k = k_base + t * stride_tok + (int64_t)h * head_dim;
                for (int g = 0; g < group; ++g) {
                    const float *qi = qs[h * group + g];
                    float dot = 0.0f;
                    for (int d = 0; d < head_dim; ++d) dot += qi[d] * load(kv_layer, k + d, bf16);
                    s[h * group + g][t] = dot;
                }
            }
        }
        for (int i = 0; i < heads; ++i) {
            if (softcap > 0.0f)
                for (int t = t0; t < n; ++t) s[i][t] = softcap * tanhf(s[i][t] * inv_cap);
            float block_max = m[i];
            for (int t = t0; t < n; ++t) block_max = s[i][t] > block_max ? s[i][t] : block_max;
            const float correction = exp_nonpos(m[i] - block_max);
            float sum = 0.0f;
            for (int t = t0; t < n; ++t) {
                s[i][t] = exp_nonpos(s[i][t] - block_max);
                sum += s[i][t];
            }
            l[i] = l[i] * correction + sum;
            for (int d = 0; d < head_dim; ++d) acc[i][d] *= correction;
            m[i] = block_max;
        }
        for (int t = t0; t < n; ++t) {
            if (next) prefetch_row(next + (stride_kv + t * stride_tok) * elem, row_bytes);
            for (int h = 0; h < nh; ++h) {
                const int64_t v = v_base + t * stride_tok + (int64_t)h * head_dim;
                for (int g = 0; g < group; ++g) {
                    const float p = s[h * group + g][t];
                    float *a = acc[h * group + g];
                    for (int d = 0; d < head_dim; ++d) a[d] += p * load(kv_layer, v + d, bf16);
                }
            }
        }
    }
    float *ob = out + ((int64_t)b * num_heads + (int64_t)h0 * group) * head_dim;
    for (int i = 0; i < heads; ++i) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int d = 0; d < head_dim; ++d) ob[(int64_t)i * head_dim + d] = acc[i][d] * inv;
    }
}
