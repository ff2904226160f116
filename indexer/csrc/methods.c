/* The methods of indexer._cindex.Core; signatures in indexer/_cindex.pyi. */
#include "module.h"

static int arg_wid(Core *c, PyObject *o, int *wid)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "worker id %ld out of range", v);
        return -1;
    }
    *wid = (int)v;
    return 0;
}

static int known_wid(Core *c, PyObject *o, int *wid)
{
    return arg_wid(c, o, wid) < 0 ? -1 : check_wid(c, *wid);
}

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static PyObject *Core_add_worker(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid;
    if (nargs_ok(nargs, 2, "add_worker") < 0 || arg_wid(c, args[0], &wid) < 0)
        return NULL;
    if (wid < c->nworkers && c->workers[wid].active)
        return PyErr_Format(PyExc_ValueError, "worker id %d is taken", wid);
    if (wid >= c->nworkers) {
        Worker *ws = PyMem_RawRealloc(c->workers, (size_t)(wid + 1) * sizeof(Worker));
        if (!ws)
            return PyErr_NoMemory();
        memset(ws + c->nworkers, 0, (size_t)(wid + 1 - c->nworkers) * sizeof(Worker));
        c->workers = ws;
        c->nworkers = wid + 1;
    }
    if (core_grow_words(c, wid / 64 + 1) < 0)
        return NULL;
    while (PyList_GET_SIZE(c->names) <= wid)
        if (PyList_Append(c->names, Py_None) < 0)
            return NULL;
    if (PyList_SetItem(c->names, wid, Py_NewRef(args[1])) < 0)
        return NULL;
    c->workers[wid].active = 1;
    Py_RETURN_NONE;
}

