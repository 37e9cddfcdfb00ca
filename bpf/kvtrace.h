/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvtrace.h - the few layouts the BPF program (kvtrace.bpf.c) and the Python
 * front end share, in the manner of libbpf-tools' X.h.  The front end reads
 * the enums and limits below from this file (tracer/abi.py) and gets the
 * struct layouts from bcc, which compiles this same file; nothing here is
 * written down twice.
 */
#ifndef KVTRACE_H
#define KVTRACE_H

/* Operations, one per USDT probe name in bpf/kvtrace_probes.h. */
enum kvtrace_op {
	KVTRACE_OP_RESHAPE_AND_CACHE = 0,
	KVTRACE_OP_RESHAPE_AND_CACHE_FLASH = 1,
	KVTRACE_OP_CONCAT_AND_CACHE_MLA = 2,
	KVTRACE_OP_CPU_ATTN_RESHAPE_AND_CACHE = 3,
	KVTRACE_OP_COPY_BLOCKS = 4,
	KVTRACE_OP_SWAP_BLOCKS = 5,
	KVTRACE_OP_SWAP_BLOCKS_BATCH = 6,
	KVTRACE_OP_BLOCK_TABLE = 7, /* reads: the blocks attention reads at a step */
	/* the plugin tier (the scheduler's decisions): BLOCK_ALLOC..BLOCK_EVICT
	 * in the order of enum kvtrace_life */
	KVTRACE_OP_BLOCK_ALLOC = 8,
	KVTRACE_OP_BLOCK_HIT = 9,
	KVTRACE_OP_BLOCK_CACHE = 10,
	KVTRACE_OP_BLOCK_FREE = 11,
	KVTRACE_OP_BLOCK_EVICT = 12,
	KVTRACE_OP_REQUEST = 13,
	KVTRACE_OP_REQ_PREEMPT = 14,
	KVTRACE_OP_REQ_FINISH = 15,
	KVTRACE_OP_STEP_REQS = 16, /* the requests of a step's block-table rows */
	KVTRACE_OP_STEP_ROWS = 17, /* a step's rows as deltas (the plugin's default) */
	KVTRACE_OP_PREFIX_HASHES = 18, /* a prompt's token hashes, finer than a block */
	KVTRACE_NR_OPS = 19,
};

/* Per-block movement counters: the rows of block_moves for one process are
 * proc_index * KVTRACE_NR_MOVES + kind. */
enum kvtrace_move {
	KVTRACE_MOVE_COPY_SRC = 0,
	KVTRACE_MOVE_COPY_DST = 1,
	KVTRACE_MOVE_SWAP_OUT = 2, /* device block of a device->host swap */
	KVTRACE_MOVE_SWAP_IN = 3,  /* device block of a host->device swap */
	KVTRACE_NR_MOVES = 4,
};

/* Per-block lifecycle counters (the plugin tier): the rows of block_life for
 * one process are proc_index * KVTRACE_NR_LIFE + kind, kind = op -
 * KVTRACE_OP_BLOCK_ALLOC.  A block's count is how many times the event
 * happened to it (block_hit: how many requests shared it from the cache). */
enum kvtrace_life {
	KVTRACE_LIFE_ALLOC = 0,
	KVTRACE_LIFE_HIT = 1,
	KVTRACE_LIFE_CACHE = 2,
	KVTRACE_LIFE_FREE = 3,
	KVTRACE_LIFE_EVICT = 4,
	KVTRACE_NR_LIFE = 5,
};

