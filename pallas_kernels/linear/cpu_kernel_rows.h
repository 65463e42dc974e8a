// Part of cpu_kernel.cc (included by it after GroupDot; not a standalone header): the LM head's
// group-scaled int8 rows (a tied embedding, `transposed`) against several rows of x at once.
//
// GroupDot for R rows of x at once (row r at a + r * k_len, its result at y[r * y_stride]): each
// group's weights are loaded and widened once for all R rows (a batched decode's LM head redid
// that per row), and every row's arithmetic is GroupDot's, so a row's result does not depend on
// how many rows share the call.
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

template <int R, typename S>
inline void GroupDotRowsAny(const float* a, int64_t k_len, const int8_t* b, const S* s, int64_t groups,
                            int64_t g, float* y, int64_t y_stride) {
  const int64_t vecs = g / kLanes;
  switch (g) {
    case 16: return GroupDotRows<16 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    case 32: return GroupDotRows<32 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    case 64: return GroupDotRows<64 / kLanes, R>(a, k_len, b, s, groups, vecs, y, y_stride);
    default: return GroupDotRows<0, R>(a, k_len, b, s, groups, vecs, y, y_stride);
  }
}

// Rows of x a group-scaled int8 row of W multiplies at once (3 vectors a row + 2 in registers).
constexpr int kHeadRows = kLanes == 16 ? 8 : 4;

