// The causal log-space pass of chunk.py, fused per (head, chunk) for CPUs: the "cpp" backend.
//
// chunk.py computes runs of chunks op by op over (B, H, G, L, M) tensors, and every op streams
// them through memory.  Here each thread takes whole heads and works chunk by chunk in its cache,
// with the same maths (chunk.py's docstring, 1.-4.) and BLAS (the sgemm_ / dgemm_ that torch
// links) for the products.  Only regular chunks are computed here: a chunk with exact rows (a key
// past JUMP_LIMIT) or wide pairs is handed back to chunk.py (rare: first tokens, outliers), and
// this code carries on from the chunk after it.
//
// "chunk.py" and its helpers (chunk._keys, chunk._queries, ...) below name the chunked torch algorithm
// this kernel was written against; it lives on in torch_logspace.py, rewritten without data-dependent
// branches, which takes the irregular chunks handed back (cpp_logspace.py).
//
// Built by cpp_logspace.py with the system's C++ compiler and OpenMP.  It runs in torch's own OpenMP runtime
// (libgomp is already loaded when it is), so BLAS runs on one thread inside the loop over heads.
// Plain C entry points, called through ctypes: no torch headers, a build of a few seconds.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <omp.h>
#include <type_traits>
#include <utility>
#include <vector>

using std::int64_t;

