// Ragged paged attention for XLA:CPU, called through the XLA FFI (see cpu.py, which compiles this
// file on first use and registers it as a custom call).
//
// Same contract as reference.py: one ragged token axis (sequence s owns tokens
// cu_q_lens[s]..cu_q_lens[s+1], the last ones of its kv_lens[s] cached tokens), a paged cache
// [P, page_size, 2*Hkv, D] with K of head h at 2h and V at 2h+1, GQA by grouping query heads under
// their KV head, optional sliding window / logit soft-cap / sinks / per-token causal bound (an
// image token sees its whole image). Only keys a token may see are
// read, so unused (NaN) slots never enter; page ids outside [0, P) read as zeros like the
// reference's gather with mode="fill". Padding tokens get zeros.
//
// Work: one item per (sequence, tile of up to kTileTokens query tokens), all KV heads. A tile of
// at most kChunkTokens tokens (a decode) whose keys span several chunks of kChunkKeys becomes one
// item per chunk, each keeping its rows' running max, sum and unnormalized output; the caller
// merges them once all items are done (one sequence decoding over a long context is then read by
// every thread, not by one). With few items they are split by KV head too. Items are claimed
// from an atomic counter by the calling thread and by helpers scheduled on XLA's intra-op thread
// pool; the caller returns once every item is done (a helper that starts late finds none left).
// Per item, keys go in blocks of kKeyBlock read in place from the cache (bf16 converted to f32
// scratch first): scores as dot products over head_dim, an online-softmax update with a
// polynomial exp, then P @ V over head_dim. All arithmetic in f32; q, cache and output may be f32 or bf16.
// An fp8 cache (`kv_cache_dtype="fp8"`: float8_e4m3fn values plus an int8 exponent per slot and
// K/V head, value = e4m3 * 2^exponent) is widened into the same scratch through a 256-entry table.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_helpers.h"  // the linear kernel's lingering helpers
#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kTileTokens = 16;
constexpr int kKeyBlock = 64;
// Below this many (query row x key) pairs one thread does the whole call: handing work to the pool
// costs more than it saves.
constexpr int64_t kParallelMinWork = 8192;
// An item of at most kChunkTokens tokens (decodes, speculative checks) whose keys span more than
// one chunk of kChunkKeys (chunks aligned at multiples of it; doubled until a sequence has at most
// kMaxChunks) is cut into one item per chunk, merged by log-sum-exp after all are done: a sequence
// decoding alone is then read by every thread, not one thread a KV head. The cut depends only on
// the sequence's own lengths (not on the batch or the threads), so its results do too.
constexpr int64_t kChunkTokens = 8;
constexpr int64_t kChunkKeys = 256;
constexpr int64_t kMaxChunks = 64;
// Fewer items than this (after the cut) are split by KV head as well.
constexpr int64_t kFewItems = 8;

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline float Load(const T* p, int64_t i);
template <>
inline float Load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float Load<uint16_t>(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }

// float8_e4m3fn bit patterns -> f32 (bias 7, no infinities, S.1111.111 is NaN).
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = (b & 128) ? -x : x;
    }
  }
};
const E4m3Table kE4m3;

template <typename T>
inline void Store(T* p, int64_t i, float v);
template <>
inline void Store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <>
inline void Store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = F32ToBf16(v); }

// exp(x) for x <= 0 (scores minus their running max): 2^n * e^r with |r| <= ln2/2 and a degree-7
// Taylor polynomial (relative error ~1e-7). Written branch-free so the key loop vectorizes.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Problem {
  const void* q;
  const void* cache;
  const int8_t* exponents;  // [P, page_size, 2*Hkv] for an fp8 cache, else nullptr
  void* out;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const float* sinks;  // nullptr when the model has none
  float* partials;      // chunked items' rows (Item::part)
  const int32_t* bounds;  // [T] each token's last visible key position; nullptr: its own position
  int64_t num_pages, page_size, num_kv_heads, group, head_dim, pages_per_seq;
  float sm_scale, soft_cap;  // soft_cap <= 0: none
  int64_t window;            // <= 0: none
};

