/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvtrace_vllm._status: the plugin's install outcome, as one line the tracer
 * reads from the process's memory (docs/plugin.md, "What the tracer is
 * told"): "tested vLLM release X", "untested vLLM release X" or "refused vLLM
 * release X: why".
 *
 * Apart from the probes' object on purpose: a process that maps probe sites
 * is one the tracer names a tier for, and a refused plugin fires nothing.
 * This object carries no probe; the scheduler's process maps it whatever
 * install() decided, so that a refusal's reason reaches `attach` and
 * `doctor -p` too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define KVTRACE_STATUS_LEN 256

/* exported, NUL-terminated, empty until set; the tracer finds it by name in
 * the object's symbol table */
__attribute__((visibility("default"), used)) char kvtrace_plugin_status[KVTRACE_STATUS_LEN];

static PyObject *set_status(PyObject *self, PyObject *arg)
{
	Py_ssize_t len;
	const char *s = PyUnicode_AsUTF8AndSize(arg, &len);
	(void)self;
	if (!s)
		return NULL;
	if (len > KVTRACE_STATUS_LEN - 1)
		len = KVTRACE_STATUS_LEN - 1;
	/* set once, at install, before a tracer has a reason to look */
	memset(kvtrace_plugin_status, 0, sizeof(kvtrace_plugin_status));
	memcpy(kvtrace_plugin_status, s, (size_t)len);
	Py_RETURN_NONE;
}

static PyObject *status(PyObject *self, PyObject *unused)
{
	(void)self;
	(void)unused;
	return PyUnicode_FromString(kvtrace_plugin_status);
}

static PyMethodDef methods[] = {
	{"set_status", set_status, METH_O,
	 "set_status(line): the install outcome the tracer reads (kvtrace_plugin_status)"},
	{"status", status, METH_NOARGS, "status() -> the line set_status() set"},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "kvtrace_vllm._status",
	"The plugin's install outcome, where the tracer reads it.", -1, methods,
	NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__status(void)
{
	return PyModule_Create(&module);
}