namespace {

typedef void (*gemm_f32)(const char*, const char*, const int*, const int*, const int*, const float*,
                         const float*, const int*, const float*, const int*, const float*, float*, const int*);
typedef void (*gemm_f64)(const char*, const char*, const int*, const int*, const int*, const double*,
                         const double*, const int*, const double*, const int*, const double*, double*, const int*);
gemm_f32 sgemm = nullptr;
gemm_f64 dgemm = nullptr;
double jump_limit = 30.0, pair_spread = 20.0;   // set from stable.py's constants at load

// Row-major C (m x n) = op(A) op(B) + beta C, op = transpose where asked; ld* are row strides.
// BLAS is column-major, so it is asked for C^T = op(B)^T op(A)^T.
template <typename T>
void gemm(bool ta, bool tb, int64_t m_, int64_t n_, int64_t k_, const T* a, int64_t lda_, const T* b, int64_t ldb_,
          T beta, T* c, int64_t ldc_) {
  if (m_ == 0 || n_ == 0) return;
  if (k_ == 0) {   // an empty sum (BLAS would reject its zero leading dimensions)
    for (int64_t i = 0; i < m_; ++i)
      for (int64_t j = 0; j < n_; ++j) c[i * ldc_ + j] = beta == T(0) ? T(0) : beta * c[i * ldc_ + j];
    return;
  }
  const int m = int(m_), n = int(n_), k = int(k_), lda = int(lda_), ldb = int(ldb_), ldc = int(ldc_);
  const T one = 1;
  if constexpr (std::is_same_v<T, float>) sgemm(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
  else dgemm(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

// e^x for float in a form the compiler vectorises: x = n ln2 + r, |r| <= ln2/2, e^r from Cephes'
// expf polynomial (about 1 ulp), times 2^n made in the exponent bits.  NaN stays NaN; beyond float's
// range it saturates (callers clamp from below first, as chunk._exp does).
inline float exp_value(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline double exp_value(double x) { return std::exp(x); }

// e^max(x, log(smallest normal) + 1), chunk._exp: exp is slow where it returns subnormals, and
// such terms are below 1e-37 of a denominator >= 1.
template <typename T> inline T exp_floored(T x) {
  const T low = T(std::log(double(std::numeric_limits<T>::min())) + 1.0);
  return exp_value(x < low ? low : x);
}

// max that keeps a NaN, as torch.amax does (std::max drops one in its second argument)
template <typename T> inline T max_nan(T a, T b) { return (a > b || a != a) ? a : b; }

template <typename T> inline T guard() { return std::sqrt(std::numeric_limits<T>::min()); }   // common.divide

// Log-features of queries or keys: a (B, H, N, M) tensor, or inputs @ weight^T + square_scale
// |inputs|^2 + shift of (B, H, N, D) inputs (common.LogProjection).
struct Source {
  const void* data;                       // the log-features, or the projection's inputs
  int64_t stride_b, stride_h, stride_n;   // of data, in elements; its last dimension is contiguous
  int64_t dim;                            // M for log-features, D for a projection
  const void* weight;                     // (M, D) contiguous; null: data holds the log-features
  const void* shift;                      // per-row shift with the strides below; null: shift_value
  int64_t shift_b, shift_h, shift_n;
  double shift_value, square_scale;
};

// Gradients of a source, each contiguous or null where not wanted: of the log-features (B, H, N, M)
// or of the inputs (B, H, N, D); of the shift (B, H, N); of the weight, per head (B H, M, D).
struct SourceGrad {
  void* data;
  void* shift;
  void* weight;
};

struct Call {
  int64_t batch, heads, n, m, dv, length;   // B, H, N, M, Dv and the chunk length L
  Source q, k;
  const void* v;                            // (B, H, N, Dv), strides below, last dimension contiguous
  int64_t v_b, v_h, v_n;
  const void* phases;                       // (N, M/2, 2): cos, sin per key position and pair; null: no rotation
  const void* q_phases;                     // the same per query position (queries and keys may start apart)
  void* feat;                               // (B, H, chunks + 1, M): F at each chunk's first token, and after the last
  int64_t threads;
  const void* log_decay;                    // (H,) log gamma per head; null: no decay
  int64_t lead;                             // the queries' lead, offset - key_offset, in positions
};

int64_t chunk_count(const Call& c) { return (c.n + c.length - 1) / c.length; }
int64_t chunk_rows(const Call& c, int64_t chunk) { return std::min(c.length, c.n - chunk * c.length); }

template <typename T> const T* rows_of(const void* base, int64_t sb, int64_t sh, int64_t sn, int64_t heads,
                                       int64_t head, int64_t row) {
  return static_cast<const T*>(base) + (head / heads) * sb + (head % heads) * sh + row * sn;
}

// log gamma of `head` (B H flattened), 0 without a decay.
template <typename T> T log_gamma(const Call& c, int64_t head) {
  return c.log_decay ? static_cast<const T*>(c.log_decay)[head % c.heads] : T(0);
}

// A chunk's log-features (rows x M) in the chunk's frame (torch_logspace.in_frame): row r of the queries
// + (r + lead) log gamma, of the keys - r log gamma; unchanged without a decay.
template <typename T> void in_frame(const Call& c, int64_t head, T* x, int64_t rows, bool queries) {
  if (!c.log_decay) return;
  const T lg = log_gamma<T>(c, head);
  for (int64_t r = 0; r < rows; ++r) {
    const T shift = (queries ? T(r) + T(c.lead) : T(-r)) * lg;
    for (int64_t j = 0; j < c.m; ++j) x[r * c.m + j] += shift;
  }
}

// The log-features (rows x M, row stride M) of `rows` positions of `head` from `row` on.
template <typename T> void load(const Source& s, const Call& c, int64_t head, int64_t row, int64_t rows, T* out) {
  const T* x = rows_of<T>(s.data, s.stride_b, s.stride_h, s.stride_n, c.heads, head, row);
  const int64_t m = c.m;
  if (!s.weight) {
    for (int64_t i = 0; i < rows; ++i) std::memcpy(out + i * m, x + i * s.stride_n, sizeof(T) * m);
    return;
  }
  gemm(false, true, rows, m, s.dim, x, s.stride_n, static_cast<const T*>(s.weight), s.dim, T(0), out, m);
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * s.stride_n;
    T shift = s.shift ? *rows_of<T>(s.shift, s.shift_b, s.shift_h, s.shift_n, c.heads, head, row + i)
                      : T(s.shift_value);
    if (s.square_scale != 0) {
      T square = 0;
      for (int64_t d = 0; d < s.dim; ++d) square += xi[d] * xi[d];
      shift = square * T(s.square_scale) + shift;
    }
    T* o = out + i * m;
    for (int64_t j = 0; j < m; ++j) o[j] += shift;
  }
}

// Writes d loss / d source for `rows` positions of `head` from `row`, given d loss / d log-features
// there (rows x M).  For a projection: d shift = the row sums, d inputs = d_feat @ W + 2 square_scale
// inputs d shift, d W += d_feat^T inputs.
template <typename T> void store_grad(const Source& s, const SourceGrad& g, const Call& c, int64_t head,
                                      int64_t row, int64_t rows, const T* d_feat, std::vector<T>& sums) {
  const int64_t m = c.m;
  if (!s.weight) {
    if (g.data) std::memcpy(static_cast<T*>(g.data) + (head * c.n + row) * m, d_feat, sizeof(T) * rows * m);
    return;
  }
  const int64_t d = s.dim;
  const T* x = rows_of<T>(s.data, s.stride_b, s.stride_h, s.stride_n, c.heads, head, row);
  sums.assign(rows, T(0));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < m; ++j) sums[i] += d_feat[i * m + j];
  if (g.shift)
    for (int64_t i = 0; i < rows; ++i) static_cast<T*>(g.shift)[head * c.n + row + i] = sums[i];
  if (g.data) {
    T* dx = static_cast<T*>(g.data) + (head * c.n + row) * d;
    gemm(false, false, rows, d, m, d_feat, m, static_cast<const T*>(s.weight), d, T(0), dx, d);
    if (s.square_scale != 0)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t e = 0; e < d; ++e) dx[i * d + e] += T(2 * s.square_scale) * x[i * s.stride_n + e] * sums[i];
  }
  if (g.weight)
    gemm(true, false, m, d, rows, d_feat, m, x, s.stride_n, T(1), static_cast<T*>(g.weight) + head * m * d, d);
}

// Each pair (2i, 2i+1) of row r of x (rows x M) times phases[row + r][i] = e^(i p theta), or its
// conjugate with `inverse` (rotary.rotate_pairs).
template <typename T> void rotate(T* x, const void* phases, int64_t row, int64_t rows, int64_t m, bool inverse) {
  const T sign = inverse ? T(-1) : T(1);
  for (int64_t r = 0; r < rows; ++r) {
    const T* ph = static_cast<const T*>(phases) + (row + r) * m;
    T* xr = x + r * m;
#pragma omp simd
    for (int64_t i = 0; i < m / 2; ++i) {
      const T cos = ph[2 * i], sin = sign * ph[2 * i + 1], x0 = xr[2 * i], x1 = xr[2 * i + 1];
      xr[2 * i] = x0 * cos - x1 * sin;
      xr[2 * i + 1] = x0 * sin + x1 * cos;
    }
  }
}

// One chunk of one head in the scales of the chunk's first token (chunk.py's docstring, 1.-3.).
template <typename T> struct Chunk {
  const Call& call;
  int64_t m, length, rows = 0, row = 0;
  bool rotary;
  T step = 0;   // rows log gamma: what a value of this chunk's frame gains in the next's (0: no decay)
  std::vector<T> a, b, key_den, key_rot, query_den, query_rot, scores, feat, pair, feat_next, pair_next,
      key_ratio, query_ratio, query_scale, running;

  explicit Chunk(const Call& c)
      : call(c), m(c.m), length(c.length), rotary(c.phases != nullptr), a(c.length * c.m), b(c.length * c.m),
        key_den(c.length * c.m), key_rot(c.length * c.m), query_den(c.length * c.m), query_rot(c.length * c.m),
        scores(c.length * c.length), feat(c.m), pair(c.m), feat_next(c.m), pair_next(c.m), key_ratio(c.m),
        query_ratio(c.m), query_scale(c.length), running(c.m) {}

  void at(int64_t head, int64_t chunk) {
    row = chunk * length;
    rows = chunk_rows(call, chunk);
    step = T(rows) * log_gamma<T>(call, head);
    const T* f = static_cast<const T*>(call.feat) + (head * (chunk_count(call) + 1) + chunk) * m;
    std::copy(f, f + m, feat.begin());
    std::copy(f + m, f + 2 * m, feat_next.begin());
    pair_max(feat, pair);
    pair_max(feat_next, pair_next);
    for (int64_t j = 0; j < m; ++j) {
      key_ratio[j] = exp_value(feat[j] - pair[j]);     // e^(F - P) <= 1
      query_ratio[j] = exp_value(pair[j] - feat[j]);   // e^(P - F) <= e^PAIR_SPREAD
    }
  }

  void pair_max(const std::vector<T>& f, std::vector<T>& p) const {
    if (!rotary) { p = f; return; }
    for (int64_t i = 0; i < m; i += 2) p[i] = p[i + 1] = max_nan(f[i], f[i + 1]);
  }

  // a: e^(a - F) and R e^(a - P) = R e^(a - F) e^(F - P) (chunk._keys); `cap`: a key past
  // JUMP_LIMIT feeds the state with e^(a - P') instead (chunk._run_states), only for states.
  void keys() {
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) key_den[r * m + j] = exp_floored(a[r * m + j] - feat[j]);
    if (!rotary) return;
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) key_rot[r * m + j] = key_den[r * m + j] * key_ratio[j];
    rotate(key_rot.data(), call.phases, row, rows, m, false);
  }