/* Indices of the globals array. */
enum kvtrace_global {
	KVTRACE_G_NEXT_CACHE = 0,   /* next free cache index */
	KVTRACE_G_FOREIGN = 1,      /* hits from processes we do not trace */
	KVTRACE_G_NO_SITE = 2,      /* hits at an address with no site spec */
	KVTRACE_G_CACHE_FULL = 3,   /* caches beyond KVTRACE_MAX_CACHES */
	KVTRACE_G_RECORDS_LOST = 4, /* per-op records the perf buffer refused */
	KVTRACE_G_NEXT_SEQ = 5,     /* next op sequence number (struct kvtrace_event.seq) */
	KVTRACE_G_CHUNKS_LOST = 6,  /* index chunk records the perf buffer refused */
	KVTRACE_G_NEXT_GROUP = 7,   /* next free group index (block_reads row) */
	KVTRACE_G_GROUP_FULL = 8,   /* groups beyond KVTRACE_MAX_GROUPS */
	KVTRACE_G_REQUEST_FULL = 9, /* lifecycle events of requests the requests
				     * map had no room for (counted per block
				     * all the same) */
	KVTRACE_G_REQUESTS_SEEN = 10, /* requests entered into `requests`: more
				       * than it holds = some were evicted */
	KVTRACE_G_NEXT_STACK = 11,  /* next number for a collided stack
				     * (KVTRACE_STACK_COLLIDED + n) */
	KVTRACE_NR_GLOBALS = 12,
};

/* swap_blocks direction (same values as KVTRACE_SWAP_* in kvtrace_probes.h) */
#define KVTRACE_DIR_OUT 1
#define KVTRACE_DIR_IN 2

/* How one probe argument is fetched (the scheme of libbpf's usdt.bpf.h). */
enum kvtrace_arg_kind {
	KVTRACE_ARG_CONST = 0,     /* value = val_off */
	KVTRACE_ARG_REG = 1,       /* value = regs[reg_off] */
	KVTRACE_ARG_REG_DEREF = 2, /* value = *(regs[reg_off] + val_off) */
	/* Stock uprobes on C++ ops taking `const at::Tensor&`: regs[reg_off]
	 * points at an at::Tensor, whose only member points at its TensorImpl.
	 * Offsets inside TensorImpl/StorageImpl come from the site's
	 * tensor_layout, discovered from the target's own torch at attach. */
	KVTRACE_ARG_TENSOR_DATA = 3, /* storage data + storage_offset * val_off */
	KVTRACE_ARG_TENSOR_SIZE = 4, /* sizes[val_off] */
	KVTRACE_ARG_TENSOR_STRIDE = 5, /* strides[val_off] */
	/* The same three for a tensor reference passed on the stack (C++
	 * arguments after the sixth): the at::Tensor's address is the u64 at
	 * regs[reg_off] + (val_off >> 32); the low 32 bits of val_off are the
	 * scale or dimension as above. */
	KVTRACE_ARG_STACK_TENSOR_DATA = 6,
	KVTRACE_ARG_STACK_TENSOR_SIZE = 7,
	KVTRACE_ARG_STACK_TENSOR_STRIDE = 8,
};

#define KVTRACE_MAX_ARGS 8

/*
 * Index arrays (slots, block pairs, sizes) are read KVTRACE_CHUNK int64s per
 * bpf_probe_read_user, KVTRACE_SEGMENT_CHUNKS chunks per program run; a run
 * that has more left tail-calls the next.  The kernel allows 33 tail calls,
 * so one op reads at most 33 * 8192 = 270336 values; anything beyond is
 * counted as truncated, never dropped silently.
 */
#define KVTRACE_CHUNK 64
#define KVTRACE_SEGMENT_CHUNKS 128
/* The slot stages branch once per slot (one atomic add per run of slots in
 * one block), which the verifier allows only for shorter runs: 33 * 2048 =
 * 67584 slots per op (docs/design.md). */
#define KVTRACE_SLOT_SEGMENT_CHUNKS 32
/* With the generations' fill (KVTRACE_WITH_GEN_FILL, --prometheus), the
 * pairs stage also moves each pair's fill (struct kvtrace_fill_row), a
 * longer body: 32 chunks (1024 pairs) per run keep its verification as
 * short as the slot stages'; 33 * 1024 = 33792 pairs per op. */
