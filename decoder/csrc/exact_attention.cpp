// Fused exact attention for the decoder's exact mode (DESIGN.md section 5).
//
// Contract: the result for one query row (one token, one query head) is a deterministic
// function of that row's query, its own position and the keys/values at positions <= it.
// Nothing else enters: not the other rows of the call, not how rows are split between
// calls or threads, not keys after the row's position (they are never read).
//
// How: keys are split into fixed chunks of `chunk` absolute positions. A row walks its
// chunks in position order with an online softmax (running max m, running sum l, running
// output acc), processing each chunk the same way wherever it happens:
//   scores s_j = q . k_j          (8-lane partial sums over d, then a fixed add tree)
//   m' = max(m, max_j s_j); alpha = exp(m - m'); p_j = exp(s_j - m')
//   l = l * alpha + sum_j p_j     (8-lane partial sums over j, then a fixed add tree)
//   acc = acc * alpha, then acc += p_j * v_j for j in order
// and out = acc / l at the end. Only the row's visible keys of a chunk enter. Rows are
// processed in pairs to share key/value loads, but every lane of a pair does the same
// operations in the same order as a row alone (lanes never mix), so pairing, blocking and
// threading change no bit. The state (m, l, acc) lives in caller-owned tensors, so a row
// can walk chunks [0, F) in one call and [F, ...) in a later one with bitwise the result
// of one call (shared-prefix attention relies on this).
//
// Every floating-point operation is spelled out with AVX2/FMA intrinsics (exp included)
// and the file is compiled with -ffp-contract=off and no fast-math, so the bits are a
// function of this source alone, not of the compiler or libm. Changing any arithmetic here
// changes the kernel identity (decoder/kernels_ext.py hashes this file into it).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp on 8 lanes: Cephes' range reduction (x = n ln2 + r) and degree-5 polynomial, with
// explicit FMAs. Inputs below -88.37 (and -inf) give 0; inputs here are never positive.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 n = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  n = _mm256_floor_ps(n);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(0x7f));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

// ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7))
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four dot products whose 8-lane partial sums are a0..a3, each reduced by the tree
// ((l0+l1) + (l2+l3)) + ((l4+l5) + (l6+l7)).
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Keeps loaded values in registers (the compiler would otherwise load them again as memory
// operands of each FMA that uses them). Register allocation only: no arithmetic changes.
inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }

template <typename... V>
inline void in_register(__m256& v, V&... rest) {
  in_register(v);
  in_register(rest...);
}

// Lanes [0, n) set, n in [0, 8].
inline __m256 lane_mask(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index));
}

// s[r][j] = q[r] . k[j] for keys j in [0, n) (rows R in {1, 2}); 4 keys at a time, the
// last group repeating key n-1 (never reading past it). s[r] has room for n + 3 floats.
template <int R>
inline void chunk_scores(const float* const* q, const float* k, int64_t n, int64_t dim,
                         float* const* s) {
  for (int64_t j = 0; j < n; j += 4) {
    const float* kp[4];
    for (int i = 0; i < 4; ++i) kp[i] = k + std::min(j + i, n - 1) * dim;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 k0 = _mm256_loadu_ps(kp[0] + d), k1 = _mm256_loadu_ps(kp[1] + d);
      __m256 k2 = _mm256_loadu_ps(kp[2] + d), k3 = _mm256_loadu_ps(kp[3] + d);
      in_register(k0, k1, k2, k3);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s[r] + j, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// Scores s[0, n) -> probabilities in place; updates the row's m and l; returns alpha, the
// factor that rescales the row's acc. s has room for n rounded up to 8.
inline float chunk_softmax(float* s, int64_t n, float* m, float* l) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, lane_mask(n - j)));
  }
  const float m_new = std::max(*m, hmax8(mx));
  const float alpha = exp1(*m - m_new);  // 0 for the row's first chunk (m = -inf)
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)),
                                   lane_mask(n - j));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float scaled = *l * alpha;
  *l = scaled + hsum8(sum);
  *m = m_new;
  return alpha;
}