struct Item {
  int32_t seq, h0, h1, t0, t1;  // tokens [t0, t1) of sequence `seq`, KV heads [h0, h1)
  // Keys [k0, k1) only, and its rows' running max, sum and unnormalized output written to
  // `partials + part` (m, l, then head_dim values a row) for the merge; part < 0: the whole key
  // range, the output written directly. `first`: the chunk that holds the sinks' term.
  int32_t k0 = 0, k1 = std::numeric_limits<int32_t>::max();
  int64_t part = -1;
  bool first = true;
};

#ifdef __AVX512F__
// Sum of each of 8 vectors (v[0..7]) -> one 8-lane vector of the sums, in order.
inline __m256 Sums8(const __m512* v) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm512_extractf32x8_ps(v[i], 1));
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 holds the 4 sums of v0..v3 in each 128-bit lane (partial per lane), u1 those of v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[j] = q . k_j for j in [lo, hi): 8 keys at a time, each dot product's 16-lane partial
// reduced together with the other 7 (one shuffle tree per 8 keys instead of one per key).
template <int kD>
inline void Scores(const float* q, const float* const* kp, int64_t lo, int64_t hi, float* s) {
  constexpr int kV = kD / 16;
  __m512 qv[kV];
  for (int x = 0; x < kV; ++x) qv[x] = _mm512_loadu_ps(q + 16 * x);
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    __m512 part[8];
    for (int i = 0; i < 8; ++i) {
      const float* k = kp[j + i];
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int x = 1; x < kV; ++x) a = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(k + 16 * x), a);
      part[i] = a;
    }
    _mm256_storeu_ps(s + j, Sums8(part));
  }
  for (; j < hi; ++j) {
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp[j]));
    for (int x = 1; x < kV; ++x) a = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(kp[j] + 16 * x), a);
    s[j] = _mm512_reduce_add_ps(a);
  }
}

// acc (kD floats) = alpha * acc + sum_j p[j] * v_j over [lo, hi), the accumulator in registers.
template <int kD>
inline void AccumulatePV(float* acc, float alpha, const float* p, const float* const* vp,
                         int64_t lo, int64_t hi) {
  constexpr int kV = kD / 16;
  __m512 a[kV];
  const __m512 al = _mm512_set1_ps(alpha);
  for (int x = 0; x < kV; ++x) a[x] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + 16 * x));
  for (int64_t j = lo; j < hi; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* v = vp[j];
    for (int x = 0; x < kV; ++x) a[x] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16 * x), a[x]);
  }
  for (int x = 0; x < kV; ++x) _mm512_storeu_ps(acc + 16 * x, a[x]);
}
#endif

// The largest of s[lo..hi): a running max is a chain of dependent instructions (the compiler
// keeps it scalar, NaN ordering being what it is), ~a quarter of a decode's attention time.
inline float BlockMax(const float* s, int64_t lo, int64_t hi) {
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  if (j < hi) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (hi - j)) - 1);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m[8];
  for (float& x : m) x = -std::numeric_limits<float>::infinity();
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8)
    for (int i = 0; i < 8; ++i) m[i] = std::max(m[i], s[j + i]);
  for (; j < hi; ++j) m[0] = std::max(m[0], s[j]);
  for (int i = 1; i < 8; ++i) m[0] = std::max(m[0], m[i]);
  return m[0];
#endif
}

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<float> q, kv, s, acc, m, l, zeros;
};

// The keys [begin, end) some token of item `it` may see (window and causal / image bounds),
// before any chunk cut.
void KeyRange(const Problem& pb, const Item& it, int64_t* begin, int64_t* end) {
  const int64_t q_len = pb.cu_q_lens[it.seq + 1] - pb.cu_q_lens[it.seq];
  const int64_t kv_len = pb.kv_lens[it.seq];
  const int64_t first_pos = kv_len - q_len + (it.t0 - pb.cu_q_lens[it.seq]);
  int64_t last_pos = first_pos + (it.t1 - it.t0) - 1;
  if (pb.bounds)  // an image token sees up to its image's end (never past the sequence)
    for (int64_t t = it.t0; t < it.t1; ++t)
      last_pos = std::max<int64_t>(last_pos, std::min<int64_t>(pb.bounds[t], kv_len - 1));
  *begin = pb.window > 0 ? std::max<int64_t>(0, first_pos - pb.window + 1) : 0;
  *end = last_pos + 1;  // causal: no token of the tile sees past its last bound
}

