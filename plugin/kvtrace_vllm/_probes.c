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
 * Block id lists and block tables are Python buffers of int32 (numpy int32
 * arrays, array('i')): the probe gets a pointer to the buffer's memory,
 * valid for the duration of the call, which is all a uprobe needs.
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

/* ---- block_table(table2d, seq_lens, block_size, group_id, num_blocks) ---- */

static PyObject *probe_block_table(PyObject *self, PyObject *const *args,
				   Py_ssize_t nargs)
{
	Py_buffer t, s;
	int64_t bsize, nblocks, stride, nreqs;
	uint64_t group;
	(void)self;
	if (check_nargs("block_table", nargs, 5) < 0 ||
	    get_i64(args[2], &bsize) < 0 || get_u64(args[3], &group) < 0 ||
	    get_i64(args[4], &nblocks) < 0)
		return NULL;
	if (PyObject_GetBuffer(args[0], &t, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
		return NULL;
	if (!is_int32_format(&t) || t.ndim != 2 || t.strides[1] != 4 ||
	    t.strides[0] < 0 || t.strides[0] % 4 != 0) {
		PyErr_SetString(PyExc_TypeError,
				"block_table: a 2-D int32 table with contiguous "
				"rows is needed");
		PyBuffer_Release(&t);
		return NULL;
	}
	nreqs = t.shape[0];
	stride = t.strides[0] / 4;
	if (get_int32_vector(args[1], &s, "block_table seq_lens") < 0) {
		PyBuffer_Release(&t);
		return NULL;
	}
	if (s.len / 4 < nreqs) {
		PyErr_SetString(PyExc_ValueError,
				"block_table: fewer seq_lens than table rows");
		PyBuffer_Release(&s);
		PyBuffer_Release(&t);
		return NULL;
	}
	KVTRACE_BLOCK_TABLE(t.buf, stride, nreqs, s.buf, bsize, group, nblocks,
			    (uint64_t)0);
	PyBuffer_Release(&s);
	PyBuffer_Release(&t);
	Py_RETURN_NONE;
}

/* ---- step_reqs(rows_uint64): the step's requests, then their new tokens - */

static PyObject *probe_step_reqs(PyObject *self, PyObject *arg)
{
	Py_buffer v;
	(void)self;
	if (PyObject_GetBuffer(arg, &v, PyBUF_C_CONTIGUOUS) < 0)
		return NULL;
	if (v.itemsize != 8 || v.len % 16 != 0) {
		PyErr_SetString(PyExc_TypeError,
				"step_reqs: 2 * num_reqs uint64 are needed");
		PyBuffer_Release(&v);
		return NULL;
	}
	KVTRACE_STEP_REQS(v.buf, (int64_t)(v.len / 16));
	PyBuffer_Release(&v);
	Py_RETURN_NONE;
}

/* ---- req_hash(str) -> int: FNV-1a 64 of the UTF-8 bytes ------------------ */

static PyObject *req_hash(PyObject *self, PyObject *arg)
{
	Py_ssize_t len, i;
	const unsigned char *p;
	uint64_t h = 0xcbf29ce484222325ULL;
	(void)self;
	if (!PyUnicode_Check(arg)) {
		PyErr_SetString(PyExc_TypeError, "req_hash: a str is needed");
		return NULL;
	}
	p = (const unsigned char *)PyUnicode_AsUTF8AndSize(arg, &len);
	if (!p)
		return NULL;
	for (i = 0; i < len; i++) {
		h ^= p[i];
		h *= 0x100000001b3ULL;
	}
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
	SEM(req_finish),  SEM(step_reqs),
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
	FAST(block_table, "block_table(table2d_int32, seq_lens_int32, block_size, "
			  "group_id, num_blocks): layer_id 0"),
	{"step_reqs", probe_step_reqs, METH_O,
	 "step_reqs(rows_uint64): the step's request hashes, then their new "
	 "tokens"},
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
	return PyModule_Create(&module);
}
