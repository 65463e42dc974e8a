// Part of cpu_kernel.cc (included by it after its Problem / Weight types; not a standalone header):
// int4 weights times int8-quantized activations, the `offsets` calls (cpu.py `linear(...,
// offsets=)`).
//
// Like llama.cpp's Q4_1 x Q8_1 path, but with 15-bit activations: x is quantized once per call per
// block of kQBlock = 32 input channels to xq16 = round(x * 16256 / max|x|) (the block's scale
// xd = max|x| / 16256 and its float sum xsum kept), held as two int8 parts xq16 = 128 xh + xl;
// each 32-row block of codes is multiplied by both parts in 16-bit lanes (vpmaddubsw: two rows'
// codes interleaved byte by byte against the broadcast pair of xh, then of xl), summed to 32 bits
// (xh's products every 16 rows, shifted by 7), and the block's integer sums enter y as
//   y[t, n] += isum * (s[g, n] * xd[t, b]) + o[g, n] * xsum[t, b].
// About 4 codes per instruction where the f32 path of cpu_kernel.cc does 2 (one core, from cache:
// 80 vs 168 us for SmolLM2's gate_up). One int8 part alone (llama.cpp's Q8_1: 59 us) rounded the
// activations to 1/127 of their block's max, and single-stream greedy decoding of the default
// model then agreed with the f32 reference on 7 of 12 prompts (12 with f32 products); 15 bits
// round 128x finer (BENCHMARKS.md "int4 decode step").
// On CPUs with AVX-512 VNNI + VBMI the same sums take vpdpbusd on 64-byte vectors (KnU4IntVnni:
// four rows' codes of a column gathered into one dword, two x rows per unpacking), same bits.
// Layout: `quantization="int4"`'s own, uint4 codes [K, N] (two per byte along N), f16 scales and
// offsets [G, N] read as stored; K and the group size K / G multiples of kQBlock. Or the same codes
// tiled (`Problem::tiled`, reference.tile_int4): each 32-row block is N / 64 tiles of 1 KB, tile s
// holding the 32 bytes of columns 64 s .. 64 s + 63 of each of the block's 32 rows, one row after
// the other, so a part of K rows is one contiguous stream read front to back (the [K, N] layout
// reads 32-byte pieces of 32 rows 1.5 KB apart for a gate_up; from DRAM the tiles were 1.2-1.6x
// faster, BENCHMARKS.md "int4 decode step, tiled").

// x [T, K] quantized per block of kQBlock channels to 15 bits, held as two int8 parts: xq16 =
// round(x * kXMax / max|x|) (0 for an all-zero block) = 128 * xh + xl with xh in [-127, 127] and xl
// in [-64, 63]; xd = max|x| / kXMax, xsum = the block's float sum (its four 8-lane vectors added
// pairwise, then across lanes). Vectorized: the scalar loop (its sum one chain of 32 dependent
// adds) took 1.2 us at 576 channels, 3.6 at 1536, on the caller alone before any part ran: ~0.2 ms
// of the default model's decode step; now 0.34 and 1.0 (BENCHMARKS.md "int4 prefill").
constexpr float kXMax = 127.0f * 128.0f;
inline float HMax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float HSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// Four vectors of 8 int32 (elements 0-7, 8-15, 16-23, 24-31), each in int8 range, as 32 int8 in order.
inline __m256i Narrow32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static_assert(kQBlock == 32, "QuantizeX takes a block as four 8-lane vectors");
void QuantizeX(const float* x, int64_t t_len, int64_t k_len, int8_t* xh, int8_t* xl, float* xd,
               float* xsum) {
  const int64_t blocks = k_len / kQBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i half = _mm256_set1_epi32(64);
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = t * k_len + b * kQBlock;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + at + 8 * j);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      const float amax = HMax8(m);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? kXMax / amax : 0.0f);
      __m256i h[4], l[4];
      for (int j = 0; j < 4; ++j) {  // |q| <= 16256; xh = floor((q + 64) / 128), xl = q - 128 xh
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i q = _mm256_cvtps_epi32(r);
        h[j] = _mm256_srai_epi32(_mm256_add_epi32(q, half), 7);
        l[j] = _mm256_sub_epi32(q, _mm256_slli_epi32(h[j], 7));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xh + at), Narrow32(h[0], h[1], h[2], h[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xl + at), Narrow32(l[0], l[1], l[2], l[3]));
      xd[t * blocks + b] = amax / kXMax;
      xsum[t * blocks + b] = HSum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
}

