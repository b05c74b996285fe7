"""The device sampler's CUDA C++ source: `sampling.sample` and `sampling.logprobs` for rows of logits that stay in
device memory, one thread block per row, so only a token, its log-prob and the top_n best cross to the host.

The vocabulary is never sorted (only the top_n, at most 20). Every order statistic is a selection over the float32
logits' order-preserving 32-bit keys (-0.0 read as +0.0, so it ties with +0.0 as numpy's comparisons do):

- the greedy token and the row max, with the first maximum, in one pass; a NaN or infinite max marks the row bad;
- the log-normalizer: the float64 sum of float32 exp(logit - max) over the row;
- "the m best tokens" (top-k, the kept prefix, the top_n) by radix select, 8 bits a pass over a 256-bin count
  histogram, then, where the m-th value ties, a second radix select over the tied ids (their lowest fill the
  prefix, as numpy's cut does);
- top-p by bisection over the keys: the least key whose strictly-greater tokens hold mass below top_p of the
  total (float64 sums of the float32 weights exp((v - max) / T)), then the tokens tied at it counted one by one
  against the goal; min-p by counting weights >= float32(min_p);
- the choice: Gumbel noise from the SplitMix64 hash of (seed, position, token), computed only for kept tokens whose
  scaled logit is at least -41 (a token below it scores under -4.26, and the max token never scores under -3.61),
  argmax with ties to the lowest id.

Each step reads the row once (from L2 on the GPU): greedy with top_n takes about 8 reads, top-k about 12, top-p
about 45 (32 of them its bisection), min-p 8; the noise is computed only in the last read.

The source also compiles with a host C++ compiler: every barrier-separated phase is a loop over thread ids there,
per-thread state lives in the shared struct, and `glance_choose_host` runs the blocks one after another. Apart from
the ulps in which libm's expf and log differ from CUDA's, the host build computes the same bits as the device,
so the host build is what tests check against the numpy sampler.

Float64 sums are taken in a fixed order (each thread's tokens in id order, then a tree over the threads): the same
on every run, but not numpy's order (a pairwise sum over the row, a running sum in sorted order for top-p's
prefix). The two can differ in the last bits, so a top-p cut can land one token apart from numpy's only where the
mass before a token equals top_p times the total to within that rounding, and the token drawn changes only if that
one token is also the one the noise picks. The same holds for weights within an ulp of min_p, since numpy's
float32 exp is not the CUDA or libm one. Rows holding NaN or +inf (or only -inf) are reported bad, never sampled.
"""
from __future__ import annotations

from ..decode.sampling import MAX_TOP_N

BLOCK = 512  # threads per row's block; the host build loops over as many, so both reduce in the same order
KERNEL = "glance_choose"
HOST_ENTRY = "glance_choose_host"
MAX_TOP = MAX_TOP_N  # the most top log-probs a row reports

