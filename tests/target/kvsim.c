/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvsim - a small paged-KV-cache simulator, the test target of kvtrace-bpf.
 *
 * It runs a vLLM-like block manager and scheduler (paged blocks, refcounted
 * sharing for parallel sampling and for a prefix cache, chunked prefill, swap
 * preemption, offload on finish, a sliding window) and performs every KV write, copy, swap and
 * read through the cache ops in libkvsim_ops.so, which fire the kvtrace USDT
 * probes.  Block 0 is reserved as vLLM's null block.
 *
 * A forward step runs layer by layer, as vLLM does: each layer writes the
 * step's tokens (a slot-write op), then its attention (kv_attention, probe
 * vllm:block_table) reads the step's block table: one row per scheduled
 * sequence, all layers sharing the one table (one KV-cache group).
 *
 * Independently of the probes, the scheduler records at the point where it
 * decides what to write, copy, swap or read what a tracer should have
 * counted, and writes that ground truth as JSON (--truth FILE; the read
 * fields are described at write_reads()).  It also checks the KV bytes
 * themselves: when a sequence finishes, every token it wrote must still hold
 * its expected value in every layer, and at every step each layer's
 * attention must read exactly the values its rows' sequences hold.
 *
 * Exit status: 0 ok, 1 KV mismatch or runtime failure, 2 bad usage.
 */
#define _POSIX_C_SOURCE 200809L

#include "kvsim_ops.h"

#include <errno.h>
#include <stddef.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KVSIM_VERSION 1
#define KV_BYTES_PER_TOKEN 16 /* bytes stored per slot, per layer */
#define PAD_TO 8              /* slot arrays padded to a multiple (CUDA graphs) */
#define MAX_SAMPLES 8         /* parallel samples per request */
#define MAX_LAYERS 128
#define MIN_CPU_BLOCKS 512

/* ------------------------------------------------------------------ */
/* Errors                                                              */

static void usage_error(const char *fmt, const char *arg)
{
	fprintf(stderr, "kvsim: ");
	fprintf(stderr, fmt, arg);
	fprintf(stderr, " (try --help)\n");
	exit(2);
}

static void fatal(const char *msg)
{
	fprintf(stderr, "kvsim: %s\n", msg);
	exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (!p)
		fatal("out of memory");
	return p;
}

/* ------------------------------------------------------------------ */
/* Deterministic RNG and the KV value hash                             */

static uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

struct rng {
	uint64_t state;
};

static uint64_t rng_next(struct rng *r) /* splitmix64 */
{
	r->state += 0x9e3779b97f4a7c15ULL;
	return mix64(r->state);
}

static int64_t rng_range(struct rng *r, int64_t lo, int64_t hi)
{
	return lo + (int64_t)(rng_next(r) % (uint64_t)(hi - lo + 1));
}

/*
 * The value stored for one token in one layer.  sample is 0 for positions
 * before the fork point (the shared prompt), so all samples of a request
 * expect the same prompt values.
 */
static uint64_t kv_value(uint64_t req_id, int sample, int64_t pos, int64_t layer)
{
	uint64_t h = mix64(req_id + 0x6b76736d00000000ULL);
	h = mix64(h ^ (uint64_t)sample);
	h = mix64(h ^ (uint64_t)pos);
	return mix64(h ^ ((uint64_t)layer << 32));
}

/* ------------------------------------------------------------------ */
/* Configuration and workloads                                         */

struct workload {
	const char *name;
	int64_t layers, block_size, blocks;
	int64_t requests, samples;
	int64_t prompt_min, prompt_max, gen_min, gen_max;
	int64_t max_tokens_per_step;
	int write_op;
	bool offload_on_finish; /* swap_blocks_batch when a request finishes */
	/*
	 * Tokens of a prompt prefix common to all requests, before each
	 * request's own prompt_min..prompt_max tokens (0: none).  Its full
	 * blocks are prefix-cached: written by the first request that computes
	 * them, then shared (refcount) by every later request.
	 */
	int64_t prefix;
	/*
	 * Sliding window (tokens; 0: none).  After a step, a running
	 * sequence's blocks that hold only tokens more than window positions
	 * behind its end are freed and become the null block (0) in its
	 * table, as vLLM's sliding-window manager does: attention then reads
	 * null entries there.
	 */
	int64_t window;
};

static const struct workload workloads[] = {
	{ "default", 4, 16, 512, 32, 1, 8, 300, 1, 64, 1024,
	  KV_OP_RESHAPE_AND_CACHE, false, 0, 0 },
	{ "beam", 4, 16, 512, 16, 4, 8, 300, 1, 64, 1024,
	  KV_OP_RESHAPE_AND_CACHE_FLASH, false, 0, 0 },
	{ "swap", 2, 16, 48, 24, 1, 16, 160, 32, 128, 1024,
	  KV_OP_CPU_ATTN_RESHAPE_AND_CACHE, true, 0, 0 },
	{ "stress", 2, 16, 16384, 400, 1, 256, 4096, 16, 256, 8192,
	  KV_OP_RESHAPE_AND_CACHE_FLASH, false, 0, 0 },
	{ "mla", 2, 16, 512, 32, 1, 8, 300, 1, 64, 1024,
	  KV_OP_CONCAT_AND_CACHE_MLA, false, 0, 0 },
	/* 136 = 8.5 blocks of 16: 8 shared blocks, and a partial one that
	 * each request writes itself (only full blocks are cached, as in vLLM) */
	{ "prefix", 4, 16, 512, 24, 1, 8, 120, 1, 64, 1024,
	  KV_OP_RESHAPE_AND_CACHE, false, 136, 0 },
	/* 72 = 4.5 blocks: the window never ends on a block boundary */
	{ "window", 4, 16, 512, 32, 1, 8, 300, 1, 64, 1024,
	  KV_OP_RESHAPE_AND_CACHE, false, 0, 72 },
	/* steps of up to 131072 tokens: write ops longer than the tracer
	 * reads whole (its `truncated` counter is checked against this) */
	{ "long", 1, 16, 16384, 12, 1, 20000, 30000, 1, 2, 131072,
	  KV_OP_RESHAPE_AND_CACHE_FLASH, false, 0, 0 },
	/* production-sized: an H200's 131072 blocks, an 80-layer model, 1024
	 * requests sharing a 2048-token prefix (128 blocks each row reads),
	 * a 1024-token sliding window and a preemption every other step
	 * (PROD_PREEMPT_EVERY); a
	 * step's table is over 130k entries.  Few steps (2-4 tokens each),
	 * so a run stays seconds; only the touched KV pages are memory */
	{ "prod", 80, 16, 131072, 1024, 1, 16, 48, 2, 4, 65536,
	  KV_OP_RESHAPE_AND_CACHE_FLASH, false, 2048, 1024 },
	/* a prefix cache that evicts (kvsim_evict.c): requests, blocks and
	 * block size are read; the rest is its own */
	{ "evict", 1, 16, 24, 40, 1, 0, 0, 1, 24, 0,
	  KV_OP_RESHAPE_AND_CACHE, false, 0, 0 },
};
#define NUM_WORKLOADS (sizeof(workloads) / sizeof(workloads[0]))
#define PROD_PREEMPT_EVERY 2 /* the prod workload's --preempt-every */

struct config {
	struct workload w; /* the workload with flag overrides applied */
	uint64_t seed;
	const char *truth_path;
	bool truth_steps; /* --truth-steps: per-step read rows in the truth */
	FILE *truth_rows; /* --truth-rows: every step's rows, a JSON line each */
	/*
	 * --preempt-every N: every N steps (0: never) swap out the last
	 * admitted running request, memory pressure or not: preemption in a
	 * pool too large to fill in a few steps (the prod workload).
	 */
	int64_t preempt_every;
	bool pause, quiet, progress;
	uint64_t repeat;
	uint64_t rounds; /* each round waits for SIGUSR1, runs, rewrites the truth */
	uint64_t step_delay_us;
	int64_t cpu_blocks;
};

/* ------------------------------------------------------------------ */
/* Ground truth                                                        */

enum {
	OP_COPY_BLOCKS = KV_NUM_WRITE_OPS,
	OP_SWAP_BLOCKS,
	OP_SWAP_BLOCKS_BATCH,
	NUM_OPS
};

struct op_truth {
	uint64_t calls, slots, padding, pairs, bytes;
};

/*
 * One generation of a GPU block: from its first use (a token written at
 * offset 0, or contents received by a fork copy or a swap-in) until the
 * block's next such use.  Steps count the model steps (write_step calls)
 * before an event, so a fork copy made after step k's writes is at k + 1.
 */
enum gen_kind { GEN_WRITE, GEN_COPY, GEN_SWAP_IN };

struct gen_truth {
	int64_t block;
	int kind;
	uint64_t start_step, last_step; /* last: last write, copy or swap-out */
	int64_t inherited;              /* tokens received at the start */
	int64_t fill;                   /* tokens held (1 + last position) */
	uint64_t writes;                /* tokens written (once per step) */
};

/*
 * Reads: what attention reads at each forward step, counted once per step
 * when kvsim builds the step's block table (all layers share that table:
 * one KV-cache group), from the scheduler's own rows, never from the probe.
 * write_reads() describes every field.
 */
struct read_truth {
	uint64_t steps, requests, tokens, reads, distinct, held_tokens,
		null_entries;
	uint64_t *per_block;  /* [gpu block] (step, request) pairs reading it */
	uint64_t *last_step;  /* [gpu block] step of its last read, 0 never */
	uint64_t *sharing;    /* [degree] (step, block) pairs with that many readers */
	int64_t max_degree;   /* sharing has max_degree + 1 entries */
	uint32_t *step_count; /* [gpu block] readers at the current step */
	uint32_t *step_fill;  /* [gpu block] tokens it holds at the current step */
	int32_t *step_blocks; /* the blocks read at the current step */
	/* --truth-steps: per step {step, requests, reads, distinct, tokens,
	 * null_entries, held_tokens} */
	uint64_t (*live)[7];
	int64_t nlive, live_cap;
};

/*
 * The plugin tier's truth (write_lifecycle()): one entry per request a run
 * created, in creation order.  Each run's requests get new ids, numbered on
 * across --repeat and --rounds ("kvsim-req-N": the Nth request this process
 * created, from 0), as vLLM's request ids never repeat.
 */
struct req_truth {
	char id[32];
	uint64_t req; /* FNV-1a 64 of id: the probes' req */
	int64_t prompt_tokens, output_tokens;
	uint64_t preemptions, recomputed;
	uint64_t blocks[KV_NUM_LIFE]; /* block ids per event kind */
	/* its rows of the steps' block tables (a row per sequence), the
	 * tokens they wrote and the (row, block) reads, null entries aside */
	uint64_t step_rows, tokens_written, block_reads;
};

enum { RES_LIFETIME, RES_IDLE, RES_REUSE_GAP };

struct truth {
	uint64_t **writes;     /* [layer][block] valid slots written */
	uint64_t *token_writes; /* [block] once per step, layer-independent */
	uint64_t *copy_src, *copy_dst, *swap_out, *swap_in; /* [gpu block] */
	struct op_truth ops[NUM_OPS];
	uint64_t slots_written, padding_skipped;
	uint64_t steps, requests, preemptions, forks;
	uint64_t prefix_hits; /* (request, block) pairs taken from the prefix cache */
	uint64_t window_drops; /* (sequence, block) pairs the sliding window freed */
	uint64_t kv_mismatches;
	struct read_truth rd;

	/* lifecycle (plugin tier): per GPU block and event kind, how many
	 * times the event happened to it; probe calls per op; per request */
	uint64_t *life[KV_NUM_LIFE];
	uint64_t life_calls[KV_NUM_LIFE];
	uint64_t request_calls, preempt_calls, finish_calls, step_reqs_calls;
	/* step_rows: calls, rows and tail entries sent */
	uint64_t step_rows_calls, step_rows_rows, step_rows_tail;
	struct req_truth *reqs;
	int64_t nreqs, reqs_cap;
	/* block residency (write_lifecycle()): per GPU block, by CLOCK_MONOTONIC
	 * read as its alloc or hit probe fires: its life's birth, last access
	 * and last hit (0: none), and the samples */
	int64_t *res_born, *res_last, *res_hit;
	struct ns_list {
		int64_t *v;
		int64_t n, cap;
	} res[3]; /* RES_LIFETIME, RES_IDLE, RES_REUSE_GAP */