inline __m256 HalfLoad(const uint16_t* p) {  // 8 f16 as f32 (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Columns [n0, n1) of a [K, N] block one by one (the last N % 64, which no strip holds).
void TailColumns(const uint8_t* blk, int64_t row_bytes, const int8_t* xh, const int8_t* xl, const uint16_t* srow,
                 const uint16_t* orow, float dx, float xs, float* yt, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int32_t isum = 0;
    for (int64_t r = 0; r < kQBlock; ++r)
      isum += ((blk[r * row_bytes + n / 2] >> (4 * (n & 1))) & 0x0f) * (128 * xh[r] + xl[r]);
    const float base = std::fma(_cvtsh_ss(orow[n]), xs, yt[n]);
    yt[n] = std::fma(static_cast<float>(isum), _cvtsh_ss(srow[n]) * dx, base);
  }
}

// y[t, :] = the rows [k0, k1) (multiples of kQBlock) of an `offsets` weight: per 32-row block b of
// group g, sum_k q[k, n] * xq16[t, k] in integers, then y[t, n] += that * (s[g, n] * xd[t, b]) +
// o[g, n] * xsum[t, b] (overwrites y). Columns in strips of 64 (32 bytes a row); the last N % 64
// columns one by one.
template <bool kTiled>
void KnU4Int(const Problem& pb, const Weight& wt, float* y, int64_t k0, int64_t k1) {
  const int64_t n_len = wt.n, k_len = pb.k_len, blocks = k_len / kQBlock;
  const int64_t group = k_len / wt.groups, row_bytes = n_len / 2, n64 = n_len / 64 * 64;
  const uint8_t* w = static_cast<const uint8_t*>(wt.w);
  std::memset(y, 0, pb.t_len * n_len * sizeof(float));
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t k = k0; k < k1; k += kQBlock) {
    const int64_t b = k / kQBlock;
    const uint16_t* srow = wt.scale16 + k / group * n_len;
    const uint16_t* orow = wt.offset16 + k / group * n_len;
    const uint8_t* blk = w + k * row_bytes;
    // The next block (32 rows: 16 N bytes, contiguous) prefetched into L2, 1 KB per strip (tiled:
    // exactly the strip's tile of the next block).
    const char* next = reinterpret_cast<const char*>(blk + kQBlock * row_bytes);
    for (int64_t t = 0; t < pb.t_len; ++t) {
      const int8_t* xh = pb.xq + t * k_len + k;
      const int8_t* xl = pb.xl + t * k_len + k;
      const __m256 dx = _mm256_set1_ps(pb.xd[t * blocks + b]);
      const __m256 xs = _mm256_set1_ps(pb.xsum[t * blocks + b]);
      float* yt = y + t * n_len;
      const bool prefetch = t == 0 && k + 2 * kQBlock <= k1;
      // y[c:c+8] += cols c..c+7 of the block's integer sums, scaled, plus the offsets term.
      auto emit = [&](int64_t c, __m256i v) {
        const __m256 sd = _mm256_mul_ps(HalfLoad(srow + c), dx);
        const __m256 base = _mm256_fmadd_ps(HalfLoad(orow + c), xs, _mm256_loadu_ps(yt + c));
        _mm256_storeu_ps(yt + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sd, base));
      };
      // even: sums of the low nibbles (columns c, c+2, ..., c+14), odd: high nibbles (c+1, ...).
      auto emit16 = [&](int64_t c, __m256i even, __m256i odd) {
        const __m256i lo = _mm256_unpacklo_epi32(even, odd), hi = _mm256_unpackhi_epi32(even, odd);
        emit(c, _mm256_permute2x128_si256(lo, hi, 0x20));
        emit(c + 8, _mm256_permute2x128_si256(lo, hi, 0x31));
      };
      for (int64_t n = 0; n < n64; n += 64) {
        if (prefetch)
          for (int c = 0; c < 1024; c += 64) _mm_prefetch(next + n * 16 + c, _MM_HINT_T1);
        const uint8_t* col = blk + n / 2;    // [K, N]: the strip's 32 bytes of each row
        const uint8_t* tile = blk + n * 16;  // tiled: the strip's 1 KB tile
        // Two rows at a time, interleaved byte by byte (vpunpck[lh]bw), then split into their low
        // nibbles (even columns) and high ones (odd: vpsrlw 4 keeps each byte's own high nibble
        // in its low bits), each multiplied by x's two parts.
        // NOTE: 16-bit sums: |codes * xh| <= 15 * 127, 16 of them (8 row pairs) <= 30480; |codes *
        // xl| <= 15 * 64, 32 of them (16 pairs) <= 30720: both < 2^15.
        const __m256i z = _mm256_setzero_si256();
        __m256i acc[8] = {z, z, z, z, z, z, z, z};
        __m256i h[4] = {z, z, z, z}, l[4] = {z, z, z, z};  // [lo nibbles u0, u1, hi nibbles u0, u1]
        auto widen = [&](__m256i v, __m256i* out, int shift) {
          out[0] = _mm256_add_epi32(out[0], _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)), shift));
          out[1] = _mm256_add_epi32(out[1], _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)), shift));
        };
        for (int j = 0; j < 16; ++j) {
          const int64_t r = 2 * j;
          // Rows r and r + 1 of the strip: 32 bytes apart in a tile, row_bytes apart in [K, N].
          const uint8_t* ra = kTiled ? tile + 32 * r : col + r * row_bytes;
          const uint8_t* rb = kTiled ? ra + 32 : ra + row_bytes;
          const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra));
          const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb));
          const __m256i u0 = _mm256_unpacklo_epi8(va, vb), u1 = _mm256_unpackhi_epi8(va, vb);
          int16_t ph, pl;
          std::memcpy(&ph, xh + r, 2);
          std::memcpy(&pl, xl + r, 2);
          const __m256i xph = _mm256_set1_epi16(ph), xpl = _mm256_set1_epi16(pl);
          const __m256i u[4] = {_mm256_and_si256(u0, low4), _mm256_and_si256(u1, low4),
                                _mm256_and_si256(_mm256_srli_epi16(u0, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(u1, 4), low4)};
          for (int q = 0; q < 4; ++q) {
            h[q] = _mm256_add_epi16(h[q], _mm256_maddubs_epi16(u[q], xph));
            l[q] = _mm256_add_epi16(l[q], _mm256_maddubs_epi16(u[q], xpl));
          }
          if (j % 8 == 7)
            for (int q = 0; q < 4; ++q) widen(h[q], acc + 2 * q, 7), h[q] = z;
        }
        for (int q = 0; q < 4; ++q) widen(l[q], acc + 2 * q, 0);
        // acc[0]: low nibbles of bytes 0-7, [1]: bytes 16-23, [2]: 8-15, [3]: 24-31; [4..7] the
        // high nibbles of the same bytes (byte i holds columns n + 2i and n + 2i + 1).
        emit16(n, acc[0], acc[4]);
        emit16(n + 16, acc[2], acc[6]);
        emit16(n + 32, acc[1], acc[5]);
        emit16(n + 48, acc[3], acc[7]);
      }
      TailColumns(blk, row_bytes, xh, xl, srow, orow, pb.xd[t * blocks + b], pb.xsum[t * blocks + b], yt,
                  n64, n_len);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define JAXINFER_INT4_VNNI 1
