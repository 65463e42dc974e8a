// Dense products with few token rows for XLA:CPU, called through the XLA FFI (see cpu.py,
// which compiles this file on first use and registers it as a custom call).
//
// A decode step multiplies one (or a few) activation rows by every weight of the model: the step
// is a stream of weight bytes, and its speed is the speed of that stream. XLA:CPU runs these
// products on one core at ~15-20 GB/s for the model's small matrices; this kernel reads each
// weight front to back, split over the cores of XLA's intra-op pool.
//
// y_i[T, N_i] = x[T, K] @ W_i for every weight W_i of the call (several weights may share one x:
// one call for q and fused k/v). Two weight layouts:
// - [K, N_i] ("kn", the model's linear weights): the K rows are cut into contiguous parts; a part
//   streams its rows in order, 8 at a time, and accumulates x[t, k:k+8] @ W[k:k+8, :]
//   into its own partial y (which stays in L1/L2). The partials are summed in part order at the
//   end, so the result does not depend on which thread ran which part.
// - [N_i, K] ("nk", a tied embedding used as LM head): each output is a dot product over one
//   contiguous weight row; the N rows are cut into contiguous parts, no reduction.
// Weights are float32, or int8 with group-wise f32 scales (`quantization="int8"`): one scale per
// output channel and group of g = K / G consecutive input channels (G = 1: per output channel).
// An int8 weight is read as bytes (a quarter of the f32 stream), widened to f32 in registers
// (a vector per vpmovsxbd + vcvtdq2ps) and multiplied like a float one; the scales enter where a
// group's sum is finished:
// - kn, scales [G, N]: parts and 8-row blocks start at multiples of 8 and g is a multiple of 8
//   (of 16 when G > 1; G = 1: one group), so every block lies inside one group: its 8-row partial
//   sum is multiply-added into y with the group's scale row, y[t, n] += (x[t, k:k+8] @ W[k:k+8, n])
//   * s[k / g, n]. Rows past the last full block (G = 1 only) are scaled one by one.
// - nk, scales [N, G]: G = 1 multiplies each finished dot product; G > 1 sums each group's products
//   in registers and multiply-adds that vector with the broadcast s[n, grp] into two running totals
//   (even / odd groups), reduced once per output.
// int4 weights (`quantization="int4"`, kn only, N even) are XLA's packed uint4 codes 0..15, two per
// byte: read as bytes (an eighth of the f32 stream), the nibbles split and interleaved back into
// element order and widened to f32 in registers, then scaled like int8 (the caller adds int4's
// offsets term, (x's group sums) @ offsets, a product of G rows only).
// int4 weights with f16 scales and offsets (`offsets` calls: `quantization="int4"`'s own layout)
// take integer products on activations quantized to 15 bits per 32 channels, their codes [K, N]
// or in tiles read front to back (`tiled`): cpu_kernel_int4.h.
// All arithmetic in f32, in vectors of kLanes lanes: 16 with AVX-512 F/BW/VL, 8 with AVX2 + FMA
// (whichever the compiler flags of this CPU allow; the few per-ISA helpers below are all that
// differs). Parts (one per core: `kPartsPerThread`) are claimed from an atomic counter by the
// caller and by helpers; the caller returns once every part is done (a helper that starts late
// finds nothing left and only touches the shared state it co-owns).
// Helpers: a decode step makes ~120 of these calls a few tens of microseconds apart, and a pool
// thread that went to sleep between two of them takes longer to wake (measured on the 2-core VM)
// than a 1.3 MB product takes to read: a helper that finished its parts therefore lingers,
// spinning up to kLingerNs on a mailbox for the next call's parts (../cpu_helpers.h: the attention
// kernel posts its items there too), and the caller schedules a new helper on the pool only when
// none is lingering. Whether a call takes helpers at all is
// measured, not assumed (cpu_kernel_threads.h: on a loaded machine a preempted helper stalls the
// call, and the caller alone is faster).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_helpers.h"  // the lingering helpers, shared with the attention kernel
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector of kLanes f32 lanes and the few operations the products need, per instruction set
// (chosen by the compiler flags cpu_build.py uses for this CPU). A Mask selects the leading lanes
// of a vector that a row's tail fills; kFull selects them all.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kLanes = 16;
using Vec = __m512;
using Mask = __mmask16;
constexpr Mask kFull = 0xffff;
inline Mask TailMask(int64_t n) { return static_cast<Mask>((1u << n) - 1); }  // n < kLanes
// kLanes consecutive weights from p (masked), widened to f32: int8 by vpmovsxbd + vcvtdq2ps.
inline Vec Load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec Load(const int8_t* p, Mask m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline Vec LoadFull(const float* p) { return _mm512_loadu_ps(p); }
// kLanes 4-bit codes from p (two per byte, low nibble first; masked) as f32: the 8 bytes split
// into low and high nibbles, interleaved back into element order, widened.
inline Vec LoadNibbles(const uint8_t* p, Mask m) {
  const int bytes = (__builtin_popcount(m) + 1) / 2;
  const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << bytes) - 1), p);
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}
inline void Store(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
inline Vec Set1(float a) { return _mm512_set1_ps(a); }
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 has no masked byte loads: a tail (a Mask is its lane count) goes through a zeroed buffer.
constexpr int kLanes = 8;
using Vec = __m256;
using Mask = int;
constexpr Mask kFull = kLanes;
inline Mask TailMask(int64_t n) { return static_cast<Mask>(n); }
inline Vec LoadFull(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadFull(const int8_t* p) {  // 8 bytes, vpmovsxbd + vcvtdq2ps
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
inline Vec Load(const T* p, Mask m) {
  if (m == kFull) return LoadFull(p);
  T buf[kLanes] = {};
  std::memcpy(buf, p, m * sizeof(T));
  return LoadFull(buf);
}
// The 4 bytes broadcast to every lane, lane j shifted right by 4 j and masked to its nibble.
inline Vec LoadNibbles(const uint8_t* p, Mask m) {
  uint32_t v = 0;
  std::memcpy(&v, p, m == kFull ? 4 : (m + 1) / 2);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), shifts);
  return _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(0x0f)));
}
inline void Store(float* p, Mask m, Vec v) {
  if (m == kFull) return _mm256_storeu_ps(p, v);
  float buf[kLanes];
  _mm256_storeu_ps(buf, v);
  std::memcpy(p, buf, m * sizeof(float));
}
inline Vec Set1(float a) { return _mm256_set1_ps(a); }
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "the CPU linear kernel needs AVX2 and FMA, or AVX-512 F/BW/VL (this CPU or compiler lacks them): XLA's dot is used instead"
#endif

