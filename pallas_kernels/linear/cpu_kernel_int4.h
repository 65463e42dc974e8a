// Part of cpu_kernel.cc (included by it after its Problem / Weight types; not a standalone header):
// int4 weights times int8-quantized activations, the `offsets` calls (cpu.py `linear(...,
// offsets=)`).
//
// Like llama.cpp's Q4_1 x Q8_1 path: x is quantized once per call to int8 per block of kQBlock = 32
// input channels (xq = round(x * 127 / max|x|), the block's scale xd = max|x| / 127 and its float
// sum xsum kept), and each 32-row block of codes is multiplied by xq in 16-bit lanes (vpmaddubsw:
// two rows' codes interleaved byte by byte against the broadcast xq pair), summed to 32 bits every
// 16 rows; the block's integer sums then enter y as
//   y[t, n] += isum * (s[g, n] * xd[t, b]) + o[g, n] * xsum[t, b].
// About 5 codes per instruction where the f32 path of cpu_kernel.cc does 2 (measured 2.8x faster
// on one core from cache); the activations' rounding (at most half a step of 1/127 of the block's
// max) is the numeric change (BENCHMARKS.md "int4 decode step").
// Layout: `quantization="int4"`'s own, uint4 codes [K, N] (two per byte along N), f16 scales and
// offsets [G, N] read as stored; K and the group size K / G multiples of kQBlock.

// x [T, K] quantized per block of kQBlock channels: xq = round(x * 127 / max|x|) (0 for an all-zero
// block), xd = max|x| / 127, xsum = the block's float sum (summed in order).
void QuantizeX(const float* x, int64_t t_len, int64_t k_len, int8_t* xq, float* xd, float* xsum) {
  const int64_t blocks = k_len / kQBlock;
  for (int64_t t = 0; t < t_len; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + t * k_len + b * kQBlock;
      float amax = 0.0f, sum = 0.0f;
      for (int64_t i = 0; i < kQBlock; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t i = 0; i < kQBlock; ++i)
        xq[t * k_len + b * kQBlock + i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
      xd[t * blocks + b] = amax / 127.0f;
      xsum[t * blocks + b] = sum;
    }
}

inline __m256 HalfLoad(const uint16_t* p) {  // 8 f16 as f32 (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// y[t, :] = the rows [k0, k1) (multiples of kQBlock) of an `offsets` weight: per 32-row block b of
// group g, sum_k q[k, n] * xq[t, k] in integers, then y[t, n] += that * (s[g, n] * xd[t, b]) +
// o[g, n] * xsum[t, b] (overwrites y). Columns in strips of 64 (32 bytes a row); the last N % 64
// columns one by one.
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
    // The next block (32 rows: 16 N bytes, contiguous) prefetched into L2, 1 KB per strip.
    const char* next = reinterpret_cast<const char*>(blk + kQBlock * row_bytes);
    for (int64_t t = 0; t < pb.t_len; ++t) {
      const int8_t* xq = pb.xq + t * k_len + k;
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
        const uint8_t* col = blk + n / 2;
        __m256i acc[8];
        for (auto& a : acc) a = _mm256_setzero_si256();
        // NOTE: 16-bit sums of 8 row pairs: |codes * xq| <= 15 * 127, 16 of them <= 30480 < 2^15.
        for (int h = 0; h < 2; ++h) {
          __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
          for (int j = 0; j < 8; ++j) {
            const int64_t r = 16 * h + 2 * j;
            const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + r * row_bytes));
            const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + (r + 1) * row_bytes));
            int16_t pair;
            std::memcpy(&pair, xq + r, 2);
            const __m256i xp = _mm256_set1_epi16(pair);
            const __m256i al = _mm256_and_si256(va, low4), ah = _mm256_and_si256(_mm256_srli_epi16(va, 4), low4);
            const __m256i bl = _mm256_and_si256(vb, low4), bh = _mm256_and_si256(_mm256_srli_epi16(vb, 4), low4);
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(al, bl), xp));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(al, bl), xp));
            s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ah, bh), xp));
            s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ah, bh), xp));
          }
          const __m256i s[4] = {s0, s1, s2, s3};
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] = _mm256_add_epi32(acc[2 * q], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s[q])));
            acc[2 * q + 1] = _mm256_add_epi32(acc[2 * q + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s[q], 1)));
          }
        }
        // acc[0]: low nibbles of bytes 0-7, [1]: bytes 16-23, [2]: 8-15, [3]: 24-31; [4..7] the
        // high nibbles of the same bytes (byte i holds columns n + 2i and n + 2i + 1).
        emit16(n, acc[0], acc[4]);
        emit16(n + 16, acc[2], acc[6]);
        emit16(n + 32, acc[1], acc[5]);
        emit16(n + 48, acc[3], acc[7]);
      }
      const float dxs = pb.xd[t * blocks + b], xss = pb.xsum[t * blocks + b];
      for (int64_t n = n64; n < n_len; ++n) {
        int32_t isum = 0;
        for (int64_t r = 0; r < kQBlock; ++r)
          isum += ((blk[r * row_bytes + n / 2] >> (4 * (n & 1))) & 0x0f) * xq[r];
        const float base = std::fma(_cvtsh_ss(orow[n]), xss, yt[n]);
        yt[n] = std::fma(static_cast<float>(isum), _cvtsh_ss(srow[n]) * dxs, base);
      }
    }
  }
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
