/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvtrace.bpf.c - the kernel side of kvtrace-bpf (bcc C).
 *
 * kvtrace_site_hit is attached to every probe address.  It finds the site's
 * description in `sites` by (pid, ip) - the scheme of libbpf's usdt.bpf.h -
 * so one compiled program serves every probe of every process and a new site
 * needs no recompile.  It decodes the arguments into per-CPU `work` and
 * tail-calls a stage that reads the op's index array (slots, block pairs or
 * sizes) segment by segment, tail-calling itself while there is more; the
 * last run finishes the op (totals, histogram, stack, perf record).
 *
 * Exact counts live in maps and never depend on the perf buffer: losing
 * records makes the per-op stream incomplete, never the histograms wrong.
 *
 * Verifier notes.  The per-item loops are branch-free on purpose: every
 * branch whose outcome the verifier cannot know leaves a pending state, and
 * paths that differ in a counter never merge, so branches per slot multiply
 * the work until the 1M-instruction limit.  Masks stand in for branches, and
 * OPAQUE() keeps clang from turning the masks back into branches.  One run
 * handles KVTRACE_SEGMENT_CHUNKS * KVTRACE_CHUNK items, which the verifier
 * walks in about a quarter of its budget.  The one exception is the slot
 * stages' run-of-a-block branch, which pays for itself and reads
 * KVTRACE_SLOT_SEGMENT_CHUNKS per run instead (docs/design.md).
 */
#include <uapi/linux/ptrace.h>
#include "kvtrace.h"

/* What the index stream carries (kvtrace.h): every op's values
 * (KVTRACE_WITH_INDEX_STREAM: record, attach -o), or only the plugin's
 * block events' ids (KVTRACE_WITH_BLOCK_ID_STREAM: attach --prometheus's
 * residency histograms), or nothing.  Constants, so that a stage whose
 * values are not streamed has no send in it at all. */
#if defined(KVTRACE_WITH_INDEX_STREAM)
#define STREAM_VALUES 1
#define STREAM_BLOCK_IDS 1
#elif defined(KVTRACE_WITH_BLOCK_ID_STREAM)
#define STREAM_VALUES 0
#define STREAM_BLOCK_IDS 1
#else
#define STREAM_VALUES 0
#define STREAM_BLOCK_IDS 0
#endif

/* The per-op record and its sequence number exist for a stream's consumer
 * alone: without a stream (plain attach) every count comes from the maps,
 * and the record cost about 400 ns of each op's BPF time to tell user space
 * only that it arrived.  KVTRACE_WITH_OP_RECORDS keeps them without a
 * stream: bench/run.py's carrying-capacity row measures what the
 * transports carry. */
#if STREAM_VALUES || STREAM_BLOCK_IDS || defined(KVTRACE_WITH_OP_RECORDS)
#define OP_RECORDS 1
#else
#define OP_RECORDS 0
#endif

/* Which ops send their record.  The block-id stream's consumers (attach's
 * derived reads, --prometheus's residency and miss classes, the agent's)
 * take only the plugin tier's ops, block_alloc and after: with that stream
 * alone, the op tiers' writes, moves and tables send none, so that it
 * costs them one compare an op, and the plugin tier a record per event. */
#if STREAM_VALUES || defined(KVTRACE_WITH_OP_RECORDS)
#define RECORDED(op) 1
#else
#define RECORDED(op) ((op) >= KVTRACE_OP_BLOCK_ALLOC)
#endif

BPF_HASH(traced_pids, u32, struct kvtrace_proc, 4096);
BPF_ARRAY(sites, struct kvtrace_site, KVTRACE_MAX_SITES);
#ifndef KVTRACE_SITE_COOKIES
BPF_HASH(site_index, struct kvtrace_site_key, u32, KVTRACE_MAX_SITES);
#endif
BPF_ARRAY(cache_memo, struct kvtrace_cache_memo, KVTRACE_MAX_SITES);
BPF_HASH(caches, struct kvtrace_cache_key, struct kvtrace_cache, KVTRACE_CACHE_ENTRIES);
#ifdef KVTRACE_WITH_INDEX_REUSE
/* The agent's rows of exited processes, zeroed and handed back by the front
 * end (tracer/kernel/release.py): a new cache or group (cache_of, group_of)
 * takes one of these before a new row, so that engines that come and go
 * never run out of rows. */
BPF_QUEUE(free_caches, u32, KVTRACE_CACHE_ENTRIES);
BPF_QUEUE(free_groups, u32, KVTRACE_MAX_GROUPS);
#endif
BPF_F_TABLE("array", u32, struct kvtrace_cache_stats, cache_stats, KVTRACE_CACHE_ENTRIES,
	    BPF_F_MMAPABLE);
/*
 * Every op's totals: op_stats per (proc index, op), row = proc index *
 * KVTRACE_NR_OPS + op; op_log2, the log2 histogram of items per op, row =
 * op * KVTRACE_LOG2_SLOTS + bpf_log2l(items).  Arrays, not hashes: the
 * verifier turns an array lookup into an address computation, where a hash
 * lookup hashes its key and walks a bucket.
 * Mmapable, read as numpy arrays.
 */
BPF_F_TABLE("array", u32, struct kvtrace_op_stats, op_stats,
	    KVTRACE_MAX_PROCS * KVTRACE_NR_OPS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, u64, op_log2, KVTRACE_NR_OPS * KVTRACE_LOG2_SLOTS,
	    BPF_F_MMAPABLE);
BPF_ARRAY(globals, u64, KVTRACE_NR_GLOBALS);
BPF_PROG_ARRAY(stages, KVTRACE_NR_STAGES);

/*
 * bcc builds a host-side printer and parser of every map's key and value
 * type (its "rw engine"), with one LLVM instruction per array element: a
 * row of KVTRACE_MAX_BLOCKS counters made the compile take most of a
 * minute.  The per-block rows are therefore declared to bcc as opaque
 * bytes, which it prints as one string, and each lookup casts them back.
 * The front end reads them through mmap with its own layout (abi.py).
 */