// Two 4-bit codes (XLA's packed uint4): element 2i in the low nibble of byte i, 2i + 1 in the high.
struct U4 {
  uint8_t pair;
};
template <typename T>
constexpr int kBits = std::is_same_v<T, U4> ? 4 : 8 * sizeof(T);

// kLanes consecutive weights w[i:i + kLanes] (masked) as f32: T's values, or int4 codes 0..15.
template <typename T>
inline Vec LoadAt(const T* w, int64_t i, Mask m) { return Load(w + i, m); }
inline Vec LoadAt(const U4* w, int64_t i, Mask m) {  // NOTE: i even (rows of an even length)
  return LoadNibbles(&w[i / 2].pair, m);
}
template <typename T>
inline float ValueAt(const T* w, int64_t i) { return static_cast<float>(w[i]); }
inline float ValueAt(const U4* w, int64_t i) { return static_cast<float>((w[i / 2].pair >> (4 * (i & 1))) & 0x0f); }

constexpr int kMaxWeights = 8;
constexpr int kMaxParts = 8;
// One part per thread: on the Sapphire Rapids VM (AVX-512 VNNI) 4 per thread made every part a
// shorter stream and a decode step's int4 products ~10-25% slower (a gate_up-sized call of 120
// distinct weights: 43-45 us with 1 part a thread, 53-60 with 2, 60-64 with 4; BENCHMARKS.md
// "int4 on AVX-512 VNNI").
constexpr int kPartsPerThread = 1;
// Below this many multiply-adds one thread does the whole call.
constexpr int64_t kParallelMinWork = 1 << 16;
// A part of a [K, N] weight holds at least this many rows (and a multiple of 8).
constexpr int64_t kMinRowsPerPart = 64;
// With G > 1 scale groups the group size K / G must be a multiple of this (cpu.py).
constexpr int64_t kGroupMultiple = 16;
static_assert(kGroupMultiple % kLanes == 0, "a group is whole vectors");
// `offsets` calls: x is quantized to 15 bits per block of this many input channels (K and the group
// size multiples of it; parts start at multiples of it).
constexpr int64_t kQBlock = 32;