	/* true fill per generation, from the block manager's own view */
	struct gen_truth *gens;
	int64_t ngens, gens_cap;
	int64_t *cur_gen;   /* [gpu block] its open generation, -1 none */
	int64_t *host_fill; /* [cpu block] tokens it holds */
	int64_t *tok_gain;  /* [step] tokens gained by generations then */
	int64_t tok_gain_cap;
};

static const char *op_name(int op)
{
	switch (op) {
	case OP_COPY_BLOCKS:
		return "copy_blocks";
	case OP_SWAP_BLOCKS:
		return "swap_blocks";
	case OP_SWAP_BLOCKS_BATCH:
		return "swap_blocks_batch";
	default:
		return kv_write_op_name(op);
	}
}

/* ------------------------------------------------------------------ */
/* Block pools: a FIFO free list plus refcounts (shared prompt blocks) */

/*
 * Both pools reserve block 0 as vLLM's null block: block tables use 0 as
 * padding and for blocks a sliding window dropped, and a block-table reader
 * never counts an entry of 0 as a read, so no sequence may ever hold block
 * 0.  (The host pool too, so that 0 in a swapped-out table still means the
 * null block.)  The pool keeps a reference to it for good: it is never on
 * the free list.
 */
struct pool {
	int32_t n;
	int32_t *fifo; /* free blocks, allocated from head, freed to tail */
	int32_t head, nfree;
	uint32_t *ref;
	bool null_block; /* block 0 reserved */
};

static void pool_init(struct pool *p, int32_t n, bool null_block)
{
	p->n = n;
	p->fifo = xcalloc((size_t)n, sizeof(*p->fifo));
	p->ref = xcalloc((size_t)n, sizeof(*p->ref));
	p->null_block = null_block;
}

static void pool_reset(struct pool *p)
{
	int32_t first = p->null_block ? 1 : 0;

	for (int32_t i = 0; i < p->n; i++)
		p->ref[i] = 0;
	for (int32_t i = first; i < p->n; i++)
		p->fifo[i - first] = i;
	p->head = 0;
	p->nfree = p->n - first;
	if (p->null_block && p->n > 0)
		p->ref[0] = 1;
}

/* Blocks the pool can ever hand out. */
static int64_t pool_usable(const struct pool *p)
{
	return p->n - (p->null_block ? 1 : 0);
}

static int32_t pool_alloc(struct pool *p)
{
	if (p->nfree == 0)
		return -1;
	int32_t b = p->fifo[p->head];
	p->head = (p->head + 1) % p->n;
	p->nfree--;
	p->ref[b] = 1;
	return b;
}

static void pool_incref(struct pool *p, int32_t b)
{
	p->ref[b]++;
}

static void pool_decref(struct pool *p, int32_t b)
{
	if (p->ref[b] == 0)
		fatal("internal error: block freed twice");
	if (--p->ref[b] == 0) {
		p->fifo[(p->head + p->nfree) % p->n] = b;
		p->nfree++;
	}
}

/* ------------------------------------------------------------------ */
/* Requests and sequences                                              */

struct seq {
	int32_t *table;  /* block table: GPU blocks, or CPU blocks while swapped */
	int64_t nblocks; /* entries in use == ceil(len / block_size) */
	int64_t dropped; /* leading entries the sliding window made null */
	int64_t cap;
	int64_t len;     /* tokens written to the KV cache: positions [0, len) */
	int64_t gen;     /* tokens generated so far */
	int64_t gen_len; /* finishes when gen == gen_len */
	int sample;
	bool finished;
	uint64_t new_step;  /* 1 + the step of new_tokens */
	int64_t new_tokens; /* tokens it wrote at that step (step_reqs) */
	/* table entries step_rows last reported (0: none, or freed since);
	 * stale unless reported_epoch is the sim's rows_epoch */
	int64_t reported;
	uint64_t reported_epoch;
	/*
	 * [layer] the checksum attention must get over positions [0, len):
	 * the sum of the expected values of the tokens this sequence holds
	 * (written, shared from the prefix cache or inherited at a fork),
	 * each counted once per 8-byte word of its slot (kv_attention's sum).
	 */
	uint64_t *attn_sum;
};

enum rq_state { RQ_WAITING, RQ_RUNNING, RQ_SWAPPED, RQ_DONE };
enum sched_kind { SCHED_PREFILL, SCHED_PREFILL_LAST, SCHED_DECODE };

struct request {
	uint64_t id; /* root request id */
	int64_t prompt_len; /* the workload's common prefix included */
	int64_t prefilled; /* prompt tokens written so far (chunked prefill) */
	int nsamples;
	int nseqs; /* 1 until the fork at the end of prefill, then nsamples */
	int nlive;
	enum rq_state state;
	uint64_t sched_step; /* 1 + the step that last scheduled it, 0 never */
	enum sched_kind sched_kind;
	int64_t tr; /* its entry in the truth's reqs for this run */
	int32_t fork_blocks[MAX_SAMPLES]; /* copies of the partial block */
	int nfork_blocks;
	struct seq seqs[MAX_SAMPLES];
};

/* ------------------------------------------------------------------ */
/* Simulator state                                                     */

struct sim {
	const struct config *cfg;
	int64_t L, bs, nblocks, bpb;
	struct kv_layer gpu[MAX_LAYERS], cpu[MAX_LAYERS];
	struct pool gpool, cpool;

	/* request parameters: generated once, identical in every repeat */
	int64_t nreq;
	struct request *reqs;
	int64_t max_seq_blocks;

	/* scheduler queues (indices into reqs) */
	int64_t *running, nrunning; /* admission order; victims from the end */
	int64_t *swapped, nswapped; /* FIFO */
	int64_t next_waiting;
	int64_t done;
	uint64_t step_no;
	uint64_t rounds_done;

	/* this step's tokens (slots padded to PAD_TO) and their value keys */
	int64_t cap_tokens;
	int64_t ntok;
	int64_t *slots;
	uint64_t *tok_id; /* value key: value_key() */
	int64_t *tok_pos;
	int *tok_sample;
	struct seq **tok_seq;
	uint64_t *values;

	/*
	 * This step's block table, as the attention layers read it: one row
	 * per scheduled sequence, row_stride int32 entries apart (wider than
	 * any sequence's blocks, zero padded), and each row's seq_len.
	 */
	int64_t row_stride, max_rows, nrows;
	int32_t *table;
	int32_t *seq_lens;
	struct seq **row_seq;
	/* step_reqs' rows: each row's request hash, then its new tokens */
	uint64_t *step_rows;
	int64_t *row_new;
	/* step_rows' arrays: 5 int64 a row, and the rows' new entries */
	int64_t *delta_rows;
	/* bumped at each step_rows no tracer saw: every row is sent whole
	 * at the next (a tracer attached mid-run knows no row before it) */
	uint64_t rows_epoch;
	int32_t *delta_tail;
	bool dirty; /* a run wrote the KV buffers (calloc's are zero) */

	/*
	 * The prefix cache: [j] the GPU block holding full prefix block j, or
	 * -1.  The cache holds a reference, so its blocks live for the run:
	 * vLLM would evict an unused cached block only under memory pressure,
	 * and pinning keeps "written once" exact (generate_requests() counts
	 * the pinned blocks in its worst case).
	 */
	int64_t prefix_blocks;
	int32_t *prefix_cache;

	/*
	 * Lifecycle events waiting to fire: the block ids of one request's
	 * event per kind, batched as the plugin batches them (one probe call
	 * per request, kind and scheduler action); fired by life_flush().
	 */
	struct request *life_req;
	int32_t *life_ids[KV_NUM_LIFE];
	int64_t life_n[KV_NUM_LIFE];

	/* scratch */
	int64_t *pairs;     /* 2 * max(GPU, CPU) blocks */
	int32_t *remap;     /* block -> new block, -1 if not yet mapped */
	uint8_t *offload;   /* CPU offload buffer for swap_blocks_batch */
	uint64_t *batch_src, *batch_dst, *batch_sizes;

	struct truth t;
};

static int64_t ceil_div(int64_t a, int64_t b)
{
	return (a + b - 1) / b;
}

/* Blocks a request can hold at once, at most (all samples at full length). */
static int64_t worst_case_blocks(const struct request *r, int64_t bs)
{
	int64_t shared = r->prompt_len / bs;
	int64_t total = r->nsamples > 1 ? shared : 0;
	for (int k = 0; k < r->nsamples; k++) {
		int64_t own = ceil_div(r->prompt_len + r->seqs[k].gen_len - 1, bs);
		total += r->nsamples > 1 ? own - shared : own;
	}
	return total;
}

static void generate_requests(struct sim *s)
{
	const struct workload *w = &s->cfg->w;
	struct rng rng = { s->cfg->seed };

	s->nreq = w->requests;
	s->reqs = xcalloc((size_t)s->nreq, sizeof(*s->reqs));
	s->max_seq_blocks = 0;
	for (int64_t i = 0; i < s->nreq; i++) {
		struct request *r = &s->reqs[i];
		r->id = (uint64_t)i;
		r->prompt_len = w->prefix +
				rng_range(&rng, w->prompt_min, w->prompt_max);
		r->nsamples = (int)w->samples;
		for (int k = 0; k < r->nsamples; k++) {
			struct seq *q = &r->seqs[k];
			q->gen_len = rng_range(&rng, w->gen_min, w->gen_max);
			q->cap = ceil_div(r->prompt_len + q->gen_len - 1,
					  s->bs);
			q->table = xcalloc((size_t)q->cap, sizeof(*q->table));
			q->attn_sum = xcalloc((size_t)s->L, sizeof(uint64_t));
			if (q->cap > s->max_seq_blocks)
				s->max_seq_blocks = q->cap;
		}
		/* the prefix cache's blocks stay allocated beside it */
		int64_t worst = worst_case_blocks(r, s->bs) + s->prefix_blocks;
		if (worst > pool_usable(&s->gpool)) {
			fprintf(stderr,
				"kvsim: request %" PRId64 " may need %" PRId64
				" blocks but the pool has %" PRId64
				" besides the null block (raise --blocks)\n",
				i, worst, pool_usable(&s->gpool));
			exit(2);
		}
	}
}

/* Resets all run state (for --repeat); truth counters are kept. */
static void reset_run(struct sim *s)
{
	pool_reset(&s->gpool);
	pool_reset(&s->cpool);
	/* not before the first run: a large pool's untouched pages stay
	 * unbacked (the production-sized workload's are gigabytes) */
	for (int64_t l = 0; l < s->L && s->dirty; l++) {
		memset(s->gpu[l].bytes, 0, (size_t)(s->nblocks * s->bpb));
		memset(s->cpu[l].bytes, 0, (size_t)(s->cpool.n * s->bpb));
	}
	s->dirty = true;
	for (int64_t i = 0; i < s->nreq; i++) {
		struct request *r = &s->reqs[i];
		r->prefilled = 0;
		r->nseqs = 1;
		r->nlive = 1;
		r->state = RQ_WAITING;
		r->sched_step = 0;
		r->nfork_blocks = 0;
		for (int k = 0; k < r->nsamples; k++) {
			struct seq *q = &r->seqs[k];
			q->nblocks = q->len = q->gen = q->dropped = 0;
			q->new_step = 0;
			q->reported = 0;
			q->sample = k;
			q->finished = false;
			memset(q->attn_sum, 0, (size_t)s->L * sizeof(uint64_t));
		}
	}
	for (int64_t j = 0; j < s->prefix_blocks; j++)
		s->prefix_cache[j] = -1;
	s->nrunning = s->nswapped = 0;
	s->next_waiting = 0;
	s->done = 0;
}

