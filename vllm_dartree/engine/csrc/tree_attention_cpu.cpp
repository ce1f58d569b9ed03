// dartree's CPU tree attention, read straight from vLLM's paged KV tensor.
//
// The same contract as `vllm_dartree.engine.cpu_attention.tree_attention` (its torch/SDPA
// path is the reference this kernel is tested against): request r owns query rows
// [qsl[r], qsl[r + 1]), the last q_len positions of its sequence of seq_lens[r] tokens; every
// row sees the ctx = seq_len - q_len committed positions and, inside the window, either the
// causal triangle or (is_tree[r]) its row of the packed ancestor mask
// (bit k % 32 of word k / 32 of tree_mask[r, i] = row i sees window column k).
//
// KV layouts of kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]:
//  - token (vec = false): K in the first head_size lanes of a slot, V in the rest
//    (`engine.attention.kv_views`);
//  - vec (vec = true): vLLM's own CPU layout for its `vec` ISA: per block and KV head, K
//    transposed ([head_size, block_size]: K(t, d) at d * block_size + t) followed by V
//    token-major ([block_size, head_size]). Scores then come from contiguous runs of
//    positions (one vector FMA per 8 positions and lane of the head), no horizontal sums.
//
// One work item = (request, KV head, chunk of rows); the G = num_heads / num_kv_heads query
// heads of a KV head share each K/V row it loads. Softmax is computed online over tiles of
// positions (running max and sum, rescaled when the max grows), accumulated in float
// whatever the storage type.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;   // positions per tile of the online softmax

struct Item {
  int64_t r, kvh, i0, i1;
};

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// Partial sums in 32 lanes (four vector registers, four independent FMA chains: one chain's
// latency had bounded a decode row), folded to 8 and summed; a plain reduction loop stays
// scalar without -ffast-math, which we do not want (-inf must hold).
inline float dot(const float* a, const float* b, int64_t n) {
  float part[32] = {};
  int64_t d = 0;
  for (; d + 32 <= n; d += 32)
    for (int k = 0; k < 32; ++k) part[k] += a[d + k] * b[d + k];
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) part[k] += a[d + k] * b[d + k];
  for (int k = 0; k < 8; ++k) part[k] += (part[k + 8] + part[k + 16]) + part[k + 24];
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Query rows are blocked in the inner loops: each K or V vector loaded feeds up to
// kRowBlock rows, and their independent FMA chains hide the FMA latency that one row's
// chain had exposed. A Xeon here (AVX-512, head 64, 32 positions per tile), ns per row
// and tile: scores 90 -> 45 at 15 rows, 87 -> 37 at 3; the weighted V sums 66 -> 37 at 15,
// 81 -> 61 at 3 (an AVX2 build at 15 rows: 132 -> 55 and 129 -> 71). A row's own sums run
// in the same order as before.
#if defined(__AVX512F__)
constexpr int kRowBlock = 4;   // 32 vector registers
constexpr int kLanes = 16;
#else
constexpr int kRowBlock = 2;   // 16 vector registers
constexpr int kLanes = 8;
#endif
// kLanes floats, loaded and stored unaligned; GCC / Clang lower its arithmetic to the ISA's
// vector instructions (an `omp simd` loop over a [rows][D] accumulator stayed scalar)
typedef float vecf __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

// s[r][t] = q_r . K(t) for RB rows (q_r at q + r * D) and the kTile positions of a tile of
// transposed K (K(t, d) at k[d * ldk + t]): per lane d of the head, kTile / kLanes vector
// loads shared by the RB rows, one broadcast and kTile / kLanes vector FMAs per row, the
// partial scores held in registers.
template <int RB>
inline void score_rows(const float* q, int64_t D, const float* k, int64_t ldk, float* s) {
  float acc[RB][kTile] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = k + d * ldk;
    for (int r = 0; r < RB; ++r) {
      const float qd = q[r * D + d];
#pragma omp simd
      for (int64_t t = 0; t < kTile; ++t) acc[r][t] += qd * kd[t];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int64_t t = 0; t < kTile; ++t) s[r * kTile + t] = acc[r][t];
}