struct Weight {
  const void* w;       // float or int8, [K, n] or [n, K]; or int4 codes (u4), [K, n]
  const float* scale;  // int8 / int4 weights: [G, n] (kn) or [n, G] (nk); float weights: null
  int64_t groups;      // G (1 for float weights); the group size is K / G
  float* y;            // [T, n]
  int64_t n;
  float* partial;      // [parts - 1, T, n] for the kn layout
  bool u4;             // int4 codes (with scales) rather than int8
  const uint16_t* scale16;   // f16 scales instead of `scale`: `offsets` calls [G, n], nk int8 [n, G]
  const uint16_t* offset16;  // `offsets` calls: f16 offsets [G, n]
};

struct Problem {
  const float* x;  // [T, K]
  int64_t t_len, k_len;
  bool transposed;
  bool int8;  // every weight of the call is int8 or int4 (with scales), or every one is float
  bool offsets;  // every weight is int4 codes with f16 scales and offsets: integer products
  bool tiled;    // offsets calls: the codes in tiles (cpu_kernel_int4.h), N a multiple of 64
  bool dequant;  // `Dequantize` calls: each weight's rows written out as f32 (`Weight::y` [K, n])
  int num_weights;
  Weight weights[kMaxWeights];
  int parts;
  const int8_t* xq;    // `offsets` calls: x quantized (15 bits), its high part [T, K]
  const int8_t* xl;    // and its low part: xq16 = 128 * xq + xl
  const float* xd;     // its scale per block of kQBlock channels, [T, K / kQBlock]
  const float* xsum;   // x's float sum per block, [T, K / kQBlock]
};

// y[t, :] = x[t, k0:k1] @ W[k0:k1, :] (overwrites y), W row-major [K, N] of float, or of int8 or
// int4 codes with scales [G, N] (row k of W in group k / group; int4: N even).
template <typename T>
void KnRange(const float* x, int64_t t_len, int64_t k_len, const T* w, const float* scale,
             int64_t group, int64_t n_len, float* y, int64_t k0, int64_t k1) {
  constexpr bool kScaled = !std::is_same_v<T, float>;
  std::memset(y, 0, t_len * n_len * sizeof(float));
  const Mask tail = TailMask(n_len % kLanes);
  const int64_t n_full = n_len / kLanes * kLanes;
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {
    const int64_t r = k * n_len;  // the block's first weight
    const float* srow = kScaled ? scale + k / group * n_len : nullptr;  // [N], this block's group
    for (int64_t t = 0; t < t_len; ++t) {
      const float* xt = x + t * k_len + k;
      const Vec a0 = Set1(xt[0]), a1 = Set1(xt[1]), a2 = Set1(xt[2]), a3 = Set1(xt[3]);
      const Vec a4 = Set1(xt[4]), a5 = Set1(xt[5]), a6 = Set1(xt[6]), a7 = Set1(xt[7]);
      float* yt = y + t * n_len;
      // Two independent chains of four products each, then one read-modify-write of y (int8:
      // y + (p + q) * scale in one multiply-add).
      auto body = [&](int64_t n, Mask m) {
        Vec p = Mul(a0, LoadAt(w, r + n, m));
        Vec q = Mul(a4, LoadAt(w, r + 4 * n_len + n, m));
        p = Fmadd(a1, LoadAt(w, r + n_len + n, m), p);
        q = Fmadd(a5, LoadAt(w, r + 5 * n_len + n, m), q);
        p = Fmadd(a2, LoadAt(w, r + 2 * n_len + n, m), p);
        q = Fmadd(a6, LoadAt(w, r + 6 * n_len + n, m), q);
        p = Fmadd(a3, LoadAt(w, r + 3 * n_len + n, m), p);
        q = Fmadd(a7, LoadAt(w, r + 7 * n_len + n, m), q);
        const Vec old = Load(yt + n, m);
        if constexpr (kScaled)
          Store(yt + n, m, Fmadd(Add(p, q), Load(srow + n, m), old));
        else
          Store(yt + n, m, Add(old, Add(p, q)));
      };
      // Rows k..k+7 are one contiguous block of 8 * N weights, read here as 8 interleaved row
      // streams, too short for the hardware prefetcher when N is small: the next block is
      // prefetched into L2 front to back, 8 * kLanes weights (kLanes * kBits bytes) per kLanes
      // columns, so it is in when its turn comes (+8% on the model's f32 layer chain with
      // AVX-512; 2 or 4 blocks ahead, or into L1, measured slower).
      if (t == 0 && k + 16 <= k1) {
        const char* ahead = reinterpret_cast<const char*>(w) + (r + 8 * n_len) * kBits<T> / 8;
        for (int64_t n = 0; n < n_full; n += kLanes) {
          for (int b = 0; b < kLanes * kBits<T>; b += 64)
            _mm_prefetch(ahead + n * kBits<T> + b, _MM_HINT_T1);
          body(n, kFull);
        }
      } else {
        for (int64_t n = 0; n < n_full; n += kLanes) body(n, kFull);
      }
      if (tail) body(n_full, tail);
    }
  }
  for (; k < k1; ++k) {
    const int64_t r = k * n_len;
    const float* srow = kScaled ? scale + k / group * n_len : nullptr;
    for (int64_t t = 0; t < t_len; ++t) {
      const float a = x[t * k_len + k];
      for (int64_t n = 0; n < n_len; ++n) {
        const float v = a * ValueAt(w, r + n);
        y[t * n_len + n] += kScaled ? v * srow[n] : v;
      }
    }
  }
}

