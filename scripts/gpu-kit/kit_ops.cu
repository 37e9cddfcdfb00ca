// SPDX-License-Identifier: Apache-2.0
/*
 * kit_ops.cu - libkvtrace_kit_ops.so, the GPU kit's cache ops
 * (scripts/gpu-kit/README.md): the fork's reshape_and_cache_flash and
 * swap_blocks with their vllm:* probe sites, behind a plain C ABI that takes
 * raw pointers and the caller's CUDA stream (ctypes, tensor.data_ptr(),
 * torch.cuda.current_stream().cuda_stream).
 *
 * What is the fork's, unchanged:
 * - the probe sites: the patched tree's csrc/kvtrace_cuda_sites.h and
 *   csrc/kvtrace_probes.h are included as they are (the device-to-host copy
 *   of slot_mapping, the "skip while the stream is capturing" check, the
 *   packed block pairs);
 * - the kernel: kit_kernel.inc is reshape_and_cache_flash_kernel cut
 *   verbatim out of the patched csrc/cache_kernels.cu by build.sh;
 * - the host functions below follow the fork's op line for line (site right
 *   before the launch, after the op's checks), for the NHD layout, float
 *   tensors and kv_cache_dtype "auto", with torch::stable::Tensor replaced
 *   by KitTensor.
 *
 * on_device = 0 is the CPU rehearsal: the same site code with host tensors
 * (HostIndex borrows them, as tests/fork/cuda_sites.cu does) and a host
 * loop in place of the launch, so that the kit can be traced on a machine
 * without a GPU.  No CUDA runtime call is made on that path.
 */
#include <cstdint>
#include <cstring>
#include <algorithm>

#include "quantization/vectorization_utils.cuh"
#include "kvtrace_cuda_sites.h"

namespace vllm {

enum class Fp8KVCacheDataType { kAuto = 0 };

// cache_kernels.cu's CopyWithScaleOp for kAuto, the only dtype the kit runs
// (its fp8 branch needs vLLM's fp8 conversions, which bring torch's headers)
template <typename OutT, typename InT, Fp8KVCacheDataType kv_dt>
struct CopyWithScaleOp {
  float scale;
  __device__ __forceinline__ void operator()(OutT& dst, const InT src) const {
    dst = static_cast<OutT>(src);
  }
};

#include "kit_kernel.inc"

}  // namespace vllm

namespace {

struct KitDevice {
  bool cuda;
  bool is_cuda() const { return cuda; }
};

// The five members of torch::stable::Tensor that the sites use.
struct KitTensor {
  void* ptr;
  bool cuda;
  int64_t size0;
  int64_t size1;

  KitDevice device() const { return {cuda}; }
  void* data_ptr() const { return ptr; }
  template <typename T>
  const T* const_data_ptr() const {
    return static_cast<const T*>(ptr);
  }
  int64_t size(int64_t dim) const { return dim == 0 ? size0 : size1; }
};

}  // namespace