// Run f.template operator()<RB>(first row) over `rows` rows in blocks of kRowBlock, then
// one block of the rest.
template <typename F>
inline void by_row_blocks(int64_t rows, F&& f) {
  int64_t row = 0;
  for (; row + kRowBlock <= rows; row += kRowBlock) f(std::integral_constant<int, kRowBlock>{}, row);
  switch (rows - row) {
    case 3: f(std::integral_constant<int, 3>{}, row); break;
    case 2: f(std::integral_constant<int, 2>{}, row); break;
    case 1: f(std::integral_constant<int, 1>{}, row); break;
    default: break;
  }
}

// scores [rows][kTile] of the rows qf [rows][D] against one tile of transposed K
inline void score_tile(const float* qf, int64_t D, const float* k, int64_t ldk, int64_t rows,
                       float* s) {
  by_row_blocks(rows, [&](auto rb, int64_t row) {
    score_rows<decltype(rb)::value>(qf + row * D, D, k, ldk, s + row * kTile);
  });
}

// K or V row of a slot as floats: float storage is read in place, others converted.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  load_row(src, buf, n);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

// The sum and the max of a tile's n scores. A full tile is folded in halves (16 + 16, then
// 8 + 8, ...: vector adds and maxes); a plain loop over t stays a chain of dependent scalar
// operations without -ffast-math (32 x 4 cycles, the kernel's largest cost after the FMAs).
inline float tile_sum(const float* s, int64_t n) {
  if (n != kTile) {
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    return sum;
  }
  float part[kTile / 2];
  for (int64_t k = 0; k < kTile / 2; ++k) part[k] = s[k] + s[k + kTile / 2];
  for (int64_t h = kTile / 4; h >= 1; h /= 2)
    for (int64_t k = 0; k < h; ++k) part[k] += part[k + h];
  return part[0];
}

inline float tile_max(const float* s, int64_t n, float m) {
  if (n != kTile) {
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    return m;
  }
  float part[kTile / 2];
  for (int64_t k = 0; k < kTile / 2; ++k) part[k] = std::max(s[k], s[k + kTile / 2]);
  for (int64_t h = kTile / 4; h >= 1; h /= 2)
    for (int64_t k = 0; k < h; ++k) part[k] = std::max(part[k], part[k + h]);
  return std::max(m, part[0]);
}

// exp(x) for a tile of scores, vectorised (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial for e^r, 2^n from the exponent bits; within 2 ulp of std::exp), in
// place of a scalar std::exp per score; returns their sum. Masked scores (-inf) and anything
// below -87.3 give exactly 0, so a column a row does not see never weighs in.
inline float exp_tile(float* s, int64_t n, float m) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) {
    const float x = s[t] - m;
    const float xc = std::min(std::max(x, -87.3f), 88.3f);
    const float k = std::nearbyint(xc * 1.44269504088896341f);
    float r = xc - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    const float e = x < -87.3f ? 0.f : p * scale;
    s[t] = e;
  }
  return tile_sum(s, n);
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}