  // b: e^(b + F - Q) and R e^(b + P - Q) (chunk._queries, no wide pairs); Q = max_j (b_j + F_j),
  // or the saved one with `given`.
  void queries(bool given) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* br = b.data() + r * m;
      if (!given) {
        T q = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < m; ++j) q = max_nan(q, br[j] + feat[j]);
        query_scale[r] = q;
      }
      const T q = query_scale[r];
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) query_den[r * m + j] = exp_floored((br[j] - q) + feat[j]);
    }
    if (!rotary) return;
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) query_rot[r * m + j] = query_den[r * m + j] * query_ratio[j];
    rotate(query_rot.data(), call.q_phases, row, rows, m, false);
  }

  const T* q_num() const { return rotary ? query_rot.data() : query_den.data(); }
  const T* k_num() const { return rotary ? key_rot.data() : key_den.data(); }

  // scores = tril(R q (R k)^T), rows x rows with row stride L
  void masked_scores() {
    gemm(false, true, rows, rows, m, q_num(), m, k_num(), m, T(0), scores.data(), length);
    for (int64_t r = 0; r < rows; ++r) std::fill(scores.begin() + r * length + r + 1, scores.begin() + r * length + rows, T(0));
  }

  // Whether a key passes the chunk's first-token scale by more than JUMP_LIMIT (bit 1: exact rows)
  // and whether a pair's scales differ by more than PAIR_SPREAD (bit 2: wide), as chunk._first_irregular.
  int irregular() const {
    int flags = 0;
    for (int64_t r = 0; r < rows && !(flags & 1); ++r)
      for (int64_t j = 0; j < m; ++j)
        if (a[r * m + j] - feat[j] > T(jump_limit)) { flags |= 1; break; }
    for (int64_t j = 0; rotary && j < m; ++j)
      if (pair[j] - feat[j] > T(pair_spread)) { flags |= 2; break; }
    return flags;
  }

  // The state before the next chunk from the state s, z before this one (chunk._run_states):
  // regular:  S' = e^(P - P') (R k)^T v + e^(P - P') S,   Z' = e^(F - F') sum_n k + e^(F - F') Z;
  // `capped`: S' = (R e^(a - P'))^T v + e^(P - P') S,     Z' = sum_n e^(a - F') + e^(F - F') Z.
  void next_state(const T* s, const T* z, const T* v, int64_t ldv, int64_t dv, bool capped, T* s_next, T* z_next) {
    const T* k = k_num();
    if (capped) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < m; ++j) key_rot[r * m + j] = exp_value((a[r * m + j] - pair_next[j]) + step);
      if (rotary) rotate(key_rot.data(), call.phases, row, rows, m, false);
      k = key_rot.data();
    }
    gemm(true, false, m, dv, rows, k, m, v, ldv, T(0), s_next, dv);
    std::fill(running.begin(), running.end(), T(0));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < m; ++j)
        running[j] += capped ? exp_value((a[r * m + j] - feat_next[j]) + step) : key_den[r * m + j];
    for (int64_t j = 0; j < m; ++j) {
      const T pd = exp_value((pair[j] - pair_next[j]) + step), fd = exp_value((feat[j] - feat_next[j]) + step);
      T* sj = s_next + j * dv;
      if (capped) {
        for (int64_t e = 0; e < dv; ++e) sj[e] = sj[e] + pd * s[j * dv + e];
        z_next[j] = running[j] + fd * z[j];
      } else {
        for (int64_t e = 0; e < dv; ++e) sj[e] = sj[e] * pd + pd * s[j * dv + e];
        z_next[j] = running[j] * fd + fd * z[j];
      }
    }
  }
};