// Row r of item `it` (rows ordered as in RunItem below) divided by its softmax sum `l` into the
// output; a row that saw no key (l = 0) gets zeros.
template <typename QT>
void StoreRow(const Problem& pb, const Item& it, int64_t r, const float* acc, float l) {
  const int64_t d = pb.head_dim, g = pb.group, rows_h = (it.t1 - it.t0) * g;
  const int64_t hh = r / rows_h, i = r % rows_h / g, j = r % g;
  const int64_t dst = ((it.t0 + i) * pb.num_kv_heads * g + (it.h0 + hh) * g + j) * d;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  QT* out = static_cast<QT*>(pb.out);
  for (int64_t x = 0; x < d; ++x) Store(out, dst + x, acc[x] * inv);
}

// kD > 0: head_dim known at compile time (the common sizes; loops over it unroll); 0: pb.head_dim.
// Rows are (KV head, token, group member): row hh * rows_h + i * g + j is query head
// (h0 + hh) * g + j of token t0 + i.
template <typename QT, typename CT, int kD>
void RunItem(const Problem& pb, const Item& it, Scratch& sc) {
  const int64_t d = kD > 0 ? kD : pb.head_dim;
  const int64_t g = pb.group, hkv = pb.num_kv_heads, ps = pb.page_size;
  const int64_t ntok = it.t1 - it.t0, rows_h = ntok * g, nh = it.h1 - it.h0, rows = nh * rows_h;
  const int64_t q_len = pb.cu_q_lens[it.seq + 1] - pb.cu_q_lens[it.seq];
  const int64_t kv_len = pb.kv_lens[it.seq];
  const int64_t first_pos = kv_len - q_len + (it.t0 - pb.cu_q_lens[it.seq]);
  const int64_t hq = hkv * g;
  const QT* q = static_cast<const QT*>(pb.q);
  const CT* cache = static_cast<const CT*>(pb.cache);

  sc.q.resize(rows * d);
  sc.s.resize(rows_h * kKeyBlock);
  sc.acc.assign(rows * d, 0.0f);
  sc.m.resize(rows);
  sc.l.resize(rows);
  if (!std::is_same<CT, float>::value) sc.kv.resize(2 * kKeyBlock * d);
  sc.zeros.assign(d, 0.0f);
  float* qs = sc.q.data();
  float* acc = sc.acc.data();
  const float* kp[kKeyBlock];
  const float* vp[kKeyBlock];
  const CT* slot[kKeyBlock];
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t i = 0; i < ntok; ++i)
      for (int64_t j = 0; j < g; ++j) {
        const int64_t head = (it.h0 + hh) * g + j, r = hh * rows_h + i * g + j;
        const int64_t src = ((it.t0 + i) * hq + head) * d;
        for (int64_t x = 0; x < d; ++x) qs[r * d + x] = Load(q, src + x) * pb.sm_scale;
        const bool sink = pb.sinks && it.first;
        sc.m[r] = sink ? pb.sinks[head] : -std::numeric_limits<float>::infinity();
        sc.l[r] = sink ? 1.0f : 0.0f;
      }

  int64_t k_begin, k_end;
  KeyRange(pb, it, &k_begin, &k_end);
  k_begin = std::max<int64_t>(k_begin, it.k0);
  k_end = std::min<int64_t>(k_end, it.k1);
  const int64_t page_row = static_cast<int64_t>(it.seq) * pb.pages_per_seq;
  const int64_t slot_stride = 2 * hkv * d;

  for (int64_t kb = k_begin; kb < k_end; kb += kKeyBlock) {
    const int64_t nk = std::min<int64_t>(kKeyBlock, k_end - kb);
    // Each key's slot (nullptr: a page id outside the cache, read as zeros); pages walked without
    // a division per key.
    for (int64_t j = 0, pg = kb / ps, off = kb % ps; j < nk; ++j) {
      const int64_t page = pb.page_indices[page_row + pg];
      slot[j] = page < 0 || page >= pb.num_pages ? nullptr : cache + (page * ps + off) * slot_stride;
      if (++off == ps) off = 0, ++pg;
    }
    // Heads inside the key block: a slot's heads sit side by side, so the block's pages are
    // read front to back.
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t head = it.h0 + hh;
      // Point at each key's K and V rows (f32 caches in place; bf16 ones converted into scratch).
      for (int64_t j = 0; j < nk; ++j) {
        if (slot[j] == nullptr) {
          kp[j] = vp[j] = sc.zeros.data();
          continue;
        }
        const CT* kv = slot[j] + 2 * head * d;
        if constexpr (std::is_same<CT, float>::value) {
          kp[j] = kv;
          vp[j] = kv + d;
        } else if constexpr (std::is_same<CT, uint8_t>::value) {
          const int8_t* ex = pb.exponents + (slot[j] - cache) / d + 2 * head;  // this slot's K, V rows
          const float ks = std::ldexp(1.0f, ex[0]), vs = std::ldexp(1.0f, ex[1]);
          float* dst = sc.kv.data() + 2 * j * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = kE4m3.v[kv[x]] * ks;
          for (int64_t x = 0; x < d; ++x) dst[d + x] = kE4m3.v[kv[d + x]] * vs;
          kp[j] = dst;
          vp[j] = dst + d;
        } else {
          float* dst = sc.kv.data() + 2 * j * d;
          for (int64_t x = 0; x < 2 * d; ++x) dst[x] = Load(kv, x);
          kp[j] = dst;
          vp[j] = dst + d;
        }
      }
      for (int64_t rh = 0; rh < rows_h; ++rh) {
        const int64_t r = hh * rows_h + rh;
        const int64_t pos = first_pos + rh / g;
        const int64_t last = pb.bounds ? std::min<int64_t>(pb.bounds[it.t0 + rh / g], kv_len - 1) : pos;
        // Keys of this block the row may see: [lo, hi) relative to kb (window from its position).
        const int64_t hi = std::min<int64_t>(nk, last - kb + 1);
        const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1 - kb) : 0;
        if (hi <= lo) continue;
        float* s = sc.s.data() + rh * kKeyBlock;
        const float* qr = qs + r * d;
#ifdef __AVX512F__
        if constexpr (kD > 0 && kD % 16 == 0) {
          Scores<kD>(qr, kp, lo, hi, s);
        } else
#endif
        {
          for (int64_t j = lo; j < hi; ++j) {
            const float* kj = kp[j];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; ++x) dot += qr[x] * kj[x];
            s[j] = dot;
          }
        }
        if (pb.soft_cap > 0.0f) {
          const float inv = 1.0f / pb.soft_cap;
          for (int64_t j = lo; j < hi; ++j) s[j] = pb.soft_cap * std::tanh(s[j] * inv);
        }
        const float m_blk = BlockMax(s, lo, hi);
        const float m_old = sc.m[r];
        const float m_new = std::max(m_old, m_blk);
        const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m_old - m_new);
        float psum = 0.0f;
