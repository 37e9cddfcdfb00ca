/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvsim --workload evict: a prefix cache that evicts, and why each prompt
 * block missed it (included by kvsim.c; docs/misses.md).
 *
 * Requests run one after another through a pool shaped as vLLM's
 * BlockPool: full blocks get a content hash (a chain over the block's
 * tokens, the first block's also over the request's cache salt) and stay
 * cached when freed, in a free queue that hands out its head first; a
 * freed request's blocks go to its tail, last block first; a prefix hit
 * takes a free cached block out of the queue; and handing out a block that
 * holds a hash evicts it (block_evict, for the request allocating).  The
 * last prompt token is always computed, as in vLLM.
 *
 * Prompts are built to miss in every way: documents shared by many
 * requests (one shorter than a block), two cache salts, requests that
 * repeat an earlier prompt after the cache has moved on, and a pool too
 * small for the working set.  Every block event carries its hashes, and
 * each request fires prefix_hashes (token-only hashes every
 * EVICT_TOKENS_PER_HASH tokens, and its salt as the domain).
 *
 * The truth (--truth) classifies every prompt block a request computed
 * from the pool's own state when the request came and from the prompts'
 * tokens (never from hashes of them): write_evict_truth() describes it.
 */

#define EVICT_TOKENS_PER_HASH 4
#define EVICT_DOCS 4
#define EVICT_MAX_TOKENS 256

enum evict_cause {
	EV_COMPULSORY,
	EV_CAPACITY,
	EV_BELOW_BLOCK,
	EV_HASH_DOMAIN,
	EV_RESIDENT,
	EV_NUM_CAUSES
};

static const char *const evict_cause_names[EV_NUM_CAUSES] = {
	"compulsory", "capacity", "below_block", "hash_domain", "resident"
};

/* documents' lengths: one shorter than a block, the others block-crossing */
static const int64_t evict_doc_len[EVICT_DOCS] = { 64, 12, 40, 100 };

struct evict_req {
	char id[32];
	uint64_t req;
	uint64_t salt;
	int64_t prompt_len, output_len;
	uint64_t tokens[EVICT_MAX_TOKENS]; /* prompt then output */
	int64_t hit_blocks;
	/* per prompt block computed: its cause, tokens, who evicted it */
	int64_t nmiss;
	int cause[EVICT_MAX_TOKENS];
	int64_t miss_tokens[EVICT_MAX_TOKENS];
	int64_t evicted_for[EVICT_MAX_TOKENS]; /* request index, -1 none */
};

/* what the pool remembers of a content hash */
struct evict_content {
	uint64_t hash;
	int64_t resident;   /* blocks holding it now */
	int64_t evicted_by; /* the request its last eviction was for, -1 none */
};

struct evict_sim {
	int64_t bs, nblocks;
	uint64_t *block_hash; /* [block] 0: none */
	uint32_t *ref;
	int32_t *queue; /* the free queue, a ring: head first out */
	int64_t qhead, qlen;
	struct evict_content *contents;
	int64_t ncontents, contents_cap;
	struct evict_req *reqs;
	int64_t nreqs;
	/* removals, by reason */
	uint64_t freed_finished, evicted, regret_blocks;
	uint64_t hits_total;
};

static struct evict_content *evict_content_of(struct evict_sim *e, uint64_t h,
					      bool add)
{
	for (int64_t i = 0; i < e->ncontents; i++)
		if (e->contents[i].hash == h)
			return &e->contents[i];
	if (!add)
		return NULL;
	if (e->ncontents == e->contents_cap) {
		e->contents_cap = e->contents_cap ? 2 * e->contents_cap : 256;
		e->contents = realloc(e->contents, (size_t)e->contents_cap *
						       sizeof(*e->contents));
		if (!e->contents)
			fatal("out of memory");
	}
	struct evict_content *c = &e->contents[e->ncontents++];
	c->hash = h;
	c->resident = 0;
	c->evicted_by = -1;
	return c;
}

