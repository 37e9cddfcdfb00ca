/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvsim_ops.h - the "cache ops" of the kvsim test target.
 *
 * libkvsim_ops.so plays the part of vLLM's _C.so: it owns the kernels that
 * write, copy, swap and read (attention) KV-cache blocks, and it is the ONLY
 * object that fires the kvtrace USDT probes (bpf/kvtrace_probes.h).  A tracer
 * therefore has to find the probes in a shared library mapped into the
 * process, as with vLLM.
 *
 * This header deliberately does not include kvtrace_probes.h, so that the
 * kvsim executable carries no probe semaphores of its own.
 */
#ifndef KVSIM_OPS_H
#define KVSIM_OPS_H

#include <stdint.h>
#include <stdio.h>

/* Slot-write ops; each fires the probe of the same name. */
enum kv_write_op {
	KV_OP_RESHAPE_AND_CACHE = 0,
	KV_OP_RESHAPE_AND_CACHE_FLASH,
	KV_OP_CONCAT_AND_CACHE_MLA,
	KV_OP_CPU_ATTN_RESHAPE_AND_CACHE,
	KV_NUM_WRITE_OPS
};

/* swap_blocks directions: the same values as KVTRACE_SWAP_OUT / _IN. */
#define KV_SWAP_OUT 1 /* GPU block src -> CPU block dst */
#define KV_SWAP_IN 2  /* CPU block src -> GPU block dst */

/* One layer's KV cache: num_blocks blocks of block_size tokens. */
struct kv_layer {
	uint8_t *bytes;             /* num_blocks * bytes_per_block bytes */
	int64_t block_size;         /* tokens per block */
	int64_t num_blocks;
	int64_t kv_bytes_per_token; /* bytes stored per slot */
};

static inline int64_t kv_bytes_per_block(const struct kv_layer *layer)
{
	return layer->block_size * layer->kv_bytes_per_token;
}

/* The cache_id passed to the probes: the layer buffer's base address. */
static inline uint64_t kv_cache_id(const struct kv_layer *layer)
{
	return (uint64_t)(uintptr_t)layer->bytes;
}

/*
 * When set (kvsim --ops-log FILE), every op whose probe is enabled (a
 * tracer is attached: the kernel set its semaphore) appends one line here,
 * line-buffered, just before the probe fires, in firing order: exactly what
 * a tracer could see, whenever it attached and detached.
 * "NAME CACHE_ID V..." with the
 * values the probe hands over (a write op's slots as given, padding
 * included; the block pairs of copies and swaps, flattened, a swap's
 * name saying its direction, "swap_blocks:out" or ":in"; nothing for
 * swap_blocks_batch, whose probe streams no index values).  Per-op truth
 * for the index stream's tests; off by default (it costs a line per op).
 */
extern FILE *kv_ops_log;

/*
 * --no-block-table: kv_attention fires no vllm:block_table, so that a
 * tracer knows the step's reads only from step_rows and the block events,
 * as it knows the vLLM plugin's (whose whole tables it attaches only with
 * --verify-rows).  kvsim's own count of the reads is the same either way.
 */
extern int kv_no_block_table;

/* Probe name of a write op ("reshape_and_cache", ...), NULL if invalid. */
const char *kv_write_op_name(int write_op);

/*
 * Writes values[i] into slot slots[i] of layer (the 8-byte value repeated
 * over the slot's kv_bytes_per_token bytes).  Negative slots are padding and
 * are skipped.  Fires the probe of write_op first.
 */
void kv_write_slots(int write_op, struct kv_layer *layer, const int64_t *slots,
		    int64_t n, const uint64_t *values);

/* Copies block pairs[2i] to block pairs[2i+1] inside layer (copy_blocks). */
void kv_copy_blocks(struct kv_layer *layer, const int64_t *pairs,
		    int64_t npairs);

/*
 * Copies blocks between a GPU layer and its CPU twin (swap_blocks).
 * KV_SWAP_OUT: pairs are (gpu src, cpu dst); KV_SWAP_IN: (cpu src, gpu dst).
 * The probe's cache_id is always the GPU layer's.
 */
void kv_swap_blocks(struct kv_layer *gpu, struct kv_layer *cpu,
		    const int64_t *pairs, int64_t npairs, int direction);

/* memcpy(dst[i], src[i], sizes[i]) for raw addresses (swap_blocks_batch). */
void kv_swap_blocks_batch(const uint64_t *src, const uint64_t *dst,
			  const uint64_t *sizes, int64_t n);

