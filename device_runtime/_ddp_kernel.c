/* The device's distributed-DP encoding in one compiled pass (device_runtime/ddp_kernel.py loads it
 * with ctypes; no Python API is used, so no Python headers are needed).
 *
 * Why it exists: in numpy the encoding's stages (the randomized Hadamard rotation, the conditional
 * rounding's uniforms, the Gaussian noise share) each cost about what the whole Secure Aggregation
 * masking of the same vector does (docs/benchmarks/dp.md). Here the vector goes through memory
 * once: the rotation's outer factor over column strips, then each block of 2^14 entries (128 KiB,
 * in L2) through the rest of the transform, the rounding and the noise while it is in cache.
 *
 * Randomness: xoshiro256++ (Blackman and Vigna), from a state of STATE_WORDS words the caller draws
 * from its own generator: four streams side by side in vector lanes for the rounding's uniforms, and
 * one more for the noise; standard normals by the ziggurat method (Marsaglia and Tsang 2000) over
 * tables the caller computes (device_runtime/ziggurat.py) and passes in, so that the tables are
 * checked in Python. Every function is pure apart from advancing the state it is given.
 *
 * Bump DDP_KERNEL_VERSION whenever a function's signature or draw order changes: the loader refuses
 * a library whose version differs from the one it was written for (a stale build). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DDP_KERNEL_VERSION 2
#define STATE_WORDS 20 /* 16 for the four rounding lanes (word w of lane l at 4 w + l), 4 for the noise */
#define LAYERS 256
#define BLOCK_BITS 14 /* a block: 2^14 float64 entries, 128 KiB */
#define STRIP 256     /* columns of the outer factor's strips: 64 rows x 256 = 128 KiB at 2^20 */

/* The ziggurat's layers (device_runtime/ziggurat.py): layer i is drawn with probability 1/256 as a
 * point uniform in [0, width_i) x [lo_i, hi_i); below `fast_i` (in units of 2^-52 of the width) the
 * point is under the density whatever its height. Layer 0 is the base strip and the tail past r. */
typedef struct {
    uint64_t fast[LAYERS];
    double width[LAYERS]; /* width_i / 2^52 */
    double lo[LAYERS];
    double hi[LAYERS];
    double r;
} ziggurat_t;

int ddp_kernel_version(void) { return DDP_KERNEL_VERSION; }

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t next_u64(uint64_t *s) {
    uint64_t result = rotl(s[0] + s[3], 23) + s[0];
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* The rounding's generator: four xoshiro256++ streams stepped together in vector lanes (GCC's and
 * Clang's vector extensions: one AVX2 register in the x86-64-v3 and v4 clones, two SSE2 ones on
 * baseline x86-64), their draws interleaved: lane 0 to 3, then lane 0 again. */
typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));

typedef struct {
    u64x4 s0, s1, s2, s3;
} lanes_t;

static inline lanes_t lanes_load(const uint64_t *s) {
    lanes_t g;
    memcpy(&g.s0, s, sizeof g.s0);
    memcpy(&g.s1, s + 4, sizeof g.s1);
    memcpy(&g.s2, s + 8, sizeof g.s2);
    memcpy(&g.s3, s + 12, sizeof g.s3);
    return g;
}

static inline void lanes_store(const lanes_t *g, uint64_t *s) {
    memcpy(s, &g->s0, sizeof g->s0);
    memcpy(s + 4, &g->s1, sizeof g->s1);
    memcpy(s + 8, &g->s2, sizeof g->s2);
    memcpy(s + 12, &g->s3, sizeof g->s3);
}

static inline u64x4 rotl4(u64x4 x, int k) { return (x << k) | (x >> (64 - k)); }

static inline u64x4 lanes_next(lanes_t *g) {
    u64x4 result = rotl4(g->s0 + g->s3, 23) + g->s0;
    u64x4 t = g->s1 << 17;
    g->s2 ^= g->s0;
    g->s3 ^= g->s1;
    g->s1 ^= g->s2;
    g->s0 ^= g->s3;
    g->s2 ^= t;
    g->s3 = rotl4(g->s3, 45);
    return result;
}