#ifdef KVTRACE_WITH_GEN_FILL
#define KVTRACE_PAIR_SEGMENT_CHUNKS 32
#else
#define KVTRACE_PAIR_SEGMENT_CHUNKS KVTRACE_SEGMENT_CHUNKS
#endif
#define KVTRACE_MAX_TAIL_CALLS 33
/* The index stream sends up to this many chunks (512 values) per record:
 * fewer, larger records for user space to take.  Divides SEGMENT_CHUNKS. */
#define KVTRACE_RECORD_CHUNKS 8

/* Tail-call targets (prog array `stages`); program kvtrace_stage_<name>. */
enum kvtrace_stage {
	KVTRACE_STAGE_SLOTS = 0, /* count slot numbers into block_writes */
	KVTRACE_STAGE_PAIRS = 1, /* count (src, dst) pairs into block_moves */
	KVTRACE_STAGE_SIZES = 2, /* sum swap_blocks_batch sizes */
	KVTRACE_STAGE_SLOTS_POW2 = 3, /* SLOTS for power-of-two block sizes */
	KVTRACE_STAGE_TABLE = 4, /* count block-table entries into block_reads */
	KVTRACE_STAGE_IDS = 5,   /* count block ids into block_life */
	KVTRACE_STAGE_HASHES = 6, /* stream a block event's content hashes */
	KVTRACE_NR_STAGES = 7,
};

/*
 * bpf_loop() callbacks (program kvtrace_cb_<name>).  bcc compiles each into
 * a function of its own and does not relocate a reference to one, so a
 * stage names its callback by a 64-bit marker, KVTRACE_CB_MARK in the high
 * half and the id below in the low, where the address goes; the loader
 * (tracer/program.py) appends the callback to the stage's instructions and
 * turns the marker into a BPF_PSEUDO_FUNC load of it.
 */
enum kvtrace_callback {
	KVTRACE_CB_TABLE = 1, /* one chunk of a block table */
	KVTRACE_CB_IDS = 2,   /* one chunk of a block event's ids */
};
#define KVTRACE_CB_MARK 1802920820 /* 0x6b766374, "kvct" */

/*
 * Block tables (reads) are read KVTRACE_TABLE_CHUNK int32 entries per
 * bpf_probe_read_user, KVTRACE_TABLE_SEGMENT_CHUNKS chunks per program run,
 * with the same 33 tail calls: a step reads at least 33 * 128 = 4224
 * chunks (rows, where rows are short), e.g. 256 requests x 2048 blocks.
 * Entries beyond are counted as truncated.  256 entries a read, not 128:
 * a read and a callback per chunk were a sixth of each entry's cost.
 */
#define KVTRACE_TABLE_CHUNK 256
#ifndef KVTRACE_TABLE_SEGMENT_CHUNKS
#define KVTRACE_TABLE_SEGMENT_CHUNKS 128
#endif

/* Limits; the front end may override them with -D at compile time. */
#ifndef KVTRACE_MAX_BLOCKS
#define KVTRACE_MAX_BLOCKS 131072 /* per cache (layer); a power of two */
#endif
#ifndef KVTRACE_MAX_CACHES
#define KVTRACE_MAX_CACHES 80 /* (pid, cache id) pairs, i.e. layers */
#endif
/* caches' capacity, and cache_stats' rows: every cache that gets an entry
 * has its totals, beyond KVTRACE_MAX_CACHES too */
#define KVTRACE_CACHE_ENTRIES 4096
#ifndef KVTRACE_MAX_PROCS
#define KVTRACE_MAX_PROCS 16 /* traced processes */
#endif
#ifndef KVTRACE_MAX_REQUESTS
#define KVTRACE_MAX_REQUESTS 16384 /* requests kept in `requests` (LRU) */
#endif
#ifndef KVTRACE_MAX_GROUPS
#define KVTRACE_MAX_GROUPS 16 /* (pid, KV-cache group) pairs with read rows */
#endif

