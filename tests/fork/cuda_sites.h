/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_sites.h - libfork_cuda_sites.so: the probe sites of the patched
 * csrc/cache_kernels.cu, callable without a GPU.
 *
 * Each function is the fork's call site in one CUDA cache op, line for line
 * (the KVTRACE_ENABLED() test, then the kvtrace:: function of the patched
 * csrc/kvtrace_cuda_sites.h), with the op's tensors given as host memory.
 * All arrays are HOST memory: HostIndex borrows them instead of copying from
 * a device (that copy needs a GPU and is not run here).
 */
#ifndef FORK_CUDA_SITES_H
#define FORK_CUDA_SITES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* slot-write ops: cache is the cache tensor's base, shaped [num_blocks, ...] */
void fork_reshape_and_cache(const int64_t *slots, int64_t num_tokens,
			    int64_t block_size, void *key_cache,
			    int64_t num_blocks);
void fork_reshape_and_cache_flash(const int64_t *slots, int64_t num_tokens,
				  int64_t block_size, void *key_cache,
				  int64_t num_blocks);
void fork_concat_and_cache_mla(const int64_t *slots, int64_t num_tokens,
			       int64_t block_size, void *kv_cache,
			       int64_t num_blocks);

/* swap_blocks: which side of the copy is a CUDA device */
enum fork_copy_kind { FORK_D2D = 0, FORK_D2H = 1, FORK_H2D = 2 };

/* block_mapping is a [num_pairs, 2] int64 tensor with the given strides */
void fork_swap_blocks(int kind, void *src, void *dst, int64_t bytes_per_block,
		      const int64_t *block_mapping, int64_t num_pairs,
		      int64_t stride0, int64_t stride1);

void fork_swap_blocks_batch(const int64_t *src_ptrs, const int64_t *dst_ptrs,
			    const int64_t *sizes, int64_t count);

#ifdef __cplusplus
}
#endif
#endif