// acc_r[DC] += sum_t p_r[t] * v[t][DC] for RB rows (p_r at p + r * kTile, acc_r at
// acc + r * DC), the accumulators in registers across the tile: per position DC / kLanes
// vector loads of V shared by the RB rows, and DC / kLanes independent FMAs per row.
template <int DC, int RB>
inline void accumulate_rows(const float* p, const float* const* v, int64_t n, float* acc) {
  constexpr int NV = DC / kLanes;
  vecf a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = *reinterpret_cast<const vecf*>(acc + r * DC + j * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    vecf vt[NV];
    for (int j = 0; j < NV; ++j) vt[j] = *reinterpret_cast<const vecf*>(v[t] + j * kLanes);
    for (int r = 0; r < RB; ++r) {
      const float pt = p[r * kTile + t];
      for (int j = 0; j < NV; ++j) a[r][j] += pt * vt[j];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) *reinterpret_cast<vecf*>(acc + r * DC + j * kLanes) = a[r][j];
}

// acc [rows][D] += scores [rows][kTile] x the tile's V rows; head sizes other than the
// compile-time ones (DC = 0) one row and one position at a time
template <int DC>
inline void accumulate(const float* p, const float* const* v, int64_t n, float* acc,
                       int64_t D, int64_t rows) {
  if constexpr (DC > 0 && DC % kLanes == 0) {
    by_row_blocks(rows, [&](auto rb, int64_t row) {
      accumulate_rows<DC, decltype(rb)::value>(p + row * kTile, v, n, acc + row * DC);
    });
  } else {
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t t = 0; t < n; ++t)
        if (p[row * kTile + t] != 0.f) axpy(p[row * kTile + t], v[t], acc + row * D, D);
  }
}