// A thread's buffers, allocated before any parallel region (an allocation that fails inside one
// could not be reported): one chunk's factors and everything forward and backward keep per chunk.
template <typename T> struct Workspace {
  Chunk<T> ch;
  std::vector<T> first, numerator, running, g_num, g_den, d_scores, d_q, d_k, decayed, decayed_sum, reads, sums;
  explicit Workspace(const Call& c)
      : ch(c), first(c.m), numerator(c.length * c.dv), running(c.m), g_num(c.length * c.dv), g_den(c.length),
        d_scores(c.length * c.length), d_q(c.length * c.m), d_k(c.length * c.m), decayed(c.m * c.dv),
        decayed_sum(c.m), reads(c.m * c.dv), sums(c.length) {}
};

template <typename T> std::vector<Workspace<T>> workspaces(const Call& c) {
  std::vector<Workspace<T>> spaces;
  spaces.reserve(c.threads);
  for (int64_t t = 0; t < c.threads; ++t) spaces.emplace_back(c);
  return spaces;
}

// F at the next chunk's first token, from this chunk's F and its keys (rows x M, in the chunk's frame):
// the max of every key up to this chunk's last (moved to the next frame: + rows log gamma) and of that
// token (chunk.py's `feat`); after the last chunk, of every key.
template <typename T> void write_next_scale(const Call& c, int64_t head, int64_t chunk, const T* keys, int64_t rows,
                                            T* first) {
  T* f_next = static_cast<T*>(c.feat) + (head * (chunk_count(c) + 1) + chunk + 1) * c.m;
  const T* f = f_next - c.m;
  for (int64_t j = 0; j < c.m; ++j) f_next[j] = f[j];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < c.m; ++j) f_next[j] = max_nan(f_next[j], keys[r * c.m + j]);
  if (c.log_decay) {
    const T step = T(rows) * log_gamma<T>(c, head);
    for (int64_t j = 0; j < c.m; ++j) f_next[j] += step;
  }
  if (chunk + 1 < chunk_count(c)) {
    load(c.k, c, head, (chunk + 1) * c.length, 1, first);
    for (int64_t j = 0; j < c.m; ++j) f_next[j] = max_nan(f_next[j], first[j]);
  }
}