#define KVTRACE_ROW_BYTES(type, size)                                       \
	struct type##_bytes { char bytes[size]; };                           \
	_Static_assert(sizeof(struct type##_bytes) == sizeof(struct type),   \
		       #type "_bytes is not the size of " #type)
/* sizes spelt out: bcc's type description cannot take a sizeof here */
KVTRACE_ROW_BYTES(kvtrace_block_row, 8 * KVTRACE_MAX_BLOCKS);
KVTRACE_ROW_BYTES(kvtrace_read_row, 16 * KVTRACE_MAX_BLOCKS);
#ifdef KVTRACE_WITH_GEN_FILL
KVTRACE_ROW_BYTES(kvtrace_fill_row,
		  (8 * KVTRACE_FILL_BINS + 16 + 4 * KVTRACE_MAX_BLOCKS + 7) / 8 * 8);
#endif

/*
 * Per-block counters as arrays, not hashes: one masked index and one atomic
 * add per slot.  Mmapable, so the front end reads them as numpy arrays
 * without a syscall per element.
 *   block_writes: row = cache index (one layer of one process)
 *   block_moves:  row = proc index * KVTRACE_NR_MOVES + enum kvtrace_move
 */
BPF_F_TABLE("array", u32, struct kvtrace_block_row_bytes, block_writes,
	    KVTRACE_MAX_CACHES, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct kvtrace_block_row_bytes, block_moves,
	    KVTRACE_MAX_PROCS * KVTRACE_NR_MOVES, BPF_F_MMAPABLE);
/* Generation fill per cache (struct kvtrace_fill_row): row = cache index.
 * Plain loads and stores, not atomics: one thread writes a cache (vLLM's
 * model runner), and a run of slots costs one update, not one per slot.
 * Compiled in only for the metric that needs it (--prometheus): it adds
 * a stage run per write op (docs/design.md). */
#ifdef KVTRACE_WITH_GEN_FILL
#define GEN_FILL 1
BPF_F_TABLE("array", u32, struct kvtrace_fill_row_bytes, block_fill,
	    KVTRACE_MAX_CACHES, BPF_F_MMAPABLE);
#else
#define GEN_FILL 0
#endif
/*
 * Reads, per (process, KV-cache group): row = group index.  One row more
 * than groups: a group beyond KVTRACE_MAX_GROUPS is counted into the last
 * row, which is never reported, so the per-entry loop needs no flag.
 */
BPF_HASH(groups, struct kvtrace_group_key, struct kvtrace_group, 1024);
BPF_F_TABLE("array", u32, struct kvtrace_read_row_bytes, block_reads,
	    KVTRACE_MAX_GROUPS + 1, BPF_F_MMAPABLE);

/*
 * The plugin tier's lifecycle events, per block: row = proc index *
 * KVTRACE_NR_LIFE + enum kvtrace_life.  Per request: `requests`.
 */
BPF_F_TABLE("array", u32, struct kvtrace_block_row_bytes, block_life,
	    KVTRACE_MAX_PROCS * KVTRACE_NR_LIFE, BPF_F_MMAPABLE);
/*
 * Per process, which 64ths of the block range its block_life rows count
 * in: word k is set to 1 once an id in [k * LIFE_PAGE, (k + 1) * LIFE_PAGE)
 * is counted, before the op ends (word 64 and up: a sink for the ids not
 * counted).  A store of 1, not an OR: concurrent stores cannot undo each
 * other.  The front end copies each row up to its last counted entry,
 * found in the highest 64th set, instead of scanning the whole row at
 * each refresh (session.read_maps).
 */
struct kvtrace_life_pages {
	u64 v[KVTRACE_LIFE_PAGE_WORDS];
};
BPF_F_TABLE("array", u32, struct kvtrace_life_pages, life_pages, KVTRACE_MAX_PROCS,
	    BPF_F_MMAPABLE);
BPF_TABLE("lru_hash", struct kvtrace_request_key, struct kvtrace_request, requests,
	  KVTRACE_MAX_REQUESTS);
/* A zeroed kvtrace_request to insert from (never written): on the stack it
 * would not fit beside the stages' own variables. */
BPF_PERCPU_ARRAY(request_zero, struct kvtrace_request, 1);

#define RECORD_VALUES (KVTRACE_RECORD_CHUNKS * KVTRACE_CHUNK)

/* Up to KVTRACE_RECORD_CHUNKS chunks of a user index array, read one after
 * the other behind the header of their stream record (emit_chunk).  Twice
 * as long as that, so that read and record sizes can be bounded with a
 * mask instead of a branch. */
struct chunk {
	struct kvtrace_chunk_hdr hdr;
	s64 v[2 * RECORD_VALUES];
};
BPF_PERCPU_ARRAY(scratch, struct chunk, 1);

/* One chunk of a block-table row (int32 entries); twice as long, for masks. */
struct table_chunk {
	u32 v[2 * KVTRACE_TABLE_CHUNK];
};
BPF_PERCPU_ARRAY(table_scratch, struct table_chunk, 1);

/* The op in progress on this CPU, carried across tail calls.  Safe per CPU:
 * the kernel never runs a second tracing program on a CPU while one runs
 * (bpf_prog_active); such a hit is counted as a miss instead. */
struct work {
	struct kvtrace_event ev;
	u64 arr;        /* user address of the index array */
	u64 n;          /* int64 values to read from it */
	u64 done;       /* values read so far */
	u64 block_size;
	u64 block_shift; /* log2(block_size) when it is a power of two */
	u64 keep;       /* 1 if this cache has a block_writes row */
	u64 src_on, dst_on;
	u64 oor;
	u64 rec_start;  /* index stream: the first value of the record being read */
	u32 row, src_row, dst_row, proc;
	s32 err;
	u32 id_len;     /* request: bytes of the id at arr */
	/* block events: ids to count (n - nids values of hashes follow) */
	u64 nids, hashes;
	/* the hashes stage: a second array streamed after the first (step_rows'
	 * tail), its address and the values of both (0: none) */
	u64 next_arr, next_n;
	/* block_table (reads): n = rows, done = stream values sent so far */
	u64 seqs;        /* user address of the int32 seq_lens */
	u64 stride;      /* int32 entries from one row to the next */
	u64 next_row;    /* the next row to start */
	u64 row_addr;    /* user address of the current row */
	u64 col, row_len; /* entries of the current row read, and to read */
	u64 step;        /* the group's step number of this op */
	u64 tokens, nulls, gap, trunc;
	/* slot stages: runs of the last segment whose fill is still to move */
	u64 fill_runs;
	/* table stage: stream values waiting in the chunk buffer.  Here, not
	 * on the stage's stack: a value loaded from a map has no range for the
	 * verifier, so the chunk callback's states do not differ by it (on the
	 * stack it made them, and the verifier gave up at 1M instructions). */
	u64 pos;
	/* slot stages: 1 when the record's chunks were read at once */
	u64 record_read;
};
BPF_PERCPU_ARRAY(work, struct work, 1);

/*
 * The per-op stream's transport, chosen at compile time (docs/bench.md has
 * the measurement behind the default): the per-CPU perf buffer, or with
 * -DKVTRACE_RINGBUF=PAGES one BPF ring buffer of PAGES pages shared by all
 * CPUs.  submit_record() returns < 0 when the record was dropped, for both,
 * so losses are counted in-kernel the same way.
 */
#ifdef KVTRACE_RINGBUF
BPF_RINGBUF_OUTPUT(events, KVTRACE_RINGBUF);
#else
BPF_PERF_OUTPUT(events);
#endif

/*
 * Wake-ups are batched: waking the reader costs an irq_work and an IPI per
 * record, which in a VM costs more than everything else the program does
 * (docs/bench.md).  With KVTRACE_WAKEUP_EVERY = N > 1 only every N-th op
 * record wakes the reader; it also reads, unwoken, at every poll timeout.
 * The perf buffer batches by itself: the front end opens its events with a
 * watermark of a quarter of the buffer (tracer/uprobe_pmu.py).
 */
#ifndef KVTRACE_WAKEUP_EVERY
#define KVTRACE_WAKEUP_EVERY 1
#endif
#define RB_NO_WAKEUP 1    /* BPF_RB_NO_WAKEUP */
#define RB_FORCE_WAKEUP 2 /* BPF_RB_FORCE_WAKEUP */

static __always_inline int submit_record(struct pt_regs *ctx, void *data, u64 size,
					 u64 seq, int is_op)
{
#ifdef KVTRACE_RINGBUF
	u64 flags = 0; /* the kernel's choice: wake if the reader caught up */
	if (KVTRACE_WAKEUP_EVERY > 1)
		flags = is_op && seq % KVTRACE_WAKEUP_EVERY == 0 ? RB_FORCE_WAKEUP
								 : RB_NO_WAKEUP;
	return events.ringbuf_output(data, size, flags);
#else
	return events.perf_submit(ctx, data, size);
#endif
}

#ifdef KVTRACE_WITH_STACKS
BPF_STACK_TRACE(stacks, KVTRACE_STACK_BUCKETS);
BPF_HASH(stack_weights, struct kvtrace_stack_key, u64, 65536);
/* stacks the stack map refused for a taken bucket (bpf/kvtrace.h): made as
 * they come, as few ever do */
BPF_F_TABLE("hash", struct kvtrace_stack, s32, collided_stacks, KVTRACE_COLLIDED_STACKS,
	    BPF_F_NO_PREALLOC);
BPF_PERCPU_ARRAY(stack_scratch, struct kvtrace_stack, 1);
#endif

#define BLOCK_MASK ((u64)KVTRACE_MAX_BLOCKS - 1)

/* Hide a value's origin from clang so that it cannot turn mask arithmetic
 * back into compare-and-branch (BPF has no conditional-set instruction). */
#define OPAQUE(x) asm volatile("" : "+r"(x))

/* Where a callback's address goes: the marker the loader links (kvtrace.h). */
#define KVTRACE_CALLBACK(id) ((void *)(((u64)KVTRACE_CB_MARK << 32) | (id)))
/*
 * A callback's state: bpf_loop()'s callback_ctx, the callback's second
 * argument (r2).  A callback is declared with the index alone, because bcc
 * rewrites every later argument of a function into a read of its ctx; so
 * r2 is taken as it is on entry, first thing.  The loader checks that
 * nothing before writes r2, and the verifier refuses any use of it that is
 * not the pointer bpf_loop() passed.
 */
#define KVTRACE_CALLBACK_STATE()                                               \
	({                                                                     \
		void *state_;                                                  \
		asm volatile("%0 = r2" : "=r"(state_));                        \
		state_;                                                        \
	})

/* 1 if a < b, for a, b < 2^63, without a branch */
static __always_inline u64 lt(u64 a, u64 b)
{
	u64 d = a - b;
	OPAQUE(d);
	d >>= 63;
	OPAQUE(d);
	return d;
}

/* min(a, b), for a, b < 2^63, without a branch: a chunk's length, which
 * the verifier must see bounded without the branch that clang would make */
static __always_inline u64 min_bf(u64 a, u64 b)
{
	return a - ((a - b) & -lt(b, a));
}

/* 1 if x != 0, without a branch */
static __always_inline u64 nz(u64 x)
{
	u64 d = x | -x;
	OPAQUE(d);
	return d >> 63;
}

/* a if pick, else b: pick is 0 or 1 */
static __always_inline u64 pick(u64 pick, u64 a, u64 b)
{
	u64 m = -pick;
	OPAQUE(m);
	return (a & m) | (b & ~m);
}

/*
 * A generation of one block starts (start = 1) with `tokens` held, or its
 * open one grows to hold `tokens` (start = 0), if on; the generation a
 * start ends is counted by its fill.  fill: the block's fill[] entry;
 * seen: KVTRACE_FILL_SEEN if the new generation's tokens are known (a
 * write at offset 0, a copy of a seen generation), else 0.  tokens <
 * KVTRACE_FILL_BINS: the callers keep block sizes beyond it off.
 * No branch: the stages' loops leave the verifier one state per branch.
 */
static __always_inline void gen_fill(struct kvtrace_fill_row *r, u16 *fill, u64 on,
				     u64 start, u64 tokens, u64 seen_bit)
{
	u64 old = *fill;
	u64 old_tokens = old & (KVTRACE_FILL_BINS - 1);
	u64 ends = on & start & lt(0, old);
	u64 counted = ends & (old >> 15);
	r->ended[old_tokens & -counted] += counted;
	r->ended_unseen += ends ^ counted;
	u64 grown = pick(lt(old_tokens, tokens), tokens, old_tokens) | (old & KVTRACE_FILL_SEEN);
	*fill = pick(on, pick(start, tokens | seen_bit, grown), old);
}

static __always_inline void global_add(u32 idx, u64 n)
{
	u64 *v = globals.lookup(&idx);
	if (v)
		__sync_fetch_and_add(v, n);
}

#ifdef KVTRACE_WITH_STACKS
/*
 * The id of the user stack: the stack map's, or, when another stack holds
 * its hash bucket, collided_stacks' (bpf/kvtrace.h).  Negative if the stack
 * could not be taken or kept.  The stack map's path is the common one and
 * costs what it did; a collided stack pays for taking its frames twice and
 * hashing all KVTRACE_STACK_DEPTH of them.
 */
static __always_inline s32 stack_id_of(struct pt_regs *ctx)
{
	s32 id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
	if (id != -EEXIST)
		return id;
	u32 zero = 0;
	struct kvtrace_stack *s = stack_scratch.lookup(&zero);
	if (!s)
		return -ENOENT;
	/* the key is the whole array: the frames past the stack's last are 0 */
	__builtin_memset(s, 0, sizeof(*s));
	long taken = bpf_get_stack(ctx, s->ip, sizeof(s->ip), BPF_F_USER_STACK);
	if (taken < 0)
		return taken;
	s32 *known = collided_stacks.lookup(s);
	if (known)
		return *known;
	u32 idx = KVTRACE_G_NEXT_STACK;
	u64 *next = globals.lookup(&idx);
	if (!next)
		return -ENOENT;
	s32 fresh = KVTRACE_STACK_COLLIDED + (s32)__sync_fetch_and_add(next, 1);
	if (collided_stacks.insert(s, &fresh) == 0)
		return fresh;
	/* another CPU entered the same stack first (its number wins), or the
	 * map is full */
	known = collided_stacks.lookup(s);
	return known ? *known : -E2BIG;
}
#endif

/* A user-space u64 at addr; 0 if it cannot be read. */
static __always_inline u64 read_u64(u64 addr)
{
	u64 val = 0;
	bpf_probe_read_user(&val, sizeof(val), (void *)addr);
	return val;
}

/*
 * A field of the at::Tensor that regs[spec->reg_off] points at: its data
 * address (storage data + storage_offset * element size) or one of its
 * sizes.  Only pointers and sizes are read, never tensor contents.
 */
static __always_inline u64 fetch_tensor(u64 tensor, u32 kind, u64 val,
					 const struct kvtrace_tensor_layout *l)
{
	u64 impl = read_u64(tensor); /* at::Tensor = intrusive_ptr<TensorImpl> */
	if (kind == KVTRACE_ARG_TENSOR_SIZE)
		return read_u64(impl + l->impl_sizes + 8 * (val & 7));
	if (kind == KVTRACE_ARG_TENSOR_STRIDE)
		return read_u64(impl + l->impl_strides + 8 * (val & 7));
	u64 storage = read_u64(impl + l->impl_storage);
	u64 data = read_u64(storage + l->storage_data);
	return data + read_u64(impl + l->impl_storage_offset) * val;
}

/* One probe argument, decoded as libbpf's usdt.bpf.h does. */
/* A register's value, loaded from the probe's context instead of a
 * bpf_probe_read_kernel() helper call per argument.  The verifier allows
 * loads from ctx at constant offsets only, so the offset (x86_64 struct
 * pt_regs, as tracer/discover.py computes it) picks one of these, each
 * written as inline asm: clang would merge a switch of plain ctx->field
 * loads into one load from ctx + offset, which the verifier refuses
 * ("dereference of modified ctx ptr"). */
#define CTX_U64(ctx, off)                                                \
	({                                                               \
		u64 __v;                                                 \
		asm volatile("%0 = *(u64 *)(%1 + " #off ")"              \
			     : "=r"(__v)                                 \
			     : "r"(ctx));                                \
		__v;                                                     \
	})

static __always_inline u64 read_reg(struct pt_regs *ctx, u32 off)
{
	switch (off) {
	case 0: return CTX_U64(ctx, 0);
	case 8: return CTX_U64(ctx, 8);
	case 16: return CTX_U64(ctx, 16);
	case 24: return CTX_U64(ctx, 24);
	case 32: return CTX_U64(ctx, 32);
	case 40: return CTX_U64(ctx, 40);
	case 48: return CTX_U64(ctx, 48);
	case 56: return CTX_U64(ctx, 56);
	case 64: return CTX_U64(ctx, 64);
	case 72: return CTX_U64(ctx, 72);
	case 80: return CTX_U64(ctx, 80);
	case 88: return CTX_U64(ctx, 88);
	case 96: return CTX_U64(ctx, 96);
	case 104: return CTX_U64(ctx, 104);
	case 112: return CTX_U64(ctx, 112);
	case 128: return CTX_U64(ctx, 128);
	case 152: return CTX_U64(ctx, 152);
	}
	return 0; /* discover.py names no other register */
}

static __always_inline u64 fetch_arg(struct pt_regs *ctx,
				     const struct kvtrace_site *site,
				     const struct kvtrace_arg_spec *spec)
{
	u64 val = 0;

	switch (spec->kind) {
	case KVTRACE_ARG_CONST:
		val = spec->val_off;
		break;
	case KVTRACE_ARG_REG:
		val = read_reg(ctx, spec->reg_off);
		break;
	case KVTRACE_ARG_REG_DEREF:
		val = read_reg(ctx, spec->reg_off);
		bpf_probe_read_user(&val, sizeof(val),
				    (void *)(val + spec->val_off));
		break;
	case KVTRACE_ARG_TENSOR_DATA:
	case KVTRACE_ARG_TENSOR_SIZE:
	case KVTRACE_ARG_TENSOR_STRIDE:
		val = read_reg(ctx, spec->reg_off);
		val = fetch_tensor(val, spec->kind, spec->val_off, &site->tensor);
		break;
	case KVTRACE_ARG_STACK_TENSOR_DATA:
	case KVTRACE_ARG_STACK_TENSOR_SIZE:
	case KVTRACE_ARG_STACK_TENSOR_STRIDE:
		/* regs[reg_off] is the stack pointer; the at::Tensor& is on
		 * the stack (val_off >> 32 bytes up) */
		val = read_reg(ctx, spec->reg_off);
		val = read_u64(val + (spec->val_off >> 32));
		val = fetch_tensor(val, spec->kind - (KVTRACE_ARG_STACK_TENSOR_DATA -
						      KVTRACE_ARG_TENSOR_DATA),
				   spec->val_off & 0xffffffff, &site->tensor);
		break;
	}
	/* trim to the argument's size, then sign- or zero-extend */
	val <<= spec->bitshift & 63;
	if (spec->is_signed)
		val = ((s64)val) >> (spec->bitshift & 63);
	else
		val >>= spec->bitshift & 63;
	return val;
}

/* The memo word of cache_id at a site (struct kvtrace_cache_memo); NULL for
 * an id the memo cannot hold. */
static __always_inline u64 *memo_word(u32 site_idx, u64 cache_id)
{
	if ((cache_id & 15) || (cache_id >> 48))
		return NULL;
	struct kvtrace_cache_memo *m = cache_memo.lookup(&site_idx);
	if (!m)
		return NULL;
	/* Fibonacci hashing: the layers' caches lie a constant stride apart,
	 * which a plain mask would put in one slot */
	u64 slot = ((cache_id >> 4) * 0x9E3779B97F4A7C15ULL) >> 58;
	return &m->slot[slot & (KVTRACE_MEMO_SLOTS - 1)];
}

/* The cache (layer) an op touches; a new one gets the next row. */
static __always_inline struct kvtrace_cache *cache_of(u32 pid, u64 cache_id,
						      u32 op)
{
	struct kvtrace_cache_key key = {.pid = pid, .cache_id = cache_id};
	struct kvtrace_cache *c = caches.lookup(&key);
	if (c)
		return c;

	u32 idx = KVTRACE_G_NEXT_CACHE;
	u64 *next = globals.lookup(&idx);
	if (!next)
		return 0;
	struct kvtrace_cache init = {};
	u32 row;
#ifdef KVTRACE_WITH_INDEX_REUSE
	if (free_caches.pop(&row) != 0)
#endif
		row = __sync_fetch_and_add(next, 1);
	init.index = row;
	init.op = op;
	if (init.index >= KVTRACE_MAX_CACHES)
		global_add(KVTRACE_G_CACHE_FULL, 1);
	/* BPF_NOEXIST: if another CPU won the race, use its entry (our
	 * index is then simply never used) */
	caches.insert(&key, &init);
	c = caches.lookup(&key);
#ifdef KVTRACE_WITH_INDEX_REUSE
	/* a racing CPU's entry won the insert: the row taken goes back */
	if (c && c->index != row)
		free_caches.push(&row, 0);
#endif
	return c;
}

/* The KV-cache group a block_table op reads for; a new one gets the next
 * block_reads row and the calling layer as its leader. */
static __always_inline struct kvtrace_group *group_of(u32 pid, u64 group_id,
						      u64 layer_id, u64 bs,
						      u64 nblocks)
{
	struct kvtrace_group_key key = {.pid = pid, .group_id = group_id};
	struct kvtrace_group *g = groups.lookup(&key);
	if (g)
		return g;

	u32 idx = KVTRACE_G_NEXT_GROUP;
	u64 *next = globals.lookup(&idx);
	if (!next)
		return 0;
	struct kvtrace_group init = {};
	u32 row;
#ifdef KVTRACE_WITH_INDEX_REUSE
	if (free_groups.pop(&row) != 0)
#endif
		row = __sync_fetch_and_add(next, 1);
	init.index = row;
	init.leader = layer_id;
	init.block_size = bs;
	init.num_blocks = nblocks;
	if (init.index >= KVTRACE_MAX_GROUPS)
		global_add(KVTRACE_G_GROUP_FULL, 1);
	groups.insert(&key, &init); /* BPF_NOEXIST: a racing CPU's entry wins */
	g = groups.lookup(&key);
#ifdef KVTRACE_WITH_INDEX_REUSE
	if (g && g->index != row)
		free_groups.push(&row, 0);
#endif
	return g;
}

/*
 * Read the next chunk of the op's index array into chunk slot k of buf.
 * Returns how many values it read (1..KVTRACE_CHUNK), 0 when the array is
 * done, -1 on a fault.
 */
static __always_inline s64 next_chunk(struct work *w, struct chunk *buf, u32 k)
{
	u64 done = w->done, n = w->n;
	if (done >= n)
		return 0;
	u64 left = n - done;
	u64 cnt = min_bf(left, KVTRACE_CHUNK);
	OPAQUE(cnt);
	u32 size = (cnt & (2 * KVTRACE_CHUNK - 1)) * sizeof(s64);
	s64 *dst = buf->v + (k & (KVTRACE_RECORD_CHUNKS - 1)) * KVTRACE_CHUNK;
	if (bpf_probe_read_user(dst, size, (const s64 *)w->arr + done)) {
		w->err = 1;
		return -1;
	}
	w->done = done + cnt;
	return cnt;
}

/*
 * next_chunk() for the slot stages: a record's chunks are read by one
 * bpf_probe_read_user() at its first chunk (k == 0), not one each.  The
 * helper's own cost, about 150 ns a call here, was a third of what a slot
 * cost.  If that read faults, each chunk is read alone, as before, so the
 * chunks ahead of the fault still count.
 */
static __always_inline s64 next_slot_chunk(struct work *w, struct chunk *buf, u32 k)
{
	u64 done = w->done, n = w->n;
	if (done >= n)
		return 0;
	u64 left = n - done;
	if (k == 0) {
		u64 all = min_bf(left, RECORD_VALUES);
		OPAQUE(all);
		u32 size = (all & (2 * RECORD_VALUES - 1)) * sizeof(s64);
		w->record_read = bpf_probe_read_user(buf->v, size,
						     (const s64 *)w->arr + done) == 0;
	}
	if (!w->record_read)
		return next_chunk(w, buf, k);
	u64 cnt = min_bf(left, KVTRACE_CHUNK);
	w->done = done + cnt;
	return cnt;
}

/* Number the op for the stream; its chunk records carry the number. */
static __always_inline void start_record(struct work *w)
{
	w->ev.type = KVTRACE_REC_OP;
	w->ev.seq = 0;
	if (!OP_RECORDS || !RECORDED(w->ev.op))
		return;
	u32 idx = KVTRACE_G_NEXT_SEQ;
	u64 *next = globals.lookup(&idx);
	w->ev.seq = next ? __sync_fetch_and_add(next, 1) : 0;
}

/*
 * The index stream: send the values read since w->rec_start (up to
 * KVTRACE_RECORD_CHUNKS chunks of them) as one KVTRACE_REC_CHUNK record,
 * straight from the scratch buffer, and start the next record.  Outside the
 * per-item loop.  Returns 1 if the transport refused it.  Compiled in only
 * with the stream on, so plain `attach` does not pay for it.
 *
 * No branch: it is called on every exit path of a stage's loop, where a
 * branch would double the paths the verifier walks through the rest of the
 * program (a version with one walked 618k-810k instructions instead of
 * 350k).  So an empty record (an array whose length is a multiple of 512)
 * is sent too; user space skips it, and it is not counted in ev.chunks.
 */
static __always_inline u64 emit_chunk(struct pt_regs *ctx, struct work *w,
				      struct chunk *buf, const int streamed)
{
#if STREAM_VALUES || STREAM_BLOCK_IDS
	if (!streamed) /* a constant: the stage's code has no send at all */
		return 0;
	u64 cnt = w->done - w->rec_start;
	u64 some = lt(0, cnt);
	buf->hdr.type = KVTRACE_REC_CHUNK;
	buf->hdr.count = cnt;
	buf->hdr.seq = w->ev.seq;
	buf->hdr.offset = w->done - cnt;
	u64 size = sizeof(buf->hdr) + (cnt & (2 * RECORD_VALUES - 1)) * sizeof(s64);
	u64 failed = ((u64)(s64)submit_record(ctx, buf, size, w->ev.seq, 0) >> 63) & some;
	w->ev.chunks += (failed ^ 1) & some;
	w->rec_start = w->done;
	return failed;
#else
	return 0;
#endif
}

/* After a stage's chunk loop: losses are counted here, at the source, and
 * mark the op so that user space never uses its values half. */
static __always_inline void chunks_lost(struct work *w, u64 lost)
{
	if (lost) {
		w->ev.flags |= KVTRACE_EV_CHUNKS_LOST;
		global_add(KVTRACE_G_CHUNKS_LOST, lost);
	}
}

/*
 * The plugin tier: the request an event concerns.  One scheduler thread
 * fires them, one after the other; the adds are atomic all the same (a
 * second EngineCore, data parallel, is a second process and key).
 */
static __always_inline void request_event(struct work *w)
{
	struct kvtrace_event *ev = &w->ev;
	struct kvtrace_request_key key = {.pid = ev->pid, .req = ev->cache_id};
	struct kvtrace_request *r = requests.lookup(&key);
	if (!r) {
		u32 zero = 0;
		struct kvtrace_request *init = request_zero.lookup(&zero);
		if (init && !requests.insert(&key, init)) /* BPF_NOEXIST */
			global_add(KVTRACE_G_REQUESTS_SEEN, 1);
		r = requests.lookup(&key);
		if (!r) {
			global_add(KVTRACE_G_REQUEST_FULL, 1);
			return;
		}
	}
	if (!r->first_ns)
		r->first_ns = ev->ts_ns;
	r->last_ns = ev->ts_ns;
	switch (ev->op) {
	case KVTRACE_OP_REQUEST:
	{
		/* a name, capped: never more than KVTRACE_REQ_ID_LEN bytes */
		u32 n = w->id_len;
		if (n > KVTRACE_REQ_ID_LEN)
			n = KVTRACE_REQ_ID_LEN;
		r->prompt_tokens = ev->items;
		r->id_len = n;
		bpf_probe_read_user(r->id, n, (void *)w->arr);
		break;
	}
	case KVTRACE_OP_REQ_PREEMPT:
		__sync_fetch_and_add(&r->preemptions, 1);
		__sync_fetch_and_add(&r->recomputed, ev->items);
		break;
	case KVTRACE_OP_REQ_FINISH:
		r->finish_ns = ev->ts_ns;
		r->output_tokens = ev->items;
		break;
	default: {
		u32 kind = ev->op - KVTRACE_OP_BLOCK_ALLOC;
		if (kind < KVTRACE_NR_LIFE)
			__sync_fetch_and_add(&r->blocks[kind], ev->slots);
	}
	}
}

/* Everything an op does after its index array has been read. */
static __always_inline int finish(struct pt_regs *ctx, struct work *w)
{
	struct kvtrace_event *ev = &w->ev;
	u32 op = ev->op;
	u32 op_row = w->proc * KVTRACE_NR_OPS + op;
	struct kvtrace_op_stats *st = op_stats.lookup(&op_row);
	if (!st)
		return 0;

	u64 truncated = w->n > w->done ? w->n - w->done : 0;
	if (op == KVTRACE_OP_COPY_BLOCKS || op == KVTRACE_OP_SWAP_BLOCKS)
		truncated /= 2; /* values -> pairs */
	if (op == KVTRACE_OP_BLOCK_TABLE)
		truncated = w->trunc; /* rows not (wholly) read */
	if (op >= KVTRACE_OP_REQUEST && op <= KVTRACE_OP_REQ_FINISH)
		truncated = 0; /* no array */
	if (op == KVTRACE_OP_STEP_REQS && truncated > ev->items)
		truncated = ev->items; /* rows without their tokens */
	/* step_rows: deltas, of no use in part, so an op not wholly streamed
	 * counts all its rows (without the stream nothing is read: 0) */
	if (op == KVTRACE_OP_STEP_ROWS)
		truncated = w->next_n > w->done ? ev->items : 0;
	if (truncated)
		ev->flags |= KVTRACE_EV_TRUNCATED;
	if (w->err)
		ev->flags |= KVTRACE_EV_READ_ERROR;
	__sync_fetch_and_add(&st->calls, 1);
	__sync_fetch_and_add(&st->items, ev->items);
	__sync_fetch_and_add(&st->slots, ev->slots);
	__sync_fetch_and_add(&st->padding, ev->padding);
	__sync_fetch_and_add(&st->bytes, ev->bytes);
	__sync_fetch_and_add(&st->out_of_range, w->oor);
	__sync_fetch_and_add(&st->truncated, truncated);
	__sync_fetch_and_add(&st->read_errors, w->err ? 1 : 0);

	if (op == KVTRACE_OP_BLOCK_TABLE) {
		struct kvtrace_group_key gkey = {.pid = ev->pid,
						 .group_id = ev->cache_id};
		struct kvtrace_group *g = groups.lookup(&gkey);
		if (g) {
			__sync_fetch_and_add(&g->requests, ev->rows);
			__sync_fetch_and_add(&g->tokens, w->tokens);
			__sync_fetch_and_add(&g->reads, ev->items);
			__sync_fetch_and_add(&g->distinct, ev->slots);
			__sync_fetch_and_add(&g->held_tokens, ev->held_tokens);
			__sync_fetch_and_add(&g->null_entries, w->nulls);
			__sync_fetch_and_add(&g->out_of_range, w->oor);
			__sync_fetch_and_add(&g->truncated, truncated);
			__sync_fetch_and_add(&g->read_errors, w->err ? 1 : 0);
		}
	}

	if (op >= KVTRACE_OP_BLOCK_ALLOC && op <= KVTRACE_OP_REQ_FINISH)
		request_event(w);

	if (op <= KVTRACE_OP_CPU_ATTN_RESHAPE_AND_CACHE) {
		/* by the index cache_of() gave: (u32)-1 if none, out of range */
		u32 ci = ev->cache_index;
		struct kvtrace_cache_stats *c = cache_stats.lookup(&ci);
		if (c) {
			__sync_fetch_and_add(&c->calls, 1);
			__sync_fetch_and_add(&c->slots, ev->slots);
			__sync_fetch_and_add(&c->padding, ev->padding);
			__sync_fetch_and_add(&c->out_of_range, w->oor);
		}
	}

	u32 hist_row = op * KVTRACE_LOG2_SLOTS + bpf_log2l(ev->items);
	u64 *h = op_log2.lookup(&hist_row);
	if (h)
		__sync_fetch_and_add(h, 1);

#ifdef KVTRACE_WITH_STACKS
	ev->stack_id = stack_id_of(ctx);
	struct kvtrace_stack_key wkey = {.pid = ev->pid,
					 .stack_id = ev->stack_id,
					 .op = op,
					 .cache_index = ev->cache_index};
	u64 wzero = 0, *wt = stack_weights.lookup_or_try_init(&wkey, &wzero);
	/* weight: slots written, or pairs / entries moved */
	if (wt)
		__sync_fetch_and_add(wt, op <= KVTRACE_OP_CPU_ATTN_RESHAPE_AND_CACHE
					     ? ev->slots
					     : ev->items);
#else
	ev->stack_id = -1;
#endif
	/* counted here, at the source: the user-space lost callback only
	 * hears of losses once the buffer has room again */
	if (OP_RECORDS && RECORDED(op) &&
	    submit_record(ctx, ev, sizeof(*ev), ev->seq, 1) < 0)
		global_add(KVTRACE_G_RECORDS_LOST, 1);
	return 0;
}

/* The op in progress and the chunk buffer, for a stage; non-zero if absent. */
static __always_inline int stage_state(struct work **w, struct chunk **buf)
{
	u32 zero = 0;
	*w = work.lookup(&zero);
	*buf = scratch.lookup(&zero);
	return !*w || !*buf;
}

/*
 * Tail-call a stage whose key is a constant where this is inlined: the JIT
 * makes such a call a direct jump, where a key known only at run time costs
 * two loads and an indirect jump, a retpoline here (cold, as in vLLM, a
 * quarter of a microsecond).  The asm takes the key as an immediate, so
 * clang cannot merge two calls into one with a variable key.
 */
static __always_inline void stage_call(struct pt_regs *ctx, const u32 stage)
{
	stages.call(ctx, stage);
	asm volatile("" : : "i"(stage));
}

/* A stage's last step: go on with the next segment of the array if any is
 * left, else (or when the kernel's 33 tail calls are used up) finish. */
static __always_inline int next_segment_or_finish(struct pt_regs *ctx,
						  struct work *w, u32 stage)
{
	if (w->done < w->n && !w->err)
		stages.call(ctx, stage); /* returns only if the call failed */
	return finish(ctx, w);
}

/* Runs of kept slots in one block, (first slot, last slot), of one slot
 * stage run: the generations' fill is moved after the slot loop, in a loop
 * of its own, since the verifier walks the slot loop's branch once per
 * slot and gives up on a longer body there.  A run stage reads 2048
 * slots: at most 2048 runs.  A kept slot is below KVTRACE_MAX_BLOCKS *
 * KVTRACE_FILL_BINS (2^29 at most): 32 bits hold it.  (Per-CPU values
 * are at most 32 KiB.) */
#if GEN_FILL
#define KVTRACE_FILL_RUNS (KVTRACE_SLOT_SEGMENT_CHUNKS * KVTRACE_CHUNK)
struct fill_runs {
	u32 v[3 * KVTRACE_FILL_RUNS];
};
BPF_PERCPU_ARRAY(fill_runs, struct fill_runs, 1);

/* Keep a run that ended (written over by the next one unless it counts).
 * The count lives in w, not in a register: a register the verifier tracks
 * per path would keep it from merging the slot loop's paths. */
static __always_inline void keep_run(struct fill_runs *runs, struct work *w, u64 run,
				     u64 first, u64 last, u64 fill_on)
{
	u64 nr = w->fill_runs;
	u32 *r = &runs->v[3 * (nr & (KVTRACE_FILL_RUNS - 1))];
	r[0] = first;
	r[1] = last;
	r[2] = run;
	w->fill_runs = nr + (lt(0, run) & fill_on);
}
#endif

/*
 * Stage: count slot numbers into the cache's block_writes row.  Two
 * programs from one body: block sizes that are powers of two (vLLM's usual
 * 16, 32, 64...) shift instead of dividing, a 64-bit division being most of
 * the per-slot cost; other block sizes divide.
 */
static __always_inline int count_slots(struct pt_regs *ctx, const int pow2)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u32 row_idx = w->row;
	struct kvtrace_block_row *row = (struct kvtrace_block_row *)block_writes.lookup(&row_idx);
	if (!row)
		return 0;
	u64 keep = w->keep, block_size = w->block_size, shift = w->block_shift;
	u64 valid = 0, padding = 0, oor = 0, lost = 0;
	/* Consecutive slots of one block (a prefill writes block_size of them
	 * in a row) share one atomic add: the run's count is added when the
	 * block changes, and at the end of the segment.  The run also moves
	 * the block's generation (gen_fill): its first slot, at offset 0,
	 * starts one; its last, the highest offset (a request's slots in a
	 * block are consecutive and ascending; `skipped` counts runs that
	 * are not).  All slots of a run are kept, or none is. */
	/* no block: the first slot starts a run, whatever its block */
	u64 run_block = ~0ULL, run = 0, run_pad = 0;
	OPAQUE(keep);
#if GEN_FILL
	u64 first = 0, last = 0;
	struct kvtrace_fill_row *fr = (struct kvtrace_fill_row *)block_fill.lookup(&row_idx);
	u32 zero = 0;
	struct fill_runs *runs = fill_runs.lookup(&zero);
	if (!fr || !runs)
		return 0;
	/* fills are counted for block sizes below KVTRACE_FILL_BINS */
	u64 fill_on = keep & lt(block_size, KVTRACE_FILL_BINS);
	OPAQUE(fill_on);

	/* First the previous segment's runs, in order: their blocks'
	 * generations.  Here, at the program's start, the verifier walks this
	 * loop once; after the slot loop it would walk it again for each of
	 * that loop's many end states. */
	u64 pending = w->fill_runs, skipped = 0;
#pragma clang loop unroll(disable)
	for (u32 j = 0; j < KVTRACE_FILL_RUNS; j++) {
		if (j >= pending)
			break;
		u32 *r = &runs->v[3 * (j & (KVTRACE_FILL_RUNS - 1))];
		u64 first_slot = r[0], last_slot = r[1], n = r[2];
		u64 block = pow2 ? first_slot >> (shift & 63) : first_slot / block_size;
		u64 base = pow2 ? block << (shift & 63) : block * block_size;
		gen_fill(fr, &fr->fill[block & BLOCK_MASK], 1, nz(first_slot - base) ^ 1,
			 last_slot - base + 1, KVTRACE_FILL_SEEN);
		/* a request's slots: consecutive and ascending, so the run
		 * spans as many slots as it has */
		skipped += nz(last_slot - first_slot + 1 - n);
	}
	fr->skipped += skipped;
	w->fill_runs = 0;
#endif

	w->rec_start = w->done;

	/* A run's slots share a block, so they share what they are: padding
	 * (slot < 0, whose block is beyond any real one), out of range, or
	 * kept.  That is decided once per run, when it ends, and a slot in
	 * the middle of a run costs a load, a shift, a compare and an add
	 * (docs/design.md, "Reading 8192+ slots per op"). */
#define END_RUN()                                                             \
	do {                                                                  \
		u64 real_ = run_pad ^ 1;                                      \
		u64 kept_ = real_ & keep & lt(run_block, KVTRACE_MAX_BLOCKS); \
		valid += run & -real_;                                        \
		padding += run & -run_pad;                                    \
		oor += run & -(real_ & (kept_ ^ 1));                          \
		__sync_fetch_and_add(&row->count[run_block & BLOCK_MASK],     \
				     run & -kept_);                           \
		END_RUN_FILL(kept_);                                          \
	} while (0)
#if GEN_FILL
#define END_RUN_FILL(kept) keep_run(runs, w, run & -(kept), first, last, fill_on)
#else
#define END_RUN_FILL(kept) ((void)0)
#endif

#pragma clang loop unroll(disable)
	for (u32 c = 0; c < KVTRACE_SLOT_SEGMENT_CHUNKS; c++) {
		u32 k = c & (KVTRACE_RECORD_CHUNKS - 1); /* chunk in the record */
#if GEN_FILL
		if (w->err) /* a run only to move the last fills */
			break;
#endif
		s64 cnt = next_slot_chunk(w, buf, k);
		if (cnt <= 0)
			break;
#pragma clang loop unroll(disable)
		for (u32 i = 0; i < KVTRACE_CHUNK; i++) {
			/* a 1-slot op (a decode step's) walks one lane, not
			 * 64 (1-slot op: 1.68 -> 1.33-1.45 us) */
			if (i >= cnt)
				break;
			s64 slot = buf->v[k * KVTRACE_CHUNK + i];
			u64 block = pow2 ? (u64)slot >> (shift & 63)
					 : (u64)slot / block_size;
			if (block != run_block) {
				END_RUN();
				run_block = block;
				run = 0;
				run_pad = (u64)slot >> 63;
#if GEN_FILL
				first = slot;
#endif
			}
#if GEN_FILL
			last = slot;
#endif
			/* always 1; a constant 1 would give the verifier
			 * exact counts, each a state of its own, past 1M */
			run += lt(i, cnt);
		}
		/* c is known on every path: this is no branch for the verifier */
		if (k == KVTRACE_RECORD_CHUNKS - 1)
			lost += emit_chunk(ctx, w, buf, STREAM_VALUES);
	}
	END_RUN();
#undef END_RUN
#undef END_RUN_FILL
	lost += emit_chunk(ctx, w, buf, STREAM_VALUES); /* the rest, if any */
	w->ev.slots += valid;
	w->ev.padding += padding;
	w->oor += oor;
	chunks_lost(w, lost);
#if GEN_FILL
	/* the next segment, or a run with none left that moves this one's
	 * fills (then finishes) */
	if ((w->done < w->n && !w->err) || w->fill_runs)
		stages.call(ctx, pow2 ? KVTRACE_STAGE_SLOTS_POW2 : KVTRACE_STAGE_SLOTS);
	/* the kernel's 33 tail calls are used up: these runs' fills are lost */
	fr->skipped += w->fill_runs;
	return finish(ctx, w);
#else
	return next_segment_or_finish(
	    ctx, w, pow2 ? KVTRACE_STAGE_SLOTS_POW2 : KVTRACE_STAGE_SLOTS);
#endif
}

int kvtrace_stage_slots(struct pt_regs *ctx)
{
	return count_slots(ctx, 0);
}

int kvtrace_stage_slots_pow2(struct pt_regs *ctx)
{
	return count_slots(ctx, 1);
}

/* Stage: count (src, dst) block pairs into the process's move rows. */
int kvtrace_stage_pairs(struct pt_regs *ctx)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u32 s = w->src_row, d = w->dst_row;
	struct kvtrace_block_row *src_row = (struct kvtrace_block_row *)block_moves.lookup(&s);
	struct kvtrace_block_row *dst_row = (struct kvtrace_block_row *)block_moves.lookup(&d);
	if (!src_row || !dst_row)
		return 0;
#if GEN_FILL
	/* the cache's generations: a copy's destination and a swap-in's
	 * device block start one with the source's fill; a swap-out's host
	 * block keeps the device block's, for its swap-in */
	u64 ci = w->ev.cache_index, fill_on = lt(ci, KVTRACE_MAX_CACHES);
	u32 fi = ci & -fill_on;
	struct kvtrace_fill_row *fr = (struct kvtrace_fill_row *)block_fill.lookup(&fi);
	if (!fr)
		return 0;
#endif
	u64 src_on = w->src_on, dst_on = w->dst_on, oor = 0, lost = 0;
	u64 is_copy = w->ev.op == KVTRACE_OP_COPY_BLOCKS;
	/* the stream's reader needs the direction to find the device block */
	if (!is_copy)
		w->ev.flags |= src_on ? KVTRACE_EV_SWAP_OUT
				      : dst_on ? KVTRACE_EV_SWAP_IN : 0;
	OPAQUE(src_on);
	OPAQUE(dst_on);
#if GEN_FILL
	u64 is_out = src_on & (is_copy ^ 1), is_in = dst_on & (is_copy ^ 1);
	u64 starts = is_copy | is_in;
	OPAQUE(is_out);
	OPAQUE(is_in);
	OPAQUE(starts);
#endif

	w->rec_start = w->done;

#pragma clang loop unroll(disable)
	for (u32 c = 0; c < KVTRACE_PAIR_SEGMENT_CHUNKS; c++) {
		u32 k = c & (KVTRACE_RECORD_CHUNKS - 1);
		s64 cnt = next_chunk(w, buf, k);
		if (cnt <= 0)
			break;
#pragma clang loop unroll(disable)
		for (u32 i = 0; i < KVTRACE_CHUNK; i += 2) {
			u64 live = lt(i, cnt);
			u64 src = buf->v[k * KVTRACE_CHUNK + i];
			u64 dst = buf->v[k * KVTRACE_CHUNK + i + 1];
			u64 src_ok = live & src_on & lt(src, KVTRACE_MAX_BLOCKS);
			u64 dst_ok = live & dst_on & lt(dst, KVTRACE_MAX_BLOCKS);
			oor += (live & src_on & (src_ok ^ 1)) +
			       (live & dst_on & (dst_ok ^ 1));
			__sync_fetch_and_add(&src_row->count[src & BLOCK_MASK], src_ok);
			__sync_fetch_and_add(&dst_row->count[dst & BLOCK_MASK], dst_ok);
#if GEN_FILL
			u64 both = live & fill_on & lt(src, KVTRACE_MAX_BLOCKS) &
				   lt(dst, KVTRACE_MAX_BLOCKS);
			u16 *fs = &fr->fill[src & BLOCK_MASK], *hs = &fr->host[src & BLOCK_MASK];
			u16 *fd = &fr->fill[dst & BLOCK_MASK], *hd = &fr->host[dst & BLOCK_MASK];
			*hd = pick(both & is_out, *fs, *hd);
			u64 inherit = pick(is_in, *hs, *fs);
			gen_fill(fr, fd, both & starts, 1, inherit & (KVTRACE_FILL_BINS - 1),
				 inherit & KVTRACE_FILL_SEEN);
#endif
		}
		if (k == KVTRACE_RECORD_CHUNKS - 1)
			lost += emit_chunk(ctx, w, buf, STREAM_VALUES);
	}
	lost += emit_chunk(ctx, w, buf, STREAM_VALUES);
	w->oor += oor;
	chunks_lost(w, lost);
	return next_segment_or_finish(ctx, w, KVTRACE_STAGE_PAIRS);
}

