/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvsim_ops.c - libkvsim_ops.so: the cache ops of kvsim, and its probe sites.
 *
 * Every op fires its probe (gated by the probe's semaphore) before doing the
 * work, like the vLLM kernels' host-side launch code.  The ops then really
 * move (or, for attention, read) bytes so that kvsim can check the KV
 * contents afterwards.  An index out
 * of range is a bug in kvsim's scheduler: abort rather than corrupt memory.
 */
#include "kvsim_ops.h"

#include "kvtrace_probes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(KV_SWAP_OUT == KVTRACE_SWAP_OUT, "swap direction ABI");
_Static_assert(KV_SWAP_IN == KVTRACE_SWAP_IN, "swap direction ABI");

static const char *const write_op_names[KV_NUM_WRITE_OPS] = {
	[KV_OP_RESHAPE_AND_CACHE] = "reshape_and_cache",
	[KV_OP_RESHAPE_AND_CACHE_FLASH] = "reshape_and_cache_flash",
	[KV_OP_CONCAT_AND_CACHE_MLA] = "concat_and_cache_mla",
	[KV_OP_CPU_ATTN_RESHAPE_AND_CACHE] = "cpu_attn_reshape_and_cache",
};

const char *kv_write_op_name(int write_op)
{
	if (write_op < 0 || write_op >= KV_NUM_WRITE_OPS)
		return NULL;
	return write_op_names[write_op];
}

FILE *kv_ops_log;
int kv_no_block_table;

static void log_op(const char *name, uint64_t cache_id, const int64_t *v,
		   int64_t n)
{
	if (!kv_ops_log)
		return;
	fprintf(kv_ops_log, "%s %llu", name, (unsigned long long)cache_id);
	for (int64_t i = 0; i < n; i++)
		fprintf(kv_ops_log, " %lld", (long long)v[i]);
	fputc('\n', kv_ops_log);
}

static void die(const char *op, const char *what, int64_t v)
{
	fprintf(stderr, "kvsim_ops: %s: %s (%lld)\n", op, what, (long long)v);
	abort();
}

static uint8_t *block_ptr(const struct kv_layer *layer, int64_t block,
			  const char *op)
{
	if (block < 0 || block >= layer->num_blocks)
		die(op, "block out of range", block);
	return layer->bytes + block * kv_bytes_per_block(layer);
}

static void fire_write_probe(int write_op, const struct kv_layer *layer,
			     const int64_t *slots, int64_t n)
{
	/* Unused when the probes are compiled out. */
	(void)layer;
	(void)slots;
	(void)n;

	/* One site per probe: each probe has its own note and semaphore. */
	switch (write_op) {
	case KV_OP_RESHAPE_AND_CACHE:
		if (KVTRACE_ENABLED(reshape_and_cache)) {
			log_op("reshape_and_cache", kv_cache_id(layer), slots, n);
			KVTRACE_RESHAPE_AND_CACHE(slots, n, layer->block_size,
						  kv_cache_id(layer),
						  layer->num_blocks);
		}
		break;
	case KV_OP_RESHAPE_AND_CACHE_FLASH:
		if (KVTRACE_ENABLED(reshape_and_cache_flash)) {
			log_op("reshape_and_cache_flash", kv_cache_id(layer), slots, n);
			KVTRACE_RESHAPE_AND_CACHE_FLASH(slots, n,
							layer->block_size,
							kv_cache_id(layer),
							layer->num_blocks);
		}
		break;
	case KV_OP_CONCAT_AND_CACHE_MLA:
		if (KVTRACE_ENABLED(concat_and_cache_mla)) {
			log_op("concat_and_cache_mla", kv_cache_id(layer), slots, n);
			KVTRACE_CONCAT_AND_CACHE_MLA(slots, n,
						     layer->block_size,
						     kv_cache_id(layer),
						     layer->num_blocks);
		}
		break;
	case KV_OP_CPU_ATTN_RESHAPE_AND_CACHE:
		if (KVTRACE_ENABLED(cpu_attn_reshape_and_cache)) {
			log_op("cpu_attn_reshape_and_cache", kv_cache_id(layer), slots, n);
			KVTRACE_CPU_ATTN_RESHAPE_AND_CACHE(slots, n,
							   layer->block_size,
							   kv_cache_id(layer),
							   layer->num_blocks);
		}
		break;
	default:
		die("kv_write_slots", "bad write op", write_op);
	}
}

void kv_write_slots(int write_op, struct kv_layer *layer, const int64_t *slots,
		    int64_t n, const uint64_t *values)
{
	const int64_t nslots = layer->num_blocks * layer->block_size;
	const int64_t bpt = layer->kv_bytes_per_token;

	fire_write_probe(write_op, layer, slots, n);

	for (int64_t i = 0; i < n; i++) {
		if (slots[i] < 0)
			continue; /* padding */
		if (slots[i] >= nslots)
			die("kv_write_slots", "slot out of range", slots[i]);
		uint8_t *dst = layer->bytes + slots[i] * bpt;
		for (int64_t off = 0; off < bpt; off += 8) {
			size_t len = bpt - off < 8 ? (size_t)(bpt - off) : 8;
			memcpy(dst + off, &values[i], len);
		}
	}
}

void kv_copy_blocks(struct kv_layer *layer, const int64_t *pairs,
		    int64_t npairs)
{
	const int64_t bpb = kv_bytes_per_block(layer);

	if (KVTRACE_ENABLED(copy_blocks)) {
		log_op("copy_blocks", kv_cache_id(layer), pairs, 2 * npairs);
		KVTRACE_COPY_BLOCKS(pairs, npairs, bpb, kv_cache_id(layer));
	}

	for (int64_t i = 0; i < npairs; i++) {
		uint8_t *src = block_ptr(layer, pairs[2 * i], "kv_copy_blocks");
		uint8_t *dst =
			block_ptr(layer, pairs[2 * i + 1], "kv_copy_blocks");
		if (src != dst)
			memcpy(dst, src, (size_t)bpb);
	}
}

void kv_swap_blocks(struct kv_layer *gpu, struct kv_layer *cpu,
		    const int64_t *pairs, int64_t npairs, int direction)
{
	const int64_t bpb = kv_bytes_per_block(gpu);
	struct kv_layer *from, *to;

	if (kv_bytes_per_block(cpu) != bpb)
		die("kv_swap_blocks", "block geometry mismatch", bpb);
	if (direction == KV_SWAP_OUT) {
		from = gpu;
		to = cpu;
	} else if (direction == KV_SWAP_IN) {
		from = cpu;
		to = gpu;
	} else {
		die("kv_swap_blocks", "bad direction", direction);
		return;
	}

	if (KVTRACE_ENABLED(swap_blocks)) {
		log_op(direction == KV_SWAP_OUT ? "swap_blocks:out"
						: "swap_blocks:in",
		       kv_cache_id(gpu), pairs, 2 * npairs);
		KVTRACE_SWAP_BLOCKS(pairs, npairs, bpb, direction,
				    kv_cache_id(gpu));
	}

	for (int64_t i = 0; i < npairs; i++)
		memcpy(block_ptr(to, pairs[2 * i + 1], "kv_swap_blocks"),
		       block_ptr(from, pairs[2 * i], "kv_swap_blocks"),
		       (size_t)bpb);
}

void kv_swap_blocks_batch(const uint64_t *src, const uint64_t *dst,
			  const uint64_t *sizes, int64_t n)
{
	if (KVTRACE_ENABLED(swap_blocks_batch)) {
		log_op("swap_blocks_batch", 0, NULL, 0);
		KVTRACE_SWAP_BLOCKS_BATCH(src, dst, sizes, n);
	}

	for (int64_t i = 0; i < n; i++)
		memcpy((void *)(uintptr_t)dst[i],
		       (const void *)(uintptr_t)src[i], (size_t)sizes[i]);
}

/* The wrapping sum of n / 8 little 8-byte words. */
static uint64_t checksum(const uint8_t *p, int64_t n)
{
	uint64_t sum = 0, w;

	for (int64_t off = 0; off + 8 <= n; off += 8) {
		memcpy(&w, p + off, 8);
		sum += w;
	}
	return sum;
}

/*
 * --ops-log for the read probe, every layer's call: "block_table GROUP
 * LAYER" and then what the tracer streams for a step, row after row: the
 * row's seq_len, then its ceil(seq_len / block_size) entries.  The tracer
 * reads one layer's calls (its group's leader): the test picks those.
 */
static void log_table(const struct kv_layer *layer, const int32_t *table,
		      int64_t row_stride, int64_t num_reqs,
		      const int32_t *seq_lens, uint64_t group_id)
{
	if (!kv_ops_log)
		return;
	fprintf(kv_ops_log, "block_table %llu %llu", (unsigned long long)group_id,
		(unsigned long long)kv_cache_id(layer));
	for (int64_t i = 0; i < num_reqs; i++) {
		int64_t len = seq_lens[i], n = (len + layer->block_size - 1) / layer->block_size;
		fprintf(kv_ops_log, " %lld", (long long)len);
		for (int64_t j = 0; j < n; j++)
			fprintf(kv_ops_log, " %d", table[i * row_stride + j]);
	}
	fputc('\n', kv_ops_log);
}

uint64_t kv_attention(const struct kv_layer *layer, const int32_t *block_table,
		      int64_t row_stride, int64_t num_reqs,
		      const int32_t *seq_lens, uint64_t group_id)
{
	const int64_t bs = layer->block_size;
	const int64_t bpt = layer->kv_bytes_per_token;
	uint64_t sum = 0;

	(void)group_id; /* only the probe needs it */
	if (bpt % 8)
		die("kv_attention", "bytes per token not whole words", bpt);
	if (!kv_no_block_table && KVTRACE_ENABLED(block_table)) {
		KVTRACE_BLOCK_TABLE(block_table, row_stride, num_reqs, seq_lens,
				    bs, group_id, layer->num_blocks,
				    kv_cache_id(layer));
		log_table(layer, block_table, row_stride, num_reqs, seq_lens,
			  group_id);
	}

	for (int64_t i = 0; i < num_reqs; i++) {
		const int32_t *row = block_table + i * row_stride;
		int64_t len = seq_lens[i];
		if (len < 0 || (len + bs - 1) / bs > row_stride)
			die("kv_attention", "seq_len beyond the row", len);
		/* block by block: a block's tokens are contiguous bytes */
		for (int64_t j = 0; j * bs < len; j++) {
			if (row[j] == 0)
				continue; /* the null block holds no tokens */
			int64_t ntok = len - j * bs < bs ? len - j * bs : bs;
			sum += checksum(block_ptr(layer, row[j], "kv_attention"),
					ntok * bpt);
		}
	}
	return sum;
}

/* ------------------------------------------------------------------ */
/* The plugin tier: lifecycle events of blocks and requests             */

static const char *const life_names[KV_NUM_LIFE] = {
	[KV_LIFE_ALLOC] = "block_alloc", [KV_LIFE_HIT] = "block_hit",
	[KV_LIFE_CACHE] = "block_cache", [KV_LIFE_FREE] = "block_free",
	[KV_LIFE_EVICT] = "block_evict",
};

const char *kv_life_op_name(int kind)
{
	if (kind < 0 || kind >= KV_NUM_LIFE)
		return NULL;
	return life_names[kind];
}

/* --ops-log of a block event: "NAME REQ ID... [HASH...]", as the tracer
 * streams it (the hashes only when the event passes them). */
static void log_ids_hashes(const char *name, uint64_t req, const int32_t *ids,
			   const uint64_t *hashes, int64_t n)
{
	if (!kv_ops_log)
		return;
	fprintf(kv_ops_log, "%s %llu", name, (unsigned long long)req);
	for (int64_t i = 0; i < n; i++)
		fprintf(kv_ops_log, " %d", ids[i]);
	for (int64_t i = 0; hashes && i < n; i++)
		fprintf(kv_ops_log, " %lld", (long long)hashes[i]);
	fputc('\n', kv_ops_log);
}

void kv_block_event_hashed(int kind, uint64_t req, int64_t group_id,
			   const int32_t *ids, int64_t n, int64_t num_blocks,
			   const uint64_t *hashes)
{
	/* Unused when the probes are compiled out. */
	(void)req;
	(void)group_id;
	(void)ids;
	(void)n;
	(void)num_blocks;
	(void)hashes;

	/* One site per probe, as for the write ops. */
	switch (kind) {
	case KV_LIFE_ALLOC:
		if (KVTRACE_ENABLED(block_alloc)) {
			log_ids_hashes("block_alloc", req, ids, hashes, n);
			KVTRACE_BLOCK_ALLOC(req, group_id, ids, n, num_blocks, hashes);
		}
		break;
	case KV_LIFE_HIT:
		if (KVTRACE_ENABLED(block_hit)) {
			log_ids_hashes("block_hit", req, ids, hashes, n);
			KVTRACE_BLOCK_HIT(req, group_id, ids, n, num_blocks, hashes);
		}
		break;
	case KV_LIFE_CACHE:
		if (KVTRACE_ENABLED(block_cache)) {
			log_ids_hashes("block_cache", req, ids, hashes, n);
			KVTRACE_BLOCK_CACHE(req, group_id, ids, n, num_blocks, hashes);
		}
		break;
	case KV_LIFE_FREE:
		if (KVTRACE_ENABLED(block_free)) {
			log_ids_hashes("block_free", req, ids, hashes, n);
			KVTRACE_BLOCK_FREE(req, group_id, ids, n, num_blocks, hashes);
		}
		break;
	case KV_LIFE_EVICT:
		if (KVTRACE_ENABLED(block_evict)) {
			log_ids_hashes("block_evict", req, ids, hashes, n);
			KVTRACE_BLOCK_EVICT(req, group_id, ids, n, num_blocks, hashes);
		}
		break;
	default:
		die("kv_block_event", "bad lifecycle kind", kind);
	}
}

void kv_request(uint64_t req, const char *id, int64_t id_len,
		int64_t prompt_tokens)
{
	(void)id;
	(void)id_len;
	(void)prompt_tokens;
	if (KVTRACE_ENABLED(request)) {
		log_op("request", req, NULL, 0);
		KVTRACE_REQUEST(req, id, id_len, prompt_tokens);
	}
}

void kv_req_preempt(uint64_t req, int64_t computed_tokens)
{
	(void)computed_tokens;
	if (KVTRACE_ENABLED(req_preempt)) {
		log_op("req_preempt", req, NULL, 0);
		KVTRACE_REQ_PREEMPT(req, computed_tokens);
	}
}

void kv_step_reqs(const uint64_t *rows, int64_t num_reqs)
{
	(void)rows;
	(void)num_reqs;
	if (KVTRACE_ENABLED(step_reqs)) {
		log_op("step_reqs", 0, (const int64_t *)rows, 2 * num_reqs);
		KVTRACE_STEP_REQS(rows, num_reqs);
	}
}

int kv_step_rows(const int64_t *rows, int64_t num_rows, const int32_t *tail,
		 int64_t num_tail, int64_t group_id, int64_t block_size,
		 int64_t num_blocks)
{
	(void)rows;
	(void)num_rows;
	(void)tail;
	(void)num_tail;
	(void)group_id;
	(void)block_size;
	(void)num_blocks;
	if (KVTRACE_ENABLED(step_rows)) {
		if (kv_ops_log) { /* the values as streamed: rows, then tail words */
			int64_t words = (num_tail + 1) / 2;
			int64_t *v = malloc((size_t)(5 * num_rows + words + 1) * sizeof(*v));
			if (!v)
				die("kv_step_rows", "out of memory", num_rows);
			memcpy(v, rows, (size_t)(5 * num_rows) * sizeof(*v));
			memcpy(v + 5 * num_rows, tail, (size_t)words * sizeof(*v));
			log_op("step_rows", (uint64_t)group_id, v, 5 * num_rows + words);
			free(v);
		}
		KVTRACE_STEP_ROWS(rows, num_rows, tail, num_tail, group_id,
				  block_size, num_blocks);
		return 1;
	}
	return 0;
}

void kv_req_finish(uint64_t req, int64_t output_tokens)
{
	(void)output_tokens;
	if (KVTRACE_ENABLED(req_finish)) {
		log_op("req_finish", req, NULL, 0);
		KVTRACE_REQ_FINISH(req, output_tokens);
	}
}


void kv_block_event(int kind, uint64_t req, int64_t group_id,
		    const int32_t *ids, int64_t n, int64_t num_blocks)
{
	kv_block_event_hashed(kind, req, group_id, ids, n, num_blocks, NULL);
}

void kv_prefix_hashes(uint64_t req, const uint64_t *hashes, int64_t n,
		      int64_t tokens_per_hash, int64_t block_size,
		      uint64_t domain)
{
	(void)hashes;
	(void)tokens_per_hash;
	(void)block_size;
	(void)domain;
	if (KVTRACE_ENABLED(prefix_hashes)) {
		log_op("prefix_hashes", req, (const int64_t *)hashes, n);
		KVTRACE_PREFIX_HASHES(req, hashes, n, tokens_per_hash,
				      block_size, domain);
	}
}