// Forward over chunks [start, end) of every head.  Stops at the first irregular chunk: its outputs
// are then its regular values (rows before a jump keep them, chunk._irregular_chunk), its flags
// are set and the state is the one before it, for chunk.py to take it from there.  Returns that
// chunk, or end.  Every state_group-th chunk's state before it goes to `saved`.
template <typename T>
int64_t forward(const Call& c, int64_t start, int64_t end, T* state, T* key_sum, T* out, T* den, T* query_scale,
                T* saved_states, T* saved_sums, int64_t state_group, std::int32_t* flags) {
  const int64_t heads = c.batch * c.heads, m = c.m, dv = c.dv;
  std::vector<T> spare_states(heads * m * dv), spare_sums(heads * m);
  std::vector<int> head_flags(heads);
  std::vector<Workspace<T>> spaces = workspaces<T>(c);
  T *s_now = state, *z_now = key_sum, *s_next = spare_states.data(), *z_next = spare_sums.data();
  bool in_spare = false;   // whether the state now lives in the spare buffers
  int64_t stop = end;
#pragma omp parallel num_threads(int(c.threads))
  {
    Workspace<T>& w = spaces[omp_get_thread_num()];
    Chunk<T>& ch = w.ch;
    std::vector<T>&first = w.first, &numerator = w.numerator, &running = w.running;
    for (int64_t chunk = start; chunk < end; ++chunk) {
#pragma omp for schedule(static)
      for (int64_t head = 0; head < heads; ++head) {
        const T* s = s_now + head * m * dv;
        const T* z = z_now + head * m;
        if (chunk % state_group == 0) {
          const int64_t group = chunk / state_group;
          std::copy(s, s + m * dv, saved_states + (group * heads + head) * m * dv);
          std::copy(z, z + m, saved_sums + (group * heads + head) * m);
        }
        const int64_t row = chunk * c.length, rows = chunk_rows(c, chunk);
        load(c.k, c, head, row, rows, ch.a.data());
        load(c.q, c, head, row, rows, ch.b.data());
        in_frame(c, head, ch.a.data(), rows, false);
        in_frame(c, head, ch.b.data(), rows, true);
        T* f = static_cast<T*>(c.feat) + (head * (chunk_count(c) + 1) + chunk) * m;
        if (chunk == 0) std::copy(ch.a.begin(), ch.a.begin() + m, f);   // F at the first token: its key
        write_next_scale(c, head, chunk, ch.a.data(), rows, first.data());
        ch.at(head, chunk);
        head_flags[head] = ch.irregular();
        ch.keys();
        ch.queries(false);
        // numerator R q . S + tril(R q (R k)^T) v;  denominator q . (Z + sum_{n <= m} k_n)
        const T* v = rows_of<T>(c.v, c.v_b, c.v_h, c.v_n, c.heads, head, row);
        ch.masked_scores();
        gemm(false, false, rows, dv, m, ch.q_num(), m, s, dv, T(0), numerator.data(), dv);
        gemm(false, false, rows, dv, rows, ch.scores.data(), c.length, v, c.v_n, T(1), numerator.data(), dv);
        std::copy(z, z + m, running.begin());
        for (int64_t r = 0; r < rows; ++r) {
          const T* kd = ch.key_den.data() + r * m;
          const T* qd = ch.query_den.data() + r * m;
          T d = 0;
          for (int64_t j = 0; j < m; ++j) {
            running[j] += kd[j];
            d += qd[j] * running[j];
          }
          const int64_t at = head * c.n + row + r;
          den[at] = d;
          query_scale[at] = ch.query_scale[r];
          const T divisor = std::max(d, guard<T>());
          for (int64_t e = 0; e < dv; ++e) out[at * dv + e] = numerator[r * dv + e] / divisor;
        }
        ch.next_state(s, z, v, c.v_n, dv, false, s_next + head * m * dv, z_next + head * m);
      }
#pragma omp single
      {
        int chunk_flags = 0;
        for (int64_t head = 0; head < heads; ++head) chunk_flags |= head_flags[head];
        flags[chunk] = chunk_flags;
        if (chunk_flags) stop = chunk;
        else {
          std::swap(s_now, s_next);
          std::swap(z_now, z_next);
          in_spare = !in_spare;
        }
      }
      if (stop != end) break;   // every thread reads the same `stop` after the single's barrier
    }
  }
  if (in_spare) {
    std::copy(s_now, s_now + heads * m * dv, state);
    std::copy(z_now, z_now + heads * m, key_sum);
  }
  return stop;
}

