/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvtrace_vllm._probes: the plugin tier's USDT probe sites (bpf/kvtrace_probes.h,
 * "The plugin tier"), callable from Python.
 *
 * Each function fires its probe unconditionally: the Python hooks check the
 * probe's semaphore first (semaphores() gives one memoryview per probe over
 * the header's vllm_<name>_semaphore, which the kernel increments while a
 * tracer is attached), so that with no tracer a hook never calls in here.
 *
 * Block id lists are Python buffers of int32 (array('i')): the probe gets a
 * pointer to the buffer's memory, valid for the duration of the call, which
 * is all a uprobe needs.  The step's tables are built here from vLLM's own
 * lists (below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "kvtrace_probes.h"

#ifdef KVTRACE_DISABLE_PROBES
#error "the plugin is built with its probes"
#endif

/* ---- argument helpers ---------------------------------------------------- */

static int is_int32_format(const Py_buffer *v)
{
	const char *f = v->format ? v->format : "B";
	if (v->itemsize != 4)
		return 0;
	if (*f == '<' || *f == '=' || *f == '@')
		f++;
	return (f[0] == 'i' || f[0] == 'l') && f[1] == '\0';
}

/* A 1-D C-contiguous int32 buffer.  0 on success (release with
 * PyBuffer_Release), -1 with an exception set. */
static int get_int32_vector(PyObject *obj, Py_buffer *v, const char *what)
{
	if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
		return -1;
	if (!is_int32_format(v) || v->ndim > 1) {
		PyErr_Format(PyExc_TypeError,
			     "%s: a 1-D buffer of int32 is needed (format %s, "
			     "itemsize %zd, ndim %d)",
			     what, v->format ? v->format : "B", v->itemsize,
			     v->ndim);
		PyBuffer_Release(v);
		return -1;
	}
	return 0;
}

static int get_u64(PyObject *o, uint64_t *out)
{
	unsigned long long x = PyLong_AsUnsignedLongLongMask(o);
	if (x == (unsigned long long)-1 && PyErr_Occurred())
		return -1;
	*out = (uint64_t)x;
	return 0;
}

static int get_i64(PyObject *o, int64_t *out)
{
	long long x = PyLong_AsLongLong(o);
	if (x == -1 && PyErr_Occurred())
		return -1;
	*out = (int64_t)x;
	return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
	if (nargs == want)
		return 0;
	PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name,
		     want, nargs);
	return -1;
}

/* A 1-D C-contiguous buffer of n uint64 (content hashes), or None: NULL in
 * *out.  0 on success (release with PyBuffer_Release if *out), -1 with an
 * exception set. */
static int get_hashes(PyObject *obj, Py_buffer *v, Py_ssize_t n, const uint64_t **out,
		      const char *what)
{
	*out = NULL;
	if (obj == Py_None)
		return 0;
	if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0)
		return -1;
	if (v->itemsize != 8 || v->len != n * 8) {
		PyErr_Format(PyExc_TypeError, "%s: hashes must be %zd uint64", what, n);
		PyBuffer_Release(v);
		return -1;
	}
	*out = v->buf;
	return 0;
}

/* ---- block events: (req, group_id, ids, num_blocks[, hashes]) ------------ */