#define ONE_BITS 0x3FF0000000000000ULL

/* four uniforms in [0, 1): each draw's top 52 bits as the mantissa of a number in [1, 2), minus 1 */
static inline f64x4 units_of(u64x4 r) {
    u64x4 one = {ONE_BITS, ONE_BITS, ONE_BITS, ONE_BITS};
    return (f64x4)((r >> 12) | one) - 1.0;
}

/* uniform in [0, 1): the top 53 bits (below 2^53, so the signed conversion is exact and cheap) */
static inline double next_unit(uint64_t *s) { return (double)(int64_t)(next_u64(s) >> 11) * 0x1.0p-53; }

/* uniform in (0, 1], for logarithms */
static inline double next_open(uint64_t *s) { return (double)(int64_t)((next_u64(s) >> 11) + 1) * 0x1.0p-53; }

static inline double with_sign(double x, int negative) { return negative ? -x : x; }

/* The rare part of a draw: the wedge test of layers 1..255, the tail past r for layer 0, and
 * fresh draws after a rejection. */
static double normal_slow(uint64_t *s, const ziggurat_t *z, int layer, uint64_t bits, int negative) {
    for (;;) {
        double x = (double)(int64_t)bits * z->width[layer];
        if (layer == 0) {
            if (x < z->r) return with_sign(x, negative); /* inside the base rectangle */
            for (;;) {                                   /* Marsaglia's tail: r + a, a ~ Exp(r) accepted */
                double a = -log(next_open(s)) / z->r;
                double b = -log(next_open(s));
                if (b + b > a * a) return with_sign(z->r + a, negative);
            }
        }
        double y = z->lo[layer] + next_unit(s) * (z->hi[layer] - z->lo[layer]);
        if (y < exp(-0.5 * x * x)) return with_sign(x, negative);
        uint64_t u = next_u64(s);
        layer = (int)(u & 0xff);
        negative = (int)((u >> 8) & 1);
        bits = u >> 12;
        if (bits < z->fast[layer]) return with_sign((double)(int64_t)bits * z->width[layer], negative);
    }
}

/* One standard normal: 8 bits pick the layer, 1 the sign, 52 the position. */
static inline double normal(uint64_t *s, const ziggurat_t *z) {
    uint64_t u = next_u64(s);
    int layer = (int)(u & 0xff);
    uint64_t bits = u >> 12;
    if (__builtin_expect(bits < z->fast[layer], 1)) {
        double x = (double)(int64_t)bits * z->width[layer];
        uint64_t word;
        memcpy(&word, &x, sizeof word);
        word ^= (u & 0x100) << 55; /* the sign bit */
        memcpy(&x, &word, sizeof x);
        return x;
    }
    return normal_slow(s, z, layer, bits, (int)((u >> 8) & 1));
}

/* The rounding's next n uniforms: ceil(n / 4) steps of the lanes, a last step's unused lanes dropped. */
void ddp_fill_uniform(uint64_t *s, double *out, int64_t n) {
    lanes_t g = lanes_load(s);
    for (int64_t i = 0; i < n; i += 4) {
        f64x4 u = units_of(lanes_next(&g));
        for (int64_t k = 0; k < 4 && i + k < n; k++) out[i + k] = u[k];
    }
    lanes_store(&g, s);
}

/* The noise's next n standard normals. */
void ddp_fill_normal(uint64_t *s, const ziggurat_t *z, double *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = normal(s + 16, z);
}

/* ---- the Walsh-Hadamard transform, unnormalized, in place ----------------------------------- */