static PyObject *Core_remove_worker(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    core_clear(c, wid);
    free_worker(&c->workers[wid]);
    if (PyList_SetItem(c->names, wid, Py_NewRef(Py_None)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_set_cap(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid;
    u64 cap = 0, evicted;
    if (nargs_ok(nargs, 2, "set_cap") < 0 || known_wid(c, args[0], &wid) < 0)
        return NULL;
    if (args[1] != Py_None) {
        cap = PyLong_AsUnsignedLongLong(args[1]);
        if (PyErr_Occurred())
            return NULL;
        if (!cap)
            return PyErr_Format(PyExc_ValueError, "a worker cap must be positive");
    }
    if (core_set_cap(c, wid, cap, &evicted) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(evicted);
}

static PyObject *Core_clear(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(core_clear(c, wid));
}

/* store(wid, tier, ids, router_hashes, parent, count_copies) -> (stored, at bound, at cap) */
static PyObject *Core_store(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid, tier;
    u64 parent = 0, counts[3] = {0, 0, 0};
    Py_ssize_t n, n2;
    if (nargs_ok(nargs, 6, "store") < 0 || known_wid(c, args[0], &wid) < 0)
        return NULL;
    if ((tier = tier_id(c, args[1], 1)) < 0)
        return NULL;
    int count_copies = PyObject_IsTrue(args[5]);
    if (count_copies < 0 || (args[4] != Py_None && as_u64(args[4], &parent) < 0))
        return NULL;
    u64 *ids = u64_array(args[2], &n), *rhs = ids ? u64_array(args[3], &n2) : NULL;
    int rc = -1;
    if (rhs && n != n2)
        PyErr_SetString(PyExc_ValueError, "ids and router hashes differ in length");
    else if (rhs)
        rc = core_store(c, wid, tier, ids, rhs, n, args[4] != Py_None, parent, count_copies,
                        counts);
    PyMem_RawFree(ids), PyMem_RawFree(rhs);
    if (rc < 0)
        return NULL;
    return Py_BuildValue("(KKK)", counts[0], counts[1], counts[2]);
}

/* remove(wid, tier, ids) -> (removed, unknown) */
static PyObject *Core_remove(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid;
    u64 counts[2] = {0, 0};
    Py_ssize_t n;
    if (nargs_ok(nargs, 3, "remove") < 0 || known_wid(c, args[0], &wid) < 0)
        return NULL;
    int tier = tier_id(c, args[1], 0);
    if (tier == -2)
        return NULL;
    u64 *ids = u64_array(args[2], &n);
    if (!ids)
        return NULL;
    core_remove(c, wid, tier, ids, n, counts);
    PyMem_RawFree(ids);
    return Py_BuildValue("(KK)", counts[0], counts[1]);
}

static PyObject *Core_find_matches(Core *c, PyObject *hashes)
{
    return core_find_matches(c, hashes);
}

static PyObject *Core_resolve(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid;
    u64 bid;
    if (nargs_ok(nargs, 2, "resolve") < 0 || known_wid(c, args[0], &wid) < 0 ||
        as_u64(args[1], &bid) < 0)
        return NULL;
    u32 pos = ord_find(&c->workers[wid].ids, bid);
    if (pos == ORD_NONE)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(ORD_VAL(&c->workers[wid].ids, pos));
}

static PyObject *Core_entries_of(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(c->workers[wid].entries);
}

static PyObject *Core_evicted_at_cap(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(c->workers[wid].evicted_cap);
}

static PyObject *Core_blocks(Core *c, PyObject *unused)
{
    return PyLong_FromSize_t(tab_count(&c->blocks));
}

static PyObject *Core_holds(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    Ord *ids = &c->workers[wid].ids;
    PyObject *out = PySet_New(NULL);
    for (u32 p = ids->head; out && p < ids->n; p++) {
        if (ord_is_dead(ids, p) || !held_any(c, ORD_VAL(ids, p), wid))
            continue;
        PyObject *v = PyLong_FromUnsignedLongLong(ORD_VAL(ids, p));
        if (!v || PySet_Add(out, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *Core_held_any(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    int wid;
    u64 rh;
    if (nargs_ok(nargs, 2, "held_any") < 0 || as_u64(args[0], &rh) < 0 ||
        known_wid(c, args[1], &wid) < 0)
        return NULL;
    return PyBool_FromLong(held_any(c, rh, wid));
}

static PyObject *Core_parent(Core *c, PyObject *rh_o)
{
    u64 rh;
    if (as_u64(rh_o, &rh) < 0)
        return NULL;
    u64 *rec = tab_get(&c->blocks, rh);
    if (!rec) {
        PyErr_SetObject(PyExc_KeyError, rh_o);
        return NULL;
    }
    if (rec[0] == rh)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(rec[0]);
}

static PyObject *kids_dict(const Cnt *k)
{
    PyObject *out = PyDict_New();
    for (size_t s = 0; out && s <= k->cap; s++) {
        u64 key = s < k->cap ? k->slots[s].key : 0;
        u32 val = s < k->cap ? (key ? k->slots[s].val : 0) : k->zero_val;
        if (!val)
            continue;
        PyObject *kk = PyLong_FromUnsignedLongLong(key), *vv = PyLong_FromUnsignedLong(val);
        if (!kk || !vv || PyDict_SetItem(out, kk, vv) < 0)
            Py_CLEAR(out);
        Py_XDECREF(kk), Py_XDECREF(vv);
    }
    return out;
}

/* dump(wid) -> (ids in eviction order as (id, router hash), kids, holes, entries) */
static PyObject *Core_dump(Core *c, PyObject *wid_o)
{
    int wid;
    if (known_wid(c, wid_o, &wid) < 0)
        return NULL;
    Worker *w = &c->workers[wid];
    PyObject *ids = PyList_New(0), *kids = kids_dict(&w->kids);
    for (u32 p = w->ids.head; ids && p < w->ids.n; p++) {
        if (ord_is_dead(&w->ids, p))
            continue;
        PyObject *pair = Py_BuildValue("(KK)", ORD_KEY(&w->ids, p), ORD_VAL(&w->ids, p));
        if (!pair || PyList_Append(ids, pair) < 0)
            Py_CLEAR(ids);
        Py_XDECREF(pair);
    }
    PyObject *out = ids && kids ? Py_BuildValue("(OOLK)", ids, kids, w->holes, w->entries) : NULL;
    Py_XDECREF(ids), Py_XDECREF(kids);
    return out;
}

static PyObject *Core_memory_bytes(Core *c, PyObject *unused)
{
    return PyLong_FromSize_t(core_bytes(c));
}

#define FAST(name) {#name, (PyCFunction)(void (*)(void))Core_##name, METH_FASTCALL, NULL}
#define ONE(name) {#name, (PyCFunction)Core_##name, METH_O, NULL}

PyMethodDef Core_methods[] = {
    FAST(add_worker),
    ONE(remove_worker),
    FAST(set_cap),
    ONE(clear),
    FAST(store),
    FAST(remove),
    ONE(find_matches),
    FAST(resolve),
    ONE(entries_of),
    ONE(evicted_at_cap),
    {"blocks", (PyCFunction)Core_blocks, METH_NOARGS, NULL},
    ONE(holds),
    FAST(held_any),
    ONE(parent),
    ONE(dump),
    {"memory_bytes", (PyCFunction)Core_memory_bytes, METH_NOARGS, NULL},
    {NULL},
};
