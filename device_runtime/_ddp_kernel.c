/* The device's distributed-DP encoding in one compiled pass (device_runtime/ddp_kernel.py loads it
 * with ctypes; no Python API is used, so no Python headers are needed).
 *
 * Why it exists: in numpy the encoding's stages (the randomized Hadamard rotation, the conditional
 * rounding's uniforms, the Gaussian noise share) each cost about what the whole Secure Aggregation
 * masking of the same vector does (docs/benchmarks/dp.md). Here the vector goes through memory
 * once: the rotation's outer factor over column strips, then each block of 2^14 entries (128 KiB,
 * in L2) through the rest of the transform, the rounding and the noise while it is in cache.
 *
 * Randomness: xoshiro256++ (Blackman and Vigna) from a 256-bit state the caller draws from its own
 * generator; standard normals by the ziggurat method (Marsaglia and Tsang 2000) over tables the
 * caller computes (device_runtime/ziggurat.py) and passes in, so that the tables are checked in
 * Python. Every function is pure apart from advancing the state it is given.
 *
 * Bump DDP_KERNEL_VERSION whenever a function's signature or draw order changes: the loader refuses
 * a library whose version differs from the one it was written for (a stale build). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DDP_KERNEL_VERSION 1
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

void ddp_fill_uniform(uint64_t *s, double *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = next_unit(s);
}

void ddp_fill_normal(uint64_t *s, const ziggurat_t *z, double *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = normal(s, z);
}

/* ---- the Walsh-Hadamard transform, unnormalized, in place ----------------------------------- */

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
static void levels4(double *y, int64_t n, int64_t h) {
    for (int64_t i = 0; i < n; i += 4 * h) butterfly4(y + i, y + i + h, y + i + 2 * h, y + i + 3 * h, h);
}

static void level2(double *y, int64_t n, int64_t h) {
    for (int64_t i = 0; i < n; i += 2 * h) butterfly2(y + i, y + i + h, h);
}

/* levels 0 and 1 in registers, four entries at a time */
static void levels_first(double *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i += 4) {
        double a = y[i], b = y[i + 1], c = y[i + 2], d = y[i + 3];
        double p = a + b, q = a - b, u = c + d, v = c - d;
        y[i] = p + u;
        y[i + 1] = q + v;
        y[i + 2] = p - u;
        y[i + 3] = q - v;
    }
}

static void levels_from(double *y, int64_t n, int64_t h) {
    for (; 4 * h <= n; h *= 4) levels4(y, n, h);
    if (2 * h <= n) level2(y, n, h);
}

static void fwht_block(double *y, int64_t n) {
    if (n >= 4) {
        levels_first(y, n);
        levels_from(y, n, 4);
    } else {
        levels_from(y, n, 1);
    }
}

/* the transform across `rows` rows of a strip `width` wide (row stride `stride`) */
static void fwht_rows(double *y, int64_t rows, int64_t stride, int64_t width) {
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
static void outer_factor(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, double *out) {
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
void ddp_fwht(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, double *out) {
    int64_t cols = block_size(d);
    outer_factor(x, m, signs, d, scale, out);
    for (int64_t b0 = 0; b0 < d; b0 += cols) fwht_block(out + b0, cols);
}

/* The encoding (device_runtime.ddp.encode): y = scale * H (signs * x), then block by block
 * q = floor(y + U) with one uniform per entry, its squared norm summed, and, if `noise`, plus
 * rint(std * N) with one standard normal per entry (a block's uniforms, then its normals), reduced
 * with `mask` (the modulus minus one, a power of two). `out` (d entries of 8 bytes) ends as int64
 * residues. Returns the squared norm of floor(y + U), which the caller checks against the
 * conditional rounding's bound (a failed attempt is redone from x with the state as it is now).
 * The caller guarantees |y| + 1 < 2^62 and std * 64 < 2^62, so the int64 arithmetic is exact. */
double ddp_encode(const double *x, int64_t m, const int8_t *signs, int64_t d, double scale, uint64_t *s,
                  const ziggurat_t *z, double std, int64_t mask, int noise, double *out) {
    int64_t cols = block_size(d);
    double norm2 = 0.0;
    outer_factor(x, m, signs, d, scale, out);
    for (int64_t b0 = 0; b0 < d; b0 += cols) {
        double *y = out + b0;
        int64_t *q = (int64_t *)(void *)y; /* each entry is read as a double before it is written as an int64 */
        fwht_block(y, cols);
        for (int64_t t = 0; t < cols; t++) {
            double v = y[t] + next_unit(s);
            int64_t f = (int64_t)v; /* truncation; one less below zero where v is not whole: floor */
            f -= (double)f > v;
            norm2 += (double)f * (double)f;
            q[t] = f;
        }
        if (noise)
            for (int64_t t = 0; t < cols; t++) q[t] = (q[t] + llrint(normal(s, z) * std)) & mask;
        else
            for (int64_t t = 0; t < cols; t++) q[t] &= mask;
    }
    return norm2;
}