/*
 * Attention over one layer's paged cache: what vLLM's attention kernel reads.
 * Fires vllm:block_table, then reads, for each of the num_reqs rows, the
 * bytes of the tokens [0, seq_lens[i]) through the row's block ids
 * (block_table[i * row_stride + pos / block_size]).  Block 0 is the null
 * block: its tokens are not read (padding, or dropped by a sliding window).
 * group_id names the block table the calling layers share (the probe's
 * group_id argument).
 *
 * Returns the checksum of what it read, so that the caller can check the
 * table against what it wrote: the wrapping sum, over every token read, of
 * its bytes taken as 8-byte words (kv_bytes_per_token must be a multiple
 * of 8).
 */
uint64_t kv_attention(const struct kv_layer *layer, const int32_t *block_table,
		      int64_t row_stride, int64_t num_reqs,
		      const int32_t *seq_lens, uint64_t group_id);

/*
 * The plugin tier (kvtrace_probes.h): the scheduler's own decisions, which
 * vLLM's kvtrace plugin fires from its scheduler and block pool.  kvsim's
 * scheduler fires them from its allocator; these functions do nothing but
 * fire the probe (and log it with --ops-log).
 *
 * Block events, in the order of enum kvtrace_life (bpf/kvtrace.h): what
 * happened to n GPU blocks of KV-cache group group_id for request req (the
 * FNV-1a 64 of its id string), in one call; num_blocks = the pool's blocks,
 * the null block 0 included.  --ops-log: "block_alloc REQ ID..." (the ids
 * as the tracer streams them).
 */
enum kv_life {
	KV_LIFE_ALLOC = 0, /* block_alloc: new blocks taken from the pool */
	KV_LIFE_HIT,       /* block_hit: cached prefix blocks shared */
	KV_LIFE_CACHE,     /* block_cache: full blocks made shareable */
	KV_LIFE_FREE,      /* block_free: the request's reference dropped */
	KV_LIFE_EVICT,     /* block_evict: a cached block dropped for reuse */
	KV_NUM_LIFE
};

/* Probe name of a block event ("block_alloc", ...), NULL if invalid. */
const char *kv_life_op_name(int kind);

void kv_block_event(int kind, uint64_t req, int64_t group_id,
		    const int32_t *ids, int64_t n, int64_t num_blocks);

/*
 * Requests: request names req (id: id_len bytes, not NUL-terminated) when
 * the scheduler first sees it; req_preempt: preempted with computed_tokens
 * computed; req_finish: done, output_tokens generated.  --ops-log: "request
 * REQ", "req_preempt REQ", "req_finish REQ" and no values (their probes
 * stream none).
 */
void kv_request(uint64_t req, const char *id, int64_t id_len,
		int64_t prompt_tokens);
void kv_req_preempt(uint64_t req, int64_t computed_tokens);
void kv_req_finish(uint64_t req, int64_t output_tokens);

/*
 * step_reqs: whose the rows of this step's block table are, fired before
 * any layer reads it: rows holds num_reqs request hashes (one per row, a
 * request with several sequences has several rows), then each row's new
 * tokens.  --ops-log: "step_reqs 0" and the 2 * num_reqs values.
 */
void kv_step_reqs(const uint64_t *rows, int64_t num_reqs);

/*
 * step_rows: the step's rows as deltas (bpf/kvtrace_probes.h): rows holds
 * 5 int64 a row (req, seq_len, new_tokens, row_len, tail_from), tail the
 * rows' entries [tail_from, row_len) concatenated, with room for one more
 * (a 0: the tracer reads whole 8-byte words).  --ops-log: "step_rows
 * GROUP", the 5 * num_rows row values, then the tail's (num_tail + 1) / 2
 * 8-byte words as int64: the values as the tracer streams them.
 * Returns whether the probe fired: a caller sending deltas starts every
 * row from 0 again after a step no tracer saw, as the plugin does.
 */
int kv_step_rows(const int64_t *rows, int64_t num_rows, const int32_t *tail,
		 int64_t num_tail, int64_t group_id, int64_t block_size,
		 int64_t num_blocks);

/*
 * A block event with its blocks' content hashes (block_hit, block_cache,
 * block_evict; the other kinds as kv_block_event).  --ops-log: the ids,
 * then the hashes.
 */
void kv_block_event_hashed(int kind, uint64_t req, int64_t group_id,
			   const int32_t *ids, int64_t n, int64_t num_blocks,
			   const uint64_t *hashes);

/*
 * prefix_hashes: a prompt's token-only chain hashes, one per
 * tokens_per_hash tokens, and its domain key (bpf/kvtrace_probes.h).
 * --ops-log: "prefix_hashes REQ" and the hashes.
 */
void kv_prefix_hashes(uint64_t req, const uint64_t *hashes, int64_t n,
		      int64_t tokens_per_hash, int64_t block_size,
		      uint64_t domain);

#endif /* KVSIM_OPS_H */
