/* Stores, removals, evictions and clears: indexer/index_py.py's PyCore, block for block. */
#include "core.h"

#define NO_MEM(x)                 \
    do {                          \
        if ((x) < 0) {            \
            PyErr_NoMemory();     \
            return -1;            \
        }                         \
    } while (0)

static void add_holes(Core *c, Worker *w, long long d)
{
    w->holes += d;
    c->holes_total += d;
}

/* Clear a worker's bit on one block in every tier; forget the block once nobody holds it.
 * Entry/kids/holes bookkeeping is the caller's. */
static void drop_bits(Core *c, int wid, u64 rh)
{
    u64 *rec = tab_get(&c->blocks, rh);
    if (rec)
        rec[1 + WORD(wid)] &= ~BIT(wid);
    for (int t = 1; t < c->ntiers; t++) {
        u64 *m = tab_get(&c->tiers[t], rh);
        if (!m)
            continue;
        m[WORD(wid)] &= ~BIT(wid);
        if (!any_word(m, c->W))
            tab_del(&c->tiers[t], rh);
    }
    if (!held_elsewhere(c, rh))
        tab_del(&c->blocks, rh);
}

static int unhold(Core *c, int wid, u64 rh)
{
    Worker *w = &c->workers[wid];
    w->entries--;
    c->entries--;
    u64 *rec = tab_get(&c->blocks, rh);
    if (rec && rec[0] != rh) {
        u64 p = rec[0];
        NO_MEM(cnt_add(&w->kids, p, -1));
        if (!held_any(c, p, wid))
            add_holes(c, w, -1);
    }
    add_holes(c, w, cnt_get(&w->kids, rh));
    if (!held_elsewhere(c, rh))
        tab_del(&c->blocks, rh);
    return 0;
}

/* Drop a held block in every tier, and its id's extra copies. */
static int drop_held(Core *c, int wid, u64 bid, u64 rh)
{
    Worker *w = &c->workers[wid];
    for (int t = 0; t < w->ncopies; t++)
        NO_MEM(cnt_add(&w->copies[t], bid, -(1LL << 40)));
    if (unhold(c, wid, rh) < 0) /* while its bits still say who held it */
        return -1;
    drop_bits(c, wid, rh);
    return 0;
}

/* Drop the worker's oldest held block (ids of blocks it no longer holds go on the way).
 * Returns 1, 0 if it held none, -1 on error. */
static int evict_one(Core *c, int wid)
{
    Worker *v = &c->workers[wid];
    for (;;) {
        u32 pos = ord_oldest(&v->ids);
        if (pos == ORD_NONE)
            return 0;
        u64 bid = ORD_KEY(&v->ids, pos), rh = ORD_VAL(&v->ids, pos);
        ord_del_pos(&v->ids, pos);
        if (held_any(c, rh, wid))
            return drop_held(c, wid, bid, rh) < 0 ? -1 : 1;
    }
}

/* A block id stored again for another block (a hash collision, or a mangled batch): release
 * the block it named as BlockRemoveds of it in every tier would, copies and all, so no
 * removal can be left unable to reach it. Then the id is free. */
static int release_id(Core *c, int wid, u32 pos)
{
    Worker *w = &c->workers[wid];
    u64 bid = ORD_KEY(&w->ids, pos), rh = ORD_VAL(&w->ids, pos);
    ord_del_pos(&w->ids, pos);
    if (held_any(c, rh, wid))
        return drop_held(c, wid, bid, rh);
    for (int t = 0; t < w->ncopies; t++)
        NO_MEM(cnt_add(&w->copies[t], bid, -(1LL << 40)));
    return 0;
}

static int largest_worker(const Core *c)
{
    int best = -1;
    for (int i = 0; i < c->nworkers; i++)
        if (c->workers[i].active && (best < 0 || c->workers[i].entries > c->workers[best].entries))
            best = i;
    return best;
}