static void sim_init(struct sim *s, const struct config *cfg)
{
	const struct workload *w = &cfg->w;

	memset(s, 0, sizeof(*s));
	s->cfg = cfg;
	s->L = w->layers;
	s->bs = w->block_size;
	s->nblocks = w->blocks;
	s->bpb = s->bs * KV_BYTES_PER_TOKEN;

	pool_init(&s->gpool, (int32_t)s->nblocks, true);
	pool_init(&s->cpool, (int32_t)cfg->cpu_blocks, true);
	for (int64_t l = 0; l < s->L; l++) {
		s->gpu[l] = (struct kv_layer){
			.bytes = xcalloc((size_t)s->nblocks, (size_t)s->bpb),
			.block_size = s->bs,
			.num_blocks = s->nblocks,
			.kv_bytes_per_token = KV_BYTES_PER_TOKEN,
		};
		s->cpu[l] = s->gpu[l];
		s->cpu[l].bytes = xcalloc((size_t)cfg->cpu_blocks, (size_t)s->bpb);
		s->cpu[l].num_blocks = cfg->cpu_blocks;
	}

	s->prefix_blocks = w->prefix / s->bs;
	s->prefix_cache = xcalloc((size_t)s->prefix_blocks + 1,
				  sizeof(*s->prefix_cache));
	generate_requests(s);
	s->running = xcalloc((size_t)s->nreq, sizeof(*s->running));
	s->swapped = xcalloc((size_t)s->nreq, sizeof(*s->swapped));

	s->cap_tokens = ceil_div(w->max_tokens_per_step, PAD_TO) * PAD_TO;
	s->slots = xcalloc((size_t)s->cap_tokens, sizeof(*s->slots));
	s->tok_id = xcalloc((size_t)s->cap_tokens, sizeof(*s->tok_id));
	s->tok_pos = xcalloc((size_t)s->cap_tokens, sizeof(*s->tok_pos));
	s->tok_sample = xcalloc((size_t)s->cap_tokens, sizeof(*s->tok_sample));
	s->tok_seq = xcalloc((size_t)s->cap_tokens, sizeof(*s->tok_seq));
	s->values = xcalloc((size_t)s->cap_tokens, sizeof(*s->values));

	/*
	 * Every scheduled sequence has a token in the step, so a step has at
	 * most max_tokens_per_step rows.  The stride is rounded up past the
	 * longest row, so that readers must use the stride, not the row length.
	 */
	s->row_stride = (s->max_seq_blocks / 16 + 1) * 16;
	s->max_rows = s->nreq * w->samples;
	if (s->max_rows > w->max_tokens_per_step)
		s->max_rows = w->max_tokens_per_step;
	s->table = xcalloc((size_t)(s->max_rows * s->row_stride),
			   sizeof(*s->table));
	s->seq_lens = xcalloc((size_t)s->max_rows, sizeof(*s->seq_lens));
	s->row_seq = xcalloc((size_t)s->max_rows, sizeof(*s->row_seq));
	s->step_rows = xcalloc((size_t)(2 * s->max_rows), sizeof(*s->step_rows));
	s->row_new = xcalloc((size_t)s->max_rows, sizeof(*s->row_new));
	s->delta_rows = xcalloc((size_t)(5 * s->max_rows), sizeof(*s->delta_rows));
	s->delta_tail = xcalloc((size_t)(s->max_rows * s->row_stride + 1),
				sizeof(*s->delta_tail));

	int64_t maxb = s->nblocks > cfg->cpu_blocks ? s->nblocks : cfg->cpu_blocks;
	s->pairs = xcalloc((size_t)(2 * maxb), sizeof(*s->pairs));
	s->remap = xcalloc((size_t)maxb, sizeof(*s->remap));
	for (int64_t i = 0; i < maxb; i++)
		s->remap[i] = -1;

	/* The offload area holds one finished sequence, layer-major. */
	int64_t entries = s->L * s->max_seq_blocks;
	s->offload = xcalloc((size_t)entries, (size_t)s->bpb);
	s->batch_src = xcalloc((size_t)entries, sizeof(uint64_t));
	s->batch_dst = xcalloc((size_t)entries, sizeof(uint64_t));
	s->batch_sizes = xcalloc((size_t)entries, sizeof(uint64_t));

	struct truth *t = &s->t;
	t->writes = xcalloc((size_t)s->L, sizeof(*t->writes));
	for (int64_t l = 0; l < s->L; l++)
		t->writes[l] = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	t->token_writes = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	t->cur_gen = xcalloc((size_t)s->nblocks, sizeof(*t->cur_gen));
	for (int64_t b = 0; b < s->nblocks; b++)
		t->cur_gen[b] = -1;
	t->host_fill = xcalloc((size_t)cfg->cpu_blocks, sizeof(*t->host_fill));
	t->copy_src = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	t->copy_dst = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	t->swap_out = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	t->swap_in = xcalloc((size_t)s->nblocks, sizeof(uint64_t));

	for (int k = 0; k < KV_NUM_LIFE; k++) {
		t->life[k] = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
		s->life_ids[k] = xcalloc((size_t)s->nblocks, sizeof(int32_t));
	}
	t->res_born = xcalloc((size_t)s->nblocks, sizeof(int64_t));
	t->res_last = xcalloc((size_t)s->nblocks, sizeof(int64_t));
	t->res_hit = xcalloc((size_t)s->nblocks, sizeof(int64_t));

	struct read_truth *rd = &t->rd;
	rd->per_block = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	rd->last_step = xcalloc((size_t)s->nblocks, sizeof(uint64_t));
	rd->max_degree = s->max_rows;
	rd->sharing = xcalloc((size_t)rd->max_degree + 1, sizeof(uint64_t));
	rd->step_count = xcalloc((size_t)s->nblocks, sizeof(uint32_t));
	rd->step_fill = xcalloc((size_t)s->nblocks, sizeof(uint32_t));
	rd->step_blocks = xcalloc((size_t)s->nblocks, sizeof(int32_t));
}

/* ------------------------------------------------------------------ */
/* Generations (true fill): the block manager's own bookkeeping         */

static void tok_gain(struct sim *s, uint64_t step, int64_t n)
{
	struct truth *t = &s->t;
	if ((int64_t)step >= t->tok_gain_cap) {
		int64_t cap = t->tok_gain_cap ? t->tok_gain_cap : 1024;
		while (cap <= (int64_t)step)
			cap *= 2;
		t->tok_gain = realloc(t->tok_gain, (size_t)cap * sizeof(int64_t));
		if (!t->tok_gain)
			fatal("out of memory");
		memset(t->tok_gain + t->tok_gain_cap, 0,
		       (size_t)(cap - t->tok_gain_cap) * sizeof(int64_t));
		t->tok_gain_cap = cap;
	}
	t->tok_gain[step] += n;
}

static void gen_open(struct sim *s, int64_t block, int kind, uint64_t step,
		     int64_t inherited)
{
	struct truth *t = &s->t;
	if (t->ngens == t->gens_cap) {
		t->gens_cap = t->gens_cap ? 2 * t->gens_cap : 1024;
		t->gens = realloc(t->gens, (size_t)t->gens_cap * sizeof(*t->gens));
		if (!t->gens)
			fatal("out of memory");
	}
	t->gens[t->ngens] = (struct gen_truth){
		.block = block, .kind = kind, .start_step = step,
		.last_step = step, .inherited = inherited, .fill = inherited,
	};
	t->cur_gen[block] = t->ngens++;
	tok_gain(s, step, inherited);
}

/* The open generation of a GPU block (it must have one). */
static struct gen_truth *gen_of(struct sim *s, int64_t block)
{
	if (s->t.cur_gen[block] < 0)
		fatal("internal error: block used before its first write");
	return &s->t.gens[s->t.cur_gen[block]];
}

static void gen_touch(struct gen_truth *g, uint64_t step)
{
	if (step > g->last_step)
		g->last_step = step;
}

/* ------------------------------------------------------------------ */
/* Lifecycle events (the plugin tier's probes) and their truth          */

/* FNV-1a 64 of n bytes: a request's req (bpf/kvtrace_probes.h). */
static uint64_t fnv1a64(const char *p, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < n; i++) {
		h ^= (uint8_t)p[i];
		h *= 0x100000001b3ULL;
	}
	return h;
}

/*
 * Event kind of request r happened to GPU block b: counted in the truth
 * here, where the scheduler decides it, and batched with r's other blocks
 * of that kind until life_flush() fires them.
 */
static void life_add(struct sim *s, struct request *r, int kind, int32_t b)
{
	if (s->life_req && s->life_req != r)
		fatal("internal error: lifecycle events of two requests in a batch");
	if (s->life_n[kind] >= s->nblocks || b <= 0 || b >= s->nblocks)
		fatal("internal error: lifecycle batch");
	s->life_req = r;
	s->life_ids[kind][s->life_n[kind]++] = b;
	s->t.life[kind][b]++;
	s->t.reqs[r->tr].blocks[kind]++;
}

static void res_sample(struct truth *t, int which, int64_t ns)
{
	struct ns_list *l = &t->res[which];
	if (l->n == l->cap) {
		l->cap = l->cap ? 2 * l->cap : 1024;
		l->v = realloc(l->v, (size_t)l->cap * sizeof(*l->v));
		if (!l->v)
			fatal("out of memory");
	}
	l->v[l->n++] = ns;
}

/*
 * Block residency as vLLM's KVCacheMetricsCollector defines it: a block's
 * life begins when the pool hands it out (alloc) and ends when the pool
 * hands it out again; its accesses are that alloc and each prefix hit.
 * lifetime = the next alloc - this one; idle = the next alloc - the last
 * access; a reuse gap is the time between two hits of one life (the alloc
 * is not a hit).  A block first seen by a hit has no known birth.
 */
static void res_event(struct truth *t, int kind, const int32_t *ids, int64_t n,
		      int64_t now)
{
	for (int64_t i = 0; i < n; i++) {
		int32_t b = ids[i];
		if (kind == KV_LIFE_ALLOC) {
			if (t->res_last[b]) {
				if (t->res_born[b])
					res_sample(t, RES_LIFETIME, now - t->res_born[b]);
				res_sample(t, RES_IDLE, now - t->res_last[b]);
			}
			t->res_born[b] = t->res_last[b] = now;
			t->res_hit[b] = 0;
		} else if (kind == KV_LIFE_HIT) {
			if (t->res_hit[b])
				res_sample(t, RES_REUSE_GAP, now - t->res_hit[b]);
			t->res_last[b] = t->res_hit[b] = now;
		}
	}
}

