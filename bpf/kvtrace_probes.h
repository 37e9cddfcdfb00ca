/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvtrace_probes.h - the USDT probe ABI of kvtrace-bpf.
 *
 * This is the ONE header that every probe site includes: the vLLM fork
 * (csrc/kvtrace_probes.h there is a byte-identical copy) and the test target
 * tests/target/kvsim.  The tracer reads the resulting .note.stapsdt entries;
 * the argument order and meaning below is the contract between the two.
 *
 * Every probe is under provider "vllm" and gated by an SDT semaphore
 * (vllm_<name>_semaphore, in section .probes).  The kernel increments the
 * semaphore while a tracer has the probe attached (uprobe ref_ctr_offset) and
 * decrements it when the tracer's perf event closes, whatever way it dies.
 * With no tracer attached a site costs one load and one not-taken branch:
 *
 *     if (KVTRACE_ENABLED(reshape_and_cache)) {
 *         // only here: build host copies of the arguments if needed
 *         KVTRACE_RESHAPE_AND_CACHE(slots, n, block_size, cache_id, nblocks);
 *     }
 *
 * Define KVTRACE_DISABLE_PROBES to compile every site out (benchmarks).
 *
 * Safety: the tracer reads only the index arrays passed here (slot numbers,
 * block pairs, pointers and sizes); never KV contents, never prompts.
 */
#ifndef KVTRACE_PROBES_H
#define KVTRACE_PROBES_H

#include <stdint.h>

/* swap_blocks direction argument */
#define KVTRACE_SWAP_OUT 1 /* device -> host: src blocks are device blocks */
#define KVTRACE_SWAP_IN 2  /* host -> device: dst blocks are device blocks */

#ifdef KVTRACE_DISABLE_PROBES

#define KVTRACE_ENABLED(name) 0
#define KVTRACE_RESHAPE_AND_CACHE(...) do { } while (0)
#define KVTRACE_RESHAPE_AND_CACHE_FLASH(...) do { } while (0)
#define KVTRACE_CONCAT_AND_CACHE_MLA(...) do { } while (0)
#define KVTRACE_CPU_ATTN_RESHAPE_AND_CACHE(...) do { } while (0)
#define KVTRACE_COPY_BLOCKS(...) do { } while (0)
#define KVTRACE_SWAP_BLOCKS(...) do { } while (0)
#define KVTRACE_SWAP_BLOCKS_BATCH(...) do { } while (0)
#define KVTRACE_BLOCK_TABLE(...) do { } while (0)

#else /* probes compiled in */

#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>

/*
 * One semaphore per probe.  Weak + hidden: every translation unit that
 * includes this header may define it, the linker keeps one per shared
 * object, and two libraries never share (interpose) a semaphore.
 * volatile: the kernel changes it behind the compiler's back.
 */
#define _KVTRACE_SEMAPHORE(name)                                             \
	__extension__ volatile unsigned short vllm_##name##_semaphore          \
	    __attribute__((weak, used, section(".probes"),                     \
			   visibility("hidden")))

_KVTRACE_SEMAPHORE(reshape_and_cache);
_KVTRACE_SEMAPHORE(reshape_and_cache_flash);
_KVTRACE_SEMAPHORE(concat_and_cache_mla);
_KVTRACE_SEMAPHORE(cpu_attn_reshape_and_cache);
_KVTRACE_SEMAPHORE(copy_blocks);
_KVTRACE_SEMAPHORE(swap_blocks);
_KVTRACE_SEMAPHORE(swap_blocks_batch);
_KVTRACE_SEMAPHORE(block_table);

/* Non-zero while at least one tracer has the probe attached. */
#define KVTRACE_ENABLED(name) __builtin_expect(vllm_##name##_semaphore != 0, 0)

/*
 * Slot-write ops: one call writes num_tokens tokens of one layer's KV cache.
 *
 *   slot_mapping  const int64_t *  HOST pointer to num_tokens slot numbers;
 *                                  slot = block * block_size + offset,
 *                                  negative = padding (nothing written)
 *   num_tokens    int64_t          entries in slot_mapping
 *   block_size    int64_t          tokens per block
 *   cache_id      uint64_t         the key cache's base address (data pointer
 *                                  plus storage offset): tells layers apart
 *   num_blocks    int64_t          physical blocks in this cache
 */
#define _KVTRACE_SLOT_PROBE(name, slots, ntok, bsize, cache, nblocks)        \
	STAP_PROBE5(vllm, name, (const int64_t *)(slots), (int64_t)(ntok),    \
		    (int64_t)(bsize), (uint64_t)(cache), (int64_t)(nblocks))

#define KVTRACE_RESHAPE_AND_CACHE(slots, ntok, bsize, cache, nblocks)        \
	_KVTRACE_SLOT_PROBE(reshape_and_cache, slots, ntok, bsize, cache, nblocks)