struct kvtrace_arg_spec {
	__u64 val_off;
	__u32 kind;   /* enum kvtrace_arg_kind */
	__s16 reg_off; /* byte offset into struct pt_regs */
	__u8 is_signed;
	__u8 bitshift; /* 64 - 8 * size: trims and extends sub-word arguments */
};

/*
 * Byte offsets into torch's TensorImpl and StorageImpl (tracer/torch_layout.py
 * finds them in the target's torch; they change between torch releases).
 */
struct kvtrace_tensor_layout {
	__u16 impl_storage;        /* TensorImpl: intrusive_ptr<StorageImpl> */
	__u16 storage_data;        /* StorageImpl: DataPtr's data pointer */
	__u16 impl_storage_offset; /* TensorImpl: storage_offset_ (elements) */
	__u16 impl_sizes;          /* TensorImpl: inline sizes[0] (dims <= 5) */
	__u16 impl_strides;        /* TensorImpl: inline strides[0] (dims <= 5) */
	__u16 pad[3];
};

/*
 * Sites: one row of `sites` per attached probe address in one process, its
 * index given by the front end.  A uprobe_multi link carries index + 1 as
 * each probe's cookie, so a hit finds its row by the cookie, with no hash
 * lookup (cold, as every hit in vLLM is, a hash lookup costs over half a
 * microsecond); on perf events, which have no cookie,
 * `site_index` maps (pid, address) to the row.
 */
#define KVTRACE_MAX_SITES 4096

struct kvtrace_site_key {
	__u32 pid;
	__u32 pad;
	__u64 ip;
};

struct kvtrace_site {
	__u32 op; /* enum kvtrace_op */
	__u32 nargs;
	/* the process's index (struct kvtrace_proc), here too: a hit on a
	 * known site then needs no lookup of its process */
	__u32 proc;
	__u32 pid; /* the process's: a cookie's row is checked against it */
	struct kvtrace_arg_spec args[KVTRACE_MAX_ARGS];
	struct kvtrace_tensor_layout tensor; /* for KVTRACE_ARG_TENSOR_* */
};

/*
 * A site's memo of the caches its write ops named: slot = a hash of the
 * cache id, value = (cache id >> 4) << 20 | (cache index + 1), one word, so
 * that a hit on another CPU reads a whole entry or none.  Only cache ids
 * with their low 4 bits clear and below 2^48 (a user address that malloc,
 * torch or a static array gives) have one; any other takes the caches hash
 * every time.
 */
#define KVTRACE_MEMO_SLOTS 64
#define KVTRACE_MEMO_INDEX_BITS 20 /* > log2(KVTRACE_CACHE_ENTRIES) */

struct kvtrace_cache_memo {
	__u64 slot[KVTRACE_MEMO_SLOTS];
};

/* caches: one entry per (process, cache id); a cache id is one layer */
struct kvtrace_cache_key {
	__u32 pid;
	__u32 pad;
	__u64 cache_id;
};

struct kvtrace_cache {
	__u32 index; /* row in block_writes (< KVTRACE_MAX_CACHES) and cache_stats */
	__u32 op;    /* op that first wrote it */
	__u64 block_size;
	__u64 num_blocks;
};

/* cache_stats: a cache's write-op totals, row = its index.  An array, not
 * fields of its caches entry: finish() adds them by the index the op
 * already holds, with no second hash lookup (docs/design.md). */
struct kvtrace_cache_stats {
	__u64 calls;
	__u64 slots;        /* valid slots written */
	__u64 padding;      /* negative slots skipped */
	__u64 out_of_range; /* slots whose block >= KVTRACE_MAX_BLOCKS */
};

/* groups: one entry per (process, KV-cache group); reads are counted here
 * and in the group's row of block_reads */
struct kvtrace_group_key {
	__u32 pid;
	__u32 pad;
	__u64 group_id;
};

