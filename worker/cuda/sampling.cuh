#pragma once
// Sampling on the device: the logits of a step stay in device memory and only
// the chosen token and its log-probability come back. Greedy only; other
// samplers run on the host from the logits (Backend::logits copies a row).
// A request's logit_bias and penalties are added on the device first.

#include "model/memory_plan.h"
#include "worker/cuda/common.cuh"
#include "worker/sampler.h"

namespace ds4::cuda {

struct GreedyPick {
  int32_t token = 0;
  float logprob = 0;
};

/// For each of `rows` rows of `n` logits (`ld` floats apart): the token with
/// the highest logit (ties to the lowest id, NaN never wins) and its
/// log-softmax, summed in double as worker/sampler.cpp does.
/// `scratch`: greedy_scratch_bytes(rows) of device memory for the chunks'
/// partial results.
/// `lse` (may be null): each row's log(sum(exp(logits))) in double.
void greedy_pick(const float* logits, int64_t n, int64_t ld, int rows, GreedyPick* out, void* scratch,
                 cudaStream_t s, double* lse = nullptr);
size_t greedy_scratch_bytes(int rows);

/// A row's best logits, ranked as worker/sampler.h ranks them (the higher
/// logit, then the lower id; NaN as -inf), and the whole row's log-sum-exp:
/// what a sampled token with top-k needs (sample_best), 520 bytes instead
/// of the row.
struct TopLogits {
  double lse;
  int32_t count;  // min(kCudaTopLogits, n)
  int32_t unused;
  LogitCandidate best[kCudaTopLogits];
};

/// For each of `rows` rows of `n` logits (`ld` floats apart): its
/// kCudaTopLogits best into out[row], with lse[row] (greedy_pick's).
/// `scratch`: top_scratch_bytes(rows, n) of device memory.
void top_logits(const float* logits, int64_t n, int64_t ld, int rows, const double* lse, TopLogits* out,
                void* scratch, cudaStream_t s);
size_t top_scratch_bytes(int rows, int64_t n);

/// logits[a.row * ld + a.token] += a.delta for each of the `n` entries of
/// `adds` (device memory; at most one entry a row and token).
void add_to_logits(float* logits, int64_t ld, const LogitAdjust* adds, int n, cudaStream_t s);

}  // namespace ds4::cuda