#pragma omp simd reduction(+ : psum)
        for (int64_t j = lo; j < hi; ++j) {
          const float p = ExpNonPositive(s[j] - m_new);
          s[j] = p;
          psum += p;
        }
        sc.m[r] = m_new;
        sc.l[r] = alpha * sc.l[r] + psum;
        float* ar = acc + r * d;
#ifdef __AVX512F__
        if constexpr (kD > 0 && kD % 16 == 0) {
          AccumulatePV<kD>(ar, alpha, s, vp, lo, hi);
          continue;
        }
#endif
        if (alpha != 1.0f)
          for (int64_t x = 0; x < d; ++x) ar[x] *= alpha;
        for (int64_t j = lo; j < hi; ++j) {
          const float p = s[j];
          const float* vj = vp[j];
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) ar[x] += p * vj[x];
        }
      }
    }
  }

  if (it.part >= 0) {  // a chunk: its rows' state for the merge
    float* dst = pb.partials + it.part;
    for (int64_t r = 0; r < rows; ++r, dst += d + 2) {
      dst[0] = sc.m[r];
      dst[1] = sc.l[r];
      std::memcpy(dst + 2, acc + r * d, d * sizeof(float));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) StoreRow<QT>(pb, it, r, acc + r * d, sc.l[r]);
}