// The same products with AVX-512 VNNI (vpdpbusd: four u8 x s8 products summed into each 32-bit
// lane, no 16-bit sums to widen) on 64-byte vectors, for CPUs that have it (Intel since Ice Lake,
// AMD Zen 4). Four rows of a 64-column strip at a time: their two 64-byte loads (rows r, r + 1
// and r + 2, r + 3) are split into low nibbles (even columns) and high ones (odd), and vpermt2b
// gathers each column's four codes into one dword, rows in order, against x's four bytes of those
// rows broadcast. The integer sums are exact, and the epilogue is the AVX2 path's per element
// (the same products in the same order), so both give the same bits.

// The constant index vectors of the VNNI path.
struct VnniIndex {
  // Byte 4i + j of a gathered vector: row r + j's code of column i (lo: columns 0-15 of the nibble
  // half, hi: 16-31); bytes 0-31 of a load are its first row, 32-63 its second, and vpermt2b's
  // indices 64-127 take the second operand (rows r + 2, r + 3).
  __m512i lo, hi;
  // Lanes 2i and 2i + 1 of 16 columns: lane i of the even columns' sums, then of the odd ones'.
  __m512i pair_lo, pair_hi;
  VnniIndex() {
    alignas(64) uint8_t lo_bytes[64], hi_bytes[64];
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 4; ++j) {
        lo_bytes[4 * i + j] = static_cast<uint8_t>(i + 32 * j);
        hi_bytes[4 * i + j] = static_cast<uint8_t>(i + 16 + 32 * j);
      }
    lo = _mm512_load_si512(lo_bytes);
    hi = _mm512_load_si512(hi_bytes);
    pair_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
  }
};