/* The transform's loops are inlined into each exported function, so that they are compiled for
 * each of its clones: the exported functions below run their x86-64-v4 (AVX-512) or v3 (AVX2)
 * clone where the CPU has it, picked once when the library loads (GCC's target_clones, an ifunc).
 * The clones do the same arithmetic in the same order (no fused multiply-adds: setup.py), so they
 * give the same results bit for bit (DDP_NO_CLONES builds the baseline alone, for the test of it). */
#define INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(DDP_NO_CLONES)
#define CLONED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONED
#endif

/* one radix-4 step (two levels) over n columns of four disjoint rows, and one radix-2 step */
static inline void butterfly4(double *restrict a, double *restrict b, double *restrict c, double *restrict d,
                              int64_t n) {
    for (int64_t t = 0; t < n; t++) {
        double p = a[t] + b[t], q = a[t] - b[t], u = c[t] + d[t], v = c[t] - d[t];
        a[t] = p + u;
        b[t] = q + v;
        c[t] = p - u;
        d[t] = q - v;
    }
}

static inline void butterfly2(double *restrict a, double *restrict b, int64_t n) {
    for (int64_t t = 0; t < n; t++) {
        double p = a[t] + b[t], q = a[t] - b[t];
        a[t] = p;
        b[t] = q;
    }
}

/* two levels at once: h and 2h, over a contiguous array of n entries */
static INLINE void levels4(double *y, int64_t n, int64_t h) {
    for (int64_t i = 0; i < n; i += 4 * h) butterfly4(y + i, y + i + h, y + i + 2 * h, y + i + 3 * h, h);
}

static INLINE void level2(double *y, int64_t n, int64_t h) {
    for (int64_t i = 0; i < n; i += 2 * h) butterfly2(y + i, y + i + h, h);
}

/* levels 0 and 1 in registers, four entries at a time */
static INLINE void levels_first(double *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i += 4) {
        double a = y[i], b = y[i + 1], c = y[i + 2], d = y[i + 3];
        double p = a + b, q = a - b, u = c + d, v = c - d;
        y[i] = p + u;
        y[i + 1] = q + v;
        y[i + 2] = p - u;
        y[i + 3] = q - v;
    }
}

static INLINE void levels_from(double *y, int64_t n, int64_t h) {
    for (; 4 * h <= n; h *= 4) levels4(y, n, h);
    if (2 * h <= n) level2(y, n, h);
}

static INLINE void fwht_block(double *y, int64_t n) {
    if (n >= 4) {
        levels_first(y, n);
        levels_from(y, n, 4);
    } else {
        levels_from(y, n, 1);
    }
}

/* the transform across `rows` rows of a strip `width` wide (row stride `stride`) */
static INLINE void fwht_rows(double *y, int64_t rows, int64_t stride, int64_t width) {
    int64_t h = 1;
    for (; 4 * h <= rows; h *= 4)
        for (int64_t i = 0; i < rows; i += 4 * h)
            for (int64_t j = i; j < i + h; j++)
                butterfly4(y + j * stride, y + (j + h) * stride, y + (j + 2 * h) * stride, y + (j + 3 * h) * stride,
                           width);
    if (2 * h <= rows)
        for (int64_t j = 0; j < h; j++) butterfly2(y + j * stride, y + (j + h) * stride, width);
}

static int64_t block_size(int64_t d) { return d < ((int64_t)1 << BLOCK_BITS) ? d : ((int64_t)1 << BLOCK_BITS); }

/* out[0:d] = scale * (H_R (x) I_C) (signs * x zero-padded to d): the outer factor, one strip of
 * columns at a time, each strip gathered from x once and transformed in cache. */
