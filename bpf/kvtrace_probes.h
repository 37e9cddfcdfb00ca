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
#define KVTRACE_BLOCK_ALLOC(...) do { } while (0)
#define KVTRACE_BLOCK_HIT(...) do { } while (0)
#define KVTRACE_BLOCK_CACHE(...) do { } while (0)
#define KVTRACE_BLOCK_FREE(...) do { } while (0)
#define KVTRACE_BLOCK_EVICT(...) do { } while (0)
#define KVTRACE_REQUEST(...) do { } while (0)
#define KVTRACE_REQ_PREEMPT(...) do { } while (0)
#define KVTRACE_REQ_FINISH(...) do { } while (0)
#define KVTRACE_STEP_REQS(...) do { } while (0)
#define KVTRACE_STEP_ROWS(...) do { } while (0)

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
_KVTRACE_SEMAPHORE(block_alloc);
_KVTRACE_SEMAPHORE(block_hit);
_KVTRACE_SEMAPHORE(block_cache);
_KVTRACE_SEMAPHORE(block_free);
_KVTRACE_SEMAPHORE(block_evict);
_KVTRACE_SEMAPHORE(request);
_KVTRACE_SEMAPHORE(req_preempt);
_KVTRACE_SEMAPHORE(req_finish);
_KVTRACE_SEMAPHORE(step_reqs);
_KVTRACE_SEMAPHORE(step_rows);

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

/*
 * The plugin tier (plugin/, docs/tiers.md): probes fired by the kvtrace vLLM
 * plugin from vLLM's scheduler and block pool, in the EngineCore process, in
 * Python, on any device.  The plugin also fires block_table above, once per
 * step and KV-cache group, from the step's SchedulerOutput: group_id is
 * vLLM's kv_cache_group_id (0, 1, ...), layer_id 0.
 *
 * A request is named by req, the 64-bit FNV-1a hash of its vLLM request id
 * (UTF-8 bytes; offset basis 0xcbf29ce484222325, prime 0x100000001b3).
 * The request probe maps req to the id string once, when vLLM first sees
 * the request; the tracer keeps the pair so that reports name requests.
 *
 * Block events: a list of physical block ids of one KV-cache group, what
 * happened to them, and the request it happened for.
 *   req         uint64_t         the request (hash above)
 *   group_id    int64_t          the KV-cache group (vLLM's kv_cache_group_id)
 *   block_ids   const int32_t *  HOST pointer to num_ids block ids
 *   num_ids     int64_t          entries in block_ids
 *   num_blocks  int64_t          blocks in the pool (the null block 0 included)
 *   hashes      const uint64_t * HOST pointer to num_ids content hashes, one
 *                                per id (64 bits of vLLM's block hash), or
 *                                NULL: block_hit, block_cache and
 *                                block_evict pass them (the tracer's
 *                                miss-ratio curve follows contents), the
 *                                others NULL.  Read only when recording.
 *
 *   block_alloc  blocks taken from the free queue for req (BlockPool.
 *                get_new_blocks while the scheduler allocates for req)
 *   block_hit    prefix-cache hits: cached blocks req shares instead of
 *                computing them (BlockPool.touch)
 *   block_cache  req's full blocks that got a hash: now reusable by others
 *                (BlockPool.cache_full_blocks)
 *   block_free   blocks req released (one reference dropped: a block is back
 *                in the free queue only once nobody holds it), at its end or
 *                its preemption (KVCacheManager.free, pop_blocks_for_free)
 *   block_evict  cached blocks whose hash was dropped so that they could be
 *                given to req (BlockPool._maybe_evict_cached_block): the
 *                content a later request can no longer hit
 * Block 0 (the null block) never appears in a list.
 */
#define _KVTRACE_BLOCKS_PROBE(name, req, group, ids, nids, nblocks, hashes) \
	STAP_PROBE6(vllm, name, (uint64_t)(req), (int64_t)(group),            \
		    (const int32_t *)(ids), (int64_t)(nids), (int64_t)(nblocks),   \
		    (const uint64_t *)(hashes))

#define KVTRACE_BLOCK_ALLOC(req, group, ids, nids, nblocks, hashes)           \
	_KVTRACE_BLOCKS_PROBE(block_alloc, req, group, ids, nids, nblocks, hashes)
#define KVTRACE_BLOCK_HIT(req, group, ids, nids, nblocks, hashes)             \
	_KVTRACE_BLOCKS_PROBE(block_hit, req, group, ids, nids, nblocks, hashes)
#define KVTRACE_BLOCK_CACHE(req, group, ids, nids, nblocks, hashes)           \
	_KVTRACE_BLOCKS_PROBE(block_cache, req, group, ids, nids, nblocks, hashes)
#define KVTRACE_BLOCK_FREE(req, group, ids, nids, nblocks, hashes)            \
	_KVTRACE_BLOCKS_PROBE(block_free, req, group, ids, nids, nblocks, hashes)