// One scale as f32: f32 as it is, f16 (int4's tied embedding) widened (F16C).
inline float ScaleValue(float s) { return s; }
inline float ScaleValue(uint16_t s) { return _cvtsh_ss(s); }

template <typename T>
inline float Dot(const float* a, const T* b, int64_t k_len, Mask tail) {
  Vec s0 = Zero(), s1 = Zero();
  int64_t k = 0;
  for (; k + 2 * kLanes <= k_len; k += 2 * kLanes) {
    s0 = Fmadd(LoadFull(a + k), Load(b + k, kFull), s0);
    s1 = Fmadd(LoadFull(a + k + kLanes), Load(b + k + kLanes, kFull), s1);
  }
  for (; k + kLanes <= k_len; k += kLanes) s0 = Fmadd(LoadFull(a + k), Load(b + k, kFull), s0);
  if (tail) s1 = Fmadd(Load(a + k, tail), Load(b + k, tail), s1);
  return Sum(Add(s0, s1));
}

// For each of R rows of x (row r at a + r * k_len, its result stored at y[r * y_stride]): the sum
// over groups grp of s[grp] * (a_r[grp*g : (grp+1)*g] . b[same]), g = kLanes * vecs (V = 0: `vecs`
// known at run time only). Each group's products are summed in registers (one multiply-add chain
// a row), then multiply-added with its broadcast scale into one of two running totals (even / odd
// groups), in a fixed order. A group's weights are loaded and widened once for all R rows (a
// batched decode's LM head redid that per row); every row's arithmetic is the same for any R, so
// a row's result does not depend on how many rows share the call.
template <int V, int R, typename S>
inline void GroupDotRows(const float* a, int64_t k_len, const int8_t* b, const S* s, int64_t groups,
                         int64_t vecs, float* y, int64_t y_stride) {
  const int64_t v_len = V ? V : vecs, g = kLanes * v_len;
  Vec even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = Zero();
  auto group = [&](int64_t grp, Vec* total) {
    const int8_t* bg = b + grp * g;
    const float* ag = a + grp * g;
    Vec sum[R];
    Vec w = Load(bg, kFull);
    for (int r = 0; r < R; ++r) sum[r] = Mul(LoadFull(ag + r * k_len), w);
    for (int64_t v = 1; v < v_len; ++v) {
      w = Load(bg + kLanes * v, kFull);
      for (int r = 0; r < R; ++r) sum[r] = Fmadd(LoadFull(ag + r * k_len + kLanes * v), w, sum[r]);
    }
    const Vec scale = Set1(ScaleValue(s[grp]));
    for (int r = 0; r < R; ++r) total[r] = Fmadd(sum[r], scale, total[r]);
  };
  int64_t grp = 0;
  for (; grp + 2 <= groups; grp += 2) {
    group(grp, even);
    group(grp + 1, odd);
  }
  if (grp < groups) group(grp, even);
  for (int r = 0; r < R; ++r) y[r * y_stride] = Sum(Add(even[r], odd[r]));
}