/* The ids stage's state while its chunks are read: on the stage's stack,
 * handed to kvtrace_cb_ids by bpf_loop() (see struct table_loop). */
struct ids_loop {
	struct pt_regs *ctx;
	struct work *w;
	struct chunk *buf;
	struct table_chunk *tb;
	struct kvtrace_block_row *row;
	struct kvtrace_life_pages *pages;
	u64 valid, nulls, oor, lost;
};

/* One chunk of the ids stage: bpf_loop()'s callback, index c (the loop
 * was 295k instructions of the verifier's walk).  Returns 1 to stop. */
long kvtrace_cb_ids(u64 c)
{
	struct ids_loop *s = KVTRACE_CALLBACK_STATE();
	struct work *w = s->w;
	struct chunk *buf = s->buf;
	struct table_chunk *tb = s->tb;
	struct kvtrace_block_row *row = s->row;
	struct kvtrace_life_pages *pages = s->pages;
	u32 k = c & (KVTRACE_RECORD_CHUNKS - 1);
	u64 done = w->done, n = w->nids;
	if (done >= n)
		return 1;
	u64 left = n - done;
	u64 cnt = min_bf(left, KVTRACE_CHUNK);
	OPAQUE(cnt);
	u32 size = (cnt & (2 * KVTRACE_CHUNK - 1)) * sizeof(u32);
	if (bpf_probe_read_user(tb->v, size, (const u32 *)w->arr + done)) {
		w->err = 1;
		return 1;
	}
	w->done = done + cnt;
	u64 valid = 0, nulls = 0, oor = 0;
#pragma clang loop unroll(disable)
	for (u32 i = 0; i < KVTRACE_CHUNK; i++) {
		/* an event's few ids (a decode step's one block) walk as many
		 * lanes, not 64: each is an atomic add */
		if (i >= cnt)
			break;
		u64 id = tb->v[i]; /* a negative int32 is >= 2^31 here */
		u64 nz = lt(0, id);
		u64 ok = nz & lt(id, KVTRACE_MAX_BLOCKS);
		valid += ok;
		nulls += nz ^ 1;
		oor += nz & (ok ^ 1);
		__sync_fetch_and_add(&row->count[id & BLOCK_MASK], ok);
		/* its 64th of the range, or the sink (64) where not counted */
		u64 page = ((id & BLOCK_MASK) / KVTRACE_LIFE_PAGE) & 63;
		pages->v[(page & -ok) | (64 & -(ok ^ 1))] = 1;
#if STREAM_BLOCK_IDS
		buf->v[(k * KVTRACE_CHUNK + i) & (2 * RECORD_VALUES - 1)] =
		    (s64)(s32)tb->v[i];
#endif
	}
	s->valid += valid;
	s->nulls += nulls;
	s->oor += oor;
	if (k == KVTRACE_RECORD_CHUNKS - 1)
		s->lost += emit_chunk(s->ctx, w, buf, STREAM_BLOCK_IDS);
	return 0;
}

