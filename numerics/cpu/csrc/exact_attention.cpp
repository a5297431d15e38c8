// Fused exact attention for the decoder's exact mode and near-data attention on shards
// (DESIGN.md sections 5 and 4).
//
// Contract: the result for one query row (one token, one query head) is a deterministic
// function of that row's query, its own position and the keys/values at positions <= it.
// Nothing else enters: not the other rows of the call, not how rows are split between
// calls or threads, not keys after the row's position (they are never read).
//
// How: keys are split into fixed chunks of `chunk` absolute positions. For each of its
// chunks a row first computes the chunk's own partial, the same way wherever it happens:
//   scores s_j = q . k_j          (8-lane partial sums over d, then a fixed add tree)
//   m_c = max_j s_j; p_j = exp(s_j - m_c)
//   l_c = sum_j p_j               (8-lane partial sums over j, then a fixed add tree)
//   o_c = sum_j p_j * v_j         (from zero, j in order)
// then folds it into its running state (m, l, acc) in position order (`fold_row`):
//   m' = max(m, m_c); a = exp(m - m'); b = exp(m_c - m')
//   l = l * a + l_c * b; acc = acc * a + o_c * b
// and out = acc / l at the end. Only the row's visible keys of a chunk enter. The merge is
// thus a fixed tree over positions (chunk partials folded left to right), so a chunk's
// partial can be computed anywhere the chunk lives: `partials` computes them on a shard
// (every key visible) and `fold` folds them on the decoder with this very code, giving
// bitwise the result of the one-call kernel. Rows are
// processed in pairs to share key/value loads, but every lane of a pair does the same
// operations in the same order as a row alone (lanes never mix), so pairing, blocking and
// threading change no bit. The state (m, l, acc) lives in caller-owned tensors, so a row
// can walk chunks [0, F) in one call and [F, ...) in a later one with bitwise the result
// of one call (shared-prefix and near-data attention rely on this).
//
// Every floating-point operation is spelled out with AVX2/FMA intrinsics (exp included)
// and the file is compiled with -ffp-contract=off and no fast-math, so the bits are a
// function of this source alone, not of the compiler or libm. Changing any arithmetic here
// changes the kernel identity (prefix_store/attention/kernel.py hashes this file into it).

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

// Scores s[0, n) (n >= 1) -> probabilities exp(s - m_c) in place; sets the chunk's m_c and
// l_c. s has room for n rounded up to 8.
inline void chunk_softmax(float* s, int64_t n, float* m_c, float* l_c) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, lane_mask(n - j)));
  }
  const float m_new = hmax8(mx);
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)),
                                   lane_mask(n - j));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  *l_c = hsum8(sum);
  *m_c = m_new;
}

// Folds one chunk's partial (m_c, l_c, o_c [dim]) into a row's running state (m, l, acc).
// A partial with m_c = -inf (no key) changes nothing; the first fold into the start state
// (m = -inf, l = 0, acc = 0) gives the partial itself (a = 0, b = 1).
inline void fold_row(float* m, float* l, float* acc, float m_c, float l_c, const float* o_c,
                     int64_t dim) {
  if (m_c == kNegInf) return;
  const float m_new = std::max(*m, m_c);
  const float a = exp1(*m - m_new);
  const float b = exp1(m_c - m_new);
  const float la = *l * a;
  const float lb = l_c * b;
  *l = la + lb;
  *m = m_new;
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(acc + d), av);
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(o_c + d), bv);
    _mm256_storeu_ps(acc + d, _mm256_add_ps(x, y));
  }
}

// o[r][d0, d0 + 8 NV) = (fresh ? 0 : o) + sum_{j in [j0, j1)} p[r][j] v[j], accumulated in
// key order.
template <int R, int NV>
inline void accumulate_block(float* const* o, bool fresh, const float* const* p,
                             const float* v, int64_t j0, int64_t j1, int64_t dim, int64_t d0) {
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i)
      a[r][i] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(o[r] + d0 + 8 * i);
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
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o[r] + d0 + 8 * i, a[r][i]);
}