// GroupDotRows of groups of g = K / G weights (a multiple of kGroupMultiple), the group loop
// unrolled for the common group sizes (16, 32, 64, 128).
template <int R, typename S>
inline void GroupDotRowsAny(const float* a, int64_t k_len, const int8_t* b, const S* s, int64_t groups,
                            int64_t g, float* y, int64_t y_stride) {
  const int64_t vecs = g / kLanes;
  switch (g) {
    case 16: return GroupDotRows<16 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    case 32: return GroupDotRows<32 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    case 64: return GroupDotRows<64 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    case 128: return GroupDotRows<128 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    default: return GroupDotRows<0, R>(a, k_len, b, s, groups, vecs, y, y_stride);
  }
}

// Rows of x a group-scaled int8 row of W multiplies at once (3 vectors a row + 2 in registers).
constexpr int kHeadRows = kLanes == 16 ? 8 : 4;

// y[t, n0:n1] = x[t, :] . W[n, :] for W row-major [N, K]: float (scale null), or int8 with
// scales [N, G] (f32, or f16 for int4's tied embedding; G > 1: K / G a multiple of kGroupMultiple).
template <typename T, typename S = float>
void NkRange(const float* x, int64_t t_len, int64_t k_len, const T* w, const S* scale,
             int64_t groups, int64_t n_len, float* y, int64_t n0, int64_t n1) {
  const Mask tail = TailMask(k_len % kLanes);
  for (int64_t n = n0; n < n1; ++n) {
    const T* r = w + n * k_len;
    const char* ahead = reinterpret_cast<const char*>(r + 4 * k_len);  // 4 rows ahead, into L2
    for (int64_t b = 0; b < k_len * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(ahead + b, _MM_HINT_T1);
    if constexpr (std::is_same_v<T, int8_t>) {
      if (groups > 1) {
        const int64_t g = k_len / groups;
        const S* sn = scale + n * groups;
        int64_t t = 0;
        for (; t + kHeadRows <= t_len; t += kHeadRows)
          GroupDotRowsAny<kHeadRows>(x + t * k_len, k_len, r, sn, groups, g, y + t * n_len + n, n_len);
        for (; t + 2 <= t_len; t += 2)
          GroupDotRowsAny<2>(x + t * k_len, k_len, r, sn, groups, g, y + t * n_len + n, n_len);
        if (t < t_len)
          GroupDotRowsAny<1>(x + t * k_len, k_len, r, sn, groups, g, y + t * n_len + n, n_len);
        continue;
      }
    }
    const float s = scale ? ScaleValue(scale[n]) : 1.0f;
    for (int64_t t = 0; t < t_len; ++t) y[t * n_len + n] = s * Dot(x + t * k_len, r, k_len, tail);
  }
}

#include "cpu_kernel_int4.h"  // QuantizeX, Int4Products: the `offsets` calls

// Part p of every weight: rows [k0, k1) of a kn weight, outputs [n0, n1) of an nk weight.
void RunPart(const Problem& pb, int p) {
  for (int i = 0; i < pb.num_weights; ++i) {
    const Weight& wt = pb.weights[i];
    if (pb.transposed) {
      const int64_t chunk = (wt.n + pb.parts - 1) / pb.parts;
      const int64_t n0 = std::min(wt.n, p * chunk), n1 = std::min(wt.n, n0 + chunk);
      if (pb.int8 && wt.scale16)
        NkRange(pb.x, pb.t_len, pb.k_len, static_cast<const int8_t*>(wt.w), wt.scale16, wt.groups, wt.n,
                wt.y, n0, n1);
      else if (pb.int8)
        NkRange(pb.x, pb.t_len, pb.k_len, static_cast<const int8_t*>(wt.w), wt.scale, wt.groups, wt.n,
                wt.y, n0, n1);
      else
        NkRange(pb.x, pb.t_len, pb.k_len, static_cast<const float*>(wt.w), static_cast<const float*>(nullptr), 1, wt.n,
                wt.y, n0, n1);
    } else {
      const int64_t align = pb.offsets ? kQBlock : 8;  // parts start at multiples of this
      const int64_t chunk = (pb.k_len + align * pb.parts - 1) / (align * pb.parts) * align;
      const int64_t k0 = std::min(pb.k_len, p * chunk), k1 = std::min(pb.k_len, k0 + chunk);
      if (pb.dequant) {
        if (pb.tiled)
          DequantInt4<true>(pb, wt, k0, k1);
        else
          DequantInt4<false>(pb, wt, k0, k1);
        continue;
      }
      float* y = p == 0 ? wt.y : wt.partial + (p - 1) * pb.t_len * wt.n;
      if (pb.offsets && pb.tiled)
        Int4Products<true>(pb, wt, y, k0, k1);
      else if (pb.offsets)
        Int4Products<false>(pb, wt, y, k0, k1);
      else if (wt.u4)
        KnRange(pb.x, pb.t_len, pb.k_len, static_cast<const U4*>(wt.w), wt.scale,
                pb.k_len / wt.groups, wt.n, y, k0, k1);
      else if (pb.int8)
        KnRange(pb.x, pb.t_len, pb.k_len, static_cast<const int8_t*>(wt.w), wt.scale,
                pb.k_len / wt.groups, wt.n, y, k0, k1);
      else
        KnRange(pb.x, pb.t_len, pb.k_len, static_cast<const float*>(wt.w), nullptr, 1, wt.n, y, k0, k1);
    }
  }
}

#include "cpu_kernel_threads.h"  // Shared, UseHelpers, Record, RunAll

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                  ffi::RemainingRets outs, bool transposed, bool int8, bool offsets, bool tiled) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("cpu_linear: x must be 2-D [T, K]");
  // args: the weights, then (int8) one scale array per weight, then (offsets) one offset array.
  const int64_t nargs = static_cast<int64_t>(args.size());
  const int64_t per = offsets ? 3 : int8 ? 2 : 1;
  const int64_t nw = nargs / per;
  if (nw < 1 || nw > kMaxWeights || static_cast<int64_t>(outs.size()) != nw || nargs != per * nw ||
      (offsets && (!int8 || transposed)))
    return ffi::Error::InvalidArgument(
        "cpu_linear: 1 to 8 weights (int8: each with its scales; offsets: uint4 [K, N] weights, "
        "each with f16 scales and offsets), one output each");
  if (tiled && !offsets) return ffi::Error::InvalidArgument("cpu_linear: tiled codes take offsets calls only");
  if (offsets && xd[1] % kQBlock)
    return ffi::Error::InvalidArgument("cpu_linear: offsets calls need K a multiple of " +
                                       std::to_string(kQBlock));

  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.x = x.typed_data();
  pb.t_len = xd[0];
  pb.k_len = xd[1];
  pb.transposed = transposed;
  pb.int8 = int8;
  pb.offsets = offsets;
  pb.tiled = tiled;
  pb.num_weights = static_cast<int>(nw);
  int64_t work = 0, out_floats = 0;
  for (int64_t i = 0; i < nw; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("cpu_linear: bad weight or output");
    const ffi::DataType want = int8 ? ffi::DataType::S8 : ffi::DataType::F32;
    const bool u4 = int8 && w->element_type() == ffi::DataType::U4;
    if (w->element_type() != want && !u4)
      return ffi::Error::InvalidArgument(int8 ? "cpu_linear: int8 or uint4 weights expected" : "cpu_linear: float32 weights expected");
    const auto wd = w->dimensions();
    const auto yd = (*y)->dimensions();
    if (wd.size() != 2) return ffi::Error::InvalidArgument("cpu_linear: weights must be 2-D");
    const int64_t n = transposed ? wd[0] : wd[1];
    const int64_t k = transposed ? wd[1] : wd[0];
    if (k != pb.k_len || yd.size() != 2 || yd[0] != pb.t_len || yd[1] != n)
      return ffi::Error::InvalidArgument("cpu_linear: weight / output shapes do not match x");
    if (u4 && (transposed || n % 2))
      return ffi::Error::InvalidArgument("cpu_linear: uint4 weights must be [K, N] with N even");
    const float* scale = nullptr;
    int64_t groups = 1;
    if (tiled && n % 64)
      return ffi::Error::InvalidArgument("cpu_linear: tiled uint4 weights need N a multiple of 64, got " +
                                         std::to_string(n));
    if (offsets) {
      if (auto e = OffsetsWeight(args, nw, i, k, n, u4, w->untyped_data(), (*y)->typed_data(), pb.weights[i]);
          e.failure())
        return e;
      work += pb.t_len * pb.k_len * n;
      out_floats += pb.t_len * n;
      continue;
    }
    const uint16_t* scale16 = nullptr;
    if (int8) {
      auto s = args.get<ffi::AnyBuffer>(nw + i);
      const bool half = s.has_value() && s->element_type() == ffi::DataType::F16 && transposed && !u4;
      if (!s.has_value() || (s->element_type() != ffi::DataType::F32 && !half))
        return ffi::Error::InvalidArgument("cpu_linear: scales " + std::to_string(i) +
                                           " must be float32 (or float16 for a transposed int8 weight)");
      const auto sd = s->dimensions();
      groups = sd.size() == 2 ? (transposed ? sd[1] : sd[0]) : 0;
      const bool fits = sd.size() == 2 && (transposed ? sd[0] : sd[1]) == n && groups >= 1 &&
                        k % groups == 0 &&
                        (groups == 1 || (k > 0 && (k / groups) % kGroupMultiple == 0));
      if (!fits) {
        std::string got;
        for (size_t d = 0; d < sd.size(); ++d) got += (d ? ", " : "") + std::to_string(sd[d]);
        return ffi::Error::InvalidArgument(
            "cpu_linear: scales " + std::to_string(i) + " of shape [" + got + "] must be f32 " +
            (transposed ? "[N, G] = [" + std::to_string(n) + ", G]" : "[G, N] = [G, " + std::to_string(n) + "]") +
            " with G dividing K = " + std::to_string(k) + " and, when G > 1, K / G a positive multiple of " +
            std::to_string(kGroupMultiple));
      }
      if (half)
        scale16 = static_cast<const uint16_t*>(s->untyped_data());
      else
        scale = static_cast<const float*>(s->untyped_data());
    }
    pb.weights[i] = {w->untyped_data(), scale, groups, (*y)->typed_data(), n, nullptr, u4, scale16, nullptr};
    work += pb.t_len * pb.k_len * n;
    out_floats += pb.t_len * n;
  }

  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t parts = std::min<int64_t>(kPartsPerThread * threads, kMaxParts);
  if (!transposed) parts = std::min(parts, std::max<int64_t>(1, pb.k_len / kMinRowsPerPart));
  if (work < kParallelMinWork || threads == 1) parts = 1;
  if (offsets) {  // parts of whole 32-row blocks: no empty ones
    const int64_t chunk = (pb.k_len + kQBlock * parts - 1) / (kQBlock * parts) * kQBlock;
    parts = (pb.k_len + chunk - 1) / chunk;
  }
  pb.parts = static_cast<int>(parts);
  if (offsets) {
    sh->xq.resize(2 * pb.t_len * pb.k_len);
    sh->xd.resize(pb.t_len * pb.k_len / kQBlock);
    sh->xsum.resize(sh->xd.size());
    std::tie(pb.xq, pb.xl, pb.xd, pb.xsum) =
        std::make_tuple(sh->xq.data(), sh->xq.data() + pb.t_len * pb.k_len, sh->xd.data(), sh->xsum.data());
    QuantizeX(pb.x, pb.t_len, pb.k_len, sh->xq.data(), sh->xq.data() + pb.t_len * pb.k_len, sh->xd.data(),
              sh->xsum.data());
  }
  if (!transposed && parts > 1) {
    sh->scratch.resize((parts - 1) * out_floats);
    float* s = sh->scratch.data();
    for (int i = 0; i < pb.num_weights; ++i) {
      pb.weights[i].partial = s;
      s += (parts - 1) * pb.t_len * pb.weights[i].n;
    }
  }
  RunAll(pool, sh, threads, work);

  if (!transposed)
    for (int i = 0; i < pb.num_weights; ++i) {
      const Weight& wt = pb.weights[i];
      const int64_t size = pb.t_len * wt.n;
      for (int64_t p = 1; p < parts; ++p) {
        const float* src = wt.partial + (p - 1) * size;
        for (int64_t j = 0; j < size; ++j) wt.y[j] += src[j];
      }
    }
  return ffi::Error::Success();
}