/*
 * Stage: count a lifecycle event's block ids (int32) into the process's
 * block_life row for the event.  Block 0, vLLM's null block, is never
 * counted (vLLM never hands it out; a 0 here is padding).  The ids are read
 * KVTRACE_CHUNK at a time, one chunk per callback; streamed, they go out as
 * int64 like the others.
 */
int kvtrace_stage_ids(struct pt_regs *ctx)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u32 zero = 0;
	struct table_chunk *tb = table_scratch.lookup(&zero);
	u32 r = w->row;
	struct kvtrace_block_row *row = (struct kvtrace_block_row *)block_life.lookup(&r);
	u32 pi = w->proc;
	struct kvtrace_life_pages *pages = life_pages.lookup(&pi);
	if (!tb || !row || !pages)
		return 0;
	struct ids_loop s = {.ctx = ctx, .w = w, .buf = buf, .tb = tb, .row = row,
			     .pages = pages};

	w->rec_start = w->done;
	bpf_loop(KVTRACE_SEGMENT_CHUNKS, KVTRACE_CALLBACK(KVTRACE_CB_IDS), &s, 0);
	u64 valid = s.valid, nulls = s.nulls, oor = s.oor, lost = s.lost;
	lost += emit_chunk(ctx, w, buf, STREAM_BLOCK_IDS);
	w->ev.slots += valid;
	w->ev.padding += nulls;
	w->oor += oor;
	chunks_lost(w, lost);
	if (w->done < w->nids && !w->err)
		stages.call(ctx, KVTRACE_STAGE_IDS);
	if (w->done < w->n && !w->err) {
		/* the hashes: value i of the stream is hashes[i - nids] */
		w->arr = w->hashes - 8 * w->nids;
		stages.call(ctx, KVTRACE_STAGE_HASHES);
	}
	return finish(ctx, w);
}