_TEMPLATE = r"""
#define GL_BLOCK @BLOCK@
#define GL_MAX_TOP @MAX_TOP@

typedef unsigned int gl_u32;
typedef unsigned long long gl_u64;
typedef long long gl_i64;

#ifdef __CUDACC__
#define GL_FN __device__ __forceinline__
#define GL_PHASE __syncthreads(); { const int tid = (int)threadIdx.x;
#define GL_END } __syncthreads();
#define GL_SINGLE __syncthreads(); if (threadIdx.x == 0) {
#define GL_SINGLE_END } __syncthreads();
#else
#include <math.h>
#include <string.h>
#define GL_FN static inline
#define GL_PHASE for (int tid = 0; tid < GL_BLOCK; ++tid) {
#define GL_END }
#define GL_SINGLE {
#define GL_SINGLE_END }
#endif

#define GL_GAMMA 0x9E3779B97F4A7C15ULL
#define GL_SKIP (-41.0f)

struct GlShared {
    double d[GL_BLOCK];
    gl_u32 c[GL_BLOCK];
    int i[GL_BLOCK];
    gl_u32 hist[256];
    gl_u32 scan[256];
    gl_u32 tmp[256];
    gl_u32 pick;
    gl_u32 slots;
    gl_u32 top_key[GL_MAX_TOP];
    int top_id[GL_MAX_TOP];
};

struct GlRow {
    const float* x;
    int vocab;
    float top;
    float temperature;
};

struct GlCut {  // the prefix of (logit desc, id asc): key > key, or key == key and id < id
    gl_u32 key;
    int id;
    gl_u32 above;
};

struct GlSel {
    gl_u32 value;
    gl_u32 above;
    gl_u32 equal;
};

GL_FN gl_u32 gl_bits(float x) {
#ifdef __CUDACC__
    return __float_as_uint(x);
#else
    gl_u32 b;
    memcpy(&b, &x, sizeof b);
    return b;
#endif
}

GL_FN float gl_float(gl_u32 b) {
#ifdef __CUDACC__
    return __uint_as_float(b);
#else
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
#endif
}

GL_FN gl_u32 gl_key(float x) {
    gl_u32 b = gl_bits(x);
    if (b == 0x80000000u) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

GL_FN float gl_value(gl_u32 k) { return gl_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

GL_FN bool gl_in(const GlCut& cut, gl_u32 k, int t) { return k > cut.key || (k == cut.key && t < cut.id); }

GL_FN gl_u64 gl_mix(gl_u64 z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

GL_FN double gl_gumbel(gl_u64 row_key, int t) {
    const gl_u64 bits = gl_mix(row_key + ((gl_u64)t + 1ULL) * GL_GAMMA);
    const double u = ((double)(bits >> 12) + 0.5) * 2.220446049250313080847263336181640625e-16;
    return -log(-log(u));
}

GL_FN float gl_scaled(const GlRow& r, float x) { return (x - r.top) / r.temperature; }

GL_FN float gl_weight(const GlRow& r, float x) { return expf(gl_scaled(r, x)); }

GL_FN void gl_hist_add(gl_u32* hist, gl_u32 bin) {
#if defined(__CUDACC__) && __CUDA_ARCH__ >= 700
    const gl_u32 group = __match_any_sync(0xffffffffu, bin);
    if (bin < 256u && (gl_u32)(__ffs(group) - 1) == (threadIdx.x & 31u)) atomicAdd(&hist[bin], (gl_u32)__popc(group));
#elif defined(__CUDACC__)
    if (bin < 256u) atomicAdd(&hist[bin], 1u);
#else
    if (bin < 256u) ++hist[bin];
#endif
}

GL_FN gl_u32 gl_slot(gl_u32* slots) {
#ifdef __CUDACC__
    return atomicAdd(slots, 1u);
#else
    return (*slots)++;
#endif
}

GL_FN double gl_sum(GlShared& sh) {
    for (int s = GL_BLOCK / 2; s > 0; s >>= 1) {
        GL_PHASE if (tid < s) sh.d[tid] += sh.d[tid + s]; GL_END
    }
    return sh.d[0];
}

GL_FN gl_u32 gl_total(GlShared& sh) {
    for (int s = GL_BLOCK / 2; s > 0; s >>= 1) {
        GL_PHASE if (tid < s) sh.c[tid] += sh.c[tid + s]; GL_END
    }
    return sh.c[0];
}

GL_FN gl_u32 gl_least(GlShared& sh) {
    for (int s = GL_BLOCK / 2; s > 0; s >>= 1) {
        GL_PHASE if (tid < s && sh.c[tid + s] < sh.c[tid]) sh.c[tid] = sh.c[tid + s]; GL_END
    }
    return sh.c[0];
}

// The largest d with the lowest id i among the threads that hold one (i >= 0).
GL_FN int gl_best(GlShared& sh) {
    for (int s = GL_BLOCK / 2; s > 0; s >>= 1) {
        GL_PHASE
            if (tid < s) {
                const int j = sh.i[tid + s], k = sh.i[tid];
                if (j >= 0 && (k < 0 || sh.d[tid + s] > sh.d[tid] || (sh.d[tid + s] == sh.d[tid] && j < k))) {
                    sh.d[tid] = sh.d[tid + s];
                    sh.i[tid] = j;
                }
            }
        GL_END
    }
    return sh.i[0];
}

template <class P> GL_FN gl_u32 gl_count(GlShared& sh, const GlRow& r, P pred) {
    GL_PHASE
        gl_u32 n = 0;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) {
            const float x = r.x[t];
            if (pred(x, gl_key(x), t)) ++n;
        }
        sh.c[tid] = n;
    GL_END
    return gl_total(sh);
}

template <class P> GL_FN double gl_mass(GlShared& sh, const GlRow& r, P pred) {
    GL_PHASE
        double acc = 0.0;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) {
            const float x = r.x[t];
            if (pred(x, gl_key(x), t)) acc += (double)gl_weight(r, x);
        }
        sh.d[tid] = acc;
    GL_END
    return gl_sum(sh);
}

// The m-th largest of value(x, key, t, &v) over the tokens where it returns true, 8 bits a pass; with how many
// values are above it and equal to it.
template <class V> GL_FN GlSel gl_select(GlShared& sh, const GlRow& r, gl_u32 m, V value) {
    GlSel sel = {0u, 0u, 0u};
    gl_u32 rem = m;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const gl_u32 high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        const gl_u32 prefix = sel.value;
        GL_PHASE if (tid < 256) sh.hist[tid] = 0u; GL_END
        GL_PHASE
            for (int base = 0; base < r.vocab; base += GL_BLOCK) {
                const int t = base + tid;
                gl_u32 bin = 256u;
                if (t < r.vocab) {
                    const float x = r.x[t];
                    gl_u32 v = 0u;
                    if (value(x, gl_key(x), t, v) && (v & high) == (prefix & high)) bin = (v >> shift) & 255u;
                }
                gl_hist_add(sh.hist, bin);
            }
        GL_END
        GL_PHASE if (tid < 256) sh.scan[tid] = sh.hist[tid]; GL_END
        for (int off = 1; off < 256; off <<= 1) {  // suffix sums: scan[b] = hist[b] + ... + hist[255]
            GL_PHASE if (tid < 256) sh.tmp[tid] = sh.scan[tid] + (tid + off < 256 ? sh.scan[tid + off] : 0u); GL_END
            GL_PHASE if (tid < 256) sh.scan[tid] = sh.tmp[tid]; GL_END
        }
        GL_PHASE
            if (tid < 256) {
                const gl_u32 higher = tid < 255 ? sh.scan[tid + 1] : 0u;
                if (higher < rem && rem <= sh.scan[tid]) sh.pick = (gl_u32)tid;
            }
        GL_END
        const gl_u32 b = sh.pick;
        const gl_u32 higher = b < 255u ? sh.scan[b + 1] : 0u;
        sel.above += higher;
        rem -= higher;
        sel.equal = sh.hist[b];
        sel.value = prefix | (b << shift);
    }
    return sel;
}

GL_FN GlCut gl_cut(GlShared& sh, const GlRow& r, gl_u32 m) {
    const GlSel sel = gl_select(sh, r, m, [](float, gl_u32 k, int, gl_u32& v) { v = k; return true; });
    GlCut cut = {sel.value, r.vocab, sel.above};
    const gl_u32 need = m - sel.above;
    if (need < sel.equal) {
        const gl_u32 key = sel.value;
        const GlSel ids = gl_select(sh, r, need, [key](float, gl_u32 k, int t, gl_u32& v) {
            v = ~(gl_u32)t;
            return k == key;
        });
        cut.id = (int)~ids.value + 1;
    }
    return cut;
}

GL_FN gl_u32 gl_nucleus(GlShared& sh, const GlRow& r, double top_p, const GlCut& cut, gl_u32 size) {
    const gl_u32 vocab = (gl_u32)r.vocab;
    double total;
    if (size < vocab) {
        const gl_u32 key = cut.key;
        total = gl_mass(sh, r, [key](float, gl_u32 k, int) { return k > key; })
              + (double)(size - cut.above) * (double)gl_weight(r, gl_value(key));
    } else {
        total = gl_mass(sh, r, [](float, gl_u32 k, int) { return k > 0u; });
    }
    const double goal = top_p * total;
    gl_u32 floor = 0u;  // the least key whose strictly-greater tokens weigh less than the goal
    if (size == vocab || gl_mass(sh, r, [](float, gl_u32 k, int) { return k > 0u; }) >= goal) {
        gl_u32 low = 0u;
        for (int bit = 31; bit >= 0; --bit) {
            const gl_u32 probe = low | (1u << bit);
            if (gl_mass(sh, r, [probe](float, gl_u32 k, int) { return k > probe; }) >= goal) low = probe;
        }
        floor = low + 1u;
    }
    GL_PHASE
        gl_u32 least = 0xffffffffu;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) {
            const gl_u32 k = gl_key(r.x[t]);
            if (k >= floor && k < least) least = k;
        }
        sh.c[tid] = least;
    GL_END
    const gl_u32 last = gl_least(sh);
    const gl_u32 above = gl_count(sh, r, [last](float, gl_u32 k, int) { return k > last; });
    const gl_u32 equal = gl_count(sh, r, [last](float, gl_u32 k, int) { return k == last; });
    const double before = gl_mass(sh, r, [last](float, gl_u32 k, int) { return k > last; });
    const double w = (double)gl_weight(r, gl_value(last));
    GL_PHASE
        gl_u32 n = 0;
        for (gl_u32 j = (gl_u32)tid; j < equal; j += GL_BLOCK) if (before + (double)j * w < goal) ++n;
        sh.c[tid] = n;
    GL_END
    return above + gl_total(sh);
}

GL_FN int gl_sample(GlShared& sh, const GlRow& r, int top_k, double top_p, float min_p, gl_u64 row_key) {
    const gl_u32 vocab = (gl_u32)r.vocab;
    GlCut cut = {0u, 0, 0u};  // every token: no finite key is 0
    gl_u32 size = vocab, keep = vocab;
    if (top_k > 0 && (gl_u32)top_k < vocab) {
        keep = size = (gl_u32)top_k;
        cut = gl_cut(sh, r, size);
    }
    if (top_p < 1.0) {
        const gl_u32 nucleus = gl_nucleus(sh, r, top_p, cut, size);
        if (nucleus < keep) keep = nucleus;
    }
    if (min_p > 0.0f) {
        const GlRow& row = r;
        const gl_u32 strong = gl_count(sh, r, [&row, min_p](float x, gl_u32, int) {
            return gl_weight(row, x) >= min_p;
        });
        if (strong < keep) keep = strong;
    }
    if (keep != size) {
        cut = gl_cut(sh, r, keep);
    }
    GL_PHASE
        double best = 0.0;
        int arg = -1;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) {
            const float x = r.x[t];
            if (!gl_in(cut, gl_key(x), t)) continue;
            const float s = gl_scaled(r, x);
            if (!(s >= GL_SKIP)) continue;
            const double score = (double)s + gl_gumbel(row_key, t);
            if (arg < 0 || score > best) {
                best = score;
                arg = t;
            }
        }
        sh.d[tid] = best;
        sh.i[tid] = arg;
    GL_END
    return gl_best(sh);
}

struct GlArgs {
    const float* logits;
    gl_i64 stride;
    int vocab;
    const gl_i64* rows;
    int n;
    float temperature;
    int top_k;
    double top_p;
    float min_p;
    gl_u64 seed;
    int top_n;
    unsigned char* out;
};

GL_FN void gl_row(GlShared& sh, const GlArgs& a, int b) {
    const int n = a.n, width = a.top_n < a.vocab ? a.top_n : a.vocab;
    gl_i64* tokens = (gl_i64*)a.out;
    double* logprob = (double*)(a.out + 8 * (gl_i64)n);
    gl_i64* status = (gl_i64*)(a.out + 16 * (gl_i64)n);
    gl_i64* top_ids = (gl_i64*)(a.out + 24 * (gl_i64)n) + (gl_i64)b * a.top_n;
    float* top_lp = (float*)(a.out + (24 + 8 * (gl_i64)a.top_n) * n) + (gl_i64)b * a.top_n;
    GlRow r;
    r.x = a.logits + a.rows[b] * a.stride;
    r.vocab = a.vocab;
    r.temperature = a.temperature;
    r.top = 0.0f;

    GL_PHASE
        double best = 0.0;
        int arg = -1;
        gl_u32 bad = 0u;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) {
            const float x = r.x[t];
            if (x != x) bad = 1u;
            else if (arg < 0 || (double)x > best) {
                best = (double)x;
                arg = t;
            }
        }
        sh.d[tid] = best;
        sh.i[tid] = arg;
        sh.c[tid] = bad;
    GL_END
    const int argmax = gl_best(sh);
    const float top = (float)sh.d[0];
    if (gl_total(sh) != 0u || !(top - top == 0.0f)) {
        GL_SINGLE
            tokens[b] = -1;
            logprob[b] = 0.0;
            status[b] = 1;
            for (int j = 0; j < a.top_n; ++j) {
                top_ids[j] = -1;
                top_lp[j] = 0.0f;
            }
        GL_SINGLE_END
        return;
    }
    r.top = top;
    GL_PHASE
        double acc = 0.0;
        for (int t = tid; t < r.vocab; t += GL_BLOCK) acc += (double)expf(r.x[t] - top);
        sh.d[tid] = acc;
    GL_END
    const double norm = (double)top + log(gl_sum(sh));
    int token = argmax;
    if (a.temperature > 0.0f) {
        const gl_u64 row_key = gl_mix(gl_mix(a.seed) + ((gl_u64)a.rows[a.n + b] + 1ULL) * GL_GAMMA);
        token = gl_sample(sh, r, a.top_k, a.top_p, a.min_p, row_key);
    }
    if (width > 0) {
        const GlCut best = gl_cut(sh, r, (gl_u32)width);
        GL_SINGLE sh.slots = 0u; GL_SINGLE_END
        GL_PHASE
            for (int t = tid; t < r.vocab; t += GL_BLOCK) {
                const gl_u32 k = gl_key(r.x[t]);
                if (gl_in(best, k, t)) {
                    const gl_u32 s = gl_slot(&sh.slots);
                    sh.top_key[s] = k;
                    sh.top_id[s] = t;
                }
            }
        GL_END
    }
    GL_SINGLE
        for (int j = 1; j < width; ++j) {  // best first, ties by id
            const gl_u32 k = sh.top_key[j];
            const int t = sh.top_id[j];
            int at = j;
            while (at > 0 && (sh.top_key[at - 1] < k || (sh.top_key[at - 1] == k && sh.top_id[at - 1] > t))) {
                sh.top_key[at] = sh.top_key[at - 1];
                sh.top_id[at] = sh.top_id[at - 1];
                --at;
            }
            sh.top_key[at] = k;
            sh.top_id[at] = t;
        }
        for (int j = 0; j < a.top_n; ++j) {
            top_ids[j] = j < width ? sh.top_id[j] : -1;
            top_lp[j] = j < width ? (float)((double)r.x[sh.top_id[j]] - norm) : 0.0f;
        }
        tokens[b] = token;
        logprob[b] = (double)r.x[token] - norm;
        status[b] = 0;
    GL_SINGLE_END
}

#ifdef __CUDACC__
extern "C" __global__ void __launch_bounds__(GL_BLOCK) glance_choose(
        const float* logits, long long stride, int vocab, const long long* rows_positions, int n, float temperature,
        int top_k, double top_p, float min_p, unsigned long long seed, int top_n, unsigned char* out) {
    __shared__ GlShared sh;
    const GlArgs a = {logits, stride, vocab, rows_positions, n, temperature, top_k, top_p, min_p, seed, top_n, out};
    gl_row(sh, a, (int)blockIdx.x);
}
#else
extern "C" void glance_choose_host(
        const float* logits, long long stride, int vocab, const long long* rows_positions, int n, float temperature,
        int top_k, double top_p, float min_p, unsigned long long seed, int top_n, unsigned char* out) {
    GlShared* sh = new GlShared;
    const GlArgs a = {logits, stride, vocab, rows_positions, n, temperature, top_k, top_p, min_p, seed, top_n, out};
    for (int b = 0; b < n; ++b) gl_row(*sh, a, b);
    delete sh;
}

extern "C" double glance_gumbel_host(unsigned long long seed, long long position, int token) {
    return gl_gumbel(gl_mix(gl_mix(seed) + ((gl_u64)position + 1ULL) * GL_GAMMA), token);
}
#endif
"""

SOURCE = _TEMPLATE.replace("@BLOCK@", str(BLOCK)).replace("@MAX_TOP@", str(MAX_TOP))