/* Before a new entry: the worker's cap first, then the global bound. 1: something went. */
static int make_room(Core *c, int wid, u64 counts[3])
{
    Worker *w = &c->workers[wid];
    int evicted = 0;
    if (w->cap && w->entries + 1 > w->cap) {
        int n = evict_one(c, wid);
        if (n < 0)
            return -1;
        w->evicted_cap += n;
        counts[2] += n;
        evicted = 1;
    }
    if (c->entries + 1 > c->max_entries) {
        int n = evict_one(c, w->entries ? wid : largest_worker(c));
        if (n < 0)
            return -1;
        c->evicted_bound += n;
        counts[1] += n;
        evicted = 1;
    }
    return evicted;
}

/* Set the worker's bit on one block it does not hold in this tier; room is made first. */
static int store_one(Core *c, int wid, int tier, u64 rh, int has_parent, u64 parent,
                     int check_parent, u64 counts[3])
{
    int new_entry = !held_outside(c, rh, wid, tier);
    if (new_entry) {
        int ev = make_room(c, wid, counts);
        if (ev < 0)
            return -1;
        check_parent |= ev; /* the eviction may have dropped this block's parent */
    }
    int created;
    u64 *rec = tab_put(&c->blocks, rh, &created);
    NO_MEM(rec ? 0 : -1);
    if (created)
        rec[0] = has_parent ? parent : rh;
    u64 *m = tier ? tab_put(&c->tiers[tier], rh, &created) : rec + 1;
    NO_MEM(m ? 0 : -1);
    m[WORD(wid)] |= BIT(wid);
    if (!new_entry)
        return 0; /* already held in another tier: no new entry */
    Worker *w = &c->workers[wid];
    w->entries++;
    c->entries++;
    if (has_parent) {
        NO_MEM(cnt_add(&w->kids, parent, 1));
        if (check_parent && !held_any(c, parent, wid))
            add_holes(c, w, 1);
    }
    if (w->holes)
        add_holes(c, w, -(long long)cnt_get(&w->kids, rh));
    return 0;
}

int core_store(Core *c, int wid, int tier, const u64 *ids, const u64 *rhs, Py_ssize_t n,
               int has_parent, u64 parent, int count_copies, u64 counts[3])
{
    Worker *w = &c->workers[wid];
    /* The first block's parent may be missing (a hole); every later block's parent is
     * the block stored just before it, held unless an eviction just dropped it. */
    int check_parent = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        u64 bid = ids[i], rh = rhs[i];
        if (i + 2 < n) { /* slots two blocks ahead load while this one is done (~1.5x at 2M) */
            tab_prefetch(&c->blocks, rhs[i + 2]);
            ord_prefetch(&w->ids, ids[i + 2]);
            cnt_prefetch(&w->kids, rhs[i + 1]);
        }
        u32 pos = ord_find(&w->ids, bid); /* this id's entry: ORD_NONE, or naming rh */
        if (pos != ORD_NONE && ORD_VAL(&w->ids, pos) != rh) {
            if (release_id(c, wid, pos) < 0)
                return -1;
            pos = ORD_NONE;
            check_parent = 1; /* the release may have dropped the parent */
        }
        if (!held_in(c, tier, rh, wid)) {
            if (store_one(c, wid, tier, rh, has_parent, parent, check_parent, counts) < 0)
                return -1;
            counts[0]++;
            if (pos != ORD_NONE && ord_is_dead(&w->ids, pos))
                pos = ORD_NONE; /* an eviction swept the id away (it named a block gone) */
        } else if (count_copies && pos != ORD_NONE) {
            if (core_ensure_copies(c, w, tier) < 0)
                return -1;
            NO_MEM(cnt_add(&w->copies[tier], bid, 1));
        }
        if (pos == ORD_NONE)
            NO_MEM(ord_append(&w->ids, bid, rh));
        parent = rh;
        has_parent = 1;
        check_parent = 0;
    }
    return 0;
}

static int drop_copy(Worker *w, int tier, u64 bid)
{
    if (tier >= w->ncopies || !cnt_count(&w->copies[tier]) || !cnt_get(&w->copies[tier], bid))
        return 0;
    cnt_add(&w->copies[tier], bid, -1);
    return 1;
}