static INLINE void outer_factor(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, double *out) {
    int64_t cols = block_size(d), rows = d / cols;
    int64_t width = rows > 1 && STRIP < cols ? STRIP : cols;
    for (int64_t c0 = 0; c0 < cols; c0 += width) {
        for (int64_t r = 0; r < rows; r++) {
            int64_t start = r * cols + c0;
            int64_t take = m - start < width ? (m - start > 0 ? m - start : 0) : width;
            double *o = out + start;
            if (signs != NULL)
                for (int64_t t = 0; t < take; t++) o[t] = x[start + t] * (double)signs[start + t] * scale;
            else
                for (int64_t t = 0; t < take; t++) o[t] = x[start + t] * scale;
            for (int64_t t = take; t < width; t++) o[t] = 0.0;
        }
        if (rows > 1) fwht_rows(out + c0, rows, cols, width);
    }
}

/* out[0:d] = scale * H (signs * x zero-padded to d), H the unnormalized Walsh-Hadamard matrix and
 * d a power of two; signs may be NULL (all +1). */
CLONED void ddp_fwht(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, double *out) {
    int64_t cols = block_size(d);
    outer_factor(x, m, signs, d, scale, out);
    for (int64_t b0 = 0; b0 < d; b0 += cols) fwht_block(out + b0, cols);
}

/* The encoding (device_runtime.ddp.encode): y = scale * H (signs * x), then block by block
 * q = floor(y + U) with one uniform per entry from the rounding's lanes (ddp_fill_uniform's), its
 * squared norm summed, and, if `noise`, plus rint(std * N) with one standard normal per entry from
 * the noise's stream (ddp_fill_normal's), reduced with `mask` (the modulus minus one, a power of
 * two). `out` (d entries of 8 bytes) ends as int64 residues. Returns the squared norm of
 * floor(y + U), which the caller checks against the conditional rounding's bound (a failed attempt
 * is redone from x with the state as it is now). The caller guarantees |y| + 1 < 2^51 and
 * |std| * 64 < 2^62, so the arithmetic below is exact. */
CLONED double ddp_encode(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, uint64_t *s,
                         const ziggurat_t *z, double std, int64_t mask, int noise, double *out) {
    const double magic = 0x1.8p52; /* (v + magic) - magic: v to the nearest integer, for |v| < 2^51 */
    f64x4 big = {magic, magic, magic, magic};
    i64x4 big_bits = (i64x4)big;
    u64x4 one = {ONE_BITS, ONE_BITS, ONE_BITS, ONE_BITS};
    f64x4 norm2 = {0.0, 0.0, 0.0, 0.0};
    int64_t cols = block_size(d);
    outer_factor(x, m, signs, d, scale, out);
    for (int64_t b0 = 0; b0 < d; b0 += cols) {
        double *y = out + b0;
        int64_t *q = (int64_t *)(void *)y; /* each entry is read as a double before it is written as an int64 */
        fwht_block(y, cols);
        lanes_t g = lanes_load(s);
        for (int64_t t = 0; t < cols; t += 4) {
            int64_t n = cols - t < 4 ? cols - t : 4; /* below 4 only for a vector of 1 or 2 entries */
            f64x4 v = {0.0, 0.0, 0.0, 0.0};
            if (n == 4)
                memcpy(&v, y + t, sizeof v);
            else
                for (int64_t k = 0; k < n; k++) v[k] = y[t + k];
            v += units_of(lanes_next(&g));
            f64x4 near = (v + big) - big;
            f64x4 f = near - (f64x4)((u64x4)(near > v) & one); /* floor: one less where rounding went up */
            i64x4 fq = (i64x4)(f + big) - big_bits;            /* f as an int64, exactly */
            for (int64_t k = n; k < 4; k++) f[k] = 0.0;
            norm2 += f * f;
            if (n == 4)
                memcpy(q + t, &fq, sizeof fq);
            else
                for (int64_t k = 0; k < n; k++) q[t + k] = fq[k];
        }
        lanes_store(&g, s);
        if (noise)
            for (int64_t t = 0; t < cols; t++) q[t] = (q[t] + llrint(normal(s + 16, z) * std)) & mask;
        else
            for (int64_t t = 0; t < cols; t++) q[t] &= mask;
    }
    return (norm2[0] + norm2[1]) + (norm2[2] + norm2[3]);
}