template <int R>
inline void accumulate(float* const* o, bool fresh, const float* const* p, const float* v,
                       int64_t j0, int64_t j1, int64_t dim) {
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    switch (std::min<int64_t>(4, (dim - d0) / 8)) {
      case 4: accumulate_block<R, 4>(o, fresh, p, v, j0, j1, dim, d0); break;
      case 3: accumulate_block<R, 3>(o, fresh, p, v, j0, j1, dim, d0); break;
      case 2: accumulate_block<R, 2>(o, fresh, p, v, j0, j1, dim, d0); break;
      default: accumulate_block<R, 1>(o, fresh, p, v, j0, j1, dim, d0); break;
    }
  }
}

struct Problem {
  const float* q;                 // [T, H, D]
  const float* const* k_chunk;    // per chunk in [first_chunk, stop): its keys [KVH, chunk, D]
  const int64_t* k_head;          //   and their head stride
  const float* const* v_chunk;    // the same for values
  const int64_t* v_head;
  const int64_t* last;            // [T] each token's own position: its last visible key
  float* m;                       // [T, H]
  float* l;                       // [T, H]
  float* acc;                     // [T, H, D]
  float* pm;                      // partials mode: [C, T, H] per chunk (else null)
  float* pl;                      // [C, T, H]
  float* pacc;                    // [C, T, H, D]
  int64_t tokens, heads, kv_heads, dim, chunk, first_chunk, stop_chunk;
  bool finish;

  int64_t group() const { return heads / kv_heads; }
};

// One query row: token t, query head h (hd = t * H + h).
struct Row {
  const float* q;
  float* m;
  float* l;
  float* acc;
  int64_t last;
  int64_t hd;
  float* o;  // the current chunk's o_c (scratch)
};

constexpr int64_t kTile = 256;  // keys per L1-resident tile of K or V (16 KiB at D = 64)