// x rows t0 .. t0 + kRows - 1 against one 32-row block (rows k .. k + 31) of the codes: each
// 4-row group of a strip is unpacked once for all kRows rows (8 accumulators a row; two rows keep
// the 32 vector registers enough).
template <bool kTiled, int kRows>
void VnniBlockRows(const Problem& pb, const uint8_t* blk, int64_t row_bytes, int64_t n_len,
                   const uint16_t* srow, const uint16_t* orow, float* y, int64_t k, int64_t t0,
                   const char* next, const VnniIndex& ix) {
  const int64_t k_len = pb.k_len, b = k / kQBlock, blocks = k_len / kQBlock, n64 = n_len / 64 * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int8_t *xh[kRows], *xl[kRows];
  for (int i = 0; i < kRows; ++i) {
    xh[i] = pb.xq + (t0 + i) * k_len + k;
    xl[i] = pb.xl + (t0 + i) * k_len + k;
  }
  for (int64_t n = 0; n < n64; n += 64) {
    if (next)
      for (int c = 0; c < 1024; c += 64) _mm_prefetch(next + n * 16 + c, _MM_HINT_T1);
    const uint8_t* col = blk + n / 2;    // [K, N]: the strip's 32 bytes of each row
    const uint8_t* tile = blk + n * 16;  // tiled: the strip's 1 KB tile
    const __m512i z = _mm512_setzero_si512();
    // Per x row: [even columns 0-15 of the nibble halves, 16-31, odd 0-15, odd 16-31] x xh, then
    // the same x xl.
    __m512i h[kRows][4], l[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < 4; ++j) h[i][j] = l[i][j] = z;
    for (int r = 0; r < kQBlock; r += 4) {
      __m512i p, q;  // rows r, r + 1 and r + 2, r + 3
      if (kTiled) {
        p = _mm512_loadu_si512(tile + 32 * r);
        q = _mm512_loadu_si512(tile + 32 * r + 64);
      } else {
        auto two = [&](int64_t row) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + row * row_bytes));
          const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + (row + 1) * row_bytes));
          return _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
        };
        p = two(r);
        q = two(r + 2);
      }
      const __m512i pl = _mm512_and_si512(p, low4), ql = _mm512_and_si512(q, low4);
      const __m512i ph = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
      const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
      const __m512i u[4] = {_mm512_permutex2var_epi8(pl, ix.lo, ql), _mm512_permutex2var_epi8(pl, ix.hi, ql),
                            _mm512_permutex2var_epi8(ph, ix.lo, qh), _mm512_permutex2var_epi8(ph, ix.hi, qh)};
      for (int i = 0; i < kRows; ++i) {
        int32_t xh4, xl4;
        std::memcpy(&xh4, xh[i] + r, 4);
        std::memcpy(&xl4, xl[i] + r, 4);
        const __m512i vh = _mm512_set1_epi32(xh4), vl = _mm512_set1_epi32(xl4);
        for (int j = 0; j < 4; ++j) {
          h[i][j] = _mm512_dpbusd_epi32(h[i][j], u[j], vh);
          l[i][j] = _mm512_dpbusd_epi32(l[i][j], u[j], vl);
        }
      }
    }
    for (int i = 0; i < kRows; ++i) {
      const int64_t t = t0 + i;
      const __m512 dx = _mm512_set1_ps(pb.xd[t * blocks + b]);
      const __m512 xs = _mm512_set1_ps(pb.xsum[t * blocks + b]);
      float* yt = y + t * n_len;
      auto emit = [&](int64_t c, __m512i v) {  // y[c:c+16], as the AVX2 path's emit
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(srow + c)));
        const __m512 of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(orow + c)));
        const __m512 base = _mm512_fmadd_ps(of, xs, _mm512_loadu_ps(yt + c));
        _mm512_storeu_ps(yt + c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sc, dx), base));
      };
      __m512i sum[4];
      for (int j = 0; j < 4; ++j) sum[j] = _mm512_add_epi32(_mm512_slli_epi32(h[i][j], 7), l[i][j]);
      // sum[0]: columns n + 2i (i < 16), sum[2]: n + 2i + 1, sum[1] / sum[3]: the same from n + 32.
      emit(n, _mm512_permutex2var_epi32(sum[0], ix.pair_lo, sum[2]));
      emit(n + 16, _mm512_permutex2var_epi32(sum[0], ix.pair_hi, sum[2]));
      emit(n + 32, _mm512_permutex2var_epi32(sum[1], ix.pair_lo, sum[3]));
      emit(n + 48, _mm512_permutex2var_epi32(sum[1], ix.pair_hi, sum[3]));
    }
  }
  for (int i = 0; i < kRows; ++i) {
    const int64_t t = t0 + i;
    TailColumns(blk, row_bytes, xh[i], xl[i], srow, orow, pb.xd[t * blocks + b], pb.xsum[t * blocks + b],
                y + t * n_len, n64, n_len);
  }
}