// The states before each chunk of [lo, hi) (B H, hi - lo, M, Dv) and their key sums, from the state
// before lo, as forward had them (`flags`: chunks whose keys passed the cap feed the state capped).
template <typename T>
void states(const Call& c, int64_t lo, int64_t hi, const std::int32_t* flags, const T* state, const T* key_sum,
            T* states_out, T* sums_out) {
  const int64_t heads = c.batch * c.heads, m = c.m, dv = c.dv, count = hi - lo;
  std::vector<Workspace<T>> spaces = workspaces<T>(c);
#pragma omp parallel num_threads(int(c.threads))
  {
    Chunk<T>& ch = spaces[omp_get_thread_num()].ch;
#pragma omp for schedule(static)
    for (int64_t head = 0; head < heads; ++head) {
      T* s = states_out + head * count * m * dv;
      T* z = sums_out + head * count * m;
      std::copy(state + head * m * dv, state + (head + 1) * m * dv, s);
      std::copy(key_sum + head * m, key_sum + (head + 1) * m, z);
      for (int64_t chunk = lo; chunk + 1 < hi; ++chunk, s += m * dv, z += m) {
        ch.at(head, chunk);
        load(c.k, c, head, ch.row, ch.rows, ch.a.data());
        in_frame(c, head, ch.a.data(), ch.rows, false);
        ch.keys();
        const T* v = rows_of<T>(c.v, c.v_b, c.v_h, c.v_n, c.heads, head, ch.row);
        ch.next_state(s, z, v, c.v_n, dv, flags[chunk] & 1, s + m * dv, z + m);
      }
    }
  }
}

