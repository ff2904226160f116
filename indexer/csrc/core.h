/* The compiled prefix index core: the same contract and bookkeeping as
 * indexer/index_py.py (read that first), in compact tables (tables.h).
 *
 * - blocks: router hash -> [parent, GPU mask words...], one record per block that anyone
 *   holds in any tier. A chain's first block stores itself as its parent (a block cannot be
 *   its own parent), which keeps "no parent" out of a separate flag word.
 * - tiers[t] (t >= 1): router hash -> mask words for the other tiers (usually none).
 * - workers[wid]: block id -> router hash in first-store order (Ord), held-children counts
 *   per parent (Cnt), extra cached copies per tier (Cnt), hole and entry counts, the cap.
 * Worker wid owns bit (wid % 64) of mask word (wid / 64); W words cover the fleet.
 *
 * Block ids and router hashes are 64-bit; a wider (or negative) Python int is folded to 64
 * bits with a mixing hash, the same collision odds as the router's own 64-bit hashes.
 */
#ifndef KVROUTE_CORE_H
#define KVROUTE_CORE_H

#include "tables.h"

typedef struct {
    Ord ids;     /* block id -> router hash */
    Cnt kids;    /* router hash -> held children */
    Cnt *copies; /* per tier id: block id -> copies beyond the first */
    int ncopies;
    long long holes;
    u64 entries, cap, evicted_cap; /* cap 0: none */
    int active;
} Worker;

typedef struct {
    PyObject_HEAD
    Tab blocks;
    Tab *tiers; /* index = tier id; tiers[0] unused (GPU masks live in blocks) */
    int ntiers;
    int *tier_order;      /* tier ids >= 1, fastest first */
    PyObject *tier_names; /* list: tier id -> str */
    PyObject *tier_rank;  /* callable: name -> sortable key */
    int W;
    Worker *workers;
    int nworkers;
    PyObject *names; /* list: wid -> str or None */
    PyTypeObject *overlap;
    unsigned long long max_entries, entries, evicted_bound;
    long long holes_total;
} Core;

/* ---- masks ----------------------------------------------------------------------------- */

#define WORD(wid) ((wid) >> 6)
#define BIT(wid) (1ULL << ((wid) & 63))

/* the worker-mask words of one block in one tier, or NULL if nobody holds it there */
static inline u64 *tier_masks(const Core *c, int tier, u64 rh)
{
    if (tier < 0)
        return NULL;
    if (tier == 0) {
        u64 *rec = tab_get(&c->blocks, rh);
        return rec ? rec + 1 : NULL;
    }
    return tab_get(&c->tiers[tier], rh);
}

static inline int any_word(const u64 *m, int W)
{
    for (int k = 0; k < W; k++)
        if (m[k])
            return 1;
    return 0;
}

static inline int other_active(const Core *c)
{
    for (int t = 1; t < c->ntiers; t++)
        if (tab_count(&c->tiers[t]))
            return 1;
    return 0;
}

static inline int held_in(const Core *c, int tier, u64 rh, int wid)
{
    const u64 *m = tier_masks(c, tier, rh);
    return m && (m[WORD(wid)] & BIT(wid));
}

static inline int held_any(const Core *c, u64 rh, int wid)
{
    for (int t = 0; t < c->ntiers; t++)
        if (held_in(c, t, rh, wid))
            return 1;
    return 0;
}

static inline int held_outside(const Core *c, u64 rh, int wid, int tier)
{
    for (int t = 0; t < c->ntiers; t++)
        if (t != tier && held_in(c, t, rh, wid))
            return 1;
    return 0;
}

static inline int held_elsewhere(const Core *c, u64 rh) /* by anyone, in any tier */
{
    for (int t = 0; t < c->ntiers; t++) {
        const u64 *m = tier_masks(c, t, rh);
        if (m && any_word(m, c->W))
            return 1;
    }
    return 0;
}

/* ---- conversions (module.c) ----------------------------------------------------------- */

int as_u64(PyObject *o, u64 *out);

/* ---- mutations (mutate.c) ------------------------------------------------------------- */

int core_store(Core *c, int wid, int tier, const u64 *ids, const u64 *rhs, Py_ssize_t n,
               int has_parent, u64 parent, int count_copies, u64 counts[3]);
void core_remove(Core *c, int wid, int tier, const u64 *ids, Py_ssize_t n, u64 counts[2]);
u64 core_clear(Core *c, int wid);
int core_set_cap(Core *c, int wid, u64 cap, u64 *evicted);
int core_grow_words(Core *c, int W);
int core_ensure_copies(Core *c, Worker *w, int tier);
size_t core_bytes(const Core *c);

/* ---- lookup (lookup.c) ---------------------------------------------------------------- */

PyObject *core_find_matches(Core *c, PyObject *hashes);

#endif
