/* indexer._cindex.Core: the Python face of the compiled index core (contract: index_py.PyCore,
 * stub: indexer/_cindex.pyi). Arguments are checked here; core.c functions trust them. */
#include "core.h"
#include "module.h"
#include <structmember.h>

#define MAX_TIERS 64

/* A Python int beyond 64 bits (or negative): its 64-bit limbs folded through mix64. */
static int fold_big(PyObject *o, u64 *out)
{
    PyObject *zero = PyLong_FromLong(0);
    int neg = zero ? PyObject_RichCompareBool(o, zero, Py_LT) : -1;
    Py_XDECREF(zero);
    PyObject *x = neg < 0 ? NULL : PyNumber_Absolute(o);
    PyObject *mask = PyLong_FromUnsignedLongLong(~0ULL), *shift = PyLong_FromLong(64);
    u64 h = 0x9E3779B97F4A7C15ULL ^ (u64)(neg == 1);
    int rc = x && mask && shift ? 0 : -1;
    while (rc == 0 && PyObject_IsTrue(x) == 1) {
        PyObject *lo = PyNumber_And(x, mask);
        u64 limb = lo ? PyLong_AsUnsignedLongLong(lo) : 0;
        Py_XDECREF(lo);
        Py_SETREF(x, PyNumber_Rshift(x, shift));
        if (PyErr_Occurred() || !x)
            rc = -1;
        h = mix64(h ^ limb) + 0x632BE59BD9B4E019ULL;
    }
    Py_XDECREF(x), Py_XDECREF(mask), Py_XDECREF(shift);
    *out = h;
    return rc;
}

int as_u64(PyObject *o, u64 *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block hashes are ints, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030E0000
    /* O(1) range check, then the digit loop without the generic byte-array path */
    if (_PyLong_Sign(o) >= 0 && _PyLong_NumBits(o) <= 64) {
        *out = PyLong_AsUnsignedLongLongMask(o);
        return 0;
    }
#endif
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out != (u64)-1 || !PyErr_Occurred())
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_OverflowError))
        return -1;
    PyErr_Clear();
    return fold_big(o, out);
}

/* a sequence of ints -> a fresh u64 array (PyMem_RawFree it); NULL with an error set */
u64 *u64_array(PyObject *seq_in, Py_ssize_t *n)
{
    PyObject *seq = PySequence_Fast(seq_in, "expected a sequence of ints");
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    u64 *out = PyMem_RawMalloc((size_t)(*n ? *n : 1) * sizeof(u64));
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out && i < *n; i++)
        if (as_u64(items[i], &out[i]) < 0)
            PyMem_RawFree(out), out = NULL;
    if (!out && !PyErr_Occurred())
        PyErr_NoMemory();
    Py_DECREF(seq);
    return out;
}

int check_wid(Core *c, int wid)
{
    if (wid >= 0 && wid < c->nworkers && c->workers[wid].active)
        return 0;
    PyErr_Format(PyExc_KeyError, "no worker id %d", wid);
    return -1;
}