/* Fires the batched events, one probe call per kind, in kind order. */
static void life_flush(struct sim *s)
{
	for (int k = 0; k < KV_NUM_LIFE; k++) {
		if (!s->life_n[k])
			continue;
		/* the clock as close to the probe as kvsim can read it: a
		 * tracer's timestamp comes microseconds later */
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		res_event(&s->t, k, s->life_ids[k], s->life_n[k],
			  (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec);
		kv_block_event(k, s->t.reqs[s->life_req->tr].req, 0,
			       s->life_ids[k], s->life_n[k], s->nblocks);
		s->t.life_calls[k]++;
		s->life_n[k] = 0;
	}
	s->life_req = NULL;
}

/*
 * Whether a live sequence of r other than q still holds GPU block b: a
 * request's samples share their prompt blocks, and the request releases a
 * block (block_free) when its last sequence holding it lets go.
 */
static bool others_hold(const struct request *r, const struct seq *q,
			int32_t b)
{
	for (int k = 0; k < r->nseqs; k++) {
		const struct seq *o = &r->seqs[k];
		if (o == q || o->finished)
			continue;
		for (int64_t j = o->dropped; j < o->nblocks; j++)
			if (o->table[j] == b)
				return true;
	}
	return false;
}

/* A run's new request: named (its id and req), counted, probe fired. */
static void request_start(struct sim *s, struct request *r)
{
	struct truth *t = &s->t;

	if (t->nreqs == t->reqs_cap) {
		t->reqs_cap = t->reqs_cap ? 2 * t->reqs_cap : 256;
		t->reqs = realloc(t->reqs, (size_t)t->reqs_cap * sizeof(*t->reqs));
		if (!t->reqs)
			fatal("out of memory");
	}
	struct req_truth *rt = &t->reqs[t->nreqs];
	memset(rt, 0, sizeof(*rt));
	int len = snprintf(rt->id, sizeof(rt->id), "kvsim-req-%" PRId64,
			   t->nreqs);
	rt->req = fnv1a64(rt->id, (size_t)len);
	rt->prompt_tokens = r->prompt_len;
	r->tr = t->nreqs++;
	kv_request(rt->req, rt->id, len, r->prompt_len);
	t->request_calls++;
}

/*
 * Tokens r has computed (in the KV cache): its prompt so far (prefix hits
 * included, as vLLM's num_computed_tokens), and each live sequence's
 * tokens beyond the prompt.
 */
static int64_t computed_tokens(const struct request *r)
{
	int64_t n = r->prefilled;

	for (int k = 0; k < r->nseqs; k++) {
		const struct seq *q = &r->seqs[k];
		if (!q->finished && q->len > r->prompt_len)
			n += q->len - r->prompt_len;
	}
	return n;
}

/* ------------------------------------------------------------------ */
/* Sequences: allocation, token emission, verification                 */

static int sample_at(const struct request *r, const struct seq *q, int64_t pos)
{
	return pos < r->prompt_len ? 0 : q->sample;
}

/* Not a request id: the key of the workload's common prefix. */
#define PREFIX_KEY UINT64_MAX

/*
 * The request key of a token's value: the common prefix has one key for all
 * requests, so a request that shares the cached prefix blocks expects the
 * values another request wrote there.
 */
static uint64_t value_key(const struct sim *s, const struct request *r,
			  int64_t pos)
{
	return pos < s->cfg->w.prefix ? PREFIX_KEY : r->id;
}

/* kv_attention's checksum terms for one token: its value in every word. */
#define WORDS_PER_TOKEN (KV_BYTES_PER_TOKEN / 8)
_Static_assert(KV_BYTES_PER_TOKEN % 8 == 0, "whole words per slot");

/*
 * A full prefix block has just been scheduled for writing (its last token
 * emitted): cache it, unless the cache has that block already.  Blocks
 * written in a step are readable by any request scheduled in the same step:
 * all writes of a layer precede its attention.
 */
static void prefix_cache_put(struct sim *s, struct request *r, int64_t pos,
			     int32_t block)
{
	int64_t j = pos / s->bs;

	if (j >= s->prefix_blocks || pos % s->bs != s->bs - 1 ||
	    s->prefix_cache[j] >= 0)
		return;
	s->prefix_cache[j] = block;
	pool_incref(&s->gpool, block);
	life_add(s, r, KV_LIFE_CACHE, block); /* now shareable */
}

/*
 * Prefix blocks a new request can take from the cache: the leading cached
 * ones, and never the whole prompt (the last prompt token is always
 * computed, as in vLLM, to sample the first token from).
 */
static int64_t prefix_cache_hits(const struct sim *s, const struct request *r)
{
	int64_t n = 0, most = (r->prompt_len - 1) / s->bs;

	while (n < s->prefix_blocks && n < most && s->prefix_cache[n] >= 0)
		n++;
	return n;
}

/* Gives a new request its cached prefix blocks (before its first chunk). */
static void prefix_cache_take(struct sim *s, struct request *r, int64_t hits)
{
	struct seq *q = &r->seqs[0];

	for (int64_t j = 0; j < hits; j++) {
		q->table[j] = s->prefix_cache[j];
		pool_incref(&s->gpool, s->prefix_cache[j]);
	}
	q->nblocks = hits;
	q->len = r->prefilled = hits * s->bs;
}

/* Undoes prefix_cache_take() for a request that could not be admitted. */
static void prefix_cache_untake(struct sim *s, struct request *r)
{
	struct seq *q = &r->seqs[0];

	for (int64_t j = 0; j < q->nblocks; j++)
		pool_decref(&s->gpool, q->table[j]);
	q->nblocks = q->len = r->prefilled = 0;
}

/* An admitted request's prefix hits: counted, and its checksum primed. */
static void prefix_cache_commit(struct sim *s, struct request *r)
{
	struct seq *q = &r->seqs[0];

	s->t.prefix_hits += (uint64_t)q->nblocks;
	for (int64_t j = 0; j < q->nblocks; j++)
		life_add(s, r, KV_LIFE_HIT, q->table[j]);
	life_flush(s);
	for (int64_t l = 0; l < s->L; l++)
		for (int64_t pos = 0; pos < q->len; pos++)
			q->attn_sum[l] += WORDS_PER_TOKEN *
					  kv_value(PREFIX_KEY, 0, pos, l);
}

/* Appends the token at q->len to this step's slot array. */
static void emit_token(struct sim *s, struct request *r, struct seq *q)
{
	int64_t pos = q->len;

	if (pos / s->bs >= q->nblocks) {
		if (q->nblocks >= q->cap)
			fatal("internal error: block table overflow");
		int32_t b = pool_alloc(&s->gpool);
		if (b < 0)
			fatal("internal error: allocation not reserved");
		q->table[q->nblocks++] = b;
		life_add(s, r, KV_LIFE_ALLOC, b);
	}
	if (s->ntok >= s->cap_tokens)
		fatal("internal error: step token budget overflow");

	int64_t block = q->table[pos / s->bs];
	int64_t i = s->ntok++;
	s->slots[i] = block * s->bs + pos % s->bs;
	s->tok_id[i] = value_key(s, r, pos);
	s->tok_pos[i] = pos;
	s->tok_sample[i] = sample_at(r, q, pos);
	s->tok_seq[i] = q;
	if (q->new_step != s->step_no + 1) {
		q->new_step = s->step_no + 1;
		q->new_tokens = 0;
	}
	q->new_tokens++;
	prefix_cache_put(s, r, pos, (int32_t)block);
	s->t.token_writes[block]++;
	if (pos % s->bs == 0)
		gen_open(s, block, GEN_WRITE, s->step_no, 0);
	struct gen_truth *g = gen_of(s, block);
	g->writes++;
	gen_touch(g, s->step_no);
	if (pos % s->bs + 1 > g->fill) {
		tok_gain(s, s->step_no, pos % s->bs + 1 - g->fill);
		g->fill = pos % s->bs + 1;
	}
	q->len++;
}

/* Counts a KV mismatch of every (token, layer) whose bytes are wrong. */
static void verify_seq(struct sim *s, const struct request *r,
		       const struct seq *q)
{
	uint8_t want[KV_BYTES_PER_TOKEN];

	/* tokens the window dropped were checked by attention while held */
	for (int64_t pos = q->dropped * s->bs; pos < q->len; pos++) {
		int64_t slot = (int64_t)q->table[pos / s->bs] * s->bs + pos % s->bs;
		for (int64_t l = 0; l < s->L; l++) {
			uint64_t v = kv_value(value_key(s, r, pos),
					      sample_at(r, q, pos), pos, l);
			for (int off = 0; off < KV_BYTES_PER_TOKEN; off += 8)
				memcpy(want + off, &v, 8);
			if (memcmp(s->gpu[l].bytes + slot * KV_BYTES_PER_TOKEN,
				   want, KV_BYTES_PER_TOKEN) != 0)
				s->t.kv_mismatches++;
		}
	}
}

/* Offloads a finished sequence's blocks with one swap_blocks_batch call. */
static void offload_seq(struct sim *s, const struct seq *q)
{
	int64_t n = 0;

	for (int64_t l = 0; l < s->L; l++) {
		for (int64_t j = q->dropped; j < q->nblocks; j++, n++) {
			s->batch_src[n] = (uint64_t)(uintptr_t)(
				s->gpu[l].bytes + (int64_t)q->table[j] * s->bpb);
			s->batch_dst[n] = (uint64_t)(uintptr_t)(
				s->offload + (l * q->nblocks + j) * s->bpb);
			s->batch_sizes[n] = (uint64_t)s->bpb;
		}
	}
	kv_swap_blocks_batch(s->batch_src, s->batch_dst, s->batch_sizes, n);

	struct op_truth *o = &s->t.ops[OP_SWAP_BLOCKS_BATCH];
	o->calls++;
	o->pairs += (uint64_t)n;
	for (int64_t i = 0; i < n; i++) {
		o->bytes += s->batch_sizes[i];
		if (memcmp((void *)(uintptr_t)s->batch_dst[i],
			   (void *)(uintptr_t)s->batch_src[i],
			   (size_t)s->batch_sizes[i]) != 0)
			s->t.kv_mismatches++;
	}
}

static void finish_seq(struct sim *s, struct request *r, struct seq *q)
{
	if (q->len != r->prompt_len + q->gen_len - 1)
		fatal("internal error: finished sequence has the wrong length");
	verify_seq(s, r, q);
	if (s->cfg->w.offload_on_finish)
		offload_seq(s, q);
	for (int64_t j = q->dropped; j < q->nblocks; j++) {
		pool_decref(&s->gpool, q->table[j]);
		if (!others_hold(r, q, q->table[j]))
			life_add(s, r, KV_LIFE_FREE, q->table[j]);
	}
	life_flush(s);
	q->nblocks = 0;
	q->finished = true;
	if (--r->nlive == 0) {
		struct req_truth *rt = &s->t.reqs[r->tr];
		r->state = RQ_DONE;
		s->done++;
		s->t.requests++;
		rt->output_tokens = 0;
		for (int k = 0; k < r->nsamples; k++)
			rt->output_tokens += r->seqs[k].gen;
		kv_req_finish(rt->req, rt->output_tokens);
		s->t.finish_calls++;
	}
}

/* ------------------------------------------------------------------ */
/* Fork (parallel sampling) and swapping                               */

/*
 * After prefill, a request with n samples forks into n sequences.  Full
 * prompt blocks are shared (refcount); each extra sample gets its own copy of
 * the last, partial block (reserved in fork_blocks when the last prefill
 * chunk was scheduled), copied with one copy_blocks call per layer.
 */
static void fork_request(struct sim *s, struct request *r)
{
	struct seq *parent = &r->seqs[0];
	int64_t full = r->prompt_len / s->bs;
	bool partial = r->prompt_len % s->bs != 0;
	int64_t npairs = 0;

	for (int k = 1; k < r->nsamples; k++) {
		struct seq *q = &r->seqs[k];
		for (int64_t j = 0; j < full; j++) {
			q->table[j] = parent->table[j];
			if (j >= parent->dropped) /* not the null block */
				pool_incref(&s->gpool, parent->table[j]);
		}
		q->nblocks = full;
		q->dropped = parent->dropped;
		if (partial) {
			int32_t dst = r->fork_blocks[k - 1];
			q->table[q->nblocks++] = dst;
			s->pairs[2 * npairs] = parent->table[full];
			s->pairs[2 * npairs + 1] = dst;
			npairs++;
		}
		q->len = parent->len;
		/* the same prompt values: shared blocks and the copied one */
		memcpy(q->attn_sum, parent->attn_sum,
		       (size_t)s->L * sizeof(uint64_t));
	}
	r->nfork_blocks = 0;
	r->nseqs = r->nlive = r->nsamples;
	s->t.forks++;

	if (npairs == 0)
		return; /* prompt ends on a block boundary: nothing to copy */
	for (int64_t l = 0; l < s->L; l++)
		kv_copy_blocks(&s->gpu[l], s->pairs, npairs);

	struct op_truth *o = &s->t.ops[OP_COPY_BLOCKS];
	o->calls += (uint64_t)s->L;
	o->pairs += (uint64_t)(npairs * s->L);
	o->bytes += (uint64_t)(npairs * s->L * s->bpb);
	for (int64_t i = 0; i < npairs; i++) {
		s->t.copy_src[s->pairs[2 * i]] += (uint64_t)s->L;
		s->t.copy_dst[s->pairs[2 * i + 1]] += (uint64_t)s->L;
		/* after this step's writes: the next step's clock */
		struct gen_truth *src = gen_of(s, s->pairs[2 * i]);
		gen_touch(src, s->step_no + 1);
		gen_open(s, s->pairs[2 * i + 1], GEN_COPY, s->step_no + 1,
			 src->fill);
	}
}

/* Blocks a request's live sequences reference, each shared block once. */
static int64_t unique_blocks(struct sim *s, const struct request *r)
{
	int64_t n = 0;

	for (int k = 0; k < r->nseqs; k++) {
		const struct seq *q = &r->seqs[k];
		if (q->finished)
			continue;
		for (int64_t j = q->dropped; j < q->nblocks; j++) {
			if (s->remap[q->table[j]] == -1) {
				s->remap[q->table[j]] = 0;
				s->pairs[n++] = q->table[j];
			}
		}
	}
	for (int64_t i = 0; i < n; i++)
		s->remap[s->pairs[i]] = -1;
	return n;
}

/*
 * Moves all of a request's blocks from one pool to the other, keeping
 * sharing: each distinct block is copied once and the tables are rewritten.
 * Builds the (src, dst) pairs in s->pairs and returns how many.
 */
static int64_t move_request_blocks(struct sim *s, struct request *r,
				   struct pool *from, struct pool *to)
{
	int64_t npairs = 0;

	for (int k = 0; k < r->nseqs; k++) {
		struct seq *q = &r->seqs[k];
		if (q->finished)
			continue;
		for (int64_t j = q->dropped; j < q->nblocks; j++) {
			int32_t src = q->table[j];
			int32_t dst = s->remap[src];
			if (dst == -1) {
				dst = pool_alloc(to);
				if (dst < 0 && to == &s->cpool)
					fatal("CPU swap pool exhausted");
				if (dst < 0)
					fatal("internal error: swap-in not reserved");
				s->remap[src] = dst;
				s->pairs[2 * npairs] = src;
				s->pairs[2 * npairs + 1] = dst;
				npairs++;
			} else {
				pool_incref(to, dst);
			}
			pool_decref(from, src);
			q->table[j] = dst;
		}
	}
	for (int64_t i = 0; i < npairs; i++)
		s->remap[s->pairs[2 * i]] = -1;
	return npairs;
}

static void record_swap(struct sim *s, int64_t npairs, int direction)
{
	struct op_truth *o = &s->t.ops[OP_SWAP_BLOCKS];

	for (int64_t l = 0; l < s->L; l++)
		kv_swap_blocks(&s->gpu[l], &s->cpu[l], s->pairs, npairs,
			       direction);
	o->calls += (uint64_t)s->L;
	o->pairs += (uint64_t)(npairs * s->L);
	o->bytes += (uint64_t)(npairs * s->L * s->bpb);
	for (int64_t i = 0; i < npairs; i++) {
		int64_t src = s->pairs[2 * i], dst = s->pairs[2 * i + 1];
		if (direction == KV_SWAP_OUT) {
			s->t.swap_out[src] += (uint64_t)s->L;
			struct gen_truth *g = gen_of(s, src);
			gen_touch(g, s->step_no);
			s->t.host_fill[dst] = g->fill;
		} else {
			s->t.swap_in[dst] += (uint64_t)s->L;
			gen_open(s, dst, GEN_SWAP_IN, s->step_no,
				 s->t.host_fill[src]);
		}
	}
}

/* Preempts the most recently admitted running request by swapping it out. */
static void preempt_last(struct sim *s)
{
	struct request *r = &s->reqs[s->running[--s->nrunning]];

	if (r->nfork_blocks)
		fatal("internal error: preempting a request with a pending fork");
	struct req_truth *rt = &s->t.reqs[r->tr];
	int64_t computed = computed_tokens(r);
	rt->preemptions++;
	rt->recomputed += (uint64_t)computed;
	kv_req_preempt(rt->req, computed);
	s->t.preempt_calls++;
	int64_t npairs = move_request_blocks(s, r, &s->gpool, &s->cpool);
	record_swap(s, npairs, KV_SWAP_OUT);
	/* its rows now hold host blocks: step_rows sends them whole again */
	for (int k = 0; k < r->nseqs; k++)
		r->seqs[k].reported = 0;
	/* the request's GPU blocks, each once (pairs: distinct sources) */
	for (int64_t i = 0; i < npairs; i++)
		life_add(s, r, KV_LIFE_FREE, (int32_t)s->pairs[2 * i]);
	life_flush(s);
	r->state = RQ_SWAPPED;
	s->swapped[s->nswapped++] = r - s->reqs;
	s->t.preemptions++;
}

/* Swaps swapped requests back in, oldest first, while blocks allow. */
static void swap_in_ready(struct sim *s)
{
	while (s->nswapped > 0) {
		struct request *r = &s->reqs[s->swapped[0]];
		/*
		 * Keep room for one decode block per sequence when others are
		 * running, so a swapped-in request is not evicted at once.
		 */
		int64_t need = unique_blocks(s, r) + (s->nrunning ? r->nlive : 0);
		if (s->gpool.nfree < need)
			break;
		int64_t npairs = move_request_blocks(s, r, &s->cpool, &s->gpool);
		/* new GPU blocks for it, then its contents copied in */
		for (int64_t i = 0; i < npairs; i++)
			life_add(s, r, KV_LIFE_ALLOC, (int32_t)s->pairs[2 * i + 1]);
		life_flush(s);
		record_swap(s, npairs, KV_SWAP_IN);
		r->state = RQ_RUNNING;
		s->running[s->nrunning++] = s->swapped[0];
		memmove(s->swapped, s->swapped + 1,
			(size_t)(--s->nswapped) * sizeof(*s->swapped));
	}
}

/* ------------------------------------------------------------------ */
/* Scheduling                                                          */

/* New GPU blocks a prefill chunk needs, including the fork's copies. */
static int64_t prefill_blocks(const struct sim *s, const struct request *r,
			      int64_t chunk)
{
	int64_t end = r->prefilled + chunk;
	int64_t need = ceil_div(end, s->bs) - r->seqs[0].nblocks;

	if (end == r->prompt_len && r->nsamples > 1 && r->prompt_len % s->bs)
		need += r->nsamples - 1;
	return need;
}

static int64_t decode_blocks(const struct sim *s, const struct request *r)
{
	int64_t need = 0;

	for (int k = 0; k < r->nseqs; k++) {
		const struct seq *q = &r->seqs[k];
		if (!q->finished && q->len == q->nblocks * s->bs)
			need++;
	}
	return need;
}

static void schedule_prefill(struct sim *s, struct request *r, int64_t chunk)
{
	struct seq *q = &r->seqs[0];

	for (int64_t i = 0; i < chunk; i++)
		emit_token(s, r, q);
	r->prefilled += chunk;
	r->sched_step = s->step_no + 1;
	r->sched_kind = SCHED_PREFILL;
	if (r->prefilled < r->prompt_len) {
		life_flush(s);
		return;
	}
	r->sched_kind = SCHED_PREFILL_LAST;
	if (r->nsamples > 1 && r->prompt_len % s->bs) {
		/* reserve the fork's partial-block copies now */
		for (int k = 1; k < r->nsamples; k++) {
			int32_t b = pool_alloc(&s->gpool);
			r->fork_blocks[r->nfork_blocks++] = b;
			life_add(s, r, KV_LIFE_ALLOC, b);
		}
	}
	life_flush(s);
}

static void schedule_decode(struct sim *s, struct request *r)
{
	for (int k = 0; k < r->nseqs; k++)
		if (!r->seqs[k].finished)
			emit_token(s, r, &r->seqs[k]);
	life_flush(s);
	r->sched_step = s->step_no + 1;
	r->sched_kind = SCHED_DECODE;
}

/*
 * The sliding window: frees, in every running sequence, the blocks whose
 * tokens all lie more than window positions behind its end, and puts the
 * null block in their place.  Run between steps, so that a block written
 * in a step (a long prefill chunk) is read by that step's attention first.
 */
static void drop_out_of_window(struct sim *s)
{
	const int64_t window = s->cfg->w.window;

	if (window <= 0)
		return;
	for (int64_t i = 0; i < s->nrunning; i++) {
		struct request *r = &s->reqs[s->running[i]];
		for (int k = 0; k < r->nseqs; k++) {
			struct seq *q = &r->seqs[k];
			int64_t keep_from = q->len - window; /* first position kept */
			if (q->finished || keep_from <= 0)
				continue;
			for (; (q->dropped + 1) * s->bs <= keep_from; q->dropped++) {
				int64_t j = q->dropped;
				for (int64_t pos = j * s->bs; pos < (j + 1) * s->bs;
				     pos++)
					for (int64_t l = 0; l < s->L; l++)
						q->attn_sum[l] -=
							WORDS_PER_TOKEN *
							kv_value(value_key(s, r, pos),
								 sample_at(r, q, pos),
								 pos, l);
				pool_decref(&s->gpool, q->table[j]);
				if (!others_hold(r, q, q->table[j]))
					life_add(s, r, KV_LIFE_FREE, q->table[j]);
				q->table[j] = 0;
				s->t.window_drops++;
			}
		}
		life_flush(s);
	}
}

/*
 * Builds this step's token list: swap-ins first, then every running request
 * (continuing prefill chunks, or one decode token per live sequence), then new
 * prefills from the waiting queue, all within max_tokens_per_step.  When a
 * running request cannot get its blocks, the most recently admitted running
 * request is swapped out (possibly the request itself), as vLLM does.
 */
static void schedule_step(struct sim *s)
{
	int64_t budget = s->cfg->w.max_tokens_per_step;

	s->ntok = 0;
	drop_out_of_window(s);
	swap_in_ready(s);
	if (s->cfg->preempt_every && s->step_no &&
	    s->step_no % (uint64_t)s->cfg->preempt_every == 0 && s->nrunning > 1)
		preempt_last(s);

	for (int64_t i = 0; i < s->nrunning; i++) {
		struct request *r = &s->reqs[s->running[i]];
		bool prefill = r->prefilled < r->prompt_len;
		int64_t chunk = 0, need;

		if (prefill) {
			chunk = r->prompt_len - r->prefilled;
			if (chunk > budget)
				chunk = budget;
			if (chunk == 0)
				continue;
			need = prefill_blocks(s, r, chunk);
		} else {
			if (budget < r->nlive)
				continue;
			need = decode_blocks(s, r);
		}
		/* victims come from the end: never an already scheduled one */
		while (s->gpool.nfree < need && s->nrunning - 1 > i)
			preempt_last(s);
		if (s->gpool.nfree < need) {
			preempt_last(s); /* the request itself */
			break;
		}
		if (prefill) {
			schedule_prefill(s, r, chunk);
			budget -= chunk;
		} else {
			schedule_decode(s, r);
			budget -= r->nlive;
		}
	}

	/* New prefills wait while anything is swapped out. */
	while (s->nswapped == 0 && s->next_waiting < s->nreq && budget > 0) {
		struct request *r = &s->reqs[s->next_waiting];
		prefix_cache_take(s, r, prefix_cache_hits(s, r));
		int64_t chunk = r->prompt_len - r->prefilled;
		if (chunk > budget)
			chunk = budget;
		if (s->gpool.nfree < prefill_blocks(s, r, chunk)) {
			prefix_cache_untake(s, r);
			break;
		}
		prefix_cache_commit(s, r);
		r->state = RQ_RUNNING;
		s->running[s->nrunning++] = s->next_waiting++;
		schedule_prefill(s, r, chunk);
		budget -= chunk;
	}
}

/*
 * step_rows (bpf/kvtrace_probes.h): the step's rows as deltas, each row's
 * entries since its last report, from the sequences' own tables.  A
 * request's row is one sequence's, so only workloads of one sample a
 * request fire it (vLLM's scheduler runs no request with several).  Entries
 * the sliding window nulls were reported before and their block_free fired;
 * a swapped-out sequence is reported whole again (preempt_last()).
 * --truth-rows writes the rows as the sequences hold them, a JSON line:
 * {"step": N, "rows": [[req, seq_len, new_tokens, [entries]], ...]}.
 */
static void fire_step_rows(struct sim *s, uint64_t step)
{
	int64_t nt = 0;
	FILE *f = s->cfg->truth_rows;

	if (s->cfg->w.samples != 1)
		return;
	for (int64_t i = 0; i < s->nrows; i++) {
		struct seq *q = s->row_seq[i];
		int64_t *r = s->delta_rows + 5 * i;
		int64_t from = q->reported_epoch == s->rows_epoch &&
			       q->reported <= q->nblocks ? q->reported : 0;
		r[0] = (int64_t)s->step_rows[i];
		r[1] = q->len;
		r[2] = s->row_new[i];
		r[3] = q->nblocks;
		r[4] = from;
		for (int64_t j = from; j < q->nblocks; j++)
			s->delta_tail[nt++] = q->table[j];
		q->reported = q->nblocks;
		q->reported_epoch = s->rows_epoch;
	}
	s->delta_tail[nt] = 0; /* the padding to whole 8-byte words */
	if (kv_step_rows(s->delta_rows, s->nrows, s->delta_tail, nt, 0, s->bs,
			 s->nblocks)) {
		s->t.step_rows_calls++;
		s->t.step_rows_rows += (uint64_t)s->nrows;
		s->t.step_rows_tail += (uint64_t)nt;
	} else {
		s->rows_epoch++;
	}
	if (!f)
		return;
	fprintf(f, "{\"step\": %" PRIu64 ", \"rows\": [", step);
	for (int64_t i = 0; i < s->nrows; i++) {
		const struct seq *q = s->row_seq[i];
		fprintf(f, "%s[%" PRIu64 ", %" PRId64 ", %" PRId64 ", [", i ? ", " : "",
			s->step_rows[i], q->len, s->row_new[i]);
		for (int64_t j = 0; j < q->nblocks; j++)
			fprintf(f, j ? ",%d" : "%d", q->table[j]);
		fputs("]]", f);
	}
	fputs("]}\n", f);
}

/* One row of per-step read figures (--truth-steps). */
static void live_push(struct read_truth *rd, const uint64_t row[7])
{
	if (rd->nlive == rd->live_cap) {
		rd->live_cap = rd->live_cap ? 2 * rd->live_cap : 1024;
		rd->live = realloc(rd->live, (size_t)rd->live_cap * sizeof(*rd->live));
		if (!rd->live)
			fatal("out of memory");
	}
	memcpy(rd->live[rd->nlive++], row, sizeof(*rd->live));
}

/*
 * Builds this step's block table from the scheduler's books, the rows that
 * every layer's attention reads: one per sequence scheduled at this step (a
 * prefill chunk or a decode token), in scheduling order, with seq_len = the
 * tokens it holds once this step's writes are done.  Only the first
 * ceil(seq_len / block_size) entries of a row are read; the rest of the row
 * is null-block padding.  Counts the step's reads into the truth here, from
 * the same rows, once per step (not per layer).
 */
static void build_block_table(struct sim *s)
{
	struct read_truth *rd = &s->t.rd;
	uint64_t step = s->step_no + 1; /* steps count from 1 (see write_truth) */
	uint64_t reads = 0, tokens = 0, nulls = 0, held = 0;
	int64_t ndistinct = 0;

	s->nrows = 0;
	for (int64_t i = 0; i < s->nrunning; i++) {
		struct request *r = &s->reqs[s->running[i]];
		if (r->sched_step != s->step_no + 1)
			continue;
		for (int k = 0; k < r->nseqs; k++) {
			struct seq *q = &r->seqs[k];
			if (q->finished)
				continue;
			if (s->nrows >= s->max_rows || q->nblocks >= s->row_stride ||
			    q->nblocks != ceil_div(q->len, s->bs))
				fatal("internal error: block table row");
			int32_t *row = s->table + s->nrows * s->row_stride;
			memcpy(row, q->table, (size_t)q->nblocks * sizeof(*row));
			memset(row + q->nblocks, 0,
			       (size_t)(s->row_stride - q->nblocks) * sizeof(*row));
			struct req_truth *rt = &s->t.reqs[r->tr];
			int64_t new = q->new_step == step ? q->new_tokens : 0;
			s->seq_lens[s->nrows] = (int32_t)q->len;
			s->step_rows[s->nrows] = rt->req;
			s->row_new[s->nrows] = new;
			s->row_seq[s->nrows++] = q;
			tokens += (uint64_t)q->len;
			rt->step_rows++;
			rt->tokens_written += (uint64_t)new;
			for (int64_t j = 0; j < q->nblocks; j++) {
				int32_t b = row[j];
				if (b == 0) {
					nulls++;
					continue;
				}
				reads++;
				rt->block_reads++;
				rd->per_block[b]++;
				rd->last_step[b] = step;
				/*
				 * The tokens block b holds: its share of this
				 * row's seq_len.  Only full blocks are shared
				 * (prompt blocks of forks, the prefix cache),
				 * so every reader agrees; counted once.
				 */
				int64_t fill = q->len - j * s->bs;
				if (fill > s->bs)
					fill = s->bs;
				if (rd->step_count[b]++ == 0) {
					rd->step_blocks[ndistinct++] = b;
					rd->step_fill[b] = (uint32_t)fill;
					held += (uint64_t)fill;
				} else if (rd->step_fill[b] != fill) {
					fatal("internal error: readers disagree on a block's fill");
				}
			}
		}
	}
	for (int64_t i = 0; i < ndistinct; i++) {
		int32_t b = rd->step_blocks[i];
		rd->sharing[rd->step_count[b]]++;
		rd->step_count[b] = 0;
	}
	/* whose the rows are, before any layer reads them */
	for (int64_t i = 0; i < s->nrows; i++)
		s->step_rows[s->nrows + i] = (uint64_t)s->row_new[i];
	kv_step_reqs(s->step_rows, s->nrows);
	s->t.step_reqs_calls++;
	fire_step_rows(s, step);
	rd->steps++;
	rd->requests += (uint64_t)s->nrows;
	rd->tokens += tokens;
	rd->reads += reads;
	rd->distinct += (uint64_t)ndistinct;
	rd->held_tokens += held;
	rd->null_entries += nulls;
	if (s->cfg->truth_steps) {
		uint64_t row[7] = { step, (uint64_t)s->nrows, reads,
				    (uint64_t)ndistinct, tokens, nulls, held };
		live_push(rd, row);
	}
}

/*
 * Attention of layer l over the step's table; its checksum must be the sum
 * of what the rows' sequences hold (a wrong block in a row, or a block whose
 * contents are not the sequence's, shows up as a KV mismatch).
 */
static void attend_layer(struct sim *s, int64_t l)
{
	uint64_t want = 0;

	uint64_t got = kv_attention(&s->gpu[l], s->table, s->row_stride,
				    s->nrows, s->seq_lens,
				    (uint64_t)(uintptr_t)s->table);
	for (int64_t i = 0; i < s->nrows; i++)
		want += s->row_seq[i]->attn_sum[l];
	if (got != want)
		s->t.kv_mismatches++;
}

/*
 * Runs the model on this step's tokens, layer by layer as vLLM does: each
 * layer writes the step's tokens (one write call), then its attention reads
 * the step's block table (one kv_attention call).
 */
static void write_step(struct sim *s)
{
	const int op = s->cfg->w.write_op;
	int64_t n = ceil_div(s->ntok, PAD_TO) * PAD_TO;
	uint64_t pad = (uint64_t)(n - s->ntok);

	for (int64_t i = s->ntok; i < n; i++)
		s->slots[i] = -1;

	for (int64_t l = 0; l < s->L; l++) {
		for (int64_t i = 0; i < s->ntok; i++)
			s->values[i] = kv_value(s->tok_id[i], s->tok_sample[i],
						s->tok_pos[i], l);
		for (int64_t i = s->ntok; i < n; i++)
			s->values[i] = 0;
		kv_write_slots(op, &s->gpu[l], s->slots, n, s->values);

		for (int64_t i = 0; i < s->ntok; i++) {
			s->t.writes[l][s->slots[i] / s->bs]++;
			s->tok_seq[i]->attn_sum[l] +=
				WORDS_PER_TOKEN * s->values[i];
		}
		attend_layer(s, l);
		s->t.ops[op].calls++;
		s->t.ops[op].slots += (uint64_t)s->ntok;
		s->t.ops[op].padding += pad;
		s->t.slots_written += (uint64_t)s->ntok;
		s->t.padding_skipped += pad;
	}
}

/* After the step: sample tokens, fork, finish sequences. */
static void complete_step(struct sim *s)
{
	int64_t kept = 0;

	for (int64_t i = 0; i < s->nrunning; i++) {
		struct request *r = &s->reqs[s->running[i]];

		if (r->sched_step == s->step_no + 1 &&
		    r->sched_kind != SCHED_PREFILL) {
			if (r->sched_kind == SCHED_PREFILL_LAST &&
			    r->nsamples > 1)
				fork_request(s, r);
			/*
			 * The prefill samples each sequence's first token; a
			 * decode step samples the next one.
			 */
			for (int k = 0; k < r->nseqs; k++) {
				struct seq *q = &r->seqs[k];
				if (q->finished)
					continue;
				q->gen++;
				if (q->gen == q->gen_len)
					finish_seq(s, r, q);
			}
		}
		if (r->state != RQ_DONE)
			s->running[kept++] = s->running[i];
	}
	s->nrunning = kept;
}

/* SIGUSR2: stop after the current repetition, then end as if --repeat (and
 * --rounds) had been reached: truth written, KV contents checked.  Tests run
 * a long --repeat and stop it when they are done with it, instead of
 * guessing how long a run takes on a loaded machine. */
static volatile sig_atomic_t stop_requested;

static void on_sigusr2(int sig)
{
	(void)sig;
	stop_requested = 1;
}

static void run_once(struct sim *s)
{
	const struct timespec delay = {
		.tv_sec = (time_t)(s->cfg->step_delay_us / 1000000),
		.tv_nsec = (long)(s->cfg->step_delay_us % 1000000) * 1000,
	};

	reset_run(s);
	/* every request is queued when the run starts (an offline batch) */
	for (int64_t i = 0; i < s->nreq; i++)
		request_start(s, &s->reqs[i]);
	while (s->done < s->nreq) {
		schedule_step(s);
		if (s->ntok == 0)
			fatal("internal error: scheduler made no progress");
		build_block_table(s);
		write_step(s);
		complete_step(s);
		s->step_no++;
		s->t.steps++;
		if (s->cfg->step_delay_us && s->done < s->nreq)
			nanosleep(&delay, NULL);
	}
}

/* ------------------------------------------------------------------ */
/* Output                                                              */

static void print_array(FILE *f, const uint64_t *a, int64_t n)
{
	fputc('[', f);
	for (int64_t i = 0; i < n; i++)
		fprintf(f, i ? ", %" PRIu64 : "%" PRIu64, a[i]);
	fputc(']', f);
}

static void print_i64s(FILE *f, const char *name, const struct gen_truth *g,
		       int64_t n, size_t off, int is_u64)
{
	fprintf(f, "    \"%s\": [", name);
	for (int64_t i = 0; i < n; i++) {
		const char *p = (const char *)&g[i] + off;
		if (is_u64)
			fprintf(f, i ? ", %" PRIu64 : "%" PRIu64, *(const uint64_t *)p);
		else
			fprintf(f, i ? ", %" PRId64 : "%" PRId64, *(const int64_t *)p);
	}
	fprintf(f, "]");
}

/*
 * "generations": one entry per generation in the order they started
 * (column arrays), and per step the generations active (start <= step <=
 * last) and the tokens they hold.
 */
static void write_generations(FILE *f, const struct sim *s)
{
	const struct truth *t = &s->t;
	int64_t n = t->ngens, steps = (int64_t)t->steps;
	static const char *kinds[] = { "write", "copy", "swap_in" };

	fprintf(f, "  \"generations\": {\n    \"kind\": [");
	for (int64_t i = 0; i < n; i++)
		fprintf(f, i ? ", \"%s\"" : "\"%s\"", kinds[t->gens[i].kind]);
	fprintf(f, "],\n");
#define GEN_FIELD(name, u) \
	print_i64s(f, #name, t->gens, n, offsetof(struct gen_truth, name), u); \
	fprintf(f, ",\n")
	GEN_FIELD(block, 0);
	GEN_FIELD(start_step, 1);
	GEN_FIELD(last_step, 1);
	GEN_FIELD(inherited, 0);
	GEN_FIELD(fill, 0);
	print_i64s(f, "writes", t->gens, n, offsetof(struct gen_truth, writes), 1);
#undef GEN_FIELD
	fprintf(f, "\n  },\n");

	int64_t *blocks = xcalloc((size_t)steps + 2, sizeof(int64_t));
	int64_t *tokens = xcalloc((size_t)steps + 2, sizeof(int64_t));
	for (int64_t k = 0; k < steps && k < t->tok_gain_cap; k++)
		tokens[k] += t->tok_gain[k];
	for (int64_t i = 0; i < n; i++) {
		const struct gen_truth *g = &t->gens[i];
		int64_t start = (int64_t)g->start_step, end = (int64_t)g->last_step + 1;
		blocks[start < steps + 1 ? start : steps + 1]++;
		blocks[end < steps + 1 ? end : steps + 1]--;
		tokens[end < steps + 1 ? end : steps + 1] -= g->fill;
	}
	const char *names[] = { "active_blocks", "active_tokens" };
	int64_t *series[] = { blocks, tokens };
	for (int j = 0; j < 2; j++) {
		int64_t sum = 0;
		fprintf(f, "  \"%s\": [", names[j]);
		for (int64_t k = 0; k < steps; k++) {
			sum += series[j][k];
			fprintf(f, k ? ", %" PRId64 : "%" PRId64, sum);
		}
		fprintf(f, "],\n");
	}
	free(blocks);
	free(tokens);
}

/* [[index, a[index]], ...] for the non-zero entries of a. */
static void print_sparse(FILE *f, const uint64_t *a, int64_t n)
{
	bool first = true;

	fputc('[', f);
	for (int64_t i = 0; i < n; i++) {
		if (!a[i])
			continue;
		fprintf(f, "%s[%" PRId64 ", %" PRIu64 "]", first ? "" : ", ", i,
			a[i]);
		first = false;
	}
	fputc(']', f);
}

/*
 * "reads": what attention read, counted by build_block_table() from the
 * rows it gives every layer (one KV-cache group: all layers share the
 * table), cumulative over --repeat and --rounds like the rest of the truth.
 * A read is one (step, request row, block) entry among the first
 * ceil(seq_len / block_size) entries of a row, block != 0.
 *
 *   group_id      the probe's group_id: the block table buffer's address
 *   steps         forward steps that ran attention (every step does)
 *   layers        attention calls per step (the layer count); each fires
 *                 vllm:block_table with the same table
 *   block_size    tokens per block
 *   requests      rows, summed over steps (a row per scheduled sequence)
 *   tokens        seq_len summed over rows and steps
 *   reads         entries read with block != 0, summed over steps
 *   distinct      distinct non-null blocks read at a step, summed over steps
 *   held_tokens   tokens those distinct blocks hold at the step (a block's
 *                 share of its readers' seq_len: full blocks hold
 *                 block_size; shared blocks are always full), summed over
 *                 steps
 *   null_entries  entries of block 0 within the rows' read lengths: the
 *                 blocks a sliding window dropped (--workload window);
 *                 kvsim's other padding lies beyond the read lengths
 *   per_block     [[block, reads]]: for each block read, the (step, request)
 *                 pairs that read it; sums to reads
 *   last_step     [[block, step]]: the step of each block's last read.
 *                 Steps count from 1 at the run's first step and go on
 *                 counting across --repeat and --rounds (the Nth step this
 *                 process ran is step N), so after R rounds the steps of
 *                 round R are those above the previous truth's "steps"
 *   sharing       [[degree, count]]: a histogram over the (step, block) pairs
 *                 of a step's live set: count pairs had exactly degree
 *                 readers (rows) at that step; sum of count = distinct,
 *                 sum of degree * count = reads.  degree > 1: a block shared
 *                 by several requests (a common prefix) or samples (beam)
 *   live_sets     null, unless --truth-steps: then one row per step,
 *                 [step, requests, reads, distinct, tokens, null_entries,
 *                 held_tokens], the step's share of the totals above
 *                 (distinct = the step's live set).
 *                 Grows by one row per step, hence the flag.
 *
 * "prefix_hits" (top level): (request, block) pairs a new request took from
 * the prefix cache instead of writing them (--workload prefix; else 0).
 * "window_drops" (top level): (sequence, block) pairs the sliding window
 * freed and made null (--workload window; else 0).
 */
static void write_reads(FILE *f, const struct sim *s)
{
	const struct read_truth *rd = &s->t.rd;

	fprintf(f, "  \"reads\": {\n");
	fprintf(f, "    \"group_id\": %" PRIu64 ",\n",
		(uint64_t)(uintptr_t)s->table);
	fprintf(f,
		"    \"steps\": %" PRIu64 ", \"layers\": %" PRId64
		", \"block_size\": %" PRId64 ",\n",
		rd->steps, s->L, s->bs);
	fprintf(f,
		"    \"requests\": %" PRIu64 ", \"tokens\": %" PRIu64
		", \"reads\": %" PRIu64 ", \"distinct\": %" PRIu64
		", \"held_tokens\": %" PRIu64 ", \"null_entries\": %" PRIu64
		",\n",
		rd->requests, rd->tokens, rd->reads, rd->distinct,
		rd->held_tokens, rd->null_entries);
	fprintf(f, "    \"per_block\": ");
	print_sparse(f, rd->per_block, s->nblocks);
	fprintf(f, ",\n    \"last_step\": ");
	print_sparse(f, rd->last_step, s->nblocks);
	fprintf(f, ",\n    \"sharing\": ");
	print_sparse(f, rd->sharing, rd->max_degree + 1);
	fprintf(f, ",\n    \"live_sets\": ");
	if (!s->cfg->truth_steps) {
		fprintf(f, "null");
	} else {
		fputc('[', f);
		for (int64_t i = 0; i < rd->nlive; i++) {
			const uint64_t *r = rd->live[i];
			fprintf(f,
				"%s[%" PRIu64 ", %" PRIu64 ", %" PRIu64
				", %" PRIu64 ", %" PRIu64 ", %" PRIu64
				", %" PRIu64 "]",
				i ? ", " : "", r[0], r[1], r[2], r[3], r[4],
				r[5], r[6]);
		}
		fputc(']', f);
	}
	fprintf(f, "\n  },\n");
}

/*
 * "lifecycle": the plugin tier's events as kvsim's scheduler decided them
 * (life_add(), request_start() and the preempt and finish paths), counted
 * whether a tracer is attached or not and cumulative over --repeat and
 * --rounds, like the rest of the truth.
 *
 *   group_id, num_blocks  what every block event passes (one KV-cache
 *                 group; the GPU pool's blocks, the null block included)
 *   calls         probe calls per op (one per request, kind and scheduler
 *                 action: the ids of one are batched into one call;
 *                 step_reqs and step_rows once a step, step_rows only in
 *                 workloads of one sample a request)
 *   step_rows_rows, step_rows_tail  the rows and tail entries step_rows
 *                 sent (fire_step_rows())
 *   blocks        {kind: [[block, count]]}: per GPU block, how many times
 *                 the event happened to it; kinds: alloc (taken from the
 *                 pool for a request: its new blocks at a prefill chunk,
 *                 a decode step, a fork's copy or a swap-in), hit (a
 *                 cached prefix block a new request shares), cache (a full
 *                 prefix block entering the prefix cache), free (a request
 *                 dropped its reference: at its end, a swap-out, or the
 *                 sliding window; a block its samples share is released
 *                 once, by the last one), evict (never: kvsim pins its
 *                 cached blocks, see struct sim's prefix_cache)
 *   totals        {kind: sum of the counts above}
 *   residency     {lifetime_ns, idle_before_evict_ns, reuse_gap_ns}: every
 *                 sample of vLLM's block residency (res_event()), in the
 *                 order taken, timed by CLOCK_MONOTONIC read just before
 *                 each alloc and hit probe call
 *   requests      one per request created, in creation order: id, req
 *                 (FNV-1a 64 of id, 16 hex digits), prompt_tokens,
 *                 output_tokens (tokens generated, all samples; 0 until it
 *                 finished), preemptions (swap-outs), recomputed (tokens it
 *                 had computed at its preemptions, summed), blocks {kind:
 *                 ids its events passed}
 */
static void write_lifecycle(FILE *f, const struct sim *s)
{
	const struct truth *t = &s->t;
	static const char *const kinds[KV_NUM_LIFE] = { "alloc", "hit", "cache",
							 "free", "evict" };

	fprintf(f, "  \"lifecycle\": {\n");
	fprintf(f, "    \"group_id\": 0, \"num_blocks\": %" PRId64 ",\n", s->nblocks);
	fprintf(f, "    \"calls\": {");
	for (int k = 0; k < KV_NUM_LIFE; k++)
		fprintf(f, "\"%s\": %" PRIu64 ", ", kv_life_op_name(k),
			t->life_calls[k]);
	fprintf(f,
		"\"request\": %" PRIu64 ", \"req_preempt\": %" PRIu64
		", \"req_finish\": %" PRIu64 ", \"step_reqs\": %" PRIu64
		", \"step_rows\": %" PRIu64 "},\n",
		t->request_calls, t->preempt_calls, t->finish_calls,
		t->step_reqs_calls, t->step_rows_calls);
	/* step_rows' rows and tail entries: its op totals' items and slots */
	fprintf(f, "    \"step_rows_rows\": %" PRIu64 ", \"step_rows_tail\": %" PRIu64 ",\n",
		t->step_rows_rows, t->step_rows_tail);
	fprintf(f, "    \"blocks\": {");
	for (int k = 0; k < KV_NUM_LIFE; k++) {
		fprintf(f, "%s\"%s\": ", k ? ", " : "", kinds[k]);
		print_sparse(f, t->life[k], s->nblocks);
	}
	fprintf(f, "},\n    \"totals\": {");
	for (int k = 0; k < KV_NUM_LIFE; k++) {
		uint64_t sum = 0;
		for (int64_t b = 0; b < s->nblocks; b++)
			sum += t->life[k][b];
		fprintf(f, "%s\"%s\": %" PRIu64, k ? ", " : "", kinds[k], sum);
	}
	fprintf(f, "},\n    \"residency\": {");
	static const char *const res_names[3] = { "lifetime_ns", "idle_before_evict_ns",
						   "reuse_gap_ns" };
	for (int r = 0; r < 3; r++) {
		fprintf(f, "%s\"%s\": [", r ? ", " : "", res_names[r]);
		for (int64_t i = 0; i < t->res[r].n; i++)
			fprintf(f, "%s%" PRId64, i ? ", " : "", t->res[r].v[i]);
		fputc(']', f);
	}
	fprintf(f, "},\n    \"requests\": [");
	for (int64_t i = 0; i < t->nreqs; i++) {
		const struct req_truth *rt = &t->reqs[i];
		fprintf(f,
			"%s\n      {\"id\": \"%s\", \"req\": \"%016" PRIx64
			"\", \"prompt_tokens\": %" PRId64
			", \"output_tokens\": %" PRId64 ", \"preemptions\": %" PRIu64
			", \"recomputed\": %" PRIu64 ", \"step_rows\": %" PRIu64
			", \"tokens_written\": %" PRIu64
			", \"block_reads\": %" PRIu64 ", \"blocks\": {",
			i ? "," : "", rt->id, rt->req, rt->prompt_tokens,
			rt->output_tokens, rt->preemptions, rt->recomputed,
			rt->step_rows, rt->tokens_written, rt->block_reads);
		for (int k = 0; k < KV_NUM_LIFE; k++)
			fprintf(f, "%s\"%s\": %" PRIu64, k ? ", " : "", kinds[k],
				rt->blocks[k]);
		fprintf(f, "}}");
	}
	fprintf(f, "\n    ]\n  },\n");
}

static void write_truth(const struct sim *s, const char *path)
{
	const struct config *c = s->cfg;
	const struct truth *t = &s->t;
	size_t len = strlen(path) + 32;
	char *tmp = xcalloc(len, 1);
	snprintf(tmp, len, "%s.tmp.%ld", path, (long)getpid());

	FILE *f = fopen(tmp, "w");
	if (!f) {
		fprintf(stderr, "kvsim: %s: %s\n", tmp, strerror(errno));
		exit(1);
	}
	fprintf(f, "{\n");
	fprintf(f, "  \"kvsim_version\": %d,\n", KVSIM_VERSION);
	fprintf(f, "  \"workload\": \"%s\",\n", c->w.name);
	fprintf(f, "  \"seed\": %" PRIu64 ",\n", c->seed);
	fprintf(f, "  \"pid\": %ld,\n", (long)getpid());
	fprintf(f, "  \"repeat\": %" PRIu64 ",\n", c->repeat);
	fprintf(f, "  \"rounds_done\": %" PRIu64 ",\n", s->rounds_done);
	fprintf(f, "  \"block_size\": %" PRId64 ",\n", s->bs);
	fprintf(f, "  \"num_blocks\": %" PRId64 ",\n", s->nblocks);
	fprintf(f, "  \"num_layers\": %" PRId64 ",\n", s->L);
	fprintf(f, "  \"bytes_per_block\": %" PRId64 ",\n", s->bpb);
	fprintf(f, "  \"write_op\": \"%s\",\n", kv_write_op_name(c->w.write_op));
	fprintf(f, "  \"layers\": [\n");
	for (int64_t l = 0; l < s->L; l++) {
		fprintf(f,
			"    {\"layer\": %" PRId64 ", \"cache_id\": %" PRIu64
			", \"writes\": ",
			l, kv_cache_id(&s->gpu[l]));
		print_array(f, t->writes[l], s->nblocks);
		fprintf(f, "}%s\n", l + 1 < s->L ? "," : "");
	}
	fprintf(f, "  ],\n");
	const struct {
		const char *name;
		const uint64_t *a;
	} arrays[] = {
		{ "token_writes", t->token_writes }, { "copy_src", t->copy_src },
		{ "copy_dst", t->copy_dst },         { "swap_out", t->swap_out },
		{ "swap_in", t->swap_in },
	};
	for (size_t i = 0; i < sizeof(arrays) / sizeof(arrays[0]); i++) {
		fprintf(f, "  \"%s\": ", arrays[i].name);
		print_array(f, arrays[i].a, s->nblocks);
		fprintf(f, ",\n");
	}
	fprintf(f, "  \"ops\": {\n");
	for (int op = 0; op < NUM_OPS; op++) {
		const struct op_truth *o = &t->ops[op];
		fprintf(f,
			"    \"%s\": {\"calls\": %" PRIu64 ", \"slots\": %" PRIu64
			", \"padding\": %" PRIu64 ", \"pairs\": %" PRIu64
			", \"bytes\": %" PRIu64 "}%s\n",
			op_name(op), o->calls, o->slots, o->padding, o->pairs,
			o->bytes, op + 1 < NUM_OPS ? "," : "");
	}
	fprintf(f, "  },\n");
	fprintf(f, "  \"slots_written\": %" PRIu64 ",\n", t->slots_written);
	fprintf(f, "  \"padding_skipped\": %" PRIu64 ",\n", t->padding_skipped);
	fprintf(f, "  \"steps\": %" PRIu64 ",\n", t->steps);
	fprintf(f, "  \"requests\": %" PRIu64 ",\n", t->requests);
	fprintf(f, "  \"preemptions\": %" PRIu64 ",\n", t->preemptions);
	fprintf(f, "  \"forks\": %" PRIu64 ",\n", t->forks);
	fprintf(f, "  \"prefix_hits\": %" PRIu64 ",\n", t->prefix_hits);
	fprintf(f, "  \"window_drops\": %" PRIu64 ",\n", t->window_drops);
	write_reads(f, s);
	write_lifecycle(f, s);
	write_generations(f, s);
	fprintf(f, "  \"kv_checksum_ok\": %s\n",
		t->kv_mismatches ? "false" : "true");
	fprintf(f, "}\n");

	/* '|' not '||': the file must be closed whatever ferror() says */
	if ((ferror(f) | (fclose(f) != 0)) || rename(tmp, path) != 0) {
		fprintf(stderr, "kvsim: cannot write %s: %s\n", path,
			strerror(errno));
		unlink(tmp);
		exit(1);
	}
	free(tmp);
}

/* ------------------------------------------------------------------ */
/* Command line                                                        */

static void print_help(void)
{
	printf("usage: kvsim [options]\n"
	       "A paged-KV-cache simulator that fires the kvtrace USDT probes.\n"
	       "\n"
	       "  --workload NAME      default | beam | swap | stress | mla | prefix |\n"
	       "                       window | long | prod | evict\n"
	       "  --seed N             RNG seed (default 1)\n"
	       "  --truth FILE         write the ground-truth JSON to FILE\n"
	       "  --truth-steps        include per-step read rows (reads.live_sets)\n"
	       "  --truth-rows FILE    write every step's rows, as the sequences hold\n"
	       "                       them, to FILE: a JSON line a step\n"
	       "  --pause              wait for SIGUSR1 before running\n"
	       "  --repeat N           run the workload N times (default 1)\n"
	       "  --rounds N           N rounds, each: wait for SIGUSR1, run the\n"
	       "                       workload --repeat times, rewrite --truth\n"
	       "                       (cumulative); for attach/detach windows\n"
	       "  --step-delay-us N    sleep N us between steps (default 0)\n"
	       "  --layers N           override the workload's layer count\n"
	       "  --blocks N           override the GPU block count\n"
	       "  --block-size N       override the tokens per block\n"
	       "  --sliding-window N   override the sliding window (tokens, 0 none)\n"
	       "  --preempt-every N    swap out the last admitted running request\n"
	       "                       every N steps (default 0: only when blocks\n"
	       "                       run out; prod: 2)\n"
	       "  --write-op NAME      reshape_and_cache | reshape_and_cache_flash |\n"
	       "                       concat_and_cache_mla | cpu_attn_reshape_and_cache\n"
	       "  --ops-log FILE       one line per op fired with its probe enabled\n"
	       "                       (traced): NAME CACHE_ID VALUES... (per-op truth)\n"
	       "  --no-block-table     attention fires no vllm:block_table: its reads\n"
	       "                       are in step_rows alone, as the plugin tier's\n"
	       "  --progress           print 'kvsim: repetition N done' to stderr\n"
	       "                       after each repetition (an event to wait on)\n"
	       "  --quiet              no summary line\n"
	       "  --help               this text\n"
	       "\n"
	       "SIGUSR2 stops it after the current repetition (truth written, KV\n"
	       "checked, exit as if --repeat and --rounds were reached).\n"
	       "\n"
	       "Exit status: 0 ok, 1 KV contents mismatch or failure, 2 bad usage.\n");
}

static uint64_t parse_u64(const char *flag, const char *v, uint64_t min,
			  uint64_t max)
{
	char *end;

	errno = 0;
	if (*v < '0' || *v > '9')
		usage_error("bad number for %s", flag);
	unsigned long long x = strtoull(v, &end, 10);
	if (errno || *end || x < min || x > max)
		usage_error("bad number for %s", flag);
	return (uint64_t)x;
}

static void parse_args(int argc, char **argv, struct config *c)
{
	const char *workload = "default";
	int64_t layers = -1, blocks = -1, block_size = -1, window = -1;
	int64_t preempt_every = -1;
	int write_op = -1;

	c->seed = 1;
	c->repeat = 1;
	c->rounds = 1;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *val = NULL;
		char flag[64];

		if (strncmp(a, "--", 2) != 0)
			usage_error("unexpected argument '%s'", a);
		/* accept both --flag VALUE and --flag=VALUE */
		const char *eq = strchr(a, '=');
		size_t flen = eq ? (size_t)(eq - a) : strlen(a);
		if (flen >= sizeof(flag))
			usage_error("unknown option '%s'", a);
		memcpy(flag, a, flen);
		flag[flen] = '\0';

		bool has_arg = !strcmp(flag, "--workload") ||
			       !strcmp(flag, "--seed") ||
			       !strcmp(flag, "--truth") ||
			       !strcmp(flag, "--truth-rows") ||
			       !strcmp(flag, "--preempt-every") ||
			       !strcmp(flag, "--ops-log") ||
			       !strcmp(flag, "--repeat") ||
			       !strcmp(flag, "--rounds") ||
			       !strcmp(flag, "--step-delay-us") ||
			       !strcmp(flag, "--layers") ||
			       !strcmp(flag, "--blocks") ||
			       !strcmp(flag, "--block-size") ||
			       !strcmp(flag, "--sliding-window") ||
			       !strcmp(flag, "--write-op");
		if (has_arg) {
			if (eq)
				val = eq + 1;
			else if (i + 1 < argc)
				val = argv[++i];
			else
				usage_error("%s needs a value", flag);
		} else if (eq) {
			usage_error("%s takes no value", flag);
		}

		if (!strcmp(flag, "--help")) {
			print_help();
			exit(0);
		} else if (!strcmp(flag, "--pause")) {
			c->pause = true;
		} else if (!strcmp(flag, "--quiet")) {
			c->quiet = true;
		} else if (!strcmp(flag, "--no-block-table")) {
			kv_no_block_table = 1;
		} else if (!strcmp(flag, "--truth-steps")) {
			c->truth_steps = true;
		} else if (!strcmp(flag, "--progress")) {
			c->progress = true;
		} else if (!strcmp(flag, "--workload")) {
			workload = val;
		} else if (!strcmp(flag, "--seed")) {
			c->seed = parse_u64(flag, val, 0, UINT64_MAX);
		} else if (!strcmp(flag, "--truth")) {
			if (!*val)
				usage_error("%s needs a file name", flag);
			c->truth_path = val;
		} else if (!strcmp(flag, "--preempt-every")) {
			preempt_every = (int64_t)parse_u64(flag, val, 0, 1 << 30);
		} else if (!strcmp(flag, "--truth-rows")) {
			if (!*val)
				usage_error("%s needs a file name", flag);
			c->truth_rows = fopen(val, "w");
			if (!c->truth_rows)
				usage_error("cannot write %s", val);
		} else if (!strcmp(flag, "--ops-log")) {
			if (!*val)
				usage_error("%s needs a file name", flag);
			kv_ops_log = fopen(val, "w");
			if (!kv_ops_log)
				usage_error("cannot write %s", val);
			/* a line per op as it fires: a SIGTERM loses none */
			setvbuf(kv_ops_log, NULL, _IOLBF, 0);
		} else if (!strcmp(flag, "--repeat")) {
			c->repeat = parse_u64(flag, val, 1, 1000000);
		} else if (!strcmp(flag, "--rounds")) {
			c->rounds = parse_u64(flag, val, 1, 1000000);
		} else if (!strcmp(flag, "--step-delay-us")) {
			c->step_delay_us = parse_u64(flag, val, 0, 60000000);
		} else if (!strcmp(flag, "--layers")) {
			layers = (int64_t)parse_u64(flag, val, 1, MAX_LAYERS);
		} else if (!strcmp(flag, "--blocks")) {
			blocks = (int64_t)parse_u64(flag, val, 1, 1 << 22);
		} else if (!strcmp(flag, "--block-size")) {
			block_size = (int64_t)parse_u64(flag, val, 1, 1 << 12);
		} else if (!strcmp(flag, "--sliding-window")) {
			window = (int64_t)parse_u64(flag, val, 0, 1 << 30);
		} else if (!strcmp(flag, "--write-op")) {
			for (int op = 0; op < KV_NUM_WRITE_OPS; op++)
				if (!strcmp(val, kv_write_op_name(op)))
					write_op = op;
			if (write_op < 0)
				usage_error("unknown write op '%s'", val);
		} else {
			usage_error("unknown option '%s'", a);
		}
	}

	size_t w;
	for (w = 0; w < NUM_WORKLOADS; w++)
		if (!strcmp(workload, workloads[w].name))
			break;
	if (w == NUM_WORKLOADS)
		usage_error("unknown workload '%s'", workload);
	c->w = workloads[w];
	if (layers > 0)
		c->w.layers = layers;
	if (blocks > 0)
		c->w.blocks = blocks;
	if (block_size > 0)
		c->w.block_size = block_size;
	if (write_op >= 0)
		c->w.write_op = write_op;
	if (window >= 0)
		c->w.window = window;
	c->preempt_every = preempt_every >= 0 ? preempt_every
			   : !strcmp(c->w.name, "prod") ? PROD_PREEMPT_EVERY : 0;
	c->cpu_blocks = c->w.blocks > MIN_CPU_BLOCKS ? c->w.blocks : MIN_CPU_BLOCKS;
}

/* Blocks SIGUSR1 before announcing the pause, so no signal can be missed. */
static void wait_for_sigusr1(void)
{
	sigset_t set, old;
	int sig;

	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	if (sigprocmask(SIG_BLOCK, &set, &old) != 0)
		fatal("sigprocmask failed");
	fprintf(stderr, "kvsim: pid %ld paused, send SIGUSR1 to start\n",
		(long)getpid());
	fflush(stderr);
	while (sigwait(&set, &sig) != 0)
		;
	sigprocmask(SIG_SETMASK, &old, NULL);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#include "kvsim_evict.c"

int main(int argc, char **argv)
{
	struct config cfg = { 0 };
	static struct sim sim;

	parse_args(argc, argv, &cfg);
	if (!strcmp(cfg.w.name, "evict"))
		return evict_main(&cfg);
	struct sigaction sa = { .sa_handler = on_sigusr2 };
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGUSR2, &sa, NULL) != 0)
		fatal("sigaction failed");
	/* Everything (library, KV buffers, requests) is set up before --pause. */
	sim_init(&sim, &cfg);
	double elapsed = 0;
	uint64_t reps = 0;
	for (uint64_t r = 0; r < cfg.rounds && !stop_requested; r++) {
		/* the truth file is complete before the next pause is announced,
		 * so a tracer test can read each window's truth at the pause */
		if (cfg.pause || cfg.rounds > 1)
			wait_for_sigusr1();
		double t0 = now_s();
		for (uint64_t i = 0; i < cfg.repeat && !stop_requested; i++) {
			run_once(&sim);
			if (cfg.progress) {
				fprintf(stderr, "kvsim: repetition %" PRIu64 " done\n",
					++reps);
				fflush(stderr);
			}
		}
		elapsed += now_s() - t0;
		sim.rounds_done++;
		if (cfg.truth_path)
			write_truth(&sim, cfg.truth_path);
	}

	if (kv_ops_log && fclose(kv_ops_log) != 0)
		fatal("cannot write the --ops-log file");
	if (cfg.truth_rows && fclose(cfg.truth_rows) != 0)
		fatal("cannot write the --truth-rows file");
	const struct truth *t = &sim.t;
	if (!cfg.quiet)
		fprintf(stderr,
			"kvsim: workload=%s seed=%" PRIu64 " repeat=%" PRIu64
			" steps=%" PRIu64 " requests=%" PRIu64
			" slots_written=%" PRIu64 " padding=%" PRIu64
			" preemptions=%" PRIu64 " forks=%" PRIu64
			" copies=%" PRIu64 " kv=%s time=%.3fs\n",
			cfg.w.name, cfg.seed, cfg.repeat, t->steps, t->requests,
			t->slots_written, t->padding_skipped, t->preemptions,
			t->forks, t->ops[OP_COPY_BLOCKS].pairs,
			t->kv_mismatches ? "MISMATCH" : "ok", elapsed);
	if (t->kv_mismatches) {
		fprintf(stderr, "kvsim: %" PRIu64 " KV mismatches\n",
			t->kv_mismatches);
		return 1;
	}
	return 0;
}