template <typename T, int DC, bool VEC>
void run(const torch::Tensor& query, const torch::Tensor& kv_cache,
         const torch::Tensor& block_table, const torch::Tensor& qsl,
         const torch::Tensor& seq_lens, const torch::Tensor& requests,
         const torch::Tensor& is_tree, const torch::Tensor& tree_mask, double scale,
         int64_t row_chunk, torch::Tensor& out) {
  const int64_t NH = query.size(1), D = query.size(2);
  const int64_t KVH = kv_cache.size(1), BS = kv_cache.size(2);
  const int64_t G = NH / KVH;
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T* kv = kv_cache.data_ptr<T>();
  const int64_t q_st = query.stride(0), q_sh = query.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  const int64_t kv_sb = kv_cache.stride(0), kv_sh = kv_cache.stride(1),
                kv_so = kv_cache.stride(2);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_s = block_table.stride(0);
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const bool has_trees = tree_mask.numel() > 0;
  const uint8_t* trees = has_trees ? is_tree.data_ptr<uint8_t>() : nullptr;
  const int32_t* tm = has_trees ? tree_mask.data_ptr<int32_t>() : nullptr;
  const int64_t tm_sr = has_trees ? tree_mask.stride(0) : 0;
  const int64_t tm_si = has_trees ? tree_mask.stride(1) : 0;
  const float fscale = static_cast<float>(scale);

  std::vector<Item> items;
  const int64_t* req = requests.data_ptr<int64_t>();
  for (int64_t n = 0; n < requests.numel(); ++n) {
    const int64_t r = req[n];
    const int64_t q_len = starts[r + 1] - starts[r];
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < q_len; i0 += row_chunk)
        items.push_back({r, h, i0, std::min(q_len, i0 + row_chunk)});
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // K and V rows of a tile as floats: pointers into the cache for float storage, else
    // converted once per tile into kbuf / vbuf
    std::vector<float> qf, scores, acc, kbuf(kTile * D), vbuf(kTile * D), run_max, denom;
    const T* tile[kTile];
    const float* kf[kTile];
    const float* vf[kTile];
    for (int64_t it = begin; it < end; ++it) {
      const Item& w = items[it];
      const int64_t r = w.r, start = starts[r], q_len = starts[r + 1] - start;
      const int64_t seq_len = lens[r], ctx = seq_len - q_len;
      const bool tree = has_trees && trees[r];
      const int64_t rows = (w.i1 - w.i0) * G;
      // causal rows see ctx + i + 1 positions; tree rows at most the whole window
      const int64_t limit = tree ? seq_len : ctx + w.i1;
      qf.assign(rows * D, 0.f);
      scores.assign(rows * kTile, -INFINITY);
      acc.assign(rows * D, 0.f);
      run_max.assign(rows, -INFINITY);
      denom.assign(rows, 0.f);
      for (int64_t i = w.i0; i < w.i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          float* dst = &qf[((i - w.i0) * G + g) * D];
          load_row(q + (start + i) * q_st + (w.kvh * G + g) * q_sh, dst, D);
          for (int64_t d = 0; d < D; ++d) dst[d] *= fscale;
        }
      const int32_t* row_blocks = bt + r * bt_s;
      auto sees = [&](int64_t i, int64_t j) {   // window column k = j - ctx
        const int64_t k = j - ctx;
        if (!tree) return k <= i;
        return ((tm[r * tm_sr + i * tm_si + k / 32] >> (k % 32)) & 1) != 0;
      };
      // Tiles of kTile positions, softmax online (flash-style): each K/V slot is read from
      // memory once; its V half is still in cache when the tile's weights are applied.
      for (int64_t j0 = 0; j0 < limit; j0 += kTile) {
        const int64_t n = std::min(kTile, limit - j0);
        if constexpr (VEC) {
          // a tile never crosses a block (block_size % kTile == 0, checked by the caller)
          const T* head = kv + static_cast<int64_t>(row_blocks[j0 / BS]) * kv_sb +
                          w.kvh * kv_sh;
          const int64_t off = j0 % BS;
          const T* kt = head + off;                 // K(t, d) at kt[d * BS + t]
          const T* vt = head + BS * D + off * D;    // V(t, d) at vt[t * D + d]
          const float* kfl;
          int64_t ldk;
          if constexpr (std::is_same_v<T, float>) {
            kfl = kt, ldk = BS;
          } else {
            for (int64_t d = 0; d < D; ++d) load_row(kt + d * BS, &kbuf[d * kTile], kTile);
            kfl = kbuf.data(), ldk = kTile;
          }
          for (int64_t t = 0; t < n; ++t) vf[t] = as_float(vt + t * D, &vbuf[t * D], D);
          // all kTile columns are computed (they lie inside the block); those past n and
          // those a row does not see are set to -inf
          score_tile(qf.data(), D, kfl, ldk, rows, scores.data());
          const bool masked = j0 + n > ctx;
          for (int64_t i = w.i0; i < w.i1; ++i)
            for (int64_t g = 0; g < G; ++g) {
              float* sr = &scores[((i - w.i0) * G + g) * kTile];
              for (int64_t t = n; t < kTile; ++t) sr[t] = -INFINITY;
              if (masked)
                for (int64_t t = 0; t < n; ++t)
                  if (j0 + t >= ctx && !sees(i, j0 + t)) sr[t] = -INFINITY;
            }
        } else {
        std::fill(scores.begin(), scores.end(), -INFINITY);
        {   // the tile's slots, found once for K and V (one division per tile)
          int64_t b = j0 / BS, off = j0 % BS;
          for (int64_t t = 0; t < n; ++t) {
            tile[t] = kv + static_cast<int64_t>(row_blocks[b]) * kv_sb + w.kvh * kv_sh +
                      off * kv_so;
            if (++off == BS) off = 0, ++b;
          }
          for (int64_t t = 0; t < n; ++t) {
            kf[t] = as_float(tile[t], &kbuf[t * D], D);
            vf[t] = as_float(tile[t] + D, &vbuf[t * D], D);
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const int64_t j = j0 + t;
          const float* k = kf[t];
          for (int64_t i = w.i0; i < w.i1; ++i) {
            if (j >= ctx && !sees(i, j)) continue;
            for (int64_t g = 0; g < G; ++g) {
              const int64_t row = (i - w.i0) * G + g;
              scores[row * kTile + t] = dot(&qf[row * D], k, D);
            }
          }
        }
        }
        for (int64_t row = 0; row < rows; ++row) {
          float* sr = &scores[row * kTile];
          const float m = tile_max(sr, n, run_max[row]);
          if (m == -INFINITY) continue;           // nothing seen yet
          if (m > run_max[row]) {                 // rescale what was accumulated
            const float c = run_max[row] == -INFINITY ? 0.f : std::exp(run_max[row] - m);
            denom[row] *= c;
            for (int64_t d = 0; d < D; ++d) acc[row * D + d] *= c;
            run_max[row] = m;
          }
          denom[row] += exp_tile(sr, n, m);       // 0 for unseen columns
        }
        accumulate<DC>(scores.data(), vf, n, acc.data(), D, rows);
      }
      for (int64_t i = w.i0; i < w.i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = (i - w.i0) * G + g;
          const float inv = denom[row] > 0.f ? 1.f / denom[row] : 0.f;
          T* dst = o + (start + i) * o_st + (w.kvh * G + g) * o_sh;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[row * D + d] * inv);
        }
    }
  });
}

}  // namespace