// acc[r][d0, d0 + 8 NV) = (rescale ? acc * alpha[r] : acc) + sum_{j in [j0, j1)} p[r][j] v[j],
// accumulated in key order.
template <int R, int NV>
inline void accumulate_block(float* const* acc, const float* alpha, bool rescale,
                             const float* const* p, const float* v, int64_t j0, int64_t j1,
                             int64_t dim, int64_t d0) {
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) {
      a[r][i] = _mm256_loadu_ps(acc[r] + d0 + 8 * i);
      if (rescale) a[r][i] = _mm256_mul_ps(a[r][i], _mm256_set1_ps(alpha[r]));
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vp = v + j * dim + d0;
    __m256 vv[NV];
    for (int i = 0; i < NV; ++i) {
      vv[i] = _mm256_loadu_ps(vp + 8 * i);
      in_register(vv[i]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_set1_ps(p[r][j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(pr, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc[r] + d0 + 8 * i, a[r][i]);
}

template <int R>
inline void accumulate(float* const* acc, const float* alpha, bool rescale,
                       const float* const* p, const float* v, int64_t j0, int64_t j1,
                       int64_t dim) {
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    switch (std::min<int64_t>(4, (dim - d0) / 8)) {
      case 4: accumulate_block<R, 4>(acc, alpha, rescale, p, v, j0, j1, dim, d0); break;
      case 3: accumulate_block<R, 3>(acc, alpha, rescale, p, v, j0, j1, dim, d0); break;
      case 2: accumulate_block<R, 2>(acc, alpha, rescale, p, v, j0, j1, dim, d0); break;
      default: accumulate_block<R, 1>(acc, alpha, rescale, p, v, j0, j1, dim, d0); break;
    }
  }
}

struct Problem {
  const float* q;       // [T, H, D]
  const float* keys;    // [KVH, cap, D], head stride k_head
  const float* values;  // [KVH, cap, D], head stride v_head
  const int64_t* last;  // [T] each token's own position: its last visible key
  float* m;             // [T, H]
  float* l;             // [T, H]
  float* acc;           // [T, H, D]
  int64_t tokens, heads, kv_heads, dim, k_head, v_head, chunk, first_chunk, stop_chunk;
  bool finish;

  int64_t group() const { return heads / kv_heads; }
};

// One query row: token t, query head h.
struct Row {
  const float* q;
  float* m;
  float* l;
  float* acc;
  int64_t last;
};

constexpr int64_t kTile = 256;  // keys per L1-resident tile of K or V (16 KiB at D = 64)

// The rows of one chunk, paired; row a (and b) sees keys [0, na) (and [0, nb)) of it.
struct Pair {
  const Row* a;
  const Row* b;  // null: a alone
  int64_t na, nb;
  float* s[2];   // scores, then probabilities
  float alpha[2];
};

// Scores of every pair for keys [j0, j1) of the chunk (K tile shared by all pairs).
void tile_scores(std::vector<Pair>& pairs, const float* k, int64_t j0, int64_t j1,
                 int64_t dim) {
  for (Pair& pr : pairs) {
    const int64_t n = std::max(pr.na, pr.nb);
    if (j0 >= n) continue;
    const int64_t n_tile = std::min(j1, n) - j0;
    const float* kt = k + j0 * dim;
    if (pr.b) {
      const float* q[2] = {pr.a->q, pr.b->q};
      float* s[2] = {pr.s[0] + j0, pr.s[1] + j0};
      chunk_scores<2>(q, kt, n_tile, dim, s);
    } else {
      const float* q[1] = {pr.a->q};
      float* s[1] = {pr.s[0] + j0};
      chunk_scores<1>(q, kt, n_tile, dim, s);
    }
  }
}

// acc += p v for every pair over keys [j0, j1) of the chunk (V tile shared by all pairs).
void tile_accumulate(std::vector<Pair>& pairs, const float* v, int64_t j0, int64_t j1,
                     int64_t dim) {
  const bool first = j0 == 0;
  for (Pair& pr : pairs) {
    float* acc[2] = {pr.a->acc, pr.b ? pr.b->acc : nullptr};
    const float* p[2] = {pr.s[0], pr.s[1]};
    const int64_t both = pr.b ? std::min(pr.na, pr.nb) : 0;
    if (j0 < both) accumulate<2>(acc, pr.alpha, first, p, v, j0, std::min(j1, both), dim);
    const int64_t from = std::max(j0, both);
    if (from < std::min(j1, pr.na))
      accumulate<1>(acc, pr.alpha, first && both == 0, p, v, from, std::min(j1, pr.na), dim);
    if (pr.b && from < std::min(j1, pr.nb))
      accumulate<1>(acc + 1, pr.alpha + 1, false, p + 1, v, from, std::min(j1, pr.nb), dim);
  }
}

// Rows [r0, r1) of kv head `kvh` (row r is token r / group, query head kvh * group +
// r % group), chunk by chunk in position order. Within a chunk the keys (then the values)
// are walked in L1-sized tiles, each tile serving every row; no row's arithmetic changes.
void run_block(const Problem& pb, int64_t kvh, int64_t r0, int64_t r1) {
  const int64_t group = pb.group(), dim = pb.dim, chunk = pb.chunk;
  std::vector<Row> rows;
  int64_t top = -1;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / group, hd = t * pb.heads + kvh * group + r % group;
    rows.push_back({pb.q + hd * dim, pb.m + hd, pb.l + hd, pb.acc + hd * dim, pb.last[t]});
    top = std::max(top, pb.last[t]);
  }
  const int64_t stride = chunk + 8;
  std::vector<float> scratch(rows.size() * stride + stride, 0.0f);
  const float* keys = pb.keys + kvh * pb.k_head;
  const float* values = pb.values + kvh * pb.v_head;
  const int64_t stop = std::min(pb.stop_chunk, top / chunk + 1);
  std::vector<Pair> pairs;
  for (int64_t c = pb.first_chunk; c < stop; ++c) {
    const int64_t base = c * chunk;
    pairs.clear();
    const Row* waiting = nullptr;
    int64_t used = 0;
    for (const Row& row : rows) {
      if (row.last < base) continue;
      if (waiting == nullptr) {
        waiting = &row;
        continue;
      }
      float* s0 = scratch.data() + (used++) * stride;
      float* s1 = scratch.data() + (used++) * stride;
      pairs.push_back({waiting, &row, std::min(chunk, waiting->last - base + 1),
                       std::min(chunk, row.last - base + 1), {s0, s1}, {0.0f, 0.0f}});
      waiting = nullptr;
    }
    if (waiting != nullptr) {
      float* s0 = scratch.data() + (used++) * stride;
      pairs.push_back({waiting, nullptr, std::min(chunk, waiting->last - base + 1), 0,
                       {s0, scratch.data() + rows.size() * stride}, {0.0f, 0.0f}});
    }
    const float* k = keys + base * dim;
    const float* v = values + base * dim;
    for (int64_t j0 = 0; j0 < chunk; j0 += kTile)
      tile_scores(pairs, k, j0, std::min(chunk, j0 + kTile), dim);
    for (Pair& pr : pairs) {
      pr.alpha[0] = chunk_softmax(pr.s[0], pr.na, pr.a->m, pr.a->l);
      if (pr.b) pr.alpha[1] = chunk_softmax(pr.s[1], pr.nb, pr.b->m, pr.b->l);
    }
    for (int64_t j0 = 0; j0 < chunk; j0 += kTile)
      tile_accumulate(pairs, v, j0, std::min(chunk, j0 + kTile), dim);
  }
  if (!pb.finish) return;
  for (const Row& row : rows) {
    const __m256 l = _mm256_set1_ps(*row.l);
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(row.acc + d, _mm256_div_ps(_mm256_loadu_ps(row.acc + d), l));
  }
}

// Rows per work item: enough items for every thread, rows paired, but at least 4 rows
// (below that a block is bound by reading its keys and values, which splitting repeats).
// Only speed depends on it.
int64_t block_rows(int64_t rows, int64_t kv_heads) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t items = threads == 1 ? 1 : 4 * threads;
  const int64_t per_head = std::max<int64_t>(1, (items + kv_heads - 1) / kv_heads);
  int64_t size = std::max<int64_t>(4, (rows + per_head - 1) / per_head);
  size += size % 2;
  return std::min<int64_t>({size, 24, rows});
}

void check_layout(const torch::Tensor& x, int64_t dims, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == dims, name, " must have ", dims, " dimensions");
}

}  // namespace