void core_remove(Core *c, int wid, int tier, const u64 *ids, Py_ssize_t n, u64 counts[2])
{
    Worker *w = &c->workers[wid];
    for (Py_ssize_t i = 0; i < n; i++) {
        u32 pos = ord_find(&w->ids, ids[i]);
        if (pos == ORD_NONE) {
            counts[1]++;
            continue;
        }
        u64 rh = ORD_VAL(&w->ids, pos);
        u64 *m = tier_masks(c, tier, rh);
        if (!(m && (m[WORD(wid)] & BIT(wid)))) {
            counts[1]++;
            if (!held_any(c, rh, wid))
                ord_del_pos(&w->ids, pos); /* an alias of a block already gone */
            continue;
        }
        counts[0]++;
        if (drop_copy(w, tier, ids[i]))
            continue; /* another copy of the block is still cached */
        m[WORD(wid)] &= ~BIT(wid);
        if (tier && !any_word(m, c->W))
            tab_del(&c->tiers[tier], rh);
        if (held_any(c, rh, wid))
            continue; /* still held in another tier */
        ord_del_pos(&w->ids, pos);
        unhold(c, wid, rh); /* only shrinks tables: cannot fail */
    }
}

u64 core_clear(Core *c, int wid)
{
    Worker *w = &c->workers[wid];
    u64 dropped = w->entries;
    for (u32 p = w->ids.head; p < w->ids.n; p++)
        if (!ord_is_dead(&w->ids, p))
            drop_bits(c, wid, ORD_VAL(&w->ids, p));
    c->holes_total -= w->holes;
    c->entries -= w->entries;
    ord_free(&w->ids);
    cnt_free(&w->kids);
    for (int t = 0; t < w->ncopies; t++)
        cnt_free(&w->copies[t]);
    w->holes = 0;
    w->entries = 0;
    return dropped;
}

int core_set_cap(Core *c, int wid, u64 cap, u64 *evicted)
{
    Worker *w = &c->workers[wid];
    w->cap = cap;
    *evicted = 0;
    while (cap && w->entries > cap) {
        int n = evict_one(c, wid);
        if (n < 0)
            return -1;
        if (!n)
            break;
        *evicted += n;
    }
    w->evicted_cap += *evicted;
    return 0;
}

int core_ensure_copies(Core *c, Worker *w, int tier)
{
    if (tier < w->ncopies)
        return 0;
    Cnt *copies = PyMem_RawRealloc(w->copies, (size_t)(tier + 1) * sizeof(Cnt));
    NO_MEM(copies ? 0 : -1);
    memset(copies + w->ncopies, 0, (size_t)(tier + 1 - w->ncopies) * sizeof(Cnt));
    w->copies = copies;
    w->ncopies = tier + 1;
    (void)c;
    return 0;
}

/* Widen every mask to W words (a worker id beyond 64 * W arrived). */
int core_grow_words(Core *c, int W)
{
    if (W <= c->W)
        return 0;
    NO_MEM(tab_rebuild(&c->blocks, c->blocks.cap, 1 + W));
    for (int t = 1; t < c->ntiers; t++)
        NO_MEM(tab_rebuild(&c->tiers[t], c->tiers[t].cap, W));
    c->W = W;
    return 0;
}

size_t core_bytes(const Core *c)
{
    size_t n = sizeof(Core) + tab_bytes(&c->blocks);
    n += (size_t)c->ntiers * (sizeof(Tab) + sizeof(int));
    for (int t = 1; t < c->ntiers; t++)
        n += tab_bytes(&c->tiers[t]);
    n += (size_t)c->nworkers * sizeof(Worker);
    for (int i = 0; i < c->nworkers; i++) {
        const Worker *w = &c->workers[i];
        n += ord_bytes(&w->ids) + cnt_bytes(&w->kids) + (size_t)w->ncopies * sizeof(Cnt);
        for (int t = 0; t < w->ncopies; t++)
            n += cnt_bytes(&w->copies[t]);
    }
    return n;
}