// Backward (chunk.py 4.) from chunk hi down to lo, stopping at an irregular chunk (left to
// chunk.py) or below lo; returns that chunk, or lo - 1.  states, sums: the states before each chunk
// of [first, first + count) (B H, count, .), from `states`.  later, later_sum: d loss / d S and
// d loss / d Z after chunk hi, updated to before the last chunk done.  grad_lse: d loss / d the rows'
// log-normalisers log(den) + Q (B H, N), or null.
template <typename T>
int64_t backward(const Call& c, int64_t hi, int64_t lo, const std::int32_t* flags, const T* states_in,
                 const T* sums_in, int64_t first, int64_t count, const T* grad, const T* grad_lse, const T* out,
                 const T* den, const T* query_scale, T* later, T* later_sum, const SourceGrad& dq,
                 const SourceGrad& dk, T* dv_out) {
  int64_t stop = hi;
  while (stop >= lo && !flags[stop]) --stop;
  const int64_t heads = c.batch * c.heads, m = c.m, dv = c.dv, L = c.length;
  std::vector<Workspace<T>> spaces = workspaces<T>(c);
#pragma omp parallel num_threads(int(c.threads))
  {
    Workspace<T>& w = spaces[omp_get_thread_num()];
    Chunk<T>& ch = w.ch;
    std::vector<T>&g_num = w.g_num, &g_den = w.g_den, &d_scores = w.d_scores, &d_q = w.d_q, &d_k = w.d_k,
                  &decayed = w.decayed, &decayed_sum = w.decayed_sum, &reads = w.reads, &sums = w.sums,
                  &running = w.running;
#pragma omp for schedule(static)
    for (int64_t head = 0; head < heads; ++head) {
      T* G = later + head * m * dv;
      T* H = later_sum + head * m;
      for (int64_t chunk = hi; chunk > stop; --chunk) {
        ch.at(head, chunk);
        const int64_t row = ch.row, rows = ch.rows;
        const T* s = states_in + (head * count + chunk - first) * m * dv;
        const T* z = sums_in + (head * count + chunk - first) * m;
        load(c.k, c, head, row, rows, ch.a.data());
        load(c.q, c, head, row, rows, ch.b.data());
        in_frame(c, head, ch.a.data(), rows, false);
        in_frame(c, head, ch.b.data(), rows, true);
        const int64_t at = head * c.n + row;
        std::copy(query_scale + at, query_scale + at + rows, ch.query_scale.begin());
        ch.keys();
        ch.queries(true);
        ch.masked_scores();
        // g_num = g / den, g_den = -(g . out) / den (common.output_gradients), + g_lse / den
        for (int64_t r = 0; r < rows; ++r) {
          const T d = den[at + r], divisor = std::max(d, guard<T>());
          T dot = grad_lse ? -grad_lse[at + r] : T(0);
          for (int64_t e = 0; e < dv; ++e) {
            g_num[r * dv + e] = grad[(at + r) * dv + e] / divisor;
            dot += grad[(at + r) * dv + e] * out[(at + r) * dv + e];
          }
          g_den[r] = d < guard<T>() ? T(0) : -dot / divisor;
        }
        // G~ = e^(P - P') dL/dS',  H~ = e^(F - F') dL/dZ';  then dL/dS = G~ + (R q)^T g_num, dL/dZ = H~ + sum g_den q
        for (int64_t j = 0; j < m; ++j) {
          const T pd = exp_value((ch.pair[j] - ch.pair_next[j]) + ch.step),
                  fd = exp_value((ch.feat[j] - ch.feat_next[j]) + ch.step);
          for (int64_t e = 0; e < dv; ++e) decayed[j * dv + e] = G[j * dv + e] * pd;
          decayed_sum[j] = H[j] * fd;
        }
        gemm(true, false, m, dv, rows, ch.q_num(), m, g_num.data(), dv, T(0), reads.data(), dv);
        std::fill(running.begin(), running.end(), T(0));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < m; ++j) running[j] += g_den[r] * ch.query_den[r * m + j];
        for (int64_t i = 0; i < m * dv; ++i) G[i] = reads[i] + decayed[i];
        for (int64_t j = 0; j < m; ++j) H[j] = running[j] + decayed_sum[j];
        // dv = tril(scores)^T g_num + (R k) G~
        const T* v = rows_of<T>(c.v, c.v_b, c.v_h, c.v_n, c.heads, head, row);
        T* dv_rows = dv_out + at * dv;
        gemm(false, false, rows, dv, m, ch.k_num(), m, decayed.data(), dv, T(0), dv_rows, dv);
        gemm(true, false, rows, dv, rows, ch.scores.data(), L, g_num.data(), dv, T(1), dv_rows, dv);
        // d(R q) = g_num S^T + tril(g_num v^T) (R k);  d(R k) = tril(g_num v^T)^T (R q) + v G~^T
        gemm(false, true, rows, rows, dv, g_num.data(), dv, v, c.v_n, T(0), d_scores.data(), L);
        for (int64_t r = 0; r < rows; ++r) std::fill(d_scores.begin() + r * L + r + 1, d_scores.begin() + r * L + rows, T(0));
        gemm(false, true, rows, m, dv, g_num.data(), dv, s, dv, T(0), d_q.data(), m);
        gemm(false, false, rows, m, rows, d_scores.data(), L, ch.k_num(), m, T(1), d_q.data(), m);
        gemm(false, true, rows, m, dv, v, c.v_n, decayed.data(), dv, T(0), d_k.data(), m);
        gemm(true, false, rows, m, rows, d_scores.data(), L, ch.q_num(), m, T(1), d_k.data(), m);
        if (ch.rotary) {   // back through R, then to the factors' own scale: d num * num / den = d num * ratio
          rotate(d_q.data(), c.q_phases, row, rows, m, true);
          rotate(d_k.data(), c.phases, row, rows, m, true);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < m; ++j) {
              d_q[r * m + j] *= ch.query_ratio[j];
              d_k[r * m + j] *= ch.key_ratio[j];
            }
        }
        // the denominator: d q_den_m = g_den_m (Z + sum_{n <= m} k_den_n), d k_den_n = sum_{m >= n} g_den_m q_den_m
        std::copy(z, z + m, running.begin());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < m; ++j) {
            running[j] += ch.key_den[r * m + j];
            d_q[r * m + j] += g_den[r] * running[j];
          }
        std::copy(decayed_sum.begin(), decayed_sum.end(), running.begin());   // H~: through Z'
        for (int64_t r = rows - 1; r >= 0; --r)
          for (int64_t j = 0; j < m; ++j) {
            running[j] += g_den[r] * ch.query_den[r * m + j];
            d_k[r * m + j] += running[j];
          }
        // through the exponentials: d log-feature = d factor * factor
        for (int64_t i = 0; i < rows * m; ++i) {
          d_q[i] *= ch.query_den[i];
          d_k[i] *= ch.key_den[i];
        }
        store_grad(c.q, dq, c, head, row, rows, d_q.data(), sums);
        store_grad(c.k, dk, c, head, row, rows, d_k.data(), sums);
      }
    }
  }
  return stop;
}