#define KVTRACE_BLOCK_EVICT(req, group, ids, nids, nblocks, hashes)           \
	_KVTRACE_BLOCKS_PROBE(block_evict, req, group, ids, nids, nblocks, hashes)

/*
 * request: names a request, once, when the scheduler first sees it.
 *   req      uint64_t      the hash above
 *   id       const char *  HOST pointer to the request id, UTF-8, not
 *                          NUL-terminated (the tracer reads id_len bytes,
 *                          at most 64: an id is a name, never a prompt)
 *   id_len   int64_t
 *   prompt_tokens int64_t  tokens of its prompt (a count, never the tokens)
 */
#define KVTRACE_REQUEST(req, id, idlen, ntok)                                 \
	STAP_PROBE4(vllm, request, (uint64_t)(req), (const char *)(id),        \
		    (int64_t)(idlen), (int64_t)(ntok))

/*
 * req_preempt: the scheduler preempted req (its blocks are freed by the
 * block_free that follows; its computed tokens are computed again later).
 *   req             uint64_t
 *   computed_tokens int64_t  tokens it had computed, now to recompute
 * req_finish: req finished (any reason) and leaves the scheduler.
 *   req             uint64_t
 *   output_tokens   int64_t  tokens it generated
 */
#define KVTRACE_REQ_PREEMPT(req, ntok)                                        \
	STAP_PROBE2(vllm, req_preempt, (uint64_t)(req), (int64_t)(ntok))
#define KVTRACE_REQ_FINISH(req, ntok)                                         \
	STAP_PROBE2(vllm, req_finish, (uint64_t)(req), (int64_t)(ntok))

/*
 * step_reqs: whose rows the step's block tables are, and what each wrote.
 * Fired once per scheduler step, just before that step's block_table probes
 * (one per KV-cache group), whose rows are the same requests in the same
 * order.  With it, each row's reads and writes belong to a request:
 * request i writes the tokens [seq_lens[i] - new_tokens_i, seq_lens[i]) of
 * its row (the blocks that hold them) and reads its row as block_table says.
 *   rows      const uint64_t *  HOST pointer to 2 * num_reqs values: the
 *                               rows' requests (req above; a request that
 *                               runs several sequences has a row for
 *                               each), then the tokens each row computes
 *                               at the step (vLLM's num_scheduled_tokens)
 *   num_reqs  int64_t           the step's rows
 * Streamed only when recording; nothing is counted from it in the kernel.
 */
#define KVTRACE_STEP_REQS(rows, nreqs)                                        \
	STAP_PROBE2(vllm, step_reqs, (const uint64_t *)(rows), (int64_t)(nreqs))

/*
 * step_rows: a step's rows of one KV-cache group as deltas, in place of the
 * whole table (block_table above).  Fired once per scheduler step and
 * group, by the plugin in place of step_reqs + block_table (it fires those
 * too while a tracer has block_table attached: verification), and by
 * kvsim beside them.  Its size is the step's requests and the entries they
 * gained, never the rows' whole length: a tracer keeps each row from the
 * tails, the block_free events (sliding-window blocks replaced by the null
 * block) and the resets (tail_from 0).
 *
 *   rows        const int64_t *  HOST pointer to num_rows records of 5
 *                                int64, row-major:
 *                 req         the request (hash above)
 *                 seq_len     tokens in the cache once this step has written
 *                 new_tokens  tokens it computes at this step
 *                 row_len     entries of its row in this group now (null
 *                             blocks included)
 *                 tail_from   where this op's tail for the row starts: the
 *                             row_len last reported for req in this group,
 *                             or 0 if its row was freed since (preemption)
 *                             or it is new
 *   num_rows    int64_t
 *   tail        const int32_t *  HOST pointer to the rows' new entries,
 *                                concatenated: row i's entries [tail_from_i,
 *                                row_len_i), block ids, 0 the null block.
 *                                The buffer holds an even number of int32
 *                                (a 0 after the last when num_tail is odd):
 *                                the tracer reads it in 8-byte words.
 *   num_tail    int64_t          entries in tail (the padding not counted)
 *   group_id    int64_t          the KV-cache group (kv_cache_group_id)
 *   block_size  int64_t          tokens per block
 *   num_blocks  int64_t          blocks in the pool
 * Streamed whenever attached; nothing is counted per block from it.
 */
#define KVTRACE_STEP_ROWS(rows, nrows, tail, ntail, group, bsize, nblocks)   \
	STAP_PROBE7(vllm, step_rows, (const int64_t *)(rows), (int64_t)(nrows), \
		    (const int32_t *)(tail), (int64_t)(ntail), (int64_t)(group),   \
		    (int64_t)(bsize), (int64_t)(nblocks))

#endif /* KVTRACE_DISABLE_PROBES */
#endif /* KVTRACE_PROBES_H */