/* Stage: stream a block event's content hashes (int64 each), after its
 * ids, prefix_hashes' hashes, step_reqs' rows, or step_rows' rows and then
 * its tail (the second array, next_arr, read in int64 words); nothing is
 * counted from them in the kernel.  Streamed with the block ids
 * (--prometheus's stream too): step_reqs and step_rows, whose rows only a
 * recording uses, set no values to stream without STREAM_VALUES. */
int kvtrace_stage_hashes(struct pt_regs *ctx)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u64 lost = 0;

	w->rec_start = w->done;

#pragma clang loop unroll(disable)
	for (u32 c = 0; c < KVTRACE_SEGMENT_CHUNKS; c++) {
		u32 k = c & (KVTRACE_RECORD_CHUNKS - 1);
		if (next_chunk(w, buf, k) <= 0)
			break;
		if (k == KVTRACE_RECORD_CHUNKS - 1)
			lost += emit_chunk(ctx, w, buf, STREAM_BLOCK_IDS);
	}
	lost += emit_chunk(ctx, w, buf, STREAM_BLOCK_IDS);
	chunks_lost(w, lost);
	if (w->done >= w->n && w->next_n > w->n && !w->err) {
		/* the second array: value i of the stream is its word i - n */
		w->arr = w->next_arr - 8 * w->n;
		w->n = w->next_n;
	}
	return next_segment_or_finish(ctx, w, KVTRACE_STAGE_HASHES);
}

