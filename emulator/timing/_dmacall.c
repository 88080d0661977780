/*
 * cxlemu DMA engine (emulator.dma): its per-descriptor entry points in C.
 *
 * issue() of one descriptor (its cxl_desc built and pinned once); ChannelState, a channel's
 * claim word; HandleBase, the fields of a DmaHandle; and inline1(), the whole inline submission
 * of one descriptor (claim an idle channel, issue, and a done handle in the completion queue)
 * in one call, where Python-level bookkeeping would cost several times the transfer.  Pointers
 * to the core's own structs travel as ints: these are private entry points, called only by
 * emulator.dma with addresses it owns.
 *
 * Like _fastcall.c, a further module (emulator.timing._dmacall) of the cffi extension's shared
 * library (PEP 489, "multiple modules in one library"), loaded from that file by
 * emulator.timing.cimpl; it needs the limited API of 3.11 (older interpreters get no
 * PyInit__dmacall and the engine issues through cffi).
 */
#include <patchlevel.h>
#if PY_VERSION_HEX >= 0x030B0000
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stddef.h>
#include <structmember.h>
#include <time.h>

#include "_datapath.h"

/* issue(dp, desc, now, err) -> int: cxl_issue() of one DMA descriptor (addresses of the
 * cxl_dp, of a cxl_desc whose host pointer is pinned by its owner, and of an error cell):
 * its completion time, or a negative CXL_E_* code.  The DMA engine's per-descriptor call;
 * a cffi call's argument conversion would cost more than the issue itself. */
static PyObject *fc_issue(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "issue() takes 4 arguments");
        return NULL;
    }
    const cxl_dp *dp = (const cxl_dp *)PyLong_AsVoidPtr(args[0]);
    const cxl_desc *desc = (const cxl_desc *)PyLong_AsVoidPtr(args[1]);
    long long now = PyLong_AsLongLong(args[2]);
    uint64_t *err = (uint64_t *)PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (dp == NULL || desc == NULL || err == NULL) {
        PyErr_SetString(PyExc_ValueError, "issue(): null data path, descriptor or error cell");
        return NULL;
    }
    int64_t rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cxl_issue(dp, desc, now, err);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(rc);
}

/* HandleBase: the fields of emulator.dma.DmaHandle (which subclasses it and adds the methods).
 * A Python class with __slots__ costs ~0.25 us to construct on a slow host (its __init__ frame
 * and six slot stores): as much as the whole inline DMA transfer it describes.  Fields are
 * exposed as members: id, channel, count (read-only), _results, _event, _callbacks. */
typedef struct {
    PyObject_HEAD
    PyObject *id;
    PyObject *channel;
    PyObject *count;
    PyObject *results;   /* NULL (None) until complete */
    PyObject *event;
    PyObject *callbacks;
} HandleObject;

static PyObject *handle_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"handle_id", "channel", "count", "results", NULL};
    PyObject *id, *channel, *count, *results = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O", kwlist, &id, &channel, &count, &results))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    HandleObject *self = (HandleObject *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(id);
    Py_INCREF(channel);
    Py_INCREF(count);
    self->id = id;
    self->channel = channel;
    self->count = count;
    if (results != Py_None) {
        Py_INCREF(results);
        self->results = results;
    }
    return (PyObject *)self;
}

static int handle_traverse(PyObject *op, visitproc visit, void *arg)
{
    HandleObject *self = (HandleObject *)op;
    Py_VISIT(Py_TYPE(op)); /* a heap type's instances keep it alive */
    Py_VISIT(self->id);
    Py_VISIT(self->channel);
    Py_VISIT(self->count);
    Py_VISIT(self->results);
    Py_VISIT(self->event);
    Py_VISIT(self->callbacks);
    return 0;
}

static int handle_clear(PyObject *op)
{
    HandleObject *self = (HandleObject *)op;
    Py_CLEAR(self->id);
    Py_CLEAR(self->channel);
    Py_CLEAR(self->count);
    Py_CLEAR(self->results);
    Py_CLEAR(self->event);
    Py_CLEAR(self->callbacks);
    return 0;
}

static void handle_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    handle_clear(op);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(op);
    Py_DECREF(type);
}