// Returns how many items this thread ran.
template <typename QT, typename CT>
int64_t RunItems(const Problem& pb, const Item* items, int64_t n, std::atomic<int64_t>& next,
                 std::atomic<int64_t>& done) {
  thread_local Scratch scratch;
  int64_t ran = 0;
  for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1), ++ran) {
    switch (pb.head_dim) {
      case 64: RunItem<QT, CT, 64>(pb, items[i], scratch); break;
      case 128: RunItem<QT, CT, 128>(pb, items[i], scratch); break;
      case 256: RunItem<QT, CT, 256>(pb, items[i], scratch); break;
      default: RunItem<QT, CT, 0>(pb, items[i], scratch);
    }
    done.fetch_add(1, std::memory_order_release);
  }
  return ran;
}

// An item cut into `chunks` chunk items: `whole.part` is the first chunk's rows in `partials`, the
// others follow it.
struct Cut {
  Item whole;
  int64_t chunks;
};

// Shared with helpers, which may start after the call returned: they then only touch `next`.
struct Shared {
  Problem pb;
  std::vector<Item> items;
  std::vector<float> partials;
  std::vector<Cut> cuts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The cut of kChunkKeys above: each chunk item's rows get room in `partials`.
void CutIntoChunks(Shared& sh) {
  const Problem& pb = sh.pb;
  std::vector<Item> out;
  int64_t floats = 0;
  for (const Item& it : sh.items) {
    int64_t begin, end;
    KeyRange(pb, it, &begin, &end);
    int64_t chunk = kChunkKeys;
    const int64_t kv_len = pb.kv_lens[it.seq];
    while (kv_len > chunk * kMaxChunks) chunk *= 2;
    const int64_t c0 = begin / chunk, c1 = end > begin ? (end - 1) / chunk + 1 : c0;
    if (it.t1 - it.t0 > kChunkTokens || c1 - c0 < 2) {
      out.push_back(it);
      continue;
    }
    const int64_t rows = (it.h1 - it.h0) * (it.t1 - it.t0) * pb.group;
    Cut cut{it, c1 - c0};
    cut.whole.part = floats;
    sh.cuts.push_back(cut);
    for (int64_t c = c0; c < c1; ++c) {
      Item part = it;
      part.k0 = static_cast<int32_t>(c * chunk);
      part.k1 = static_cast<int32_t>((c + 1) * chunk);
      part.part = floats;
      part.first = c == c0;
      floats += rows * (pb.head_dim + 2);
      out.push_back(part);
    }
  }
  sh.items.swap(out);
  sh.partials.resize(floats);
  sh.pb.partials = sh.partials.data();
}

// Each cut item's output from its chunks' rows: the running maxima rescaled to the largest.
template <typename QT>
void Merge(const Shared& sh) {
  const Problem& pb = sh.pb;
  const int64_t d = pb.head_dim;
  std::vector<float> acc(d);
  for (const Cut& cut : sh.cuts) {
    const Item& it = cut.whole;
    const int64_t rows = (it.h1 - it.h0) * (it.t1 - it.t0) * pb.group, stride = rows * (d + 2);
    const float* base = pb.partials + it.part;
    for (int64_t r = 0; r < rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < cut.chunks; ++c) m = std::max(m, base[c * stride + r * (d + 2)]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      if (m != -std::numeric_limits<float>::infinity())
        for (int64_t c = 0; c < cut.chunks; ++c) {
          const float* row = base + c * stride + r * (d + 2);
          if (row[0] == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(row[0] - m);
          l += w * row[1];
          for (int64_t x = 0; x < d; ++x) acc[x] += w * row[2 + x];
        }
      StoreRow<QT>(pb, it, r, acc.data(), l);
    }
  }
}

// Items lingering helpers ran (`JaxinferCpuAttentionHelped`, for tests), and whether calls post
// to lingering helpers at all (`JaxinferCpuAttentionUseLingering`, for benchmarks alternating both
// ways in one process).
std::atomic<int64_t> helped_items{0};
std::atomic<bool> use_lingering{true};

// A call's items as a job for a lingering helper (../cpu_helpers.h).
template <typename QT, typename CT>
struct ItemsJob : jaxinfer_cpu::Job {
  std::shared_ptr<Shared> sh;
  explicit ItemsJob(std::shared_ptr<Shared> s) : sh(std::move(s)) {}
  void Run() override {
    const int64_t n = static_cast<int64_t>(sh->items.size());
    helped_items.fetch_add(RunItems<QT, CT>(sh->pb, sh->items.data(), n, sh->next, sh->done));
  }
};

// Items run on the caller and: with enough work, on helpers scheduled on the pool; with less (a
// sequence decoding alone, ~35 us of keys on one core), on a helper the products left lingering,
// if one is (waking a pool thread for it takes longer than the call on a small VM).
template <typename QT, typename CT>
void Run(ffi::ThreadPool& pool, std::shared_ptr<Shared> sh, int64_t work) {
  const int64_t n = static_cast<int64_t>(sh->items.size());
  int64_t helpers = 0;
  if (work >= kParallelMinWork) helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([sh, n] { RunItems<QT, CT>(sh->pb, sh->items.data(), n, sh->next, sh->done); });
  if (helpers == 0 && n > 1 && use_lingering.load(std::memory_order_relaxed) &&
      jaxinfer_cpu::Box().lingering.load(std::memory_order_relaxed) > 0)
    jaxinfer_cpu::Post(std::make_shared<ItemsJob<QT, CT>>(sh));
  RunItems<QT, CT>(sh->pb, sh->items.data(), n, sh->next, sh->done);
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  Merge<QT>(*sh);
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                                ffi::Buffer<ffi::S8> exponents, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> bounds,
                                ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                                int64_t sliding_window, float soft_cap, bool has_sinks,
                                bool has_bound) {
  const auto qd = q.dimensions();
  const auto cd = cache.dimensions();
  const auto pd = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks for q, kv_cache or page_indices");
  const auto qt = q.element_type(), ct = cache.element_type();
  const bool q_ok = qt == ffi::DataType::F32 || qt == ffi::DataType::BF16;
  const bool fp8 = ct == ffi::DataType::F8E4M3FN;
  const bool c_ok = ct == ffi::DataType::F32 || ct == ffi::DataType::BF16 || fp8;
  if (!q_ok || !c_ok || out->element_type() != qt)
    return ffi::Error::InvalidArgument("ragged_paged_attention: q and out must be float32 or bfloat16, kv_cache also float8_e4m3fn");
  if (fp8 && static_cast<int64_t>(exponents.element_count()) != cd[0] * cd[1] * cd[2])
    return ffi::Error::InvalidArgument("ragged_paged_attention: an fp8 kv_cache needs one exponent per slot and K/V head");

  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  const int64_t t_len = qd[0], hq = qd[1], d = qd[2];
  pb.q = q.untyped_data();
  pb.cache = cache.untyped_data();
  pb.exponents = fp8 ? exponents.typed_data() : nullptr;
  pb.out = out->untyped_data();
  pb.kv_lens = kv_lens.typed_data();
  pb.page_indices = page_indices.typed_data();
  pb.cu_q_lens = cu_q_lens.typed_data();
  pb.sinks = has_sinks ? sinks.typed_data() : nullptr;
  if (has_bound && static_cast<int64_t>(bounds.element_count()) != qd[0])
    return ffi::Error::InvalidArgument("ragged_paged_attention: causal_bound needs one entry per token");
  pb.bounds = has_bound ? bounds.typed_data() : nullptr;
  pb.num_pages = cd[0];
  pb.page_size = cd[1];
  pb.num_kv_heads = cd[2] / 2;
  pb.group = hq / pb.num_kv_heads;
  pb.head_dim = d;
  pb.pages_per_seq = pd[1];
  pb.sm_scale = sm_scale;
  pb.soft_cap = soft_cap;
  pb.window = sliding_window;

  const int64_t s_max = pd[0];
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, s_max);
  const int64_t capacity = pb.pages_per_seq * pb.page_size;
  int64_t work = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t a = pb.cu_q_lens[s], b = pb.cu_q_lens[s + 1];
    const int64_t kv_len = pb.kv_lens[s];
    // Metadata the host validates (reference.check_values); inconsistent values would index
    // outside the buffers, so they are refused here too.
    if (a < 0 || b < a || b > t_len || kv_len < b - a || kv_len > capacity)
      return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent cu_q_lens / kv_lens");
    for (int32_t t0 = a; t0 < b; t0 += kTileTokens) {
      const int32_t t1 = std::min<int32_t>(b, t0 + kTileTokens);
      sh->items.push_back({static_cast<int32_t>(s), 0, static_cast<int32_t>(pb.num_kv_heads), t0, t1});
      const int64_t keys = pb.window > 0 ? std::min<int64_t>(kv_len, pb.window + (t1 - t0)) : kv_len;
      work += keys * (t1 - t0) * hq;
    }
  }
  CutIntoChunks(*sh);
  // An item covers every KV head (each slot's heads are contiguous in the cache); with too few
  // items to keep the pool busy (one sequence decoding), split them by head instead.
  if (static_cast<int64_t>(sh->items.size()) < kFewItems && pb.num_kv_heads > 1) {
    std::vector<Item> split;
    for (const Item& it : sh->items)
      for (int32_t h = 0; h < pb.num_kv_heads; ++h) {
        Item one = it;
        one.h0 = h;
        one.h1 = h + 1;
        // A chunk's rows are head-major: this head's come after the earlier heads' rows.
        if (it.part >= 0) one.part += h * (it.t1 - it.t0) * pb.group * (pb.head_dim + 2);
        split.push_back(one);
      }
    sh->items.swap(split);
  }
  // Padding tokens (after the last live sequence's tokens) produce zeros.
  const int64_t t_real = n > 0 ? pb.cu_q_lens[n] : 0;
  const int64_t row_bytes = hq * d * (qt == ffi::DataType::F32 ? 4 : 2);
  std::memset(static_cast<char*>(pb.out) + t_real * row_bytes, 0, (t_len - t_real) * row_bytes);