/* Stage: sum the sizes array of swap_blocks_batch. */
int kvtrace_stage_sizes(struct pt_regs *ctx)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u64 bytes = 0;

#pragma clang loop unroll(disable)
	for (u32 c = 0; c < KVTRACE_SEGMENT_CHUNKS; c++) {
		s64 cnt = next_chunk(w, buf, 0);
		if (cnt <= 0)
			break;
#pragma clang loop unroll(disable)
		for (u32 i = 0; i < KVTRACE_CHUNK; i++)
			bytes += (u64)buf->v[i] & -lt(i, cnt);
	}
	w->ev.bytes += bytes;
	return next_segment_or_finish(ctx, w, KVTRACE_STAGE_SIZES);
}

/*
 * Stage: count a block table's entries into the group's block_reads row.
 * Row after row: the row's seq_len, then its ceil(seq_len / block_size)
 * entries, KVTRACE_TABLE_CHUNK per read, counted in runs of TABLE_RUN
 * while the row lasts.  Per entry, branch-free: one add to its read
 * counter, and a swap of its last-read step, which also says whether
 * another request already read it at this step (distinct blocks: the
 * step's live set).  Only the group's leader layer reads, one
 * step after the other (a model's forward steps do not overlap), so neither
 * the counter nor the stamp needs an atomic: a lock-prefixed add was most
 * of the per-entry cost.
 *
 * Tokens held in the step's live set: every distinct block holds
 * block_size tokens but a row's last one, which holds what is left of its
 * seq_len; the gap is counted when the row's last entry is a fresh block.
 *
 * The inner loop keeps few values live (the verifier walks it entry by
 * entry, and every spill to the stack costs instructions there): its three
 * counts share one register, packed 16 bits apart (at most 256 each).
 */
/* Entries per run of the table stage's inner loop (see kvtrace_cb_table). */
#define TABLE_RUN 16
#define PACK_OK 1ULL
#define PACK_FRESH (1ULL << 16)
#define PACK_REAL (1ULL << 32)

/*
 * The table stage's state while its chunks are read: on the stage's stack,
 * handed to kvtrace_cb_table by bpf_loop().  The pointers are the stage's
 * own (map values, ctx); the verifier follows them into the callback.
 */
struct table_loop {
	struct pt_regs *ctx;
	struct work *w;
	struct chunk *buf;
	struct table_chunk *tb;
	struct kvtrace_read_row *row;
	u64 step, bs, gap, col, row_len, row_addr, next_row, n, rows, tokens;
	u64 counted, distinct, real, entries, lost, gaps;
};

/*
 * One chunk of the table stage: bpf_loop()'s callback, index c.  The
 * verifier walks a bounded loop iteration by iteration, but a callback
 * once per state it starts from: the chunk loop was 718k of the 1.78M
 * instructions the verifier walked at every attach.
 * Returns 1 to stop the loop.
 *
 * Starting the next row is branch-free (its seq_len is read on every
 * chunk and used only when the row before is done): a branch here would
 * make the verifier walk the inner loop once per path.
 */