/* the chain hash of block j of r's tokens, the salt in the first block's */
static uint64_t evict_block_hash(const struct evict_req *r, int64_t j,
				 int64_t bs)
{
	uint64_t h = mix64(0x626c6f636bULL ^ mix64(r->salt + 1));
	for (int64_t t = 0; t < (j + 1) * bs; t++)
		h = mix64(h ^ r->tokens[t]);
	return h | 1;
}

/* the token-only chain hash of tokens [0, n) */
static uint64_t evict_token_hash(const struct evict_req *r, int64_t n)
{
	uint64_t h = 0x746f6b656eULL;
	for (int64_t t = 0; t < n; t++)
		h = mix64(h + 0x9e3779b97f4a7c15ULL * (r->tokens[t] | 1));
	return h | 1;
}

static void evict_queue_remove(struct evict_sim *e, int32_t b)
{
	int64_t n = e->nblocks;
	for (int64_t i = 0; i < e->qlen; i++) {
		if (e->queue[(e->qhead + i) % n] != b)
			continue;
		for (int64_t k = i; k + 1 < e->qlen; k++)
			e->queue[(e->qhead + k) % n] = e->queue[(e->qhead + k + 1) % n];
		e->qlen--;
		return;
	}
	fatal("internal error: block not in the free queue");
}

/* a resident block holding hash h, -1 none */
static int32_t evict_find(const struct evict_sim *e, uint64_t h)
{
	for (int32_t b = 1; b < e->nblocks; b++)
		if (e->block_hash[b] == h)
			return b;
	return -1;
}

/* the tokens of the prompt common to r and an earlier request (of the same
 * salt if same, else of another salt), whole hash grains only */
static int64_t evict_common(const struct evict_sim *e, int64_t ri, bool same)
{
	const struct evict_req *r = &e->reqs[ri];
	int64_t best = 0;
	for (int64_t k = 0; k < ri; k++) {
		const struct evict_req *o = &e->reqs[k];
		if ((o->salt == r->salt) != same)
			continue;
		int64_t n = 0, most = r->prompt_len < o->prompt_len ? r->prompt_len
								    : o->prompt_len;
		while (n < most && o->tokens[n] == r->tokens[n])
			n++;
		if (n > best)
			best = n;
	}
	return best / EVICT_TOKENS_PER_HASH * EVICT_TOKENS_PER_HASH;
}