// int4's own layout (uint4 codes [K, N], tiled or not, f16 scales and offsets [G, N]) dequantized
// to f32 [K, N] (`DequantInt4`), the rows in parts of whole 32-row blocks like a product's. `x`
// [T, K] is not read: it ties the conversion to the layer that uses it, so that XLA:CPU makes each
// layer's copy when that layer runs (see `jaxinfer.layers._tie`).
ffi::Error Dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                      ffi::AnyBuffer offsets, ffi::Result<ffi::Buffer<ffi::F32>> out, bool tiled) {
  const auto cd = codes.dimensions();
  const auto od = out->dimensions();
  if (codes.element_type() != ffi::DataType::U4 || cd.size() != 2 || od.size() != 2 || od[0] != cd[0] ||
      od[1] != cd[1] || cd[1] % 2 || cd[0] % kQBlock || x.dimensions().size() != 2 || x.dimensions()[1] != cd[0])
    return ffi::Error::InvalidArgument(
        "cpu_dequantize: uint4 codes [K, N] (K a multiple of " + std::to_string(kQBlock) +
        ", N even), an f32 output of their shape and x [T, K]");
  const int64_t k = cd[0], n = cd[1];
  if (tiled && n % 64)
    return ffi::Error::InvalidArgument("cpu_dequantize: tiled codes need N a multiple of 64, got " + std::to_string(n));
  if (auto e = CheckHalves(scales, "scales", 0, k, n); e.failure()) return e;
  if (auto e = CheckHalves(offsets, "offsets", 0, k, n); e.failure()) return e;
  if (offsets.dimensions()[0] != scales.dimensions()[0])
    return ffi::Error::InvalidArgument("cpu_dequantize: offsets must have the scales' shape");
  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.x = x.typed_data();
  pb.t_len = 1;
  pb.k_len = k;
  pb.offsets = pb.int8 = pb.dequant = true;
  pb.tiled = tiled;
  pb.num_weights = 1;
  pb.weights[0] = {codes.untyped_data(), nullptr, scales.dimensions()[0], out->typed_data(), n, nullptr, true,
                   static_cast<const uint16_t*>(scales.untyped_data()),
                   static_cast<const uint16_t*>(offsets.untyped_data())};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = k / kQBlock;
  int64_t parts = k * n < kParallelMinWork ? 1 : std::min<int64_t>({kPartsPerThread * threads, kMaxParts, blocks});
  const int64_t chunk = (blocks + parts - 1) / parts * kQBlock;
  pb.parts = static_cast<int>((k + chunk - 1) / chunk);
  // NOTE: size classes of their own (helpers or not is measured per class of work, and a code
  // written out costs other than a multiply-add): a product's work stays below 2^36.
  RunAll(pool, sh, threads, (k * n) << 20);
  return ffi::Error::Success();
}

}  // namespace

// The vector width this build uses (16: AVX-512, 8: AVX2), for cpu.py's `lanes()`.
extern "C" int JaxinferCpuLinearLanes() { return kLanes; }
// Whether int4's integer products take the AVX-512 VNNI path (cpu.py's `int4_path()`).
extern "C" int JaxinferCpuLinearInt4Vnni() { return Int4Vnni() ? 1 : 0; }
// The lingering helpers' mailbox (../cpu_helpers.h), for the attention kernel's library.
extern "C" void* JaxinferCpuHelperBox() { return &jaxinfer_cpu::Box(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCpuDequantize, Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("tiled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCpuLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transposed")
                                  .Attr<bool>("int8")
                                  .Attr<bool>("offsets")
                                  .Attr<bool>("tiled"));
