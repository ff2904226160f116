/* find_matches: per worker, the leading blocks of a request's chain it holds, by tier.
 *
 * Each 64-worker mask word is searched on its own. While no worker has holes and only the
 * GPU tier is in use, a word's mask along the chain can only shrink, so the points where
 * it shrinks are found by bisection (a few probes for a 512-block chain); otherwise the
 * chain is scanned until every worker of the word has dropped out. */
#include "core.h"

typedef struct {
    u64 bits;
    Py_ssize_t count;
} End;

typedef struct {
    Core *c;
    PyObject **items;
    Py_ssize_t n;
    int word;
    End *ends;
    int nends;
} Search;

static int hash_at(Search *s, Py_ssize_t i, u64 *h) { return as_u64(s->items[i], h); }

static int gpu_word(Search *s, Py_ssize_t i, u64 *m)
{
    u64 h;
    if (hash_at(s, i, &h) < 0)
        return -1;
    const u64 *rec = tab_get(&s->c->blocks, h);
    *m = rec ? rec[1 + s->word] : 0;
    return 0;
}

#define MAX_ENDS 130

static void add_end(Search *s, u64 bits, Py_ssize_t count)
{
    if (s->nends == MAX_ENDS)
        return; /* only reachable if the no-holes invariant were broken */
    s->ends[s->nends].bits = bits;
    s->ends[s->nends].count = count;
    s->nends++;
}

/* At most 64 bits drop along a chain, so at most 64 disjoint intervals with a drop inside
 * are ever on the stack, and at most 65 ends come out. */
static int ends_bisect(Search *s)
{
    u64 first, last;
    if (gpu_word(s, 0, &first) < 0)
        return -1;
    if (!first)
        return 0;
    Py_ssize_t last_i = s->n - 1;
    if (gpu_word(s, last_i, &last) < 0)
        return -1;
    last &= first;
    struct {
        Py_ssize_t lo, hi;
        u64 mlo, mhi;
    } stack[130];
    int sp = 0;
    if (first != last)
        stack[sp].lo = 0, stack[sp].hi = last_i, stack[sp].mlo = first, stack[sp].mhi = last, sp++;
    while (sp) {
        sp--;
        Py_ssize_t lo = stack[sp].lo, hi = stack[sp].hi;
        u64 mlo = stack[sp].mlo, mhi = stack[sp].mhi, mm;
        if (hi - lo == 1) {
            add_end(s, mlo & ~mhi, hi);
            continue;
        }
        Py_ssize_t mid = (lo + hi) >> 1;
        if (sp > 126) { /* only reachable if the no-holes invariant were broken */
            s->nends = 0;
            return 1;
        }
        if (gpu_word(s, mid, &mm) < 0)
            return -1;
        mm &= mlo;
        if (mm != mlo)
            stack[sp].lo = lo, stack[sp].hi = mid, stack[sp].mlo = mlo, stack[sp].mhi = mm, sp++;
        if (mm != mhi)
            stack[sp].lo = mid, stack[sp].hi = hi, stack[sp].mlo = mm, stack[sp].mhi = mhi, sp++;
    }
    if (last)
        add_end(s, last, last_i + 1);
    return 0;
}

static int ends_linear(Search *s)
{
    u64 active = ~0ULL;
    for (Py_ssize_t i = 0; i < s->n; i++) {
        u64 h, m = 0;
        if (hash_at(s, i, &h) < 0)
            return -1;
        for (int t = 0; t < s->c->ntiers; t++) {
            const u64 *tm = tier_masks(s->c, t, h);
            if (tm)
                m |= tm[s->word];
        }
        m &= active;
        if (m != active) {
            if (i)
                add_end(s, active & ~m, i);
            active = m;
            if (!active)
                return 0;
        }
    }
    add_end(s, active, s->n);
    return 0;
}

/* {tier name: blocks} for one worker's first `count` blocks, each in its fastest tier. */
static PyObject *split_tiers(Search *s, Py_ssize_t count, int wid, int others)
{
    Core *c = s->c;
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    if (!others) {
        PyObject *v = PyLong_FromSsize_t(count);
        if (!v || PyDict_SetItem(out, PyList_GET_ITEM(c->tier_names, 0), v) < 0)
            goto fail_v;
        Py_DECREF(v);
        return out;
    fail_v:
        Py_XDECREF(v);
        Py_DECREF(out);
        return NULL;
    }
    Py_ssize_t per[64] = {0}; /* tier ids are capped at 64 in module.c */
    for (Py_ssize_t i = 0; i < count; i++) {
        u64 h;
        if (hash_at(s, i, &h) < 0)
            goto fail;
        if (held_in(c, 0, h, wid)) {
            per[0]++;
            continue;
        }
        for (int r = 0; r < c->ntiers - 1; r++)
            if (held_in(c, c->tier_order[r], h, wid)) {
                per[c->tier_order[r]]++;
                break;
            }
    }
    for (int t = 0; t < c->ntiers; t++) {
        if (!per[t])
            continue;
        PyObject *v = PyLong_FromSsize_t(per[t]);
        if (!v || PyDict_SetItem(out, PyList_GET_ITEM(c->tier_names, t), v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *make_overlap(Core *c, Py_ssize_t count, PyObject *by_tier)
{
    PyObject *o = c->overlap->tp_alloc(c->overlap, 2);
    PyObject *n = PyLong_FromSsize_t(count);
    if (!o || !n) {
        Py_XDECREF(o), Py_XDECREF(n), Py_DECREF(by_tier);
        return NULL;
    }
    PyTuple_SET_ITEM(o, 0, n);
    PyTuple_SET_ITEM(o, 1, by_tier); /* steals */
    return o;
}

static int emit_ends(Search *s, PyObject *out, int others)
{
    for (int e = 0; e < s->nends; e++) {
        for (u64 bits = s->ends[e].bits; bits; bits &= bits - 1) {
            int wid = s->word * 64 + __builtin_ctzll(bits);
            if (wid >= s->c->nworkers || !s->c->workers[wid].active)
                continue; /* a removed worker's bit cannot be set; never name None */
            PyObject *split = split_tiers(s, s->ends[e].count, wid, others);
            PyObject *ov = split ? make_overlap(s->c, s->ends[e].count, split) : NULL;
            if (!ov)
                return -1;
            int rc = PyDict_SetItem(out, PyList_GET_ITEM(s->c->names, wid), ov);
            Py_DECREF(ov);
            if (rc < 0)
                return -1;
        }
    }
    return 0;
}

PyObject *core_find_matches(Core *c, PyObject *hashes)
{
    PyObject *seq = PySequence_Fast(hashes, "find_matches takes a sequence of router hashes");
    if (!seq)
        return NULL;
    PyObject *out = PyDict_New();
    End ends[MAX_ENDS];
    Search s = {c, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), 0, ends, 0};
    int others = other_active(c);
    int bisect = c->holes_total == 0 && !others;
    for (int k = 0; out && s.n && k < c->W; k++) {
        s.word = k;
        s.nends = 0;
        int rc = bisect ? ends_bisect(&s) : ends_linear(&s);
        if (rc == 1)
            rc = ends_linear(&s);
        if (rc < 0 || emit_ends(&s, out, others) < 0)
            Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}