struct kvtrace_group {
	__u32 index; /* row in block_reads; >= KVTRACE_MAX_GROUPS: not kept */
	__u32 pad;
	__u64 leader;      /* layer_id of the layer whose calls read the table */
	__u64 block_size;
	__u64 num_blocks;
	__u64 steps;       /* forward steps: the leader's calls */
	__u64 layer_calls; /* every layer's calls (layers x steps) */
	__u64 requests;    /* request rows read, summed over steps */
	__u64 tokens;      /* seq_len summed over rows and steps */
	__u64 reads;       /* entries counted: (request, block) reads */
	__u64 distinct;    /* distinct blocks read at a step, summed over steps */
	__u64 held_tokens; /* tokens in those blocks, summed over steps */
	__u64 null_entries; /* entries of block 0 (padding, outside the window) */
	__u64 out_of_range; /* entries >= KVTRACE_MAX_BLOCKS or no row left */
	__u64 truncated;    /* entries beyond what one step can read */
	__u64 read_errors;  /* steps whose table or seq_lens could not be read */
};

/* requests: the plugin tier's per-request totals, one entry per (process,
 * request hash).  An LRU map: on a long run the least recently active
 * requests make room (their per-block counts stay in block_life). */
#define KVTRACE_REQ_ID_LEN 64
struct kvtrace_request_key {
	__u32 pid;
	__u32 pad;
	__u64 req; /* FNV-1a 64 of vLLM's request id (kvtrace_probes.h) */
};
struct kvtrace_request {
	__u64 first_ns;      /* its first event (bpf_ktime_get_ns) */
	__u64 last_ns;       /* its latest event */
	__u64 finish_ns;     /* req_finish, 0 while it runs */
	__u64 prompt_tokens; /* from the request probe */
	__u64 output_tokens; /* from req_finish */
	__u64 preemptions;
	__u64 recomputed;    /* computed tokens it lost to preemptions */
	__u64 blocks[KVTRACE_NR_LIFE]; /* block ids per lifecycle event */
	__u32 id_len;        /* bytes of id (at most KVTRACE_REQ_ID_LEN) */
	__u32 pad;
	char id[KVTRACE_REQ_ID_LEN]; /* vLLM's request id, from the request probe */
};

/* op_stats: exact per-(process, op) totals */
struct kvtrace_op_stats {
	__u64 calls;
	__u64 items;       /* tokens (write ops), pairs, or batch entries */
	__u64 slots;       /* valid slots written */
	__u64 padding;     /* negative slots skipped */
	__u64 bytes;       /* bytes moved (copy, swap, batch) */
	__u64 truncated;   /* items beyond what one op can read */
	__u64 read_errors; /* index arrays that could not be read */
	__u64 out_of_range; /* blocks >= KVTRACE_MAX_BLOCKS, or no row left */
};

/* traced_pids value: which block_moves rows belong to the process */
struct kvtrace_proc {
	__u32 index; /* < KVTRACE_MAX_PROCS, assigned by the front end */
	__u32 pad;
};

/* One row of per-block counters (block_writes, block_moves). */
struct kvtrace_block_row {
	__u64 count[KVTRACE_MAX_BLOCKS];
};

/* block_life's rows per 64th of the block range (kvtrace.bpf.c life_pages):
 * KVTRACE_MAX_BLOCKS / 64 blocks a 64th, at least 1; 64 words and a sink */
#if KVTRACE_MAX_BLOCKS >= 64
#define KVTRACE_LIFE_PAGE (KVTRACE_MAX_BLOCKS / 64)
#else
#define KVTRACE_LIFE_PAGE 1
#endif
#define KVTRACE_LIFE_PAGE_WORDS 128

/*
 * Block generations' fill, per cache (one layer of one process), row =
 * cache index in block_fill.  A generation starts with a write at block
 * offset 0, or when the block receives another's contents (copy_blocks'
 * destination, a host->device swap's device block), and lasts until the
 * block's next start: the definition of `report`'s occupancy
 * (docs/occupancy.md).  Its fill is the tokens it holds: 1 + the highest
 * offset written, or the tokens it inherited, if more.  When the next
 * start ends it, its fill is counted in ended[].
 */