// Results below -1 are errors (a C caller cannot catch C++ exceptions): the buffers did not fit in
// memory, or something else failed.
constexpr int64_t OUT_OF_MEMORY = -2, FAILED = -3;

template <typename F> int64_t guarded(F&& run) {
  try {
    return run();
  } catch (const std::bad_alloc&) {
    return OUT_OF_MEMORY;
  } catch (...) {
    return FAILED;
  }
}

}  // namespace

extern "C" {

void linattn_set_blas(void* s, void* d, double jump, double spread) {
  sgemm = reinterpret_cast<gemm_f32>(s);
  dgemm = reinterpret_cast<gemm_f64>(d);
  jump_limit = jump;
  pair_spread = spread;
}

// dtype: 0 float32, 1 float64 (every tensor of a call has it)
int64_t linattn_forward(int dtype, const Call* c, int64_t start, int64_t end, void* state, void* key_sum, void* out,
                        void* den, void* query_scale, void* saved_states, void* saved_sums, int64_t state_group,
                        std::int32_t* flags) {
  return guarded([&] {
    if (dtype == 0)
      return forward<float>(*c, start, end, (float*)state, (float*)key_sum, (float*)out, (float*)den,
                            (float*)query_scale, (float*)saved_states, (float*)saved_sums, state_group, flags);
    return forward<double>(*c, start, end, (double*)state, (double*)key_sum, (double*)out, (double*)den,
                           (double*)query_scale, (double*)saved_states, (double*)saved_sums, state_group, flags);
  });
}

int64_t linattn_states(int dtype, const Call* c, int64_t lo, int64_t hi, const std::int32_t* flags, const void* state,
                       const void* key_sum, void* states_out, void* sums_out) {
  return guarded([&] {
    if (dtype == 0)
      states<float>(*c, lo, hi, flags, (const float*)state, (const float*)key_sum, (float*)states_out,
                    (float*)sums_out);
    else
      states<double>(*c, lo, hi, flags, (const double*)state, (const double*)key_sum, (double*)states_out,
                     (double*)sums_out);
    return int64_t(0);
  });
}

int64_t linattn_backward(int dtype, const Call* c, int64_t hi, int64_t lo, const std::int32_t* flags,
                         const void* states_in, const void* sums_in, int64_t first, int64_t count, const void* grad,
                         const void* grad_lse, const void* out, const void* den, const void* query_scale, void* later,
                         void* later_sum, const SourceGrad* dq, const SourceGrad* dk, void* dv) {
  return guarded([&] {
    if (dtype == 0)
      return backward<float>(*c, hi, lo, flags, (const float*)states_in, (const float*)sums_in, first, count,
                             (const float*)grad, (const float*)grad_lse, (const float*)out, (const float*)den,
                             (const float*)query_scale, (float*)later, (float*)later_sum, *dq, *dk, (float*)dv);
    return backward<double>(*c, hi, lo, flags, (const double*)states_in, (const double*)sums_in, first, count,
                            (const double*)grad, (const double*)grad_lse, (const double*)out, (const double*)den,
                            (const double*)query_scale, (double*)later, (double*)later_sum, *dq, *dk, (double*)dv);
  });
}

}  // extern "C"