#define KVTRACE_RESHAPE_AND_CACHE_FLASH(slots, ntok, bsize, cache, nblocks)  \
	_KVTRACE_SLOT_PROBE(reshape_and_cache_flash, slots, ntok, bsize, cache, \
			    nblocks)
#define KVTRACE_CONCAT_AND_CACHE_MLA(slots, ntok, bsize, cache, nblocks)     \
	_KVTRACE_SLOT_PROBE(concat_and_cache_mla, slots, ntok, bsize, cache,   \
			    nblocks)
#define KVTRACE_CPU_ATTN_RESHAPE_AND_CACHE(slots, ntok, bsize, cache, nblocks) \
	_KVTRACE_SLOT_PROBE(cpu_attn_reshape_and_cache, slots, ntok, bsize,    \
			    cache, nblocks)

/*
 * copy_blocks: block-to-block copies inside one device's cache (a
 * device-to-device swap_blocks in vLLM >= 0.33; parallel-sampling forks).
 *
 *   pairs            const int64_t *  HOST pointer to num_pairs (src, dst)
 *                                     block-number pairs, 2 * num_pairs int64
 *   num_pairs        int64_t
 *   bytes_per_block  int64_t          bytes copied per pair
 *   cache_id         uint64_t         the cache's base address (one layer)
 */
#define KVTRACE_COPY_BLOCKS(pairs, npairs, bpb, cache)                        \
	STAP_PROBE4(vllm, copy_blocks, (const int64_t *)(pairs),              \
		    (int64_t)(npairs), (int64_t)(bpb), (uint64_t)(cache))

/*
 * swap_blocks: block copies across devices (preemption swap-out / swap-in).
 *
 *   pairs            const int64_t *  HOST pointer to num_pairs (src, dst)
 *                                     block-number pairs
 *   num_pairs        int64_t
 *   bytes_per_block  int64_t
 *   direction        int64_t          KVTRACE_SWAP_OUT (src = device block)
 *                                     or KVTRACE_SWAP_IN (dst = device block)
 *   cache_id         uint64_t         the DEVICE-side cache's base address
 */
#define KVTRACE_SWAP_BLOCKS(pairs, npairs, bpb, dir, cache)                   \
	STAP_PROBE5(vllm, swap_blocks, (const int64_t *)(pairs),              \
		    (int64_t)(npairs), (int64_t)(bpb), (int64_t)(dir),         \
		    (uint64_t)(cache))

/*
 * swap_blocks_batch: raw-pointer batch copies (KV offloading).  No block
 * numbers exist at this level: the tracer counts calls, entries and bytes.
 *
 *   src_ptrs  const uint64_t *  HOST array of count source addresses
 *   dst_ptrs  const uint64_t *  HOST array of count destination addresses
 *   sizes     const uint64_t *  HOST array of count byte sizes
 *   count     int64_t
 */
#define KVTRACE_SWAP_BLOCKS_BATCH(src_ptrs, dst_ptrs, sizes, count)           \
	STAP_PROBE4(vllm, swap_blocks_batch, (const uint64_t *)(src_ptrs),    \
		    (const uint64_t *)(dst_ptrs), (const uint64_t *)(sizes),   \
		    (int64_t)(count))

/*
 * block_table: the blocks attention READS at one forward step (docs/access.md).
 * Fired by each attention layer at each step, before it reads the cache; the
 * layers of one KV-cache group pass the same table, and the tracer reads it
 * once per step and group (at the first layer it saw for the group) and
 * counts the other layers' calls as totals.
 *
 *   block_table  const int32_t *  HOST pointer to row 0 of the block table:
 *                                 one row of physical block ids per request
 *   row_stride   int64_t          int32 entries from one row to the next
 *   num_reqs     int64_t          rows in use (the step's requests)
 *   seq_lens     const int32_t *  HOST pointer to num_reqs sequence lengths:
 *                                 tokens in the cache once this step has
 *                                 written (cached before + computed now)
 *   block_size   int64_t          tokens per block
 *   group_id     uint64_t         the KV-cache group: any value the group's
 *                                 layers share and other groups do not (vLLM:
 *                                 the block table's base address)
 *   num_blocks   int64_t          physical blocks in the group's cache
 *   layer_id     uint64_t         the calling layer's cache id (the cache_id
 *                                 its write ops pass)
 *
 * Request i reads the first ceil(seq_lens[i] / block_size) entries of its
 * row.  Block 0 is vLLM's null block (padding, and blocks a sliding window
 * has dropped): an entry of 0 is never counted as a read.
 */
#define KVTRACE_BLOCK_TABLE(table, stride, nreqs, seqlens, bsize, group,     \
			    nblocks, layer)                                    \
	STAP_PROBE8(vllm, block_table, (const int32_t *)(table),              \
		    (int64_t)(stride), (int64_t)(nreqs),                       \
		    (const int32_t *)(seqlens), (int64_t)(bsize),               \
		    (uint64_t)(group), (int64_t)(nblocks), (uint64_t)(layer))

#endif /* KVTRACE_DISABLE_PROBES */
#endif /* KVTRACE_PROBES_H */