#ifndef KVTRACE_FILL_BINS
#define KVTRACE_FILL_BINS 2048 /* a power of two, <= 0x8000: block sizes
				* from this up are not counted */
#endif
#define KVTRACE_FILL_SEEN 0x8000 /* fill[]/host[]: the generation's start was seen */

struct kvtrace_fill_row {
	__u64 ended[KVTRACE_FILL_BINS]; /* generations ended, by fill; bin 0: never counted */
	__u64 ended_unseen; /* generations ended whose start the tracer did not see
			     * (begun before it attached, or swapped in from a host
			     * block whose swap-out it missed): not in ended[] */
	__u64 skipped;      /* runs of slots in one block whose fill may be off:
			     * not consecutive and ascending (a request's are), or
			     * read in an op's last segment when the kernel's tail
			     * calls ran out before their fill moved */
	__u16 fill[KVTRACE_MAX_BLOCKS]; /* the open generation: tokens | SEEN; 0: none */
	__u16 host[KVTRACE_MAX_BLOCKS]; /* swapped-out contents, by host block */
};

/* One row of block_reads: per block, the (request, step) pairs that read
 * it, and the group's step number (from 1) of its last read, 0 if never:
 * its age is the group's steps minus that.  Side by side, so that the
 * per-entry loop keeps one pointer. */
struct kvtrace_block_read {
	__u64 reads;
	__u64 last_step;
};

struct kvtrace_read_row {
	struct kvtrace_block_read b[KVTRACE_MAX_BLOCKS];
};

/* op_log2: log2 histogram of items per op; bcc's bpf_log2l() gives 0-64 */
#define KVTRACE_LOG2_SLOTS 65

/*
 * User stacks (-DKVTRACE_WITH_STACKS).  The kernel's stack map keeps one
 * stack per hash bucket and answers -EEXIST for a second stack whose frames
 * hash to a bucket another holds: with n stacks in 16384 buckets that is
 * likely once n passes ~150 (a vLLM with its Python frames gets there), and
 * a kvsim run's 17 stacks meet it about one run in 120.  A stack it
 * refuses is kept in collided_stacks instead, a hash map keyed by the frames
 * themselves (a hash map chains, so it never refuses a stack for another's
 * hash), under an id from KVTRACE_STACK_COLLIDED up: the id says which map
 * holds the frames (bpf/kvtrace.bpf.c stack_id_of).
 */
#ifndef KVTRACE_STACK_BUCKETS
#define KVTRACE_STACK_BUCKETS 16384 /* the stack map's size (--stack-storage-size) */
#endif
#define KVTRACE_STACK_DEPTH 127 /* frames; the kernel's perf_event_max_stack default */
#define KVTRACE_STACK_COLLIDED 1073741824 /* 1 << 30: ids of collided_stacks */
#define KVTRACE_COLLIDED_STACKS 4096 /* room in collided_stacks */

struct kvtrace_stack {
	__u64 ip[KVTRACE_STACK_DEPTH]; /* innermost first, 0 after the last */
};

/* stack_weights: folded-stack weights, exact (not from the perf buffer) */
struct kvtrace_stack_key {
	__u32 pid;
	__s32 stack_id; /* negative: the stack could not be taken */
	__u32 op;
	__u32 cache_index;
};