static void evict_run_request(struct evict_sim *e, int64_t ri)
{
	struct evict_req *r = &e->reqs[ri];
	int64_t bs = e->bs;
	int64_t full = r->prompt_len / bs;
	int64_t most = (r->prompt_len - 1) / bs; /* the last token is computed */
	int64_t total = ceil_div(r->prompt_len + r->output_len, bs);
	int32_t ids[EVICT_MAX_TOKENS];
	uint64_t hashes[EVICT_MAX_TOKENS];
	int32_t table[EVICT_MAX_TOKENS];

	kv_request(r->req, r->id, (int64_t)strlen(r->id), r->prompt_len);
	{
		uint64_t fine[EVICT_MAX_TOKENS];
		int64_t nf = r->prompt_len / EVICT_TOKENS_PER_HASH;
		for (int64_t k = 0; k < nf; k++)
			fine[k] = evict_token_hash(r, (k + 1) * EVICT_TOKENS_PER_HASH);
		kv_prefix_hashes(r->req, fine, nf, EVICT_TOKENS_PER_HASH, bs, r->salt);
	}

	/* the longest cached prefix */
	int64_t hits = 0;
	while (hits < most && evict_find(e, evict_block_hash(r, hits, bs)) >= 0)
		hits++;

	/* the truth of each prompt block it will compute, from the pool as
	 * the request finds it and from the prompts' tokens */
	int64_t same = evict_common(e, ri, true), other = evict_common(e, ri, false);
	r->hit_blocks = hits;
	r->nmiss = 0;
	for (int64_t j = hits; j < full; j++) {
		struct evict_content *c =
			evict_content_of(e, evict_block_hash(r, j, bs), false);
		int cause = EV_COMPULSORY;
		int64_t tokens = bs, lo = j * bs, hi = (j + 1) * bs;
		r->evicted_for[r->nmiss] = -1;
		if (c && c->resident) {
			cause = EV_RESIDENT;
		} else if (c) {
			cause = EV_CAPACITY;
			r->evicted_for[r->nmiss] = c->evicted_by;
			e->regret_blocks++;
		} else if (other >= hi && same < hi) {
			cause = EV_HASH_DOMAIN;
		} else if (lo < same && same < hi) {
			cause = EV_BELOW_BLOCK;
			tokens = same - lo;
		}
		r->cause[r->nmiss] = cause;
		r->miss_tokens[r->nmiss++] = tokens;
	}

	/* the hits: shared, out of the free queue if they were free */
	for (int64_t j = 0; j < hits; j++) {
		uint64_t h = evict_block_hash(r, j, bs);
		int32_t b = evict_find(e, h);
		if (e->ref[b]++ == 0)
			evict_queue_remove(e, b);
		table[j] = b;
		ids[j] = b;
		hashes[j] = h;
	}
	if (hits) {
		kv_block_event_hashed(KV_LIFE_HIT, r->req, 0, ids, hits, e->nblocks,
				      hashes);
		e->hits_total += (uint64_t)hits;
	}

	/* the new blocks, from the queue's head: a cached one is evicted for
	 * this request first (one probe call each, as vLLM's) */
	int64_t need = total - hits;
	if (need > e->qlen)
		fatal("internal error: evict workload pool too small");
	for (int64_t k = 0; k < need; k++) {
		int32_t b = e->queue[e->qhead];
		e->qhead = (e->qhead + 1) % e->nblocks;
		e->qlen--;
		if (e->block_hash[b]) {
			uint64_t h = e->block_hash[b];
			struct evict_content *c = evict_content_of(e, h, false);
			c->resident--;
			c->evicted_by = ri;
			e->block_hash[b] = 0;
			e->evicted++;
			kv_block_event_hashed(KV_LIFE_EVICT, r->req, 0, &b, 1,
					      e->nblocks, &h);
		}
		e->ref[b] = 1;
		table[hits + k] = b;
		ids[k] = b;
	}
	kv_block_event(KV_LIFE_ALLOC, r->req, 0, ids, need, e->nblocks);

	/* computed: every full block past the hits is cached, the prompt's
	 * and the output's (their hashes take the generated tokens) */
	int64_t ncache = 0;
	for (int64_t j = hits; j < (r->prompt_len + r->output_len) / bs; j++) {
		uint64_t h = evict_block_hash(r, j, bs);
		e->block_hash[table[j]] = h;
		evict_content_of(e, h, true)->resident++;
		ids[ncache] = table[j];
		hashes[ncache++] = h;
	}
	if (ncache)
		kv_block_event_hashed(KV_LIFE_CACHE, r->req, 0, ids, ncache,
				      e->nblocks, hashes);

	/* finished: freed last block first (the first to be evicted) */
	kv_req_finish(r->req, r->output_len);
	int64_t nfree = 0;
	for (int64_t j = total - 1; j >= 0; j--) {
		int32_t b = table[j];
		ids[nfree++] = b;
		if (--e->ref[b] == 0) {
			e->queue[(e->qhead + e->qlen) % e->nblocks] = b;
			e->qlen++;
		}
	}
	e->freed_finished += (uint64_t)nfree;
	kv_block_event(KV_LIFE_FREE, r->req, 0, ids, nfree, e->nblocks);
}

/* the requests of one repetition, built from the seed: the documents
 * shared (a request's prompt starts with one), the salts, the repeats */
