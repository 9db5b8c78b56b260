// Paged KV-cache write: K and V rows of one step scattered into their cache slots
// in ONE launch (the torch fallback is two index_copy_ calls per layer).
// A pure copy: no arithmetic, so it cannot change bits in any numerics mode.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
// c10's stream/guard headers only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers
// that a bare CUDA toolkit may lack.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace {

template <typename scalar_t>
__global__ void cache_kv_kernel(const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                                scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
                                const int64_t* __restrict__ slots, int64_t row_elems,
                                int64_t k_stride, int64_t v_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0) return;  // padding row: nothing to store
  const scalar_t* ks = k + token * k_stride;
  const scalar_t* vs = v + token * v_stride;
  scalar_t* kd = k_cache + slot * row_elems;
  scalar_t* vd = v_cache + slot * row_elems;
  for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// k, v: [T, H, D] (each token's H*D elements contiguous); caches: [num_blocks, block_size, H, D]
void cache_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.is_cuda() && v.is_cuda() && k_cache.is_cuda() && v_cache.is_cuda() && slots.is_cuda(),
              "cache_kv: all tensors must be on the GPU");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "cache_kv: dtype of k/v and caches must match");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "cache_kv: slots must be int64");
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.stride(1) == k.size(2), "cache_kv: k rows must be contiguous");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2), "cache_kv: v rows must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache_kv: caches must be contiguous");
  const int64_t tokens = k.size(0);
  const int64_t row_elems = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row_elems, "cache_kv: cache row size mismatch");
  if (tokens == 0) return;
  const at::cuda::OptionalCUDAGuard guard(k.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = row_elems >= 1024 ? 1024 : static_cast<int>(row_elems);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "cache_kv", [&] {
    cache_kv_kernel<scalar_t><<<tokens, threads, 0, stream>>>(
        k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        slots.data_ptr<int64_t>(), row_elems, k.stride(0), v.stride(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(vllm_parity, m) {
  m.def("cache_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_parity, CUDA, m) { m.impl("cache_kv", &cache_kv); }