// The rows of one chunk, paired; row a (and b) sees keys [0, na) (and [0, nb)) of it.
struct Pair {
  const Row* a;
  const Row* b;  // null: a alone
  int64_t na, nb;
  float* s[2];   // scores, then probabilities
  float m_c[2], l_c[2];
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

// o_c += p v for every pair over keys [j0, j1) of the chunk (V tile shared by all pairs);
// each row's o_c starts from zero at the chunk's first key.
void tile_accumulate(std::vector<Pair>& pairs, const float* v, int64_t j0, int64_t j1,
                     int64_t dim) {
  const bool first = j0 == 0;
  for (Pair& pr : pairs) {
    float* o[2] = {pr.a->o, pr.b ? pr.b->o : nullptr};
    const float* p[2] = {pr.s[0], pr.s[1]};
    const int64_t both = pr.b ? std::min(pr.na, pr.nb) : 0;
    if (j0 < both) accumulate<2>(o, first, p, v, j0, std::min(j1, both), dim);
    const int64_t from = std::max(j0, both);
    if (from < std::min(j1, pr.na))
      accumulate<1>(o, first && both == 0, p, v, from, std::min(j1, pr.na), dim);
    if (pr.b && from < std::min(j1, pr.nb))
      accumulate<1>(o + 1, false, p + 1, v, from, std::min(j1, pr.nb), dim);
  }
}

// The chunk's partial of `row` (index c - first_chunk among the call's chunks): folded into
// the row's state, or written out in partials mode.
void settle(const Problem& pb, const Row& row, int64_t index, float m_c, float l_c) {
  if (pb.pm == nullptr) {
    fold_row(row.m, row.l, row.acc, m_c, l_c, row.o, pb.dim);
    return;
  }
  const int64_t at = index * pb.tokens * pb.heads + row.hd;
  pb.pm[at] = m_c;
  pb.pl[at] = l_c;
  std::copy(row.o, row.o + pb.dim, pb.pacc + at * pb.dim);
}

// Rows [r0, r1) of kv head `kvh` (row r is token r / group, query head kvh * group +
// r % group), chunk by chunk in position order. Within a chunk the keys (then the values)
// are walked in L1-sized tiles, each tile serving every row; no row's arithmetic changes.
void run_block(const Problem& pb, int64_t kvh, int64_t r0, int64_t r1) {
  const int64_t group = pb.group(), dim = pb.dim, chunk = pb.chunk;
  std::vector<float> parts((r1 - r0) * dim, 0.0f);
  std::vector<Row> rows;
  int64_t top = -1;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / group, hd = t * pb.heads + kvh * group + r % group;
    rows.push_back({pb.q + hd * dim, pb.m + hd, pb.l + hd, pb.acc + hd * dim, pb.last[t], hd,
                    parts.data() + (r - r0) * dim});
    top = std::max(top, pb.last[t]);
  }
  const int64_t stride = chunk + 8;
  std::vector<float> scratch(rows.size() * stride + stride, 0.0f);
  const int64_t stop = std::min(pb.stop_chunk, top / chunk + 1);
  std::vector<Pair> pairs;
  for (int64_t c = pb.first_chunk; c < stop; ++c) {
    const int64_t base = c * chunk, index = c - pb.first_chunk;
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
                       std::min(chunk, row.last - base + 1), {s0, s1}, {0.0f, 0.0f},
                       {0.0f, 0.0f}});
      waiting = nullptr;
    }
    if (waiting != nullptr) {
      float* s0 = scratch.data() + (used++) * stride;
      pairs.push_back({waiting, nullptr, std::min(chunk, waiting->last - base + 1), 0,
                       {s0, scratch.data() + rows.size() * stride}, {0.0f, 0.0f},
                       {0.0f, 0.0f}});
    }
    const float* k = pb.k_chunk[index] + kvh * pb.k_head[index];
    const float* v = pb.v_chunk[index] + kvh * pb.v_head[index];
    for (int64_t j0 = 0; j0 < chunk; j0 += kTile)
      tile_scores(pairs, k, j0, std::min(chunk, j0 + kTile), dim);
    for (Pair& pr : pairs) {
      chunk_softmax(pr.s[0], pr.na, &pr.m_c[0], &pr.l_c[0]);
      if (pr.b) chunk_softmax(pr.s[1], pr.nb, &pr.m_c[1], &pr.l_c[1]);
    }
    for (int64_t j0 = 0; j0 < chunk; j0 += kTile)
      tile_accumulate(pairs, v, j0, std::min(chunk, j0 + kTile), dim);
    for (const Pair& pr : pairs) {
      settle(pb, *pr.a, index, pr.m_c[0], pr.l_c[0]);
      if (pr.b) settle(pb, *pr.b, index, pr.m_c[1], pr.l_c[1]);
    }
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

void check_kv(const torch::Tensor& keys, const torch::Tensor& values, int64_t dim,
              int64_t kv_heads) {
  check_layout(keys, 3, "keys");
  check_layout(values, 3, "values");
  TORCH_CHECK(values.sizes() == keys.sizes() && keys.size(2) == dim && keys.size(0) == kv_heads,
              "keys and values must both be [KVH, n, D]");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == dim && values.stride(2) == 1 &&
                  values.stride(1) == dim,
              "keys and values must be dense within each head");
}

void check_query(const torch::Tensor& q, int64_t kv_heads, int64_t chunk) {
  check_layout(q, 3, "q");
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(q.size(2) % 8 == 0, "head_dim must be a multiple of 8, got ", q.size(2));
  TORCH_CHECK(chunk >= 8 && chunk % 8 == 0, "chunk must be a positive multiple of 8");
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "heads must be a multiple of kv heads");
}