long kvtrace_cb_table(u64 c)
{
	struct table_loop *s = KVTRACE_CALLBACK_STATE();
	struct work *w = s->w;
	struct chunk *buf = s->buf;
	struct table_chunk *tb = s->tb;
	struct kvtrace_read_row *row = s->row;
	u64 col = s->col, row_len = s->row_len, next_row = s->next_row;
	u64 step = s->step, bs = s->bs, gap = s->gap;
	OPAQUE(step);

	u64 adv = lt(col, row_len) ^ 1; /* this row is done */
	if (adv & (lt(next_row, s->n) ^ 1))
		return 1; /* and it was the last */
	s32 seq = 0;
	bpf_probe_read_user(&seq, sizeof(seq), (void *)(w->seqs + 4 * next_row));
	u64 sl = (u64)(s64)seq & -lt(0, (u64)(s64)seq) & -lt(seq, 1ULL << 31);
	/* one division per row (a shift for powers of two would be a branch,
	 * and the verifier would walk the inner loop twice) */
	u64 len = (sl + bs - 1) / bs;
	u64 m = -adv;
	row_len = (row_len & ~m) | (len & m);
	gap = (gap & ~m) | ((len * bs - sl) & m); /* the last block's room */
	u64 row_addr = (s->row_addr & ~m) | ((w->arr + 4 * w->stride * next_row) & m);
	col &= ~m;
	next_row += adv;
	s->rows += adv;
	s->tokens += sl & m;
#if STREAM_VALUES
	u64 pos = w->pos;
	buf->v[pos & (2 * RECORD_VALUES - 1)] = sl;
	pos += adv;
#endif
	s->row_len = row_len;
	s->gap = gap;
	s->row_addr = row_addr;
	s->next_row = next_row;
	u64 left = row_len - col;
	u64 cnt = min_bf(left, KVTRACE_TABLE_CHUNK);
	OPAQUE(cnt);
	u32 size = (cnt & (2 * KVTRACE_TABLE_CHUNK - 1)) * sizeof(u32);
	if (bpf_probe_read_user(tb->v, size, (void *)(row_addr + 4 * col))) {
		s->col = col;
#if STREAM_VALUES
		w->pos = pos;
#endif
		w->err = 1;
		return 1;
	}
	col += cnt;
	s->col = col;
	s->entries += cnt;
	/* the row's last entry, if it is in this chunk, is counted after the
	 * loop, alone: its block's fill is what is left */
	u64 end = (lt(col, row_len) ^ 1) & lt(0, cnt);
	u64 body = cnt - end;
	u64 last = tb->v[(cnt - 1) & (2 * KVTRACE_TABLE_CHUNK - 1)];
	/* The loop reads whole runs of TABLE_RUN entries: what a run holds
	 * past the body reads as block 0, the null block, which counts for
	 * nothing.  So the body needs no mask of its own. */
#pragma clang loop unroll(full)
	for (u32 k = 0; k < TABLE_RUN; k++)
		tb->v[(body + k) & (2 * KVTRACE_TABLE_CHUNK - 1)] = 0;
	u64 acc = 0;
	/* Run by run while the body lasts: a short row (a decode's few
	 * blocks) costs one run, not the whole chunk. */
#pragma clang loop unroll(disable)
	for (u32 j = 0; j < KVTRACE_TABLE_CHUNK; j += TABLE_RUN) {
		if (j >= body)
			break;
#pragma clang loop unroll_count(4)
		for (u32 k = 0; k < TABLE_RUN; k++) {
			u32 i = j + k;
			u64 b = tb->v[i];
			u64 real = lt(0, b);
			u64 ok = real & lt(b, KVTRACE_MAX_BLOCKS);
			/* An entry not counted goes to block 0's, which no read
			 * counts (its stamp is not reported: session.py), so the
			 * stamp is written without a mask. */
			struct kvtrace_block_read *e = &row->b[b & -ok & BLOCK_MASK];
			e->reads += ok;
			u64 old = e->last_step;
			e->last_step = step;
			acc += ok * PACK_OK + PACK_FRESH * (ok & lt(0, old ^ step)) +
			       real * PACK_REAL;
#if STREAM_VALUES
			buf->v[(pos + i) & (2 * RECORD_VALUES - 1)] = b;
#endif
		}
	}
	{
		u64 b = last;
		u64 r = end & lt(0, b);
		u64 ok = r & lt(b, KVTRACE_MAX_BLOCKS);
		struct kvtrace_block_read *e = &row->b[b & BLOCK_MASK];
		e->reads += ok;
		u64 old = e->last_step;
		u64 fresh = ok & lt(0, old ^ step);
		e->last_step = old ^ ((old ^ step) & -ok);
		acc += ok * PACK_OK + PACK_FRESH * fresh + r * PACK_REAL;
		s->gaps += gap & -fresh;
#if STREAM_VALUES
		/* the loop wrote a null in its place (pos itself when cnt is
		 * 0: past what is sent) */
		buf->v[(pos + cnt - lt(0, cnt)) & (2 * RECORD_VALUES - 1)] = b;
#endif
	}
	s->counted += acc & 0xffff;
	s->distinct += (acc >> 16) & 0xffff;
	s->real += acc >> 32;
#if STREAM_VALUES
	pos += cnt;
	/* Every chunk sends what is waiting: at most 257 values, within a
	 * record (RECORD_VALUES). */
	w->done += pos;
	s->lost += emit_chunk(s->ctx, w, buf, STREAM_VALUES);
	w->pos = 0;
#endif
	return 0;
}

int kvtrace_stage_table(struct pt_regs *ctx)
{
	struct work *w;
	struct chunk *buf;
	if (stage_state(&w, &buf))
		return 0;
	u32 zero = 0;
	struct table_chunk *tb = table_scratch.lookup(&zero);
	u32 row_idx = w->row;
	struct kvtrace_read_row *row = (struct kvtrace_read_row *)block_reads.lookup(&row_idx);
	if (!tb || !row)
		return 0;
	struct table_loop s = {
		.ctx = ctx, .w = w, .buf = buf, .tb = tb, .row = row,
		.step = w->step, .bs = w->block_size, .gap = w->gap,
		.col = w->col, .row_len = w->row_len, .row_addr = w->row_addr,
		.next_row = w->next_row, .n = w->n,
	};
	w->rec_start = w->done;
	w->pos = 0;
	/* one chunk per iteration */
	bpf_loop(KVTRACE_TABLE_SEGMENT_CHUNKS, KVTRACE_CALLBACK(KVTRACE_CB_TABLE), &s, 0);
	u64 bs = s.bs, counted = s.counted, distinct = s.distinct, gaps = s.gaps;
	u64 entries = s.entries, real = s.real, lost = s.lost;
	w->col = s.col;
	w->row_len = s.row_len;
	w->row_addr = s.row_addr;
	w->next_row = s.next_row;
	w->gap = s.gap;
	w->ev.rows += s.rows;
	w->tokens += s.tokens;
	w->done += w->pos;
	lost += emit_chunk(ctx, w, buf, STREAM_VALUES); /* the rest, if any */
	if (!w->keep) /* counted into the sink row: none of it is kept */
		counted = distinct = gaps = 0;
	w->ev.items += counted;
	w->ev.slots += distinct;
	w->ev.held_tokens += distinct * bs - gaps;
	w->ev.padding += entries - counted;
	w->nulls += entries - real;
	w->oor += real - counted;
	chunks_lost(w, lost);
	if (!w->err && (w->next_row < w->n || w->col < w->row_len))
		stages.call(ctx, KVTRACE_STAGE_TABLE); /* returns only if it failed */
	/* rows not wholly read: the tail calls ran out, or a read failed */
	w->trunc = w->n - w->next_row + (w->col < w->row_len ? 1 : 0);
	w->ev.bytes = w->tokens;
	return finish(ctx, w);
}

int kvtrace_site_hit(struct pt_regs *ctx)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 pid = pid_tgid >> 32;

	/* The site's row: a link's cookie (row + 1), or on perf events the
	 * row of (pid, address).  A uprobe in a shared library fires for every
	 * process mapping it; a row holds its process's pid and is written only
	 * for traced processes, so a hit on one needs no other lookup; a miss
	 * is told apart (a process we were not asked to trace, or a site not
	 * described) only then. */
#ifdef KVTRACE_SITE_COOKIES
	u32 site_idx = (u32)bpf_get_attach_cookie(ctx) - 1;
#else
	struct kvtrace_site_key skey = {.pid = pid, .ip = PT_REGS_IP(ctx)};
	u32 *found = site_index.lookup(&skey);
	u32 site_idx = found ? *found : KVTRACE_MAX_SITES;
#endif
	struct kvtrace_site *site = sites.lookup(&site_idx);
	if (!site || site->pid != pid) {
		global_add(traced_pids.lookup(&pid) ? KVTRACE_G_NO_SITE
						    : KVTRACE_G_FOREIGN, 1);
		return 0;
	}
	u32 proc_index = site->proc;
	if (proc_index >= KVTRACE_MAX_PROCS)
		return 0;

	/* A step's table is read at one layer of its group, the leader; the
	 * other layers' calls are known by two arguments, before the other six
	 * are read (stock vLLM's op reads 27 words of tensors for all eight,
	 * at every layer: a model of 32 layers wasted 31 such reads a step) */
	u64 a[KVTRACE_MAX_ARGS] = {};
	u32 fetched = 0; /* the arguments already in a[], by bit */
	if (site->op == KVTRACE_OP_BLOCK_TABLE && site->nargs == 8) {
		a[5] = fetch_arg(ctx, site, &site->args[5]); /* group id */
		a[7] = fetch_arg(ctx, site, &site->args[7]); /* layer id */
		fetched = 1 << 5 | 1 << 7;
		struct kvtrace_group_key gkey = {.pid = pid, .group_id = a[5]};
		struct kvtrace_group *g = groups.lookup(&gkey);
		if (g && g->leader != a[7]) {
			__sync_fetch_and_add(&g->layer_calls, 1);
			return 0;
		}
	}