/* tier name -> id; a new name gets an id when `create`, else -1 */
int tier_id(Core *c, PyObject *name, int create)
{
    for (int t = 0; t < c->ntiers; t++) {
        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(c->tier_names, t), name, Py_EQ);
        if (eq)
            return eq < 0 ? -2 : t;
    }
    if (!create)
        return -1;
    if (c->ntiers == MAX_TIERS) {
        PyErr_SetString(PyExc_ValueError, "too many storage tiers");
        return -2;
    }
    Tab *tiers = PyMem_RawRealloc(c->tiers, (size_t)(c->ntiers + 1) * sizeof(Tab));
    if (tiers)
        c->tiers = tiers;
    int *order = PyMem_RawRealloc(c->tier_order, (size_t)(c->ntiers + 1) * sizeof(int));
    if (order)
        c->tier_order = order;
    if (!tiers || !order || tab_init(&c->tiers[c->ntiers], c->W) < 0) {
        PyErr_NoMemory();
        return -2;
    }
    if (PyList_Append(c->tier_names, name) < 0)
        return -2;
    int t = c->ntiers++;
    /* keep the other tiers sorted fastest first (insertion by the rank key) */
    PyObject *key = PyObject_CallOneArg(c->tier_rank, name);
    int r = t - 1;
    for (; key && r > 0; r--) {
        PyObject *prev = PyObject_CallOneArg(c->tier_rank, PyList_GET_ITEM(c->tier_names, c->tier_order[r - 1]));
        int less = prev ? PyObject_RichCompareBool(key, prev, Py_LT) : -1;
        Py_XDECREF(prev);
        if (less <= 0) {
            if (less < 0)
                Py_CLEAR(key);
            break;
        }
        c->tier_order[r] = c->tier_order[r - 1];
    }
    c->tier_order[r] = t;
    if (!key)
        return -2;
    Py_DECREF(key);
    return t;
}

/* ---- type ----------------------------------------------------------------------------- */

static int Core_init(Core *c, PyObject *args, PyObject *kw)
{
    static char *names[] = {"max_entries", "overlap", "tier_rank", "default_tier", NULL};
    unsigned long long max_entries;
    PyObject *overlap, *rank, *tier;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KO!OU", names, &max_entries, &PyType_Type,
                                     &overlap, &rank, &tier))
        return -1;
    if (c->names) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    c->max_entries = max_entries;
    c->W = 1;
    c->overlap = (PyTypeObject *)Py_NewRef(overlap);
    c->tier_rank = Py_NewRef(rank);
    c->names = PyList_New(0);
    c->tier_names = PyList_New(0);
    c->tiers = PyMem_RawCalloc(1, sizeof(Tab));
    c->tier_order = PyMem_RawCalloc(1, sizeof(int));
    if (!c->names || !c->tier_names || !c->tiers || !c->tier_order || tab_init(&c->blocks, 2) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    c->ntiers = 1;
    return PyList_Append(c->tier_names, tier);
}

void free_worker(Worker *w)
{
    ord_free(&w->ids);
    cnt_free(&w->kids);
    for (int t = 0; t < w->ncopies; t++)
        cnt_free(&w->copies[t]);
    PyMem_RawFree(w->copies);
    memset(w, 0, sizeof(*w));
}

static void Core_dealloc(Core *c)
{
    tab_free(&c->blocks);
    for (int t = 1; t < c->ntiers; t++)
        tab_free(&c->tiers[t]);
    PyMem_RawFree(c->tiers);
    PyMem_RawFree(c->tier_order);
    for (int i = 0; i < c->nworkers; i++)
        free_worker(&c->workers[i]);
    PyMem_RawFree(c->workers);
    Py_XDECREF(c->names);
    Py_XDECREF(c->tier_names);
    Py_XDECREF(c->tier_rank);
    Py_XDECREF((PyObject *)c->overlap);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMemberDef Core_members[] = {
    {"max_entries", T_ULONGLONG, offsetof(Core, max_entries), READONLY, NULL},
    {"entries", T_ULONGLONG, offsetof(Core, entries), READONLY, NULL},
    {"evicted_at_bound", T_ULONGLONG, offsetof(Core, evicted_bound), READONLY, NULL},
    {"holes_total", T_LONGLONG, offsetof(Core, holes_total), READONLY, NULL},
    {NULL},
};

static PyObject *Core_backend(Core *c, void *closure) { return PyUnicode_FromString("c"); }

static PyGetSetDef Core_getset[] = {
    {"backend", (getter)Core_backend, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer._cindex.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled prefix index core (see indexer/index_py.py for the contract).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer._cindex", "Compiled prefix index core.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cindex(void)
{
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0)
        Py_CLEAR(m);
    return m;
}
