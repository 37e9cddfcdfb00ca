// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_sites.cu - libfork_cuda_sites.so (see cuda_sites.h).  Compiled by nvcc
 * with the flags the full csrc/cache_kernels.cu is compiled with, against the
 * patched tree's csrc/kvtrace_cuda_sites.h and csrc/kvtrace_probes.h.
 *
 * HostTensor stands in for torch::stable::Tensor with the five members the
 * sites use; it is always on the host.
 */
#include "cuda_sites.h"

#include "kvtrace_cuda_sites.h"

namespace {

struct HostDevice {
  bool is_cuda() const { return false; }
};

struct HostTensor {
  void* ptr;
  int64_t size0;

  HostDevice device() const { return {}; }
  void* data_ptr() const { return ptr; }
  template <typename T>
  const T* const_data_ptr() const {
    return static_cast<const T*>(ptr);
  }
  int64_t size(int64_t dim) const { return dim == 0 ? size0 : -1; }
};

// The op's stream: never used for host tensors.
const cudaStream_t stream = nullptr;

HostTensor index_tensor(const int64_t* index, int64_t n) {
  return HostTensor{const_cast<int64_t*>(index), n};
}

}  // namespace

extern "C" void fork_reshape_and_cache(const int64_t* slots, int64_t num_tokens,
                                       int64_t block_size, void* key_cache,
                                       int64_t num_blocks) {
  const HostTensor slot_mapping = index_tensor(slots, num_tokens);
  const HostTensor cache{key_cache, num_blocks};
  if (KVTRACE_ENABLED(reshape_and_cache))
    kvtrace::reshape_and_cache(slot_mapping, num_tokens, block_size, cache,
                               stream);
}

extern "C" void fork_reshape_and_cache_flash(const int64_t* slots,
                                             int64_t num_tokens,
                                             int64_t block_size,
                                             void* key_cache,
                                             int64_t num_blocks) {
  const HostTensor slot_mapping = index_tensor(slots, num_tokens);
  const HostTensor cache{key_cache, num_blocks};
  if (KVTRACE_ENABLED(reshape_and_cache_flash))
    kvtrace::reshape_and_cache_flash(slot_mapping, num_tokens, block_size,
                                     cache, stream);
}

extern "C" void fork_concat_and_cache_mla(const int64_t* slots,
                                          int64_t num_tokens,
                                          int64_t block_size, void* kv_cache,
                                          int64_t num_blocks) {
  const HostTensor slot_mapping = index_tensor(slots, num_tokens);
  const HostTensor cache{kv_cache, num_blocks};
  if (KVTRACE_ENABLED(concat_and_cache_mla))
    kvtrace::concat_and_cache_mla(slot_mapping, num_tokens, block_size, cache,
                                  stream);
}

extern "C" void fork_swap_blocks(int kind, void* src, void* dst,
                                 int64_t bytes_per_block,
                                 const int64_t* block_mapping,
                                 int64_t num_pairs, int64_t stride0,
                                 int64_t stride1) {
  const cudaMemcpyKind memcpy_type = kind == FORK_D2D ? cudaMemcpyDeviceToDevice
                                     : kind == FORK_D2H
                                         ? cudaMemcpyDeviceToHost
                                         : cudaMemcpyHostToDevice;
  const HostTensor src_cache{src, 0}, dst_cache{dst, 0};
  if (KVTRACE_ENABLED(swap_blocks) || KVTRACE_ENABLED(copy_blocks))
    kvtrace::swap_blocks(memcpy_type, src_cache, dst_cache, bytes_per_block,
                         block_mapping, num_pairs, stride0, stride1);
}

extern "C" void fork_swap_blocks_batch(const int64_t* src_ptrs,
                                       const int64_t* dst_ptrs,
                                       const int64_t* sizes, int64_t count) {
  if (KVTRACE_ENABLED(swap_blocks_batch))
    kvtrace::swap_blocks_batch(src_ptrs, dst_ptrs, sizes, count);
}