extern "C" {

// 1 while a tracer has every probe of this library attached (their
// semaphores are set): the driver waits for it after loading the library,
// since the tracer finds a dlopen()ed library by rescanning the process.
int kit_probes_attached(void) {
  return KVTRACE_ENABLED(reshape_and_cache_flash) &&
         KVTRACE_ENABLED(copy_blocks) && KVTRACE_ENABLED(swap_blocks);
}

// The fork's reshape_and_cache_flash, "auto" dtype, NHD layout, contiguous
// float tensors: key/value [num_tokens, num_heads, head_size], caches
// [num_blocks, block_size, num_heads, head_size], slot_mapping int64
// [num_tokens].  Returns the launch's cudaError_t (0 on the host path).
int kit_reshape_and_cache_flash(const float* key, const float* value,
                                float* key_cache, float* value_cache,
                                const int64_t* slot_mapping, int num_tokens,
                                int num_heads, int head_size, int block_size,
                                int64_t num_blocks, int on_device,
                                void* stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const KitTensor slots{const_cast<int64_t*>(slot_mapping), on_device != 0,
                        num_tokens, 1};
  const KitTensor kcache{key_cache, on_device != 0, num_blocks, block_size};
  const int64_t key_stride = int64_t(num_heads) * head_size;
  const int64_t value_stride = key_stride;
  const int64_t page_stride = key_stride;
  const int64_t block_stride = page_stride * block_size;
  const int64_t head_stride = head_size;
  const int kv_scale_stride = 0;

  dim3 grid(num_tokens);
  dim3 block(std::min(num_heads * head_size, 512));
  // kvtrace: a host copy of slot_mapping, only while a tracer is attached.
  if (KVTRACE_ENABLED(reshape_and_cache_flash))
    kvtrace::reshape_and_cache_flash(slots, num_tokens, block_size, kcache,
                                     stream);
  if (!on_device) {
    for (int t = 0; t < num_tokens; t++) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t at = slot / block_size * block_stride +
                         slot % block_size * page_stride;
      std::memcpy(key_cache + at, key + t * key_stride,
                  key_stride * sizeof(float));
      std::memcpy(value_cache + at, value + t * value_stride,
                  key_stride * sizeof(float));
    }
    return 0;
  }
  if (num_tokens == 0) return 0;
  vllm::reshape_and_cache_flash_kernel<float, float,
                                       vllm::Fp8KVCacheDataType::kAuto>
      <<<grid, block, 0, stream>>>(key, value, key_cache, value_cache,
                                   slot_mapping, block_stride, page_stride,
                                   head_stride, key_stride, value_stride,
                                   num_heads, head_size, block_size, nullptr,
                                   nullptr, kv_scale_stride);
  return static_cast<int>(cudaGetLastError());
}

// The fork's swap_blocks: kind 0 device-to-device (vllm:copy_blocks), 1
// device-to-host (swap out), 2 host-to-device (swap in); block_mapping is a
// host [num_pairs, 2] int64 array with the given strides (in elements).
int kit_swap_blocks(int kind, void* src, void* dst, int64_t block_size_in_bytes,
                    const int64_t* block_mapping, int64_t num_pairs,
                    int64_t bm_stride0, int64_t bm_stride1, int on_device,
                    void* stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const cudaMemcpyKind memcpy_type = kind == 0   ? cudaMemcpyDeviceToDevice
                                     : kind == 1 ? cudaMemcpyDeviceToHost
                                                 : cudaMemcpyHostToDevice;
  const KitTensor src_t{src, kind != 2, 0, 0}, dst_t{dst, kind != 1, 0, 0};
  char* src_ptr = static_cast<char*>(src);
  char* dst_ptr = static_cast<char*>(dst);
  const int64_t* bm_ptr = block_mapping;
  // kvtrace: D2H/H2D fire vllm:swap_blocks, D2D vllm:copy_blocks.
  if (KVTRACE_ENABLED(swap_blocks) || KVTRACE_ENABLED(copy_blocks))
    kvtrace::swap_blocks(memcpy_type, src_t, dst_t, block_size_in_bytes, bm_ptr,
                         num_pairs, bm_stride0, bm_stride1);
  for (int64_t i = 0; i < num_pairs; i++) {
    int64_t src_block_number = bm_ptr[i * bm_stride0];
    int64_t dst_block_number = bm_ptr[i * bm_stride0 + bm_stride1];
    int64_t src_offset = src_block_number * block_size_in_bytes;
    int64_t dst_offset = dst_block_number * block_size_in_bytes;
    if (!on_device) {
      std::memcpy(dst_ptr + dst_offset, src_ptr + src_offset,
                  block_size_in_bytes);
      continue;
    }
    cudaError_t e = cudaMemcpyAsync(dst_ptr + dst_offset, src_ptr + src_offset,
                                    block_size_in_bytes, memcpy_type, stream);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // extern "C"