void tree_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_table,
                    torch::Tensor query_start_loc, torch::Tensor seq_lens,
                    torch::Tensor requests, torch::Tensor is_tree, torch::Tensor tree_mask,
                    double scale, int64_t row_chunk, bool vec, torch::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(kv_cache.size(3) == 2 * query.size(2), "KV slot must hold K and V");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, KV cache and output must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
              "block_table: int32, rows contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous(),
              "query_start_loc: contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens: contiguous int32");
  TORCH_CHECK(requests.scalar_type() == torch::kInt64 && requests.is_contiguous(),
              "requests: contiguous int64");
  if (tree_mask.numel() > 0) {
    TORCH_CHECK(tree_mask.scalar_type() == torch::kInt32 && tree_mask.dim() == 3 &&
                    tree_mask.stride(2) == 1, "tree_mask: [R, Q, words] int32");
    TORCH_CHECK(is_tree.scalar_type() == torch::kUInt8 && is_tree.is_contiguous(),
                "is_tree: contiguous uint8");
  }
  TORCH_CHECK(!vec || kv_cache.size(2) % kTile == 0,
              "the vec layout needs a block size that is a multiple of ", kTile);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16,
                                  query.scalar_type(), "dartree_tree_attention", [&] {
    const int64_t D = query.size(2);
    auto go = [&](auto dc) {
      if (vec)
        run<scalar_t, decltype(dc)::value, true>(query, kv_cache, block_table,
                                                 query_start_loc, seq_lens, requests, is_tree,
                                                 tree_mask, scale, row_chunk, out);
      else
        run<scalar_t, decltype(dc)::value, false>(query, kv_cache, block_table,
                                                  query_start_loc, seq_lens, requests,
                                                  is_tree, tree_mask, scale, row_chunk, out);
    };
    if (D == 64) go(std::integral_constant<int, 64>{});
    else if (D == 128) go(std::integral_constant<int, 128>{});
    else go(std::integral_constant<int, 0>{});
  });
}

// key / value [T, KVH, D] into slots [T] of the KV tensor (slot -1: a padding row, skipped).
void write_slots(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value,
                 torch::Tensor slots) {
  TORCH_CHECK(kv_cache.dim() == 4 && key.dim() == 3 && value.dim() == 3, "bad ranks");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and KV cache must share a dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots: contiguous int64");
  const int64_t T = slots.numel(), KVH = key.size(1), D = key.size(2);
  const int64_t BS = kv_cache.size(2), NB = kv_cache.size(0);
  TORCH_CHECK(kv_cache.size(1) == KVH && kv_cache.size(3) == 2 * D, "shapes disagree");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t esize = kv_cache.element_size();
  char* base = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    const int64_t b = slot[t] / BS, o = slot[t] % BS;
    TORCH_CHECK(b < NB, "slot ", slot[t], " is outside the KV cache");
    for (int64_t h = 0; h < KVH; ++h) {
      char* dst = base + (b * kv_cache.stride(0) + h * kv_cache.stride(1) +
                          o * kv_cache.stride(2)) * esize;
      std::memcpy(dst, k + (t * key.stride(0) + h * key.stride(1)) * esize, D * esize);
      std::memcpy(dst + D * esize, v + (t * value.stride(0) + h * value.stride(1)) * esize,
                  D * esize);
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_attention", &tree_attention, "dartree paged tree attention (CPU)");
  m.def("write_slots", &write_slots, "store key / value rows in their KV slots (CPU)");
}