static int handle_is_done(HandleObject *self) { return self->results != NULL && self->results != Py_None; }

static PyObject *handle_done(PyObject *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(handle_is_done((HandleObject *)self));
}

/* wait(timeout=None): a done handle's results, copied, at once; a pending one goes to the
 * subclass's _wait_pending(timeout), which blocks (emulator.dma.DmaHandle). */
static PyObject *handle_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    HandleObject *h = (HandleObject *)self;
    if (handle_is_done(h))
        return PyList_GetSlice(h->results, 0, PY_SSIZE_T_MAX);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_Size(kwnames);
    if (nargs + nkw > 1) {
        PyErr_SetString(PyExc_TypeError, "wait() takes at most one argument (timeout)");
        return NULL;
    }
    if (nkw == 1) {
        int is_timeout = PyUnicode_CompareWithASCIIString(PyTuple_GetItem(kwnames, 0), "timeout") == 0;
        if (!is_timeout) {
            PyErr_SetString(PyExc_TypeError, "wait() got an unexpected keyword argument");
            return NULL;
        }
    }
    PyObject *timeout = nargs + nkw == 1 ? args[0] : Py_None;
    return PyObject_CallMethod(self, "_wait_pending", "O", timeout);
}

static PyMethodDef handle_methods[] = {
    {"done", handle_done, METH_NOARGS, "Whether the submission has completed."},
    {"wait", (PyCFunction)(void (*)(void))handle_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None) -> per-descriptor results: each completion time (ns) or DmaError, in "
     "submission order; raises TimeoutError if not done in time."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef handle_members[] = {
    {"id", T_OBJECT, offsetof(HandleObject, id), READONLY, NULL},
    {"channel", T_OBJECT, offsetof(HandleObject, channel), READONLY, NULL},
    {"count", T_OBJECT, offsetof(HandleObject, count), READONLY, NULL},
    {"_results", T_OBJECT, offsetof(HandleObject, results), 0, NULL},
    {"_event", T_OBJECT, offsetof(HandleObject, event), 0, NULL},
    {"_callbacks", T_OBJECT, offsetof(HandleObject, callbacks), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot handle_slots[] = {
    {Py_tp_doc, "The fields of a DMA handle (emulator.dma.DmaHandle adds the methods)."},
    {Py_tp_new, handle_new},
    {Py_tp_traverse, handle_traverse},
    {Py_tp_clear, handle_clear},
    {Py_tp_dealloc, handle_dealloc},
    {Py_tp_members, handle_members},
    {Py_tp_methods, handle_methods},
    {0, NULL},
};

static PyType_Spec handle_spec = {
    "emulator.timing._dmacall.HandleBase", sizeof(HandleObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, handle_slots,
};

/* ChannelState: who may run a submission on one DMA channel, as one atomic word, so the
 * inline path claims an idle channel inside inline1() with one compare-and-swap and no
 * Python-level lock.  Word: OWNED (bit 0: a submission is running, inline or on the
 * channel's thread), CLOSED (bit 1), and the number of submissions queued (from bit 2).
 *   try_claim()   OWNED from 0 only: idle, nothing queued, not closed (the inline path)
 *   claim()       OWNED whatever is queued (the channel's thread), waiting out an inline
 *                 submission: spins, then yields, then naps, with the GIL released
 *   release(), add_queued(n), close(), snapshot() -> (owned, queued, closed)
 * emulator.dma keeps the queue itself; it counts what it queues here before queueing it. */
#define CHAN_OWNED 1
#define CHAN_CLOSED 2
#define CHAN_ONE_QUEUED 4

typedef struct {
    PyObject_HEAD
    int64_t word;
    /* what inline1() needs, set once by the engine (NULL: not set, inline1 refuses) */
    PyObject *channel;      /* the channel's number, for its handles */
    uint64_t *err;          /* the channel's error-DPA cell */
    PyObject *desc_type;    /* emulator.dma.Descriptor */
    PyObject *handle_cls;   /* emulator.dma.DmaHandle (a HandleBase subclass) */
    PyObject *ids;          /* the engine's handle-id iterator */
    PyObject *cq_append;    /* the engine's completion queue's append */
    long long max_bytes;    /* INLINE_BYTES */
} ChanObject;

static PyTypeObject *chan_type;  /* ChannelState, set at module init */
static PyObject *handle_type;    /* HandleBase, set at module init */
static PyObject *str_cdesc_addr, *str_length;

/* ChannelState(channel, err, descriptor_type, handle_type, ids, cq_append, max_bytes), or
 * ChannelState() for the claim word alone. */
static PyObject *chan_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"channel", "err", "descriptor_type", "handle_type", "ids", "cq_append",
                             "max_bytes", NULL};
    PyObject *channel = NULL, *err = NULL, *desc_type = NULL, *handle_cls = NULL, *ids = NULL,
             *cq_append = NULL;
    long long max_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOOOOOL", kwlist, &channel, &err, &desc_type,
                                     &handle_cls, &ids, &cq_append, &max_bytes))
        return NULL;
    int all = channel && err && desc_type && handle_cls && ids && cq_append;
    if (channel || err || desc_type || handle_cls || ids || cq_append) {
        if (!all || !PyType_Check(desc_type) || !PyType_Check(handle_cls) ||
            !PyType_IsSubtype((PyTypeObject *)handle_cls, (PyTypeObject *)handle_type) ||
            !PyCallable_Check(cq_append)) {
            PyErr_SetString(PyExc_TypeError, "ChannelState: give every argument (handle_type a "
                                             "HandleBase subclass, cq_append callable), or none");
            return NULL;
        }
    }
    uint64_t *cell = NULL;
    if (err != NULL && (cell = (uint64_t *)PyLong_AsVoidPtr(err)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ChannelState: null error cell");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    ChanObject *c = (ChanObject *)alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->err = cell;
    c->max_bytes = max_bytes;
    Py_XINCREF(channel);
    Py_XINCREF(desc_type);
    Py_XINCREF(handle_cls);
    Py_XINCREF(ids);
    Py_XINCREF(cq_append);
    c->channel = channel;
    c->desc_type = desc_type;
    c->handle_cls = handle_cls;
    c->ids = ids;
    c->cq_append = cq_append;
    return (PyObject *)c;
}

static int chan_traverse(PyObject *op, visitproc visit, void *arg)
{
    ChanObject *c = (ChanObject *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(c->channel);
    Py_VISIT(c->desc_type);
    Py_VISIT(c->handle_cls);
    Py_VISIT(c->ids);
    Py_VISIT(c->cq_append);
    return 0;
}

static int chan_clear(PyObject *op)
{
    ChanObject *c = (ChanObject *)op;
    Py_CLEAR(c->channel);
    Py_CLEAR(c->desc_type);
    Py_CLEAR(c->handle_cls);
    Py_CLEAR(c->ids);
    Py_CLEAR(c->cq_append);
    return 0;
}

static void chan_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    chan_clear(op);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(op);
    Py_DECREF(type);
}

static int chan_try_claim(ChanObject *c)
{
    int64_t idle = 0;
    return __atomic_compare_exchange_n(&c->word, &idle, CHAN_OWNED, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

static void chan_release(ChanObject *c) { __atomic_fetch_and(&c->word, ~(int64_t)CHAN_OWNED, __ATOMIC_RELEASE); }

static PyObject *chan_try_claim_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(chan_try_claim((ChanObject *)self));
}

static PyObject *chan_claim_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    ChanObject *c = (ChanObject *)self;
    Py_BEGIN_ALLOW_THREADS
    for (unsigned tries = 0;; tries++) {
        int64_t w = __atomic_load_n(&c->word, __ATOMIC_ACQUIRE);
        if (!(w & CHAN_OWNED) &&
            __atomic_compare_exchange_n(&c->word, &w, w | CHAN_OWNED, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            break;
        if (tries < 1000) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else if (tries < 2000) {
            sched_yield();
        } else { /* the owner was descheduled: nap rather than burn a core */
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *chan_release_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    chan_release((ChanObject *)self);
    Py_RETURN_NONE;
}

static PyObject *chan_add_queued_py(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    __atomic_fetch_add(&((ChanObject *)self)->word, (int64_t)n * CHAN_ONE_QUEUED, __ATOMIC_ACQ_REL);
    Py_RETURN_NONE;
}

static PyObject *chan_close_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    __atomic_fetch_or(&((ChanObject *)self)->word, (int64_t)CHAN_CLOSED, __ATOMIC_ACQ_REL);
    Py_RETURN_NONE;
}

static PyObject *chan_snapshot_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    int64_t w = __atomic_load_n(&((ChanObject *)self)->word, __ATOMIC_ACQUIRE);
    return Py_BuildValue("(OLO)", (w & CHAN_OWNED) ? Py_True : Py_False, (long long)(w / CHAN_ONE_QUEUED),
                         (w & CHAN_CLOSED) ? Py_True : Py_False);
}

static PyMethodDef chan_methods[] = {
    {"try_claim", chan_try_claim_py, METH_NOARGS, "Own the channel if idle, nothing queued, open."},
    {"claim", chan_claim_py, METH_NOARGS, "Own the channel (the channel's thread), waiting if owned."},
    {"release", chan_release_py, METH_NOARGS, "Give the channel up."},
    {"add_queued", chan_add_queued_py, METH_O, "Count n more (or fewer) queued submissions."},
    {"close", chan_close_py, METH_NOARGS, "No more inline claims."},
    {"snapshot", chan_snapshot_py, METH_NOARGS, "(owned, queued, closed)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot chan_slots[] = {
    {Py_tp_doc, "A DMA channel's claim word and inline context (see _fastcall.c)."},
    {Py_tp_new, chan_new},
    {Py_tp_traverse, chan_traverse},
    {Py_tp_clear, chan_clear},
    {Py_tp_dealloc, chan_dealloc},
    {Py_tp_methods, chan_methods},
    {0, NULL},
};

static PyType_Spec chan_spec = {
    "emulator.timing._dmacall.ChannelState", sizeof(ChanObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, chan_slots,
};


/* The descriptor's cxl_desc address if inline1 may take it (one Descriptor, built, at most
 * max_bytes), 0 if not, -1 with an exception set on an error. */
static long long inline_candidate(ChanObject *chan, PyObject *descs)
{
    if (!PyList_Check(descs) || PyList_Size(descs) != 1)
        return 0;
    PyObject *d = PyList_GetItem(descs, 0); /* borrowed */
    if ((PyObject *)Py_TYPE(d) != chan->desc_type)
        return 0;
    PyObject *addr = PyObject_GetAttr(d, str_cdesc_addr); /* absent until c_descriptor() */
    if (addr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *length = PyObject_GetAttr(d, str_length);
    long long n = length == NULL ? -1 : PyLong_AsLongLong(length);
    long long a = PyLong_AsLongLong(addr);
    Py_XDECREF(length);
    Py_DECREF(addr);
    if (PyErr_Occurred())
        return -1;
    return n <= chan->max_bytes ? a : 0;
}

/* inline1(chan, dp, descs, now) -> handle | (handle_id, code) | None
 * The DMA engine's inline path for a submission of one built descriptor (list, exactly one
 * Descriptor with its cxl_desc, at most max_bytes): None if it is not that, or the channel is
 * not idle (chan.try_claim() fails).  Else, on the claimed channel: cxl_issue(), then, if the
 * transfer is complete by now (untimed: 0; simulated time: now >= 0; real time: its completion
 * no later than cxl_link_now()), a done handle (results [completion]) passed to cq_append, the
 * channel released, and the handle returned.  Otherwise (handle_id, error code < 0 or the
 * completion still ahead), the channel still claimed: the caller finishes and releases. */
static PyObject *fc_inline1(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4 || !PyObject_TypeCheck(args[0], chan_type)) {
        PyErr_SetString(PyExc_TypeError, "inline1(chan: ChannelState, dp, descs, now)");
        return NULL;
    }
    ChanObject *chan = (ChanObject *)args[0];
    if (chan->desc_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "inline1(): the ChannelState has no inline context");
        return NULL;
    }
    const cxl_dp *dp = (const cxl_dp *)PyLong_AsVoidPtr(args[1]);
    long long now = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    long long addr = inline_candidate(chan, args[2]);
    if (addr < 0)
        return NULL;
    if (addr == 0 || dp == NULL || !chan_try_claim(chan))
        Py_RETURN_NONE;
    PyObject *handle_id = PyIter_Next(chan->ids);
    if (handle_id == NULL) {
        chan_release(chan);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "inline1(): handle ids exhausted");
        return NULL;
    }
    int64_t rc;
    int done;
    const cxl_desc *desc = (const cxl_desc *)(uintptr_t)addr;
    Py_BEGIN_ALLOW_THREADS
    rc = cxl_issue(dp, desc, now, chan->err);
    done = rc == 0 || (rc > 0 && (now >= 0 || rc <= cxl_link_now()));
    Py_END_ALLOW_THREADS
    if (!done) { /* still claimed */
        PyObject *code = PyLong_FromLongLong(rc);
        PyObject *out = code == NULL ? NULL : PyTuple_Pack(2, handle_id, code);
        Py_XDECREF(code);
        Py_DECREF(handle_id);
        if (out == NULL)
            chan_release(chan);
        return out;
    }
    PyTypeObject *cls = (PyTypeObject *)chan->handle_cls;
    allocfunc alloc = (allocfunc)PyType_GetSlot(cls, Py_tp_alloc);
    HandleObject *h = (HandleObject *)alloc(cls, 0);
    PyObject *appended = NULL;
    if (h != NULL) {
        h->results = PyList_New(1);
        h->count = PyLong_FromLong(1);
        PyObject *completion = PyLong_FromLongLong(rc);
        if (h->results != NULL && h->count != NULL && completion != NULL) {
            PyList_SetItem(h->results, 0, completion); /* steals completion */
            Py_INCREF(handle_id);
            Py_INCREF(chan->channel);
            h->id = handle_id;
            h->channel = chan->channel;
            appended = PyObject_CallFunctionObjArgs(chan->cq_append, (PyObject *)h, NULL);
        } else {
            Py_XDECREF(completion);
        }
    }
    Py_DECREF(handle_id);
    chan_release(chan); /* done, or failed to say so: either way nothing runs on it now */
    if (appended == NULL) {
        Py_XDECREF((PyObject *)h);
        return NULL;
    }
    Py_DECREF(appended);
    return (PyObject *)h;
}

static PyMethodDef dc_methods[] = {
    {"issue", (PyCFunction)(void (*)(void))fc_issue, METH_FASTCALL,
     "issue(dp, desc, now, err) -> completion ns or CXL_E_* code"},
    {"inline1", (PyCFunction)(void (*)(void))fc_inline1, METH_FASTCALL,
     "inline1(chan, dp, descs, now) -> done handle | (handle_id, code) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef dc_module = {
    PyModuleDef_HEAD_INIT, "_dmacall",
    "The DMA engine's entry points into the timed data path's C core (see _dmacall.c).",
    -1, dc_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__dmacall(void)
{
    PyObject *module = PyModule_Create(&dc_module);
    if (module == NULL)
        return NULL;
    /* module-level references, kept for the type checks of inline1 */
    str_cdesc_addr = PyUnicode_InternFromString("_cdesc_addr");
    str_length = PyUnicode_InternFromString("length");
    if (str_cdesc_addr == NULL || str_length == NULL)
        goto fail;
    handle_type = PyType_FromSpec(&handle_spec);
    chan_type = (PyTypeObject *)PyType_FromSpec(&chan_spec);
    if (handle_type == NULL || chan_type == NULL)
        goto fail;
    Py_INCREF(handle_type);
    if (PyModule_AddObject(module, "HandleBase", handle_type) < 0) {
        Py_DECREF(handle_type);
        goto fail;
    }
    Py_INCREF((PyObject *)chan_type);
    if (PyModule_AddObject(module, "ChannelState", (PyObject *)chan_type) < 0) {
        Py_DECREF((PyObject *)chan_type);
        goto fail;
    }
    return module;
fail:
    Py_XDECREF(handle_type);
    Py_XDECREF((PyObject *)chan_type);
    Py_DECREF(module);
    return NULL;
}
#endif