static void evict_make_requests(struct evict_sim *e, struct rng *rng,
				int64_t n, int64_t *next_id)
{
	e->reqs = realloc(e->reqs, (size_t)(e->nreqs + n) * sizeof(*e->reqs));
	if (!e->reqs)
		fatal("out of memory");
	for (int64_t i = 0; i < n; i++) {
		struct evict_req *r = &e->reqs[e->nreqs];
		memset(r, 0, sizeof(*r));
		int len = snprintf(r->id, sizeof(r->id), "kvsim-req-%" PRId64,
				   (*next_id)++);
		r->req = fnv1a64(r->id, (size_t)len);
		int64_t earlier = e->nreqs;
		if (earlier >= 4 && rng_range(rng, 0, 3) == 0) {
			/* the same prompt as an earlier request, maybe under
			 * the other salt */
			const struct evict_req *o =
				&e->reqs[rng_range(rng, 0, earlier - 1)];
			r->prompt_len = o->prompt_len;
			memcpy(r->tokens, o->tokens, sizeof(r->tokens));
			r->salt = rng_range(rng, 0, 2) == 0 ? 1 - o->salt : o->salt;
		} else {
			int64_t doc = rng_range(rng, 0, EVICT_DOCS - 1);
			int64_t own = rng_range(rng, 4, 40);
			r->prompt_len = evict_doc_len[doc] + own;
			if (rng_range(rng, 0, 2) == 0) /* whole blocks: the last
							* one always computed */
				r->prompt_len = ceil_div(r->prompt_len, e->bs) * e->bs;
			for (int64_t t = 0; t < r->prompt_len; t++)
				r->tokens[t] = t < evict_doc_len[doc]
					? mix64(((uint64_t)doc << 32) + (uint64_t)t)
					: mix64(((uint64_t)(e->nreqs + 1) << 40) ^
						(uint64_t)t ^ 0x75736572ULL);
			r->salt = rng_range(rng, 0, 3) == 0 ? 1 : 0;
		}
		r->output_len = rng_range(rng, 1, 24);
		for (int64_t t = r->prompt_len; t < r->prompt_len + r->output_len; t++)
			r->tokens[t] = mix64(((uint64_t)(e->nreqs + 1) << 40) ^
					     (uint64_t)t ^ 0x6f7574ULL);
		e->nreqs++;
	}
}

/*
 * The truth of the evict workload:
 *   workload, block_size, tokens_per_hash
 *   requests   one per request, in order: id, req (hex), salt,
 *              prompt_tokens, hit_blocks, and misses: one per prompt block
 *              it computed, in block order: block (its place in the
 *              prompt), cause, tokens (recomputed: the block's; below the
 *              block: the shareable ones), evicted_for (capacity: the id
 *              of the request whose allocation evicted it, else null)
 *   totals     per cause: blocks, tokens, requests (with one or more)
 *   removals   finished (blocks freed at a request's end), evicted (cached
 *              blocks dropped for an allocation)
 *   regret     blocks: capacity misses (evicted blocks asked for again)
 *   hits       prefix-hit blocks in all
 */