// Walks chunks [first_chunk, stop_chunk) (stop_chunk < 0: no limit) of every row's visible
// keys, updating the online-softmax state (m, l, acc) in place; with `finish`, acc becomes
// acc / l, the attention output. q [T, H, D], already scaled; keys/values [KVH, cap, D]
// (any stride between heads), slot j holding position j; last [T] int64, each token's own
// position (< cap); m, l [T, H] (start: -inf, 0); acc [T, H, D] (start: 0).
void attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor last,
            torch::Tensor m, torch::Tensor l, torch::Tensor acc, int64_t chunk,
            int64_t first_chunk, int64_t stop_chunk, bool finish) {
  check_layout(q, 3, "q");
  check_layout(keys, 3, "keys");
  check_layout(values, 3, "values");
  check_layout(m, 2, "m");
  check_layout(l, 2, "l");
  check_layout(acc, 3, "acc");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = keys.size(0);
  TORCH_CHECK(q.is_contiguous() && m.is_contiguous() && l.is_contiguous() &&
                  acc.is_contiguous(),
              "q, m, l and acc must be contiguous");
  TORCH_CHECK(dim % 8 == 0, "head_dim must be a multiple of 8, got ", dim);
  TORCH_CHECK(chunk >= 8 && chunk % 8 == 0, "chunk must be a positive multiple of 8");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(values.sizes() == keys.sizes() && keys.size(2) == dim,
              "keys and values must both be [KVH, cap, D]");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == dim && values.stride(2) == 1 &&
                  values.stride(1) == dim,
              "keys and values must be dense within each head");
  TORCH_CHECK(m.size(0) == tokens && m.size(1) == heads && l.sizes() == m.sizes() &&
                  acc.sizes() == q.sizes(),
              "state shapes must match q");
  TORCH_CHECK(last.dtype() == torch::kInt64 && last.dim() == 1 && last.size(0) == tokens &&
                  last.is_contiguous(),
              "last must be a contiguous int64 [T]");
  TORCH_CHECK(first_chunk >= 0, "first_chunk must be >= 0");
  if (tokens == 0) return;
  const int64_t stop = stop_chunk < 0 ? std::numeric_limits<int64_t>::max() : stop_chunk;
  const int64_t* pos = last.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0, "positions must be >= 0");
    const int64_t need = stop == std::numeric_limits<int64_t>::max()
                             ? pos[t] + 1
                             : std::min(pos[t] + 1, stop * chunk);
    TORCH_CHECK(need <= keys.size(1), "a key at position ", need - 1, " is beyond the ",
                keys.size(1), " slots of the cache");
  }
  const Problem pb{q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), pos,
                   m.data_ptr<float>(), l.data_ptr<float>(), acc.data_ptr<float>(),
                   tokens, heads, kv_heads, dim, keys.stride(0), values.stride(0), chunk,
                   first_chunk, stop, finish};
  const int64_t rows = tokens * pb.group();
  const int64_t size = block_rows(rows, kv_heads);
  const int64_t blocks = (rows + size - 1) / size;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / blocks, r0 = (item % blocks) * size;
      run_block(pb, kvh, r0, std::min(rows, r0 + size));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attend", &attend, "Fused exact attention over key chunks (online softmax state)");
}