#define BLOCK_PROBE_FN(name, MACRO)                                            \
	static PyObject *probe_##name(PyObject *self, PyObject *const *args,   \
				      Py_ssize_t nargs)                        \
	{                                                                      \
		uint64_t req;                                                  \
		int64_t group, nblocks;                                        \
		Py_buffer v, hv;                                               \
		const uint64_t *hashes;                                        \
		(void)self;                                                    \
		if ((nargs != 5 && check_nargs(#name, nargs, 4) < 0) ||        \
		    get_u64(args[0], &req) < 0 ||                              \
		    get_i64(args[1], &group) < 0 ||                            \
		    get_i64(args[3], &nblocks) < 0)                            \
			return NULL;                                           \
		if (get_int32_vector(args[2], &v, #name) < 0)                  \
			return NULL;                                           \
		if (get_hashes(nargs == 5 ? args[4] : Py_None, &hv, v.len / 4, \
			       &hashes, #name) < 0) {                          \
			PyBuffer_Release(&v);                                  \
			return NULL;                                           \
		}                                                              \
		MACRO(req, group, v.buf, v.len / 4, nblocks, hashes);          \
		if (hashes)                                                    \
			PyBuffer_Release(&hv);                                 \
		PyBuffer_Release(&v);                                          \
		Py_RETURN_NONE;                                                \
	}

BLOCK_PROBE_FN(block_alloc, KVTRACE_BLOCK_ALLOC)
BLOCK_PROBE_FN(block_hit, KVTRACE_BLOCK_HIT)
BLOCK_PROBE_FN(block_cache, KVTRACE_BLOCK_CACHE)
BLOCK_PROBE_FN(block_free, KVTRACE_BLOCK_FREE)
BLOCK_PROBE_FN(block_evict, KVTRACE_BLOCK_EVICT)

/* ---- requests ------------------------------------------------------------ */

static PyObject *probe_request(PyObject *self, PyObject *const *args,
			       Py_ssize_t nargs)
{
	uint64_t req;
	int64_t ntok;
	Py_ssize_t len;
	const char *id;
	(void)self;
	if (check_nargs("request", nargs, 3) < 0 || get_u64(args[0], &req) < 0 ||
	    get_i64(args[2], &ntok) < 0)
		return NULL;
	if (!PyUnicode_Check(args[1])) {
		PyErr_SetString(PyExc_TypeError, "request: id must be a str");
		return NULL;
	}
	/* UTF-8 form cached in the str object: alive as long as the argument */
	id = PyUnicode_AsUTF8AndSize(args[1], &len);
	if (!id)
		return NULL;
	KVTRACE_REQUEST(req, id, (int64_t)len, ntok);
	Py_RETURN_NONE;
}

static PyObject *probe_req_preempt(PyObject *self, PyObject *const *args,
				   Py_ssize_t nargs)
{
	uint64_t req;
	int64_t ntok;
	(void)self;
	if (check_nargs("req_preempt", nargs, 2) < 0 ||
	    get_u64(args[0], &req) < 0 || get_i64(args[1], &ntok) < 0)
		return NULL;
	KVTRACE_REQ_PREEMPT(req, ntok);
	Py_RETURN_NONE;
}

static PyObject *probe_req_finish(PyObject *self, PyObject *const *args,
				  Py_ssize_t nargs)
{
	uint64_t req;
	int64_t ntok;
	(void)self;
	if (check_nargs("req_finish", nargs, 2) < 0 ||
	    get_u64(args[0], &req) < 0 || get_i64(args[1], &ntok) < 0)
		return NULL;
	KVTRACE_REQ_FINISH(req, ntok);
	Py_RETURN_NONE;
}

/* prefix_hashes(req, hashes_uint64, tokens_per_hash, block_size, domain) */
static PyObject *probe_prefix_hashes(PyObject *self, PyObject *const *args,
				     Py_ssize_t nargs)
{
	uint64_t req, domain;
	int64_t per, bsize;
	Py_buffer v;
	(void)self;
	if (check_nargs("prefix_hashes", nargs, 5) < 0 || get_u64(args[0], &req) < 0 ||
	    get_i64(args[2], &per) < 0 || get_i64(args[3], &bsize) < 0 ||
	    get_u64(args[4], &domain) < 0)
		return NULL;
	if (PyObject_GetBuffer(args[1], &v, PyBUF_C_CONTIGUOUS) < 0)
		return NULL;
	if (v.itemsize != 8 || v.len % 8) {
		PyErr_SetString(PyExc_TypeError, "prefix_hashes: hashes must be uint64");
		PyBuffer_Release(&v);
		return NULL;
	}
	KVTRACE_PREFIX_HASHES(req, (const uint64_t *)v.buf, v.len / 8, per, bsize, domain);
	PyBuffer_Release(&v);
	Py_RETURN_NONE;
}

/* ---- the step's tables: built here from vLLM's own lists ------------------
 *
 * The scheduler fires step_reqs and block_table once a step, with its CPU
 * caches cold: the worker's compute evicts them between steps.  Built in
 * Python with numpy, the two took 87 us a step of 8 requests so (10 us
 * hot), and that time came out of vLLM's throughput; built here they touch
 * a few lines of C (docs/plugin.md, "What a traced step costs").  The
 * buffers are this module's, reused step after step: the GIL serialises
 * the calls, and a uprobe reads them during the probe only.
 */

/* A probe's argument must be a register or a stack slot: handed a global
 * (table_buf), the compiler names it `8@table_buf(%rip)`, which no tracer
 * here decodes.  Taking the pointer through an empty asm puts it in a
 * register first. */
#define IN_REGISTER(p) __asm__ volatile("" : "+r"(p))

static uint64_t *step_buf;
static int32_t *table_buf, *seq_buf;
static size_t step_cap, table_cap, seq_cap;
static Py_ssize_t table_rows, table_width; /* this call's table: 0 rows if none fired */
static PyObject *block_id_name;             /* "block_id", interned */

/* Room for `need` items of `size` bytes in *buf.  0, or -1 with
 * MemoryError set. */
static int reserve(void **buf, size_t *cap, size_t need, size_t size)
{
	size_t n = *cap ? *cap : 256;
	void *p;
	if (need <= *cap)
		return 0;
	while (n < need)
		n *= 2;
	if (n > PY_SSIZE_T_MAX / size) {
		PyErr_NoMemory();
		return -1;
	}
	p = PyMem_Realloc(*buf, n * size);
	if (!p) {
		PyErr_NoMemory();
		return -1;
	}
	*buf = p;
	*cap = n;
	return 0;
}

static uint64_t fnv1a(const unsigned char *p, Py_ssize_t len)
{
	uint64_t h = 0xcbf29ce484222325ULL;
	for (Py_ssize_t i = 0; i < len; i++) {
		h ^= p[i];
		h *= 0x100000001b3ULL;
	}
	return h;
}

/* FNV-1a 64 of a str's UTF-8 (the request hash).  0, or -1 with an
 * exception set. */
static int str_hash(PyObject *o, uint64_t *out)
{
	Py_ssize_t len;
	const char *p;
	if (!PyUnicode_Check(o)) {
		PyErr_SetString(PyExc_TypeError, "a request id must be a str");
		return -1;
	}
	p = PyUnicode_AsUTF8AndSize(o, &len);
	if (!p)
		return -1;
	*out = fnv1a((const unsigned char *)p, len);
	return 0;
}

/* step_reqs(req_ids, tokens): the step's request ids (str) and the tokens
 * each computes in it (int), in the order of the step's block tables */
static PyObject *probe_step_reqs(PyObject *self, PyObject *const *args,
				 Py_ssize_t nargs)
{
	PyObject *ids = NULL, *toks = NULL;
	Py_ssize_t n;
	(void)self;
	if (check_nargs("step_reqs", nargs, 2) < 0)
		return NULL;
	ids = PySequence_Fast(args[0], "step_reqs: request ids must be a sequence");
	toks = ids ? PySequence_Fast(args[1], "step_reqs: tokens must be a sequence") : NULL;
	if (!toks)
		goto fail;
	n = PySequence_Fast_GET_SIZE(ids);
	if (PySequence_Fast_GET_SIZE(toks) != n) {
		PyErr_SetString(PyExc_ValueError, "step_reqs: one token count per request");
		goto fail;
	}
	if (reserve((void **)&step_buf, &step_cap, 2 * (size_t)n, 8) < 0)
		goto fail;
	for (Py_ssize_t i = 0; i < n; i++) {
		int64_t t;
		if (str_hash(PySequence_Fast_GET_ITEM(ids, i), &step_buf[i]) < 0 ||
		    get_i64(PySequence_Fast_GET_ITEM(toks, i), &t) < 0)
			goto fail;
		step_buf[n + i] = (uint64_t)t;
	}
	{
		uint64_t *rows = step_buf;
		IN_REGISTER(rows);
		KVTRACE_STEP_REQS(rows, (int64_t)n);
	}
	Py_DECREF(ids);
	Py_DECREF(toks);
	Py_RETURN_NONE;
fail:
	Py_XDECREF(ids);
	Py_XDECREF(toks);
	return NULL;
}

/* A KVCacheBlock's block_id as an int32, into *out: 0, or -1 with an
 * exception set (named after the probe whose table it was for). */
static int block_id_of(PyObject *block, const char *probe, int32_t *out)
{
	PyObject *id = PyObject_GetAttr(block, block_id_name);
	long long v = id ? PyLong_AsLongLong(id) : -1;
	Py_XDECREF(id);
	if (v == -1 && PyErr_Occurred())
		return -1;
	if (v < 0 || v > INT32_MAX) {
		PyErr_Format(PyExc_ValueError, "%s: block id %lld", probe, v);
		return -1;
	}
	*out = (int32_t)v;
	return 0;
}

/* The blocks of request `rid` in `owners` ({req id: [KVCacheBlock]}):
 * borrowed, NULL if it has none (*err set with an exception). */
static PyObject *blocks_of(PyObject *owners, PyObject *rid, int *err)
{
	PyObject *blocks = PyDict_GetItemWithError(owners, rid);
	*err = 0;
	if (!blocks) {
		*err = PyErr_Occurred() != NULL;
		return NULL;
	}
	if (!PyList_Check(blocks)) {
		PyErr_SetString(PyExc_TypeError, "block_table: a request's blocks must be a list");
		*err = 1;
		return NULL;
	}
	return blocks;
}

/* block_table(req_to_blocks, req_ids, seq_lens, block_size, group_id,
 * num_blocks): row i of the table holds the block_id of each block of
 * req_to_blocks[req_ids[i]] (none: an empty row), 0-padded to the longest
 * row, as vLLM's own table; nothing fires if every row is empty. */
static PyObject *probe_block_table(PyObject *self, PyObject *const *args,
				   Py_ssize_t nargs)
{
	PyObject *owners, *ids = NULL, *seqs = NULL;
	int64_t bsize, nblocks;
	uint64_t group;
	Py_ssize_t n, width = 0;
	int err;
	(void)self;
	if (check_nargs("block_table", nargs, 6) < 0 ||
	    get_i64(args[3], &bsize) < 0 || get_u64(args[4], &group) < 0 ||
	    get_i64(args[5], &nblocks) < 0)
		return NULL;
	table_rows = table_width = 0;
	owners = args[0];
	if (!PyDict_Check(owners)) {
		PyErr_SetString(PyExc_TypeError, "block_table: req_to_blocks must be a dict");
		return NULL;
	}
	ids = PySequence_Fast(args[1], "block_table: request ids must be a sequence");
	seqs = ids ? PySequence_Fast(args[2], "block_table: seq_lens must be a sequence") : NULL;
	if (!seqs)
		goto fail;
	n = PySequence_Fast_GET_SIZE(ids);
	if (PySequence_Fast_GET_SIZE(seqs) != n) {
		PyErr_SetString(PyExc_ValueError, "block_table: one seq_len per request");
		goto fail;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *blocks = blocks_of(owners, PySequence_Fast_GET_ITEM(ids, i), &err);
		if (err)
			goto fail;
		if (blocks && PyList_GET_SIZE(blocks) > width)
			width = PyList_GET_SIZE(blocks);
	}
	if (width == 0)
		goto done;
	if ((size_t)n > PY_SSIZE_T_MAX / (size_t)width ||
	    reserve((void **)&table_buf, &table_cap, (size_t)n * (size_t)width, 4) < 0 ||
	    reserve((void **)&seq_buf, &seq_cap, (size_t)n, 4) < 0)
		goto fail;
	for (Py_ssize_t i = 0; i < n; i++) {
		int32_t *row = table_buf + i * width;
		PyObject *blocks = blocks_of(owners, PySequence_Fast_GET_ITEM(ids, i), &err);
		Py_ssize_t len = blocks ? PyList_GET_SIZE(blocks) : 0;
		int64_t seq;
		if (err)
			goto fail;
		if (len > width) { /* grown meanwhile: only Python code could */
			PyErr_SetString(PyExc_RuntimeError, "block_table: a row grew while read");
			goto fail;
		}
		for (Py_ssize_t j = 0; j < len; j++)
			if (block_id_of(PyList_GET_ITEM(blocks, j), "block_table", &row[j]) < 0)
				goto fail;
		memset(row + len, 0, (size_t)(width - len) * 4);
		if (get_i64(PySequence_Fast_GET_ITEM(seqs, i), &seq) < 0)
			goto fail;
		if (seq < 0 || seq > INT32_MAX) {
			PyErr_Format(PyExc_ValueError, "block_table: seq_len %lld", (long long)seq);
			goto fail;
		}
		seq_buf[i] = (int32_t)seq;
	}
	{
		int32_t *table = table_buf, *seq_lens = seq_buf;
		IN_REGISTER(table);
		IN_REGISTER(seq_lens);
		KVTRACE_BLOCK_TABLE(table, (int64_t)width, (int64_t)n, seq_lens, bsize, group,
				    nblocks, (uint64_t)0);
	}
	table_rows = n;
	table_width = width;
done:
	Py_DECREF(ids);
	Py_DECREF(seqs);
	Py_RETURN_NONE;
fail:
	Py_XDECREF(ids);
	Py_XDECREF(seqs);
	return NULL;
}

/* ---- step_rows: the step's rows as deltas ---------------------------------
 *
 * Per scheduled request one dict lookup in req_to_blocks and one in
 * `reported` ({request id: the row length last reported}, the caller's,
 * updated here), and the block ids of the entries the row gained since: no
 * walk of a whole row.  A row that is new, or was freed since (the caller
 * pops its entry then), or is shorter than reported, is sent whole from 0.
 */
static int64_t *rows_buf;
static int32_t *tail_buf;
static size_t rows_cap, tail_cap;
static Py_ssize_t rows_n, tail_n; /* this call's op: 0 rows if none fired */

#define ROW_FIELDS 5

/* step_rows(req_to_blocks, req_ids, seq_lens, tokens, reported, group_id,
 * block_size, num_blocks) */
static PyObject *probe_step_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	PyObject *owners, *reported, *ids = NULL, *seqs = NULL, *toks = NULL;
	int64_t group, bsize, nblocks;
	Py_ssize_t n, nt = 0;
	int err;
	(void)self;
	if (check_nargs("step_rows", nargs, 8) < 0 || get_i64(args[5], &group) < 0 ||
	    get_i64(args[6], &bsize) < 0 || get_i64(args[7], &nblocks) < 0)
		return NULL;
	rows_n = tail_n = 0;
	owners = args[0];
	reported = args[4];
	if (!PyDict_Check(owners) || !PyDict_Check(reported)) {
		PyErr_SetString(PyExc_TypeError,
				"step_rows: req_to_blocks and reported must be dicts");
		return NULL;
	}
	ids = PySequence_Fast(args[1], "step_rows: request ids must be a sequence");
	seqs = ids ? PySequence_Fast(args[2], "step_rows: seq_lens must be a sequence") : NULL;
	toks = seqs ? PySequence_Fast(args[3], "step_rows: tokens must be a sequence") : NULL;
	if (!toks)
		goto fail;
	n = PySequence_Fast_GET_SIZE(ids);
	if (PySequence_Fast_GET_SIZE(seqs) != n || PySequence_Fast_GET_SIZE(toks) != n) {
		PyErr_SetString(PyExc_ValueError, "step_rows: one seq_len and token count per request");
		goto fail;
	}
	if (n == 0)
		goto done;
	if (reserve((void **)&rows_buf, &rows_cap, ROW_FIELDS * (size_t)n, 8) < 0)
		goto fail;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *rid = PySequence_Fast_GET_ITEM(ids, i);
		PyObject *blocks = blocks_of(owners, rid, &err);
		PyObject *had;
		Py_ssize_t len = blocks ? PyList_GET_SIZE(blocks) : 0, from = 0, was = -1;
		int64_t *r = rows_buf + ROW_FIELDS * i;
		uint64_t h;
		if (err)
			goto fail;
		had = PyDict_GetItemWithError(reported, rid);
		if (had) {
			from = was = PyLong_AsSsize_t(had);
			if (from == -1 && PyErr_Occurred())
				goto fail;
		} else if (PyErr_Occurred()) {
			goto fail;
		}
		if (from < 0 || from > len)
			from = 0; /* shorter than reported: sent whole */
		if (str_hash(rid, &h) < 0 || get_i64(PySequence_Fast_GET_ITEM(seqs, i), &r[1]) < 0 ||
		    get_i64(PySequence_Fast_GET_ITEM(toks, i), &r[2]) < 0)
			goto fail;
		r[0] = (int64_t)h;
		r[3] = len;
		r[4] = from;
		if (len > from) {
			/* +1: room for the padding to an even count */
			if (reserve((void **)&tail_buf, &tail_cap, (size_t)(nt + len - from + 1), 4) < 0)
				goto fail;
			for (Py_ssize_t j = from; j < len; j++)
				if (block_id_of(PyList_GET_ITEM(blocks, j), "step_rows",
						&tail_buf[nt++]) < 0)
					goto fail;
		}
		if (was != len) {
			PyObject *v = PyLong_FromSsize_t(len);
			if (!v || PyDict_SetItem(reported, rid, v) < 0) {
				Py_XDECREF(v);
				goto fail;
			}
			Py_DECREF(v);
		}
	}
	if (reserve((void **)&tail_buf, &tail_cap, (size_t)nt + 1, 4) < 0)
		goto fail;
	tail_buf[nt] = 0; /* the padding: the tracer reads whole 8-byte words */
	{
		int64_t *rows = rows_buf;
		int32_t *tail = tail_buf;
		IN_REGISTER(rows);
		IN_REGISTER(tail);
		KVTRACE_STEP_ROWS(rows, (int64_t)n, tail, (int64_t)nt, group, bsize, nblocks);
	}
	rows_n = n;
	tail_n = nt;
done:
	Py_DECREF(ids);
	Py_DECREF(seqs);
	Py_DECREF(toks);
	Py_RETURN_NONE;
fail:
	Py_XDECREF(ids);
	Py_XDECREF(seqs);
	Py_XDECREF(toks);
	return NULL;
}

/* last_rows() -> (rows int64 bytes, tail int32 bytes): what the last
 * step_rows call fired, as the probe got it (empty if it fired none) */
static PyObject *last_rows(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	return Py_BuildValue("y#y#", (const char *)rows_buf, rows_n * ROW_FIELDS * 8,
			     (const char *)tail_buf, tail_n * 4);
}

/* last_table() -> (rows, width, table bytes, seq_lens bytes): the table
 * the last block_table call fired, as the probe got it, or 0 rows if it
 * fired none (KVTRACE_PLUGIN_RECORD records it) */
static PyObject *last_table(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	return Py_BuildValue("nny#y#", table_rows, table_width, (const char *)table_buf,
			     table_rows * table_width * 4, (const char *)seq_buf, table_rows * 4);
}

/* ---- req_hash(str) -> int: FNV-1a 64 of the UTF-8 bytes ------------------ */

static PyObject *req_hash(PyObject *self, PyObject *arg)
{
	uint64_t h;
	(void)self;
	if (str_hash(arg, &h) < 0)
		return NULL;
	return PyLong_FromUnsignedLongLong(h);
}

/* ---- semaphores ---------------------------------------------------------- */

struct sem {
	const char *name;
	volatile unsigned short *addr;
};

#define SEM(n) { #n, &vllm_##n##_semaphore }
static const struct sem plugin_sems[] = {
	SEM(block_table), SEM(block_alloc), SEM(block_hit),  SEM(block_cache),
	SEM(block_free),  SEM(block_evict), SEM(request),    SEM(req_preempt),
	SEM(req_finish),  SEM(step_reqs),   SEM(step_rows),
	SEM(prefix_hashes),
};
#define NSEMS (sizeof(plugin_sems) / sizeof(plugin_sems[0]))

/* {name: (address, read-only 2-byte memoryview)} of the semaphores of the
 * probes this module fires.  memoryview(...).cast("H")[0] reads one. */
static PyObject *semaphores(PyObject *self, PyObject *unused)
{
	PyObject *d = PyDict_New();
	size_t i;
	(void)self;
	(void)unused;
	if (!d)
		return NULL;
	for (i = 0; i < NSEMS; i++) {
		PyObject *mv = PyMemoryView_FromMemory(
			(char *)plugin_sems[i].addr, sizeof(unsigned short),
			PyBUF_READ);
		PyObject *t;
		if (!mv)
			goto fail;
		t = Py_BuildValue("(KN)",
				  (unsigned long long)(uintptr_t)plugin_sems[i].addr,
				  mv);
		if (!t || PyDict_SetItemString(d, plugin_sems[i].name, t) < 0) {
			Py_XDECREF(t);
			goto fail;
		}
		Py_DECREF(t);
	}
	return d;
fail:
	Py_DECREF(d);
	return NULL;
}

/* enabled(name) -> int: the semaphore's value (for tests and measurements;
 * the hooks read the memoryviews) */
static PyObject *enabled(PyObject *self, PyObject *arg)
{
	const char *name = PyUnicode_AsUTF8(arg);
	size_t i;
	(void)self;
	if (!name)
		return NULL;
	for (i = 0; i < NSEMS; i++)
		if (!strcmp(name, plugin_sems[i].name))
			return PyLong_FromLong(*plugin_sems[i].addr);
	PyErr_Format(PyExc_KeyError, "%s", name);
	return NULL;
}

static PyObject *noop(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	Py_RETURN_NONE;
}

#define FAST(n, doc) {#n, (PyCFunction)(void (*)(void))probe_##n, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
	FAST(block_alloc, "block_alloc(req, group_id, ids_int32, num_blocks)"),
	FAST(block_hit, "block_hit(req, group_id, ids_int32, num_blocks)"),
	FAST(block_cache, "block_cache(req, group_id, ids_int32, num_blocks)"),
	FAST(block_free, "block_free(req, group_id, ids_int32, num_blocks)"),
	FAST(block_evict, "block_evict(req, group_id, ids_int32, num_blocks)"),
	FAST(request, "request(req, id_str, prompt_tokens)"),
	FAST(req_preempt, "req_preempt(req, computed_tokens)"),
	FAST(req_finish, "req_finish(req, output_tokens)"),
	FAST(block_table, "block_table(req_to_blocks, req_ids, seq_lens, block_size, "
			  "group_id, num_blocks): the table of req_ids' blocks; layer_id 0"),
	FAST(step_reqs, "step_reqs(req_ids, tokens): the step's requests and "
			"the tokens each computes"),
	FAST(step_rows, "step_rows(req_to_blocks, req_ids, seq_lens, tokens, reported, "
			"group_id, block_size, num_blocks): each row's new entries since "
			"reported[req_id], which it updates"),
	{"last_rows", last_rows, METH_NOARGS,
	 "last_rows() -> (rows_int64_bytes, tail_int32_bytes) of the last step_rows"},
	FAST(prefix_hashes, "prefix_hashes(req, hashes_uint64, tokens_per_hash, "
			    "block_size, domain): a prompt's token hashes"),
	{"last_table", last_table, METH_NOARGS,
	 "last_table() -> (rows, width, table_int32_bytes, seq_lens_int32_bytes)"},
	{"req_hash", req_hash, METH_O, "req_hash(str) -> FNV-1a 64 of its UTF-8"},
	{"semaphores", semaphores, METH_NOARGS,
	 "{name: (address, memoryview of 2 bytes)} of each probe's semaphore"},
	{"enabled", enabled, METH_O, "enabled(name) -> the semaphore's value"},
	{"noop", noop, METH_NOARGS, "does nothing (cost measurements)"},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "kvtrace_vllm._probes",
	"The plugin tier's USDT probes (bpf/kvtrace_probes.h).", -1, methods,
	NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__probes(void)
{
	block_id_name = PyUnicode_InternFromString("block_id");
	if (!block_id_name)
		return NULL;
	return PyModule_Create(&module);
}