#pragma unroll
	for (int i = 0; i < KVTRACE_MAX_ARGS; i++)
		if (i < site->nargs && !(fetched & (1 << i)))
			a[i] = fetch_arg(ctx, site, &site->args[i]);

	u32 zero = 0;
	struct work *w = work.lookup(&zero);
	if (!w)
		return 0;
	__builtin_memset(w, 0, sizeof(*w));
	u32 op = site->op;
	w->ev.ts_ns = bpf_ktime_get_ns();
	w->ev.pid = pid;
	w->ev.tid = (u32)pid_tgid;
	w->ev.op = op;
	w->ev.cache_index = (u32)-1;
	w->proc = proc_index;
	u32 stage;

	if (op <= KVTRACE_OP_CPU_ATTN_RESHAPE_AND_CACHE) {
		/* (slots, num_tokens, block_size, cache_id, num_blocks) */
		u64 n = (s64)a[1] > 0 ? a[1] : 0, bs = a[2];
		if (bs == 0 || (s64)bs < 0) {
			/* no usable block size: a malformed probe, or a tensor
			 * that could not be read.  Counted as a read error,
			 * not dropped. */
			w->ev.items = n;
			w->err = 1;
			start_record(w);
			return finish(ctx, w);
		}
		/* a cache this site wrote before is in its memo: no hash lookup */
		u64 *memo = memo_word(site_idx, a[3]);
		u64 seen = memo ? *memo : 0;
		u32 index;
		if (seen && seen >> KVTRACE_MEMO_INDEX_BITS == a[3] >> 4) {
			index = (seen & ((1 << KVTRACE_MEMO_INDEX_BITS) - 1)) - 1;
		} else {
			struct kvtrace_cache *c = cache_of(pid, a[3], op);
			if (!c)
				return 0;
			if (!c->block_size) { /* first seen by a copy or swap */
				c->block_size = bs;
				c->num_blocks = a[4];
			}
			index = c->index;
			/* memoized once its block size is set, so that a hit
			 * never needs the entry */
			if (memo)
				*memo = (a[3] >> 4) << KVTRACE_MEMO_INDEX_BITS | (index + 1);
		}
		w->arr = a[0];
		w->n = n;
		w->block_size = bs;
		w->keep = index < KVTRACE_MAX_CACHES;
		w->row = w->keep ? index : 0;
		w->ev.cache_index = index;
		w->ev.cache_id = a[3];
		w->ev.items = n;
		stage = KVTRACE_STAGE_SLOTS;
		if (!(bs & (bs - 1))) {
			w->block_shift = bpf_log2l(bs) - 1; /* bcc: floor(log2) + 1 */
			stage = KVTRACE_STAGE_SLOTS_POW2;
		}
	} else if (op == KVTRACE_OP_COPY_BLOCKS || op == KVTRACE_OP_SWAP_BLOCKS) {
		/* copy: (pairs, n, bytes_per_block, cache_id)
		 * swap: (pairs, n, bytes_per_block, direction, cache_id) */
		u64 n = (s64)a[1] > 0 ? a[1] : 0;
		u64 cache_id = op == KVTRACE_OP_COPY_BLOCKS ? a[3] : a[4];
		u32 base = proc_index * KVTRACE_NR_MOVES;
		if (op == KVTRACE_OP_COPY_BLOCKS) {
			w->src_row = base + KVTRACE_MOVE_COPY_SRC;
			w->dst_row = base + KVTRACE_MOVE_COPY_DST;
			w->src_on = w->dst_on = 1;
		} else {
			/* count the device-side block of each pair */
			w->src_row = base + KVTRACE_MOVE_SWAP_OUT;
			w->dst_row = base + KVTRACE_MOVE_SWAP_IN;
			w->src_on = a[3] == KVTRACE_DIR_OUT;
			w->dst_on = a[3] == KVTRACE_DIR_IN;
		}
		struct kvtrace_cache *c = cache_of(pid, cache_id, op);
		if (!c)
			return 0;
		w->arr = a[0];
		w->n = n * 2;
		w->ev.cache_index = c->index;
		w->ev.cache_id = cache_id;
		w->ev.items = n;
		w->ev.bytes = n * a[2];
		stage = KVTRACE_STAGE_PAIRS;
	} else if (op == KVTRACE_OP_BLOCK_TABLE) {
		/* (table, row_stride, num_reqs, seq_lens, block_size, group_id,
		 *  num_blocks, layer_id) */
		u64 bs = a[4];
		struct kvtrace_group *g = group_of(pid, a[5], a[7], bs, a[6]);
		if (!g)
			return 0;
		__sync_fetch_and_add(&g->layer_calls, 1);
		/* the group's other layers read the same table at this step:
		 * counted as calls, the table is read once */
		if (g->leader != a[7])
			return 0;
		w->ev.cache_id = a[5];
		w->ev.cache_index = g->index;
		w->step = __sync_fetch_and_add(&g->steps, 1) + 1;
		w->n = (s64)a[2] > 0 ? a[2] : 0;
		if (bs == 0 || (s64)bs < 0) { /* unusable: a read error */
			w->err = 1;
			w->trunc = w->n;
			start_record(w);
			return finish(ctx, w);
		}
		w->arr = a[0];
		w->stride = a[1];
		w->seqs = a[3];
		w->block_size = bs;
		w->keep = g->index < KVTRACE_MAX_GROUPS;
		w->row = w->keep ? g->index : KVTRACE_MAX_GROUPS; /* the sink */
		stage = KVTRACE_STAGE_TABLE;
	} else if (op >= KVTRACE_OP_BLOCK_ALLOC && op <= KVTRACE_OP_BLOCK_EVICT) {
		/* (req, group_id, block_ids, num_ids, num_blocks[, hashes]) */
		u64 n = (s64)a[3] > 0 ? a[3] : 0;
		w->ev.cache_id = a[0];
		w->ev.cache_index = (u32)a[1];
		w->ev.items = n;
		w->ev.bytes = a[4];
		w->arr = a[2];
		w->n = w->nids = n;
#if STREAM_BLOCK_IDS
		/* the content hashes follow the ids in the stream (miss-ratio
		 * curves and miss causes: report, and --prometheus's); without
		 * the stream they are not read */
		if (a[5] && n) {
			w->hashes = a[5];
			w->n = 2 * n;
			w->ev.flags |= KVTRACE_EV_HASHES;
		}
#endif
		w->row = proc_index * KVTRACE_NR_LIFE + (op - KVTRACE_OP_BLOCK_ALLOC);
		stage = KVTRACE_STAGE_IDS;
	} else if (op >= KVTRACE_OP_REQUEST && op <= KVTRACE_OP_REQ_FINISH) {
		/* request: (req, id, id_len, prompt_tokens)
		 * req_preempt, req_finish: (req, tokens) */
		w->ev.cache_id = a[0];
		if (op == KVTRACE_OP_REQUEST) {
			w->arr = a[1];
			w->id_len = (s64)a[2] > 0 ? (a[2] > KVTRACE_REQ_ID_LEN
						     ? KVTRACE_REQ_ID_LEN : a[2]) : 0;
			w->ev.items = a[3];
		} else {
			w->ev.items = a[1];
		}
		start_record(w);
		return finish(ctx, w);
	} else if (op == KVTRACE_OP_STEP_REQS) {
		/* (rows, num_reqs): rows streamed as they are, nothing counted
		 * (report joins them to the step's block-table rows) */
		u64 n = (s64)a[1] > 0 ? a[1] : 0;
		w->ev.items = n;
#if STREAM_VALUES
		w->arr = a[0];
		w->n = 2 * n;
#endif
		stage = KVTRACE_STAGE_HASHES;
	} else if (op == KVTRACE_OP_STEP_ROWS) {
		/* (rows, num_rows, tail, num_tail, group_id, block_size,
		 *  num_blocks): the rows' records, then the tail's int32
		 * entries in int64 words (the buffer holds an even number),
		 * streamed as they are; nothing is counted per block.  The
		 * tracer keeps the rows from them (docs/design.md) */
		u64 n = (s64)a[1] > 0 ? a[1] : 0, nt = (s64)a[3] > 0 ? a[3] : 0;
		w->ev.cache_id = a[4];
		w->ev.cache_index = (u32)a[4];
		w->ev.items = n;
		w->ev.slots = nt;
		w->ev.rows = a[5];
		w->ev.held_tokens = a[6];
#if STREAM_BLOCK_IDS
		w->arr = a[0];
		w->n = 5 * n;
		w->next_arr = a[2];
		w->next_n = 5 * n + (nt + 1) / 2;
		if (!w->n) { /* no rows: the tail alone (none, in practice) */
			w->arr = a[2];
			w->n = w->next_n;
		}
#endif
		stage = KVTRACE_STAGE_HASHES;
	} else if (op == KVTRACE_OP_PREFIX_HASHES) {
		/* (req, hashes, num_hashes, tokens_per_hash, block_size,
		 * domain): the hashes streamed as they are, nothing counted
		 * (report's miss causes join them to the block events) */
		u64 n = (s64)a[2] > 0 ? a[2] : 0;
		w->ev.cache_id = a[0];
		w->ev.cache_index = (u32)a[3];
		/* the op's own two fields, summed nowhere (no block_table) */
		w->ev.rows = a[4];
		w->ev.held_tokens = a[5];
		w->ev.items = n;
#if STREAM_BLOCK_IDS
		w->arr = a[1];
		w->n = n;
#endif
		stage = KVTRACE_STAGE_HASHES;
	} else if (op == KVTRACE_OP_SWAP_BLOCKS_BATCH) {
		/* (src_ptrs, dst_ptrs, sizes, count): no block numbers here */
		u64 n = (s64)a[3] > 0 ? a[3] : 0;
		w->arr = a[2];
		w->n = n;
		w->ev.items = n;
		stage = KVTRACE_STAGE_SIZES;
	} else {
		return 0;
	}

	start_record(w);
	/* one call site per stage, each key a constant (stage_call()) */
	if (w->n) {
		switch (stage) {
		case KVTRACE_STAGE_SLOTS: stage_call(ctx, KVTRACE_STAGE_SLOTS); break;
		case KVTRACE_STAGE_SLOTS_POW2: stage_call(ctx, KVTRACE_STAGE_SLOTS_POW2); break;
		case KVTRACE_STAGE_PAIRS: stage_call(ctx, KVTRACE_STAGE_PAIRS); break;
		case KVTRACE_STAGE_SIZES: stage_call(ctx, KVTRACE_STAGE_SIZES); break;
		case KVTRACE_STAGE_TABLE: stage_call(ctx, KVTRACE_STAGE_TABLE); break;
		case KVTRACE_STAGE_IDS: stage_call(ctx, KVTRACE_STAGE_IDS); break;
		case KVTRACE_STAGE_HASHES: stage_call(ctx, KVTRACE_STAGE_HASHES); break;
		}
	}
	/* reached with nothing to read, or if the stage is missing */
	w->err = w->n ? 1 : 0;
	w->trunc = w->n; /* block_table: no row was read */
	return finish(ctx, w);
}

/*
 * For `attach -- CMD`: fires once at the new program's entry point, after
 * the dynamic loader mapped its libraries and before any of its code ran,
 * and stops it so the front end can attach to the probes in those
 * libraries.  A signal, not a write to the target's memory.
 */
int kvtrace_stop_at_entry(struct pt_regs *ctx)
{
	u32 pid = bpf_get_current_pid_tgid() >> 32;
	if (traced_pids.lookup(&pid))
		bpf_send_signal(19 /* SIGSTOP */);
	return 0;
}
