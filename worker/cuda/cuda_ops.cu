// Host-array wrappers around the CUDA backend's kernels, for the conformance tests.
#include "worker/cuda/cuda_ops.h"

#include <cmath>
#include <cstring>
#include <memory>

#include "worker/cuda/common.cuh"
#include "worker/cuda/kernels.cuh"
#include "worker/cuda/quant.cuh"
#include "worker/cuda/sampling.cuh"

namespace ds4::cuda_ops {
namespace {

using cuda::DeviceBuffer;

template <typename T>
DeviceBuffer to_device(const T* p, size_t n, const char* what) {
  DeviceBuffer d(std::max<size_t>(n * sizeof(T), 16), what);
  DS4_CUDA_CHECK(cudaMemcpy(d.as<void>(), p, n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
void to_host(const DeviceBuffer& d, T* p, size_t n) {
  DS4_CUDA_CHECK(cudaDeviceSynchronize());
  DS4_CUDA_CHECK(cudaMemcpy(p, d.as<void>(), n * sizeof(T), cudaMemcpyDeviceToHost));
}

struct Uploaded {
  DeviceBuffer data, staging;
  cuda::DeviceWeight w;
  explicit Uploaded(const Weight& host)
      : data(cuda::device_weight_bytes(host), "weight"),
        staging(cuda::repacked(host.type) ? size_t(cuda::host_weight_bytes(host)) : 0, "staging") {
    w = cuda::upload_weight(host, data.as<void>(), staging.as<void>(), nullptr);
    DS4_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

}  // namespace

void matmul(const Weight& w, const float* x, int64_t ldx, int64_t T, float* y, int64_t ldy, bool force_gemm,
            bool fused) {
  Uploaded uw(w);
  DeviceBuffer dx = to_device(x, size_t(T * ldx), "x");
  DeviceBuffer dy(size_t(T * ldy) * 4, "y");
  DeviceBuffer other(size_t(T * ldy) * 4, "y2");
  DS4_CUDA_CHECK(cudaMemset(dy.as<void>(), 0xff, dy.size()));  // poison: every output must be written
  cublasHandle_t blas = nullptr;
  DS4_BLAS_CHECK(cuda::blas::create(&blas));
  DeviceBuffer act(size_t(T * w.cols) * 2, "act"), deq(size_t(w.rows * w.cols) * 2, "deq");
  cuda::GemmContext g{blas, act.as<void>(), act.size(), deq.as<__half>(), deq.size()};
  try {
    const cuda::Product p[3] = {{&uw.w, dy.as<float>(), ldy}, {&uw.w, other.as<float>(), ldy},
                                {&uw.w, other.as<float>(), ldy}};
    cuda::matmul(p, fused ? 3 : 1, dx.as<float>(), ldx, int(T), g, nullptr, force_gemm);
    to_host(dy, y, size_t(T * ldy));
  } catch (...) {
    cuda::blas::destroy(blas);
    throw;
  }
  cuda::blas::destroy(blas);
}

std::vector<float> dequantize(const Weight& w) {
  Uploaded uw(w);
  const size_t n = size_t(w.rows * w.cols);
  DeviceBuffer out(n * 4, "dequantised");
  DS4_CUDA_CHECK(cudaMemset(out.as<void>(), 0xff, out.size()));
  if (!cuda::is_block_quant(w.type)) throw Error("dequantize: not a block-quantised type");
  cuda::dequant_quant_f32(uw.w, out.as<float>(), nullptr);
  std::vector<float> v(n);
  to_host(out, v.data(), n);
  return v;
}

void matmul_swiglu(const Weight& gate, const Weight& up, const float* x, int64_t ldx, int64_t T, float* h,
                   int64_t ldh, bool force_gemm) {
  Uploaded ug(gate), uu(up);
  DeviceBuffer dx = to_device(x, size_t(T * ldx), "x");
  DeviceBuffer dh(size_t(T * ldh) * 4, "h"), dh2(size_t(T * ldh) * 4, "h2");
  DS4_CUDA_CHECK(cudaMemset(dh.as<void>(), 0xff, dh.size()));
  cublasHandle_t blas = nullptr;
  DS4_BLAS_CHECK(cuda::blas::create(&blas));
  DeviceBuffer act(size_t(T * gate.cols) * 2, "act"), deq(size_t(gate.rows * gate.cols) * 2, "deq");
  cuda::GemmContext g{blas, act.as<void>(), act.size(), deq.as<__half>(), deq.size()};
  try {
    cuda::matmul_swiglu(ug.w, uu.w, dx.as<float>(), ldx, int(T), dh.as<float>(), dh2.as<float>(), ldh, g, nullptr,
                        force_gemm);
    to_host(dh, h, size_t(T * ldh));
  } catch (...) {
    cuda::blas::destroy(blas);
    throw;
  }
  cuda::blas::destroy(blas);
}

void rmsnorm_matmul(const Weight& w, const Weight* up, const float* g, float eps, const float* x, int64_t ldx,
                    int64_t T, float* y, int64_t ldy) {
  Uploaded uw(w);
  std::unique_ptr<Uploaded> uu(up ? new Uploaded(*up) : nullptr);
  DeviceBuffer dx = to_device(x, size_t(T * ldx), "x"), dg = to_device(g, size_t(w.cols), "g");
  DeviceBuffer dy(size_t(T * ldy) * 4, "y"), dy2(size_t(T * ldy) * 4, "y2"), normed(size_t(T * ldx) * 4, "normed");
  DS4_CUDA_CHECK(cudaMemset(dy.as<void>(), 0xff, dy.size()));
  cublasHandle_t blas = nullptr;
  DS4_BLAS_CHECK(cuda::blas::create(&blas));
  DeviceBuffer act(size_t(T * w.cols) * 2, "act"), deq(size_t(w.rows * w.cols) * 2, "deq");
  cuda::GemmContext gc{blas, act.as<void>(), act.size(), deq.as<__half>(), deq.size()};
  const cuda::RmsNorm norm{dg.as<float>(), eps, normed.as<float>()};
  try {
    if (uu) {
      cuda::matmul_swiglu(uw.w, uu->w, dx.as<float>(), ldx, int(T), dy.as<float>(), dy2.as<float>(), ldy, gc, nullptr,
                          false, &norm);
    } else {
      const cuda::Product p{&uw.w, dy.as<float>(), ldy};
      cuda::matmul(&p, 1, dx.as<float>(), ldx, int(T), gc, nullptr, false, &norm);
    }
    to_host(dy, y, size_t(T * ldy));
  } catch (...) {
    cuda::blas::destroy(blas);
    throw;
  }
  cuda::blas::destroy(blas);
}

double gemv_bytes_per_second(GgmlType type, int64_t N, int64_t K, int T, bool glu, bool norm, int launches) {
  return cuda::gemv_bytes_per_second(type, N, K, T, glu, norm, launches);
}

double product_seconds(GgmlType type, int64_t N, int64_t K, int T, int way, int launches) {
  return cuda::product_seconds(type, N, K, T, static_cast<cuda::ProductWay>(way), launches);
}

std::vector<std::pair<std::vector<LogitCandidate>, double>> top_logits(const std::vector<float>& logits, int64_t n,
                                                                       int rows) {
  DeviceBuffer dl = to_device(logits.data(), logits.size(), "logits");
  DeviceBuffer picks(size_t(rows) * sizeof(cuda::GreedyPick) + cuda::greedy_scratch_bytes(rows), "picks");
  DeviceBuffer lse(size_t(rows) * sizeof(double), "lse"), top(size_t(rows) * sizeof(cuda::TopLogits), "top");
  DeviceBuffer scratch(cuda::top_scratch_bytes(rows, n), "top scratch");
  auto* p = picks.as<cuda::GreedyPick>();
  cuda::greedy_pick(dl.as<float>(), n, n, rows, p, p + rows, nullptr, lse.as<double>());
  cuda::top_logits(dl.as<float>(), n, n, rows, lse.as<double>(), top.as<cuda::TopLogits>(), scratch.as<void>(), nullptr);
  std::vector<cuda::TopLogits> host(static_cast<size_t>(rows));
  DS4_CUDA_CHECK(cudaMemcpy(host.data(), top.as<void>(), host.size() * sizeof(cuda::TopLogits), cudaMemcpyDeviceToHost));
  std::vector<std::pair<std::vector<LogitCandidate>, double>> out;
  for (const cuda::TopLogits& t : host) out.push_back({{t.best, t.best + t.count}, t.lse});
  return out;
}

void rmsnorm(const float* x, int64_t T, int64_t n, const float* g, float eps, float* out) {
  DeviceBuffer dx = to_device(x, size_t(T * n), "x"), dg = to_device(g, size_t(n), "g");
  DeviceBuffer dout(size_t(T * n) * 4, "out");
  cuda::rmsnorm(dx.as<float>(), n, dg.as<float>(), n, eps, dout.as<float>(), n, int(T), nullptr);
  to_host(dout, out, size_t(T * n));
}

void embed(const Weight& table, const std::vector<BatchToken>& batch, float* out) {
  Uploaded uw(table);
  DeviceBuffer db = to_device(batch.data(), batch.size(), "batch");
  DeviceBuffer dout(batch.size() * size_t(table.cols) * 4, "out");
  cuda::embed(uw.w, db.as<BatchToken>(), int(batch.size()), dout.as<float>(), table.cols, nullptr);
  to_host(dout, out, batch.size() * size_t(table.cols));
}

void rope_store(std::vector<float>& q, std::vector<float>& k, const std::vector<float>& v,
                const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int n_rot,
                float rope_base, int64_t slots, int64_t ctx, std::vector<uint16_t>& k_cache,
                std::vector<uint16_t>& v_cache, const RopeVariant& var) {
  const int T = int(batch.size());
  DeviceBuffer dq = to_device(q.data(), q.size(), "q"), dk = to_device(k.data(), k.size(), "k");
  DeviceBuffer dv = to_device(v.data(), v.size(), "v"), db = to_device(batch.data(), batch.size(), "batch");
  DeviceBuffer kc = to_device(k_cache.data(), k_cache.size(), "k cache");
  DeviceBuffer vc = to_device(v_cache.data(), v_cache.size(), "v cache");
  DeviceBuffer dff;
  if (!var.freq_factors.empty()) dff = to_device(var.freq_factors.data(), var.freq_factors.size(), "freq factors");
  cuda::RopeArgs a;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.head_dim = head_dim;
  a.n_rot = n_rot;
  a.theta_scale = std::pow(rope_base, -2.0f / float(n_rot));
  a.freq_scale = var.freq_scale;
  a.neox = var.neox;
  a.freq_factors = var.freq_factors.empty() ? nullptr : dff.as<float>();
  a.ctx = ctx;
  (void)slots;
  cuda::rope_store(dq.as<float>(), int64_t(n_heads) * head_dim, dk.as<float>(), dv.as<float>(),
                   int64_t(n_kv_heads) * head_dim, db.as<BatchToken>(), T, a, kc.as<__half>(), vc.as<__half>(), nullptr);
  to_host(dq, q.data(), q.size());
  to_host(dk, k.data(), k.size());
  to_host(kc, k_cache.data(), k_cache.size());
  to_host(vc, v_cache.data(), v_cache.size());
}

namespace {
// attention() over caches already on the device.
void attention_on(const std::vector<float>& q, cuda::KvLayer kc, cuda::KvLayer vc, const std::vector<BatchToken>& batch,
                  int n_heads, int n_kv_heads, int head_dim, int64_t ctx, std::vector<float>& out) {
  const int T = int(batch.size());
  int n_sm = 0;
  DS4_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
  cuda::AttentionArgs a{n_heads, n_kv_heads, head_dim, ctx, 1.0f / std::sqrt(float(head_dim))};
  a.positions = cuda::deepest_positions(batch.data(), T);
  a.splits = cuda::attention_splits(T, n_heads, n_kv_heads, head_dim, kc.q8(), a.positions, ctx, n_sm);
  const int splits = std::max(a.splits, cuda::prefill_splits(T, n_heads, head_dim, a.positions, n_sm));
  DeviceBuffer dq = to_device(q.data(), q.size(), "q"), db = to_device(batch.data(), batch.size(), "batch");
  DeviceBuffer scratch(size_t(cuda::attention_scratch_floats(T, n_heads, head_dim, splits)) * 4, "scratch");
  DS4_CUDA_CHECK(cudaMemset(scratch.as<void>(), 0, scratch.size()));  // zeroed, as the backend's scratch
  out.assign(size_t(T) * n_heads * head_dim, NAN);
  DeviceBuffer dout = to_device(out.data(), out.size(), "out");
  cuda::attention(dq.as<float>(), int64_t(n_heads) * head_dim, kc, vc, db.as<BatchToken>(), T, a, scratch.as<float>(),
                  dout.as<float>(), int64_t(n_heads) * head_dim, nullptr);
  to_host(dout, out.data(), out.size());
}
}  // namespace

int prefill_splits(const std::vector<BatchToken>& batch, int n_heads, int head_dim) {
  return cuda::prefill_splits(int(batch.size()), n_heads, head_dim, cuda::deepest_positions(batch.data(), int(batch.size())),
                              cuda::multiprocessor_count());
}

bool decode_mma(const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim) {
  return cuda::decode_mma_takes(n_heads, n_kv_heads, head_dim, false,
                                cuda::deepest_positions(batch.data(), int(batch.size())));
}

void attention(const std::vector<float>& q, const std::vector<uint16_t>& k_cache, const std::vector<uint16_t>& v_cache,
               const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int64_t slots,
               int64_t ctx, std::vector<float>& out) {
  (void)slots;
  DeviceBuffer kc = to_device(k_cache.data(), k_cache.size(), "k cache");
  DeviceBuffer vc = to_device(v_cache.data(), v_cache.size(), "v cache");
  attention_on(q, {kc.as<void>(), nullptr}, {vc.as<void>(), nullptr}, batch, n_heads, n_kv_heads, head_dim, ctx, out);
}

void attention_q8(const std::vector<float>& q, const Q8Cache& k_cache, const Q8Cache& v_cache,
                  const std::vector<BatchToken>& batch, int n_heads, int n_kv_heads, int head_dim, int64_t ctx,
                  std::vector<float>& out) {
  DeviceBuffer kq = to_device(k_cache.q.data(), k_cache.q.size(), "k values");
  DeviceBuffer kd = to_device(k_cache.d.data(), k_cache.d.size(), "k scales");
  DeviceBuffer vq = to_device(v_cache.q.data(), v_cache.q.size(), "v values");
  DeviceBuffer vd = to_device(v_cache.d.data(), v_cache.d.size(), "v scales");
  attention_on(q, {kq.as<void>(), kd.as<__half>()}, {vq.as<void>(), vd.as<__half>()}, batch, n_heads, n_kv_heads,
               head_dim, ctx, out);
}

void store_kv_q8(const std::vector<float>& k, const std::vector<float>& v, const std::vector<BatchToken>& batch,
                 int kv_dim, int64_t ctx, Q8Cache& k_cache, Q8Cache& v_cache) {
  DeviceBuffer dk = to_device(k.data(), k.size(), "k"), dv = to_device(v.data(), v.size(), "v");
  DeviceBuffer db = to_device(batch.data(), batch.size(), "batch");
  DeviceBuffer kq = to_device(k_cache.q.data(), k_cache.q.size(), "k values");
  DeviceBuffer kd = to_device(k_cache.d.data(), k_cache.d.size(), "k scales");
  DeviceBuffer vq = to_device(v_cache.q.data(), v_cache.q.size(), "v values");
  DeviceBuffer vd = to_device(v_cache.d.data(), v_cache.d.size(), "v scales");
  cuda::store_kv_q8(dk.as<float>(), dv.as<float>(), kv_dim, db.as<BatchToken>(), int(batch.size()), kv_dim, ctx,
                    {kq.as<void>(), kd.as<__half>()}, {vq.as<void>(), vd.as<__half>()}, nullptr);
  to_host(kq, k_cache.q.data(), k_cache.q.size());
  to_host(kd, k_cache.d.data(), k_cache.d.size());
  to_host(vq, v_cache.q.data(), v_cache.q.size());
  to_host(vd, v_cache.d.data(), v_cache.d.size());
}

void swiglu(std::vector<float>& g, const std::vector<float>& u) {
  DeviceBuffer dg = to_device(g.data(), g.size(), "g"), du = to_device(u.data(), u.size(), "u");
  cuda::swiglu(dg.as<float>(), du.as<float>(), int64_t(g.size()), int64_t(g.size()), 1, nullptr);
  to_host(dg, g.data(), g.size());
}

void head_norm(std::vector<float>& x, int64_t T, int heads, const std::vector<float>& g, float eps) {
  const int64_t n = int64_t(g.size());
  DeviceBuffer dx = to_device(x.data(), x.size(), "x"), dg = to_device(g.data(), g.size(), "g");
  cuda::head_norm(dx.as<float>(), heads * n, heads, n, dg.as<float>(), eps, int(T), nullptr);
  to_host(dx, x.data(), x.size());
}

void add_bias(std::vector<float>& y, int64_t T, const std::vector<float>& b) {
  const int64_t n = int64_t(b.size());
  DeviceBuffer dy = to_device(y.data(), y.size(), "y"), db = to_device(b.data(), b.size(), "b");
  cuda::add_bias(dy.as<float>(), n, db.as<float>(), n, int(T), nullptr);
  to_host(dy, y.data(), y.size());
}

}  // namespace ds4::cuda_ops