  const bool qf = qt == ffi::DataType::F32, cf = ct == ffi::DataType::F32;
  if (fp8 && qf) Run<float, uint8_t>(pool, sh, work);
  else if (fp8) Run<uint16_t, uint8_t>(pool, sh, work);
  else if (qf && cf) Run<float, float>(pool, sh, work);
  else if (qf) Run<float, uint16_t>(pool, sh, work);
  else if (cf) Run<uint16_t, float>(pool, sh, work);
  else Run<uint16_t, uint16_t>(pool, sh, work);
  return ffi::Error::Success();
}

}  // namespace

// Points this library at the linear kernel's helper mailbox (`JaxinferCpuHelperBox`; cpu.py calls
// it once, before any call): its lingering helpers then take attention items too.
extern "C" void JaxinferCpuUseHelperBox(void* box) {
  if (box != nullptr) jaxinfer_cpu::BoxSlot() = static_cast<jaxinfer_cpu::Mailbox*>(box);
}
// Tests: the mailbox this library posts to (the linear kernel's once shared), a helper made to
// linger `ns` on it, and how many items lingering helpers have run.
extern "C" void* JaxinferCpuAttentionHelperBox() { return &jaxinfer_cpu::Box(); }
extern "C" void JaxinferCpuAttentionLinger(int64_t ns) { jaxinfer_cpu::Linger(ns); }
extern "C" int64_t JaxinferCpuAttentionHelped() { return helped_items.load(); }
extern "C" void JaxinferCpuAttentionUseLingering(int on) { use_lingering.store(on != 0); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("has_sinks")
                                  .Attr<bool>("has_bound"));