static void write_evict_truth(const struct evict_sim *e, const char *path)
{
	FILE *f = fopen(path, "w");
	if (!f)
		fatal("cannot write the truth file");
	fprintf(f, "{\"workload\": \"evict\", \"block_size\": %" PRId64
		   ", \"tokens_per_hash\": %d, \"requests\": [",
		e->bs, EVICT_TOKENS_PER_HASH);
	uint64_t tb[EV_NUM_CAUSES] = { 0 }, tt[EV_NUM_CAUSES] = { 0 },
		 tr[EV_NUM_CAUSES] = { 0 };
	for (int64_t i = 0; i < e->nreqs; i++) {
		const struct evict_req *r = &e->reqs[i];
		bool has[EV_NUM_CAUSES] = { false };
		fprintf(f, "%s{\"id\": \"%s\", \"req\": \"%016" PRIx64
			   "\", \"salt\": %" PRIu64 ", \"prompt_tokens\": %" PRId64
			   ", \"hit_blocks\": %" PRId64 ", \"misses\": [",
			i ? ", " : "", r->id, r->req, r->salt, r->prompt_len,
			r->hit_blocks);
		for (int64_t m = 0; m < r->nmiss; m++) {
			int c = r->cause[m];
			fprintf(f, "%s{\"block\": %" PRId64 ", \"cause\": \"%s\", "
				   "\"tokens\": %" PRId64 ", \"evicted_for\": ",
				m ? ", " : "", r->hit_blocks + m,
				evict_cause_names[c], r->miss_tokens[m]);
			if (r->evicted_for[m] >= 0)
				fprintf(f, "\"%s\"}", e->reqs[r->evicted_for[m]].id);
			else
				fprintf(f, "null}");
			tb[c]++;
			tt[c] += (uint64_t)r->miss_tokens[m];
			has[c] = true;
		}
		fprintf(f, "]}");
		for (int c = 0; c < EV_NUM_CAUSES; c++)
			tr[c] += has[c];
	}
	fprintf(f, "], \"totals\": {");
	for (int c = 0; c < EV_NUM_CAUSES; c++)
		fprintf(f, "%s\"%s\": {\"blocks\": %" PRIu64 ", \"tokens\": %" PRIu64
			   ", \"requests\": %" PRIu64 "}",
			c ? ", " : "", evict_cause_names[c], tb[c], tt[c], tr[c]);
	fprintf(f, "}, \"removals\": {\"finished\": %" PRIu64
		   ", \"evicted\": %" PRIu64 "}, \"regret\": {\"blocks\": %" PRIu64
		   "}, \"hits\": %" PRIu64 "}\n",
		e->freed_finished, e->evicted, e->regret_blocks, e->hits_total);
	if (fclose(f) != 0)
		fatal("cannot write the truth file");
}

static int evict_main(const struct config *cfg)
{
	static struct evict_sim e;
	struct rng rng = { cfg->seed };
	int64_t next_id = 0;

	e.bs = cfg->w.block_size;
	e.nblocks = cfg->w.blocks;
	if ((evict_doc_len[3] + 40 + 24) / e.bs + 2 >= e.nblocks ||
	    evict_doc_len[3] + 40 + 24 > EVICT_MAX_TOKENS)
		usage_error("--workload evict needs more --blocks than %s",
			    "its largest request");
	e.block_hash = xcalloc((size_t)e.nblocks, sizeof(*e.block_hash));
	e.ref = xcalloc((size_t)e.nblocks, sizeof(*e.ref));
	e.queue = xcalloc((size_t)e.nblocks, sizeof(*e.queue));
	for (int32_t b = 1; b < e.nblocks; b++) /* block 0: the null block */
		e.queue[e.qlen++] = b;
	if (cfg->pause)
		wait_for_sigusr1();
	for (uint64_t rep = 0; rep < cfg->repeat && !stop_requested; rep++) {
		int64_t first = e.nreqs;
		evict_make_requests(&e, &rng, cfg->w.requests, &next_id);
		for (int64_t i = first; i < e.nreqs; i++)
			evict_run_request(&e, i);
	}
	if (cfg->truth_path)
		write_evict_truth(&e, cfg->truth_path);
	if (kv_ops_log && fclose(kv_ops_log) != 0)
		fatal("cannot write the --ops-log file");
	if (!cfg->quiet)
		fprintf(stderr, "kvsim: workload=evict seed=%" PRIu64
				" requests=%" PRId64 " hits=%" PRIu64
				" evicted=%" PRIu64 "\n",
			cfg->seed, e.nreqs, e.hits_total, e.evicted);
	return 0;
}