template <bool kTiled>
void KnU4IntVnni(const Problem& pb, const Weight& wt, float* y, int64_t k0, int64_t k1) {
  static const VnniIndex ix;
  const int64_t n_len = wt.n, group = pb.k_len / wt.groups, row_bytes = n_len / 2;
  const uint8_t* w = static_cast<const uint8_t*>(wt.w);
  std::memset(y, 0, pb.t_len * n_len * sizeof(float));
  for (int64_t k = k0; k < k1; k += kQBlock) {
    const uint16_t* srow = wt.scale16 + k / group * n_len;
    const uint16_t* orow = wt.offset16 + k / group * n_len;
    const uint8_t* blk = w + k * row_bytes;
    // The next block prefetched into L2 while the first rows of x go over this one.
    const char* next =
        k + 2 * kQBlock <= k1 ? reinterpret_cast<const char*>(blk + kQBlock * row_bytes) : nullptr;
    int64_t t = 0;
    for (; t + 2 <= pb.t_len; t += 2, next = nullptr)
      VnniBlockRows<kTiled, 2>(pb, blk, row_bytes, n_len, srow, orow, y, k, t, next, ix);
    if (t < pb.t_len) VnniBlockRows<kTiled, 1>(pb, blk, row_bytes, n_len, srow, orow, y, k, t, next, ix);
  }
}
#endif

// The integer products of one part: the VNNI path where this build has it, unless the environment
// sets JAXINFER_CPU_INT4_AVX2 (read once; for tests and benchmarks comparing the two paths).
bool Int4Vnni() {
#ifdef JAXINFER_INT4_VNNI
  static const bool vnni = std::getenv("JAXINFER_CPU_INT4_AVX2") == nullptr;
  return vnni;
#else
  return false;
#endif
}

template <bool kTiled>
void Int4Products(const Problem& pb, const Weight& wt, float* y, int64_t k0, int64_t k1) {
#ifdef JAXINFER_INT4_VNNI
  if (Int4Vnni()) return KnU4IntVnni<kTiled>(pb, wt, y, k0, k1);
#endif
  KnU4Int<kTiled>(pb, wt, y, k0, k1);
}

// The f16 scales or offsets `which` of weight i of an `offsets` call: [G, n] with G dividing K and
// K / G a multiple of kQBlock.
ffi::Error CheckHalves(const ffi::AnyBuffer& a, const char* which, int64_t i, int64_t k, int64_t n) {
  const auto d = a.dimensions();
  if (a.element_type() == ffi::DataType::F16 && d.size() == 2 && d[1] == n && d[0] >= 1 &&
      k % d[0] == 0 && (k / d[0]) % kQBlock == 0)
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("cpu_linear: ") + which + " " + std::to_string(i) + " must be f16 [G, " +
      std::to_string(n) + "] with K / G a multiple of " + std::to_string(kQBlock) + " (K = " +
      std::to_string(k) + ")");
}

