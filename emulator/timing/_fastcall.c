/*
 * cxlemu timed data path: per-call entry points from Python, without cffi's conversions.
 *
 * A cffi call needs a cdata pointer, and turning a numpy array or bytearray into one
 * (ffi.from_buffer, require_writable) costs ~0.35 us per call: a third of a 64 KiB copy's time.
 * transfer() takes the buffer itself and borrows its memory through the buffer protocol for
 * the duration of the call (PyObject_GetBuffer, ~30 ns), as numpy's own C functions do; the
 * exporter refuses a read-only buffer for a read and a non-contiguous one (no PyBUF_STRIDES in
 * the request), so the C core only ever writes within [buf, buf + len) of a writable buffer.
 * read_bytes() is MemDev.read's timed read into a new bytes object.  Pointers to the core's own
 * structs travel as ints: these are private entry points, called only by
 * emulator.timing.DataPath with addresses it owns.  The DMA engine's entry points are in
 * _dmacall.c.
 *
 * It is compiled into the cffi extension (_cdatapath) as a second module of the same shared
 * library (PEP 489, "multiple modules in one library") and loaded from that file by
 * emulator.timing.cimpl: setuptools builds one library, and the modules share the C core.
 * It needs the buffer protocol in the limited API (3.11); older interpreters get no
 * PyInit__fastcall and the data path keeps ffi.from_buffer.
 */
#include <patchlevel.h>
#if PY_VERSION_HEX >= 0x030B0000
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_datapath.h"

/* transfer(dp, err, dir, dpa, buffer, now, wait) -> int
 *   dp, err: addresses of the cxl_dp and of a uint64_t (ints, from ffi.cast("uintptr_t", ...))
 *   dir: CXL_DIR_READ (media -> buffer; the buffer must be writable) or CXL_DIR_WRITE
 *   now: < 0 real time, else simulated ns; wait: truthy to wait for completion (real time)
 * Returns cxl_read / cxl_write's result (completion ns, or a negative CXL_E_* code). Raises
 * the exporter's TypeError / BufferError for an object that is not a usable buffer. */
static PyObject *fc_transfer(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "transfer() takes 7 arguments");
        return NULL;
    }
    const cxl_dp *dp = (const cxl_dp *)PyLong_AsVoidPtr(args[0]);
    uint64_t *err = (uint64_t *)PyLong_AsVoidPtr(args[1]);
    long dir = PyLong_AsLong(args[2]);
    unsigned long long dpa = PyLong_AsUnsignedLongLong(args[3]);
    long long now = PyLong_AsLongLong(args[5]);
    int wait = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (dp == NULL || err == NULL || (dir != CXL_DIR_READ && dir != CXL_DIR_WRITE)) {
        PyErr_SetString(PyExc_ValueError, "transfer(): bad data path, error cell or direction");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[4], &view, dir == CXL_DIR_READ ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t rc;
    Py_BEGIN_ALLOW_THREADS
    if (dir == CXL_DIR_READ)
        rc = cxl_read(dp, dpa, (uint8_t *)view.buf, (uint64_t)view.len, now, wait, err);
    else
        rc = cxl_write(dp, dpa, (const uint8_t *)view.buf, (uint64_t)view.len, now, wait, err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(rc);
}

/* read_bytes(dp, err, dpa, n, now) -> bytes | int: a read of n bytes into a new bytes object
 * (MemDev.read), or the negative CXL_E_* code.  The object is allocated uninitialised (no zero
 * fill) and filled by the one copy the transfer makes, so read() costs what read_into() costs
 * plus an allocation.  A real-time read longer than the short path is stamped before the
 * allocation: its allocation, page faults and copy run inside the link time, as the bytes of a
 * streaming read arrive while the host is still taking them (a 2 MiB read() used to reach 0.75
 * GB/s of 2.5, its zero-filled buffer and second copy outside the link time).  The short path
 * counts its latency from the copy, as read_into's does. */
static PyObject *fc_read_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_bytes() takes 5 arguments");
        return NULL;
    }
    const cxl_dp *dp = (const cxl_dp *)PyLong_AsVoidPtr(args[0]);
    uint64_t *err = (uint64_t *)PyLong_AsVoidPtr(args[1]);
    unsigned long long dpa = PyLong_AsUnsignedLongLong(args[2]);
    long long n = PyLong_AsLongLong(args[3]);
    long long now = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (dp == NULL || err == NULL || n < 0) {
        PyErr_SetString(PyExc_ValueError, "read_bytes(): bad data path, error cell or length");
        return NULL;
    }
    if (cxl_check_range(dp, dpa, (uint64_t)n))  /* before allocating n bytes */
        return PyLong_FromLongLong(CXL_E_RANGE);
    int64_t ref_ns = -1;
    uint64_t ref_tsc = 0;
    int stamped = now < 0 && !dp->untimed && n > CXL_SHORT_BYTES;
    if (stamped)
        cxl_stamp(&ref_ns, &ref_tsc);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out == NULL)
        return NULL;
    uint8_t *buf = (uint8_t *)PyBytes_AsString(out);
    int64_t rc;
    Py_BEGIN_ALLOW_THREADS
    if (stamped)
        rc = cxl_read_from(dp, dpa, buf, (uint64_t)n, ref_ns, ref_tsc, err);
    else
        rc = cxl_read(dp, dpa, buf, (uint64_t)n, now, 1, err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(out);
        return PyLong_FromLongLong(rc);
    }
    return out;
}

static PyMethodDef fc_methods[] = {
    {"read_bytes", (PyCFunction)(void (*)(void))fc_read_bytes, METH_FASTCALL,
     "read_bytes(dp, err, dpa, n, now): a timed read into a new bytes object, or a CXL_E_* code."},
    {"transfer", (PyCFunction)(void (*)(void))fc_transfer, METH_FASTCALL,
     "transfer(dp, err, dir, dpa, buffer, now, wait) -> completion ns or CXL_E_* code"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fc_module = {
    PyModuleDef_HEAD_INIT, "_fastcall",
    "Plain host buffers straight to the timed data path's C core (see _fastcall.c).",
    -1, fc_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void)
{
    return PyModule_Create(&fc_module);
}
#endif