void check_state(const torch::Tensor& m, const torch::Tensor& l, const torch::Tensor& acc,
                 const torch::Tensor& q) {
  check_layout(m, 2, "m");
  check_layout(l, 2, "l");
  check_layout(acc, 3, "acc");
  TORCH_CHECK(m.is_contiguous() && l.is_contiguous() && acc.is_contiguous(),
              "m, l and acc must be contiguous");
  TORCH_CHECK(m.size(0) == q.size(0) && m.size(1) == q.size(1) && l.sizes() == m.sizes() &&
                  acc.sizes() == q.sizes(),
              "state shapes must match q");
}

// Runs the problem's rows, split by (kv head, row block) over the threads.
void run(const Problem& pb) {
  if (pb.tokens == 0) return;
  const int64_t rows = pb.tokens * pb.group();
  const int64_t size = block_rows(rows, pb.kv_heads);
  const int64_t blocks = (rows + size - 1) / size;
  at::parallel_for(0, pb.kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / blocks, r0 = (item % blocks) * size;
      run_block(pb, kvh, r0, std::min(rows, r0 + size));
    }
  });
}

}  // namespace

// Walks chunks [first_chunk, stop_chunk) (stop_chunk < 0: no limit) of every row's visible
// keys, folding each chunk's partial into the online-softmax state (m, l, acc) in place;
// with `finish`, acc becomes acc / l, the attention output. q [T, H, D], already scaled;
// keys/values [KVH, cap, D] (any stride between heads), slot j holding position j; last [T]
// int64, each token's own position (< cap); m, l [T, H] (start: -inf, 0); acc [T, H, D]
// (start: 0).
void attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor last,
            torch::Tensor m, torch::Tensor l, torch::Tensor acc, int64_t chunk,
            int64_t first_chunk, int64_t stop_chunk, bool finish) {
  const int64_t kv_heads = keys.size(0), tokens = q.size(0), dim = q.size(2);
  check_query(q, kv_heads, chunk);
  check_kv(keys, values, dim, kv_heads);
  check_state(m, l, acc, q);
  TORCH_CHECK(last.dtype() == torch::kInt64 && last.dim() == 1 && last.size(0) == tokens &&
                  last.is_contiguous(),
              "last must be a contiguous int64 [T]");
  TORCH_CHECK(first_chunk >= 0, "first_chunk must be >= 0");
  if (tokens == 0) return;
  const int64_t limit = stop_chunk < 0 ? std::numeric_limits<int64_t>::max() : stop_chunk;
  const int64_t* pos = last.data_ptr<int64_t>();
  int64_t top = -1;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0, "positions must be >= 0");
    const int64_t need = stop_chunk < 0 ? pos[t] + 1 : std::min(pos[t] + 1, limit * chunk);
    TORCH_CHECK(need <= keys.size(1), "a key at position ", need - 1, " is beyond the ",
                keys.size(1), " slots of the cache");
    top = std::max(top, pos[t]);
  }
  const int64_t stop = std::min(limit, top / chunk + 1);
  std::vector<const float*> k_chunk, v_chunk;
  for (int64_t c = first_chunk; c < stop; ++c) {
    k_chunk.push_back(keys.data_ptr<float>() + c * chunk * dim);
    v_chunk.push_back(values.data_ptr<float>() + c * chunk * dim);
  }
  const std::vector<int64_t> k_head(k_chunk.size() + 1, keys.stride(0));
  const std::vector<int64_t> v_head(v_chunk.size() + 1, values.stride(0));
  run(Problem{q.data_ptr<float>(), k_chunk.data(), k_head.data(), v_chunk.data(),
              v_head.data(), pos, m.data_ptr<float>(), l.data_ptr<float>(),
              acc.data_ptr<float>(), nullptr, nullptr, nullptr, tokens, q.size(1), kv_heads,
              dim, chunk, first_chunk, stop, finish});
}