// Weight i of an `offsets` call (args: the weights, their scales, their offsets) into `out`.
ffi::Error OffsetsWeight(ffi::RemainingArgs& args, int64_t nw, int64_t i, int64_t k, int64_t n, bool u4,
                         const void* w, float* y, Weight& out) {
  auto s = args.get<ffi::AnyBuffer>(nw + i);
  auto o = args.get<ffi::AnyBuffer>(2 * nw + i);
  if (!u4 || !s.has_value() || !o.has_value())
    return ffi::Error::InvalidArgument("cpu_linear: offsets calls take uint4 weights, f16 scales and offsets");
  if (auto e = CheckHalves(*s, "scales", i, k, n); e.failure()) return e;
  if (auto e = CheckHalves(*o, "offsets", i, k, n); e.failure()) return e;
  if (o->dimensions()[0] != s->dimensions()[0])
    return ffi::Error::InvalidArgument("cpu_linear: offsets " + std::to_string(i) + " must have the scales' shape");
  out = {w, nullptr, s->dimensions()[0], y, n, nullptr, true, static_cast<const uint16_t*>(s->untyped_data()),
         static_cast<const uint16_t*>(o->untyped_data())};
  return ffi::Error::Success();
}

// Rows [k0, k1) (multiples of kQBlock) of an `offsets` weight dequantized into `wt.y` as f32 [K, N]
// in row-major order: out[k, n] = q[k, n] * s[k / group, n] + o[k / group, n] (a product, then a
// sum: XLA's dequantization, rounded the same way), for the products of many rows (prefill), which
// XLA's dot then takes as a float32 weight (`Dequantize`). XLA's own conversion of the uint4
// codes (untiling them first for a CPU runner) ran at ~1 ns a code: as long as the f32 product
// itself at 128 rows (BENCHMARKS.md "int4 prefill").
template <bool kTiled>
void DequantInt4(const Problem& pb, const Weight& wt, int64_t k0, int64_t k1) {
  const int64_t n_len = wt.n, group = pb.k_len / wt.groups, row_bytes = n_len / 2, n64 = n_len / 64 * 64;
  const uint8_t* w = static_cast<const uint8_t*>(wt.w);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int64_t k = k0; k < k1; k += kQBlock) {
    const uint16_t* srow = wt.scale16 + k / group * n_len;
    const uint16_t* orow = wt.offset16 + k / group * n_len;
    const uint8_t* blk = w + k * row_bytes;
    float* out = wt.y + k * n_len;
    for (int64_t n = 0; n < n64; n += 64) {
      __m256 s[8], o[8];
      for (int v = 0; v < 8; ++v) s[v] = HalfLoad(srow + n + 8 * v), o[v] = HalfLoad(orow + n + 8 * v);
      const uint8_t* col = blk + n / 2;    // [K, N]: the strip's 32 bytes of each row
      const uint8_t* tile = blk + n * 16;  // tiled: the strip's 1 KB tile
      for (int64_t r = 0; r < kQBlock; ++r) {
        const uint8_t* src = kTiled ? tile + 32 * r : col + r * row_bytes;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        // Byte i holds columns 2i (low nibble) and 2i + 1: interleaved back, a = columns 0-15 |
        // 32-47, b = 16-31 | 48-63 (per 128-bit lane).
        const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
        const __m128i q[4] = {_mm256_castsi256_si128(a), _mm256_castsi256_si128(b), _mm256_extracti128_si256(a, 1),
                              _mm256_extracti128_si256(b, 1)};
        float* dst = out + r * n_len + n;
        for (int j = 0; j < 4; ++j) {  // columns 16 j .. 16 j + 15
          const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j]));
          const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q[j], 8)));
          _mm256_storeu_ps(dst + 16 * j, _mm256_add_ps(_mm256_mul_ps(c0, s[2 * j]), o[2 * j]));
          _mm256_storeu_ps(dst + 16 * j + 8, _mm256_add_ps(_mm256_mul_ps(c1, s[2 * j + 1]), o[2 * j + 1]));
        }
      }
    }
    for (int64_t r = 0; r < kQBlock; ++r)  // the last N % 64 columns ([K, N] codes only)
      for (int64_t n = n64; n < n_len; ++n) {
        const int code = (blk[r * row_bytes + n / 2] >> (4 * (n & 1))) & 0x0f;
        out[r * n_len + n] = static_cast<float>(code) * _cvtsh_ss(srow[n]) + _cvtsh_ss(orow[n]);
      }
  }
}