/*
 * The perf buffer carries two kinds of record, told apart by their first
 * field.  Every op sends one KVTRACE_REC_OP record (struct kvtrace_event).
 * With the index stream on (-DKVTRACE_WITH_INDEX_STREAM), an op that reads
 * an index array (slots of a write op, (src, dst) pairs of copy/swap) first
 * sends the raw int64 values, up to KVTRACE_RECORD_CHUNKS * KVTRACE_CHUNK
 * per KVTRACE_REC_CHUNK record,
 * all from the CPU that then sends the op record; padding (-1) included.  A
 * chunk names its op by seq.  The exact counters never depend on either.
 * -DKVTRACE_WITH_BLOCK_ID_STREAM streams only the plugin tier's block
 * events' ids and content hashes, and prefix_hashes' hashes (no slots,
 * pairs, table rows nor step_reqs rows): what attach --prometheus's
 * residency histograms and miss causes need, at a fraction of the cost.
 */
enum kvtrace_rec {
	KVTRACE_REC_OP = 1,
	KVTRACE_REC_CHUNK = 2,
};

/*
 * One record per op.  A block_table op (reads) sends its record only for the
 * call that read the table (the group's leader layer), with
 *   cache_id = group_id, cache_index = group index,
 *   items = entries counted (request-block reads), slots = distinct blocks
 *   read (the step's live set), padding = entries not counted (null or
 *   out of range), bytes = sum of seq_len (tokens), rows, held_tokens =
 *   tokens in the distinct blocks (each block's fill as its first reader
 *   at the step sees it), flags as for the other ops;
 * and its index stream is, row after row, the row's seq_len followed by its
 * ceil(seq_len / block_size) entries (null entries included).
 *
 * The plugin tier's ops: cache_id = the request hash; block events
 * (block_alloc..block_evict) have cache_index = the KV-cache group, items =
 * ids passed, slots = ids counted, padding = null ids (0), bytes = blocks in
 * the pool, and their index stream is the block ids, followed (flag
 * KVTRACE_EV_HASHES) by their content hashes when the probe passes them;
 * request, req_preempt
 * and req_finish have items = their token count and no stream; step_reqs
 * has items = the step's requests, and its index stream is the probe's
 * rows array as it is: the requests' hashes, then their new tokens (2 *
 * items values, only when the program streams values); prefix_hashes has
 * cache_id = the request, cache_index = tokens per hash, rows = the block
 * size, held_tokens = the domain key, items = its hashes, and its index stream is
 * the hashes (only when the program streams values).
 */
struct kvtrace_event {
	__u32 type; /* KVTRACE_REC_OP */
	__u32 chunks; /* chunk records this op sent (accepted by the buffer) */
	__u64 seq;  /* op sequence number, unique per tracer (KVTRACE_G_NEXT_SEQ) */
	__u64 ts_ns;
	__u32 pid;
	__u32 tid;
	__u32 op;
	__u32 cache_index;
	__u64 cache_id;
	__u64 items;
	__u64 slots;
	__u64 padding;
	__u64 bytes;
	__s32 stack_id;
	__u32 flags; /* KVTRACE_EV_* */
	__u64 rows;        /* block_table: request rows read; step_rows: the
			    * block size */
	__u64 held_tokens; /* block_table: tokens held in the blocks read;
			    * step_rows: blocks in the pool */
};

#define KVTRACE_EV_TRUNCATED 1 /* more items than the per-op read limit */
#define KVTRACE_EV_READ_ERROR 2
#define KVTRACE_EV_CHUNKS_LOST 4 /* some of this op's chunk records were refused */
#define KVTRACE_EV_SWAP_OUT 8    /* swap_blocks, device -> host */
#define KVTRACE_EV_SWAP_IN 16    /* swap_blocks, host -> device */
#define KVTRACE_EV_HASHES 32     /* block event: its stream is the ids, then
				  * as many content hashes (uint64) */

/* One chunk of an op's index array: the record's header, followed by
 * `count` int64 values (the record is sent only that long). */
struct kvtrace_chunk_hdr {
	__u32 type;   /* KVTRACE_REC_CHUNK */
	__u32 count;  /* int64 values after the header, 1..RECORD_CHUNKS * CHUNK */
	__u64 seq;    /* the op's kvtrace_event.seq */
	__u64 offset; /* index of the first value in the op's array */
};

#endif /* KVTRACE_H */