// Near-data attention on a shard: each chunk's own partial (m_c, l_c, o_c) for every row,
// every key of the chunks visible to every row (the rows come after them). q [T, H, D],
// scaled; keys[c], values[c] [KVH, chunk, D] (dense within each head); pm, pl [C, T, H] and
// pacc [C, T, H, D] receive the partials. Folding them in chunk order with `fold` gives
// bitwise what `attend` gives over the same chunks.
void partials(torch::Tensor q, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
              int64_t chunk, torch::Tensor pm, torch::Tensor pl, torch::Tensor pacc) {
  const int64_t n = static_cast<int64_t>(keys.size()), tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(n > 0 && values.size() == keys.size(), "one values tensor per keys tensor");
  const int64_t kv_heads = keys[0].size(0);
  check_query(q, kv_heads, chunk);
  std::vector<const float*> k_chunk, v_chunk;
  std::vector<int64_t> k_head, v_head;
  for (int64_t c = 0; c < n; ++c) {
    check_kv(keys[c], values[c], dim, kv_heads);
    TORCH_CHECK(keys[c].size(1) == chunk, "every chunk must hold ", chunk, " keys");
    k_chunk.push_back(keys[c].data_ptr<float>());
    v_chunk.push_back(values[c].data_ptr<float>());
    k_head.push_back(keys[c].stride(0));
    v_head.push_back(values[c].stride(0));
  }
  check_layout(pm, 3, "pm");
  check_layout(pl, 3, "pl");
  check_layout(pacc, 4, "pacc");
  TORCH_CHECK(pm.is_contiguous() && pl.is_contiguous() && pacc.is_contiguous(),
              "pm, pl and pacc must be contiguous");
  TORCH_CHECK(pm.size(0) == n && pm.size(1) == tokens && pm.size(2) == q.size(1) &&
                  pl.sizes() == pm.sizes() && pacc.size(0) == n && pacc.size(1) == tokens &&
                  pacc.size(2) == q.size(1) && pacc.size(3) == dim,
              "partial shapes must be [C, T, H] and [C, T, H, D]");
  // Every row sees every key: its position is the last key's.
  const std::vector<int64_t> last(tokens, n * chunk - 1);
  run(Problem{q.data_ptr<float>(), k_chunk.data(), k_head.data(), v_chunk.data(),
              v_head.data(), last.data(), nullptr, nullptr, nullptr, pm.data_ptr<float>(),
              pl.data_ptr<float>(), pacc.data_ptr<float>(), tokens, q.size(1), kv_heads, dim,
              chunk, 0, n, false});
}

// Folds partials pm, pl [C, T, H], pacc [C, T, H, D] (chunks in position order) into the
// state m, l [T, H], acc [T, H, D], exactly as `attend` folds the chunks it walks.
void fold(torch::Tensor m, torch::Tensor l, torch::Tensor acc, torch::Tensor pm,
          torch::Tensor pl, torch::Tensor pacc) {
  check_state(m, l, acc, acc);
  check_layout(pm, 3, "pm");
  check_layout(pl, 3, "pl");
  check_layout(pacc, 4, "pacc");
  TORCH_CHECK(pm.is_contiguous() && pl.is_contiguous() && pacc.is_contiguous(),
              "pm, pl and pacc must be contiguous");
  const int64_t n = pm.size(0), rows = m.numel(), dim = acc.size(2);
  TORCH_CHECK(dim % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(pm.size(1) * pm.size(2) == rows && pl.sizes() == pm.sizes() &&
                  pacc.size(0) == n && pacc.size(1) * pacc.size(2) == rows &&
                  pacc.size(3) == dim,
              "partials must match the state's rows");
  float* mp = m.data_ptr<float>();
  float* lp = l.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  const float* pmp = pm.data_ptr<float>();
  const float* plp = pl.data_ptr<float>();
  const float* pap = pacc.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < n; ++c)
        fold_row(mp + r, lp + r, ap + r * dim, pmp[c * rows + r], plp[c * rows + r],
                 pap + (c * rows + r) * dim, dim);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attend", &attend, "Fused exact attention over key chunks (online softmax state)");
  module.def("partials", &partials, "Each chunk's attention partial (near-data attention)");
  module.def("fold", &fold, "Fold chunk partials into online-softmax state, in chunk order");
}
