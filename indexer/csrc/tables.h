/* Open-addressing tables for the compiled prefix index (see core.h for how they are used).
 *
 * All three kinds probe linearly from a mixed hash of a 64-bit key, delete by backward
 * shift (no tombstones, so a lookup's probe run never grows with churn), and allocate with
 * PyMem_Raw* so tracemalloc sees every byte.
 *
 * - Tab: key -> `pw` 64-bit payload words in one slot. Key 0 marks an empty slot; a real
 *   key 0 lives in a side slot.
 * - Cnt: key -> uint32 count (a count of 0 is never stored).
 * - Ord: key -> 64-bit value in insertion order: a dense array of entries (a dead bit per
 *   deleted one) plus an index of tagged positions. Insertion order is the eviction order.
 */
#ifndef KVROUTE_TABLES_H
#define KVROUTE_TABLES_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef uint32_t u32;

#define MIN_CAP 16
/* grow at 80% full: linear probing stays short, the tables stay dense */
#define FULL(used, cap) ((used) * 5 >= (cap) * 4)

static inline u64 mix64(u64 x) /* murmur3's finalizer: engine ids can be sequential */
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* ---- Tab ------------------------------------------------------------------------------ */

/* slot = [key, payload words...]: one cache miss finds a key and its payload */
typedef struct {
    u64 *slots;
    size_t cap, used;
    int pw, stride;
    int has_zero;
    u64 *zero_pay;
} Tab;

static int tab_init(Tab *t, int pw)
{
    memset(t, 0, sizeof(*t));
    t->pw = pw, t->stride = 1 + pw;
    t->slots = PyMem_RawCalloc((size_t)MIN_CAP * t->stride, sizeof(u64));
    t->zero_pay = PyMem_RawCalloc(pw, sizeof(u64));
    if (!t->slots || !t->zero_pay)
        return -1;
    t->cap = MIN_CAP;
    return 0;
}

static void tab_free(Tab *t)
{
    PyMem_RawFree(t->slots);
    PyMem_RawFree(t->zero_pay);
    memset(t, 0, sizeof(*t));
}

static inline size_t tab_count(const Tab *t) { return t->used + (size_t)t->has_zero; }

static size_t tab_bytes(const Tab *t) { return (t->cap * t->stride + t->pw) * sizeof(u64); }

static inline u64 *tab_get(const Tab *t, u64 key)
{
    if (key == 0)
        return t->has_zero ? t->zero_pay : NULL;
    size_t mask = t->cap - 1, i = mix64(key) & mask;
    for (;;) {
        u64 *s = t->slots + i * t->stride;
        if (s[0] == key)
            return s + 1;
        if (s[0] == 0)
            return NULL;
        i = (i + 1) & mask;
    }
}

/* Rebuild with `cap` slots and `pw` payload words (old words kept, new ones zero). */
static int tab_rebuild(Tab *t, size_t cap, int pw)
{
    int stride = 1 + pw;
    u64 *slots = PyMem_RawCalloc(cap * stride, sizeof(u64));
    u64 *zero = PyMem_RawCalloc(pw, sizeof(u64));
    if (!slots || !zero) {
        PyMem_RawFree(slots), PyMem_RawFree(zero);
        return -1;
    }
    int keep = pw < t->pw ? pw : t->pw;
    size_t mask = cap - 1;
    for (size_t j = 0; j < t->cap; j++) {
        const u64 *old = t->slots + j * t->stride;
        if (!old[0])
            continue;
        size_t i = mix64(old[0]) & mask;
        while (slots[i * stride])
            i = (i + 1) & mask;
        memcpy(slots + i * stride, old, (1 + keep) * sizeof(u64));
    }
    memcpy(zero, t->zero_pay, keep * sizeof(u64));
    PyMem_RawFree(t->slots), PyMem_RawFree(t->zero_pay);
    t->slots = slots, t->zero_pay = zero;
    t->cap = cap, t->pw = pw, t->stride = stride;
    return 0;
}

/* The payload of `key`, created zeroed if absent (*created says which). NULL: no memory. */
static u64 *tab_put(Tab *t, u64 key, int *created)
{
    u64 *p = tab_get(t, key);
    *created = p == NULL;
    if (p)
        return p;
    if (key == 0) {
        t->has_zero = 1;
        memset(t->zero_pay, 0, t->pw * sizeof(u64));
        return t->zero_pay;
    }
    if (FULL(t->used + 1, t->cap) && tab_rebuild(t, t->cap * 2, t->pw) < 0)
        return NULL;
    size_t mask = t->cap - 1, i = mix64(key) & mask;
    while (t->slots[i * t->stride])
        i = (i + 1) & mask;
    u64 *s = t->slots + i * t->stride;
    s[0] = key;
    memset(s + 1, 0, t->pw * sizeof(u64));
    t->used++;
    return s + 1;
}

static void tab_del(Tab *t, u64 key)
{
    if (key == 0) {
        t->has_zero = 0;
        return;
    }
    size_t mask = t->cap - 1, i = mix64(key) & mask;
    while (t->slots[i * t->stride] != key) {
        if (!t->slots[i * t->stride])
            return;
        i = (i + 1) & mask;
    }
    /* backward shift: pull later members of the probe run into the hole */
    for (size_t j = i;;) {
        j = (j + 1) & mask;
        u64 k = t->slots[j * t->stride];
        if (!k)
            break;
        size_t home = mix64(k) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            memcpy(t->slots + i * t->stride, t->slots + j * t->stride, t->stride * sizeof(u64));
            i = j;
        }
    }
    t->slots[i * t->stride] = 0;
    t->used--;
}

static inline void tab_prefetch(const Tab *t, u64 key)
{
    __builtin_prefetch(t->slots + (mix64(key) & (t->cap - 1)) * t->stride);
}

/* ---- Cnt ------------------------------------------------------------------------------ */

typedef struct __attribute__((packed)) {
    u64 key;
    u32 val;
} CntSlot; /* 12 bytes: key and count in one cache line */

typedef struct {
    CntSlot *slots;
    size_t cap, used;
    u32 zero_val; /* the count of key 0 (0: absent) */
} Cnt;

static void cnt_free(Cnt *c)
{
    PyMem_RawFree(c->slots);
    memset(c, 0, sizeof(*c));
}

static size_t cnt_bytes(const Cnt *c) { return c->cap * sizeof(CntSlot); }

static inline size_t cnt_count(const Cnt *c) { return c->used + (c->zero_val != 0); }

static inline u32 cnt_get(const Cnt *c, u64 key)
{
    if (key == 0)
        return c->zero_val;
    if (!c->cap)
        return 0;
    size_t mask = c->cap - 1, i = mix64(key) & mask;
    for (;;) {
        u64 k = c->slots[i].key;
        if (k == key)
            return c->slots[i].val;
        if (k == 0)
            return 0;
        i = (i + 1) & mask;
    }
}

static int cnt_rebuild(Cnt *c, size_t cap)
{
    CntSlot *slots = PyMem_RawCalloc(cap, sizeof(CntSlot));
    if (!slots)
        return -1;
    size_t mask = cap - 1;
    for (size_t j = 0; j < c->cap; j++) {
        if (!c->slots[j].key)
            continue;
        size_t i = mix64(c->slots[j].key) & mask;
        while (slots[i].key)
            i = (i + 1) & mask;
        slots[i] = c->slots[j];
    }
    PyMem_RawFree(c->slots);
    c->slots = slots, c->cap = cap;
    return 0;
}

static void cnt_del_slot(Cnt *c, size_t i)
{
    size_t mask = c->cap - 1;
    for (size_t j = i;;) {
        j = (j + 1) & mask;
        u64 k = c->slots[j].key;
        if (!k)
            break;
        size_t home = mix64(k) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            c->slots[i] = c->slots[j];
            i = j;
        }
    }
    c->slots[i].key = 0;
    c->used--;
}

/* count(key) += delta, deleting the key at 0; the count never goes below 0. -1: no memory. */
static int cnt_add(Cnt *c, u64 key, long long delta)
{
    if (key == 0) {
        long long v = (long long)c->zero_val + delta;
        c->zero_val = v > 0 ? (u32)v : 0;
        return 0;
    }
    if (c->cap) {
        size_t mask = c->cap - 1, i = mix64(key) & mask;
        for (; c->slots[i].key; i = (i + 1) & mask) {
            if (c->slots[i].key != key)
                continue;
            long long v = (long long)c->slots[i].val + delta;
            if (v > 0)
                c->slots[i].val = (u32)v;
            else
                cnt_del_slot(c, i);
            return 0;
        }
    }
    if (delta <= 0)
        return 0;
    if ((!c->cap || FULL(c->used + 1, c->cap)) && cnt_rebuild(c, c->cap ? c->cap * 2 : MIN_CAP) < 0)
        return -1;
    size_t mask = c->cap - 1, i = mix64(key) & mask;
    while (c->slots[i].key)
        i = (i + 1) & mask;
    c->slots[i].key = key, c->slots[i].val = (u32)delta;
    c->used++;
    return 0;
}

static inline void cnt_prefetch(const Cnt *c, u64 key)
{
    if (c->cap)
        __builtin_prefetch(c->slots + (mix64(key) & (c->cap - 1)));
}

/* ---- Ord ------------------------------------------------------------------------------ */

/* The index slot holds (32-bit hash tag << 32 | position + 1), so a probe that meets other
 * keys rarely touches the dense array. */
typedef struct {
    u64 *kv;   /* dense [key, value] pairs, in insertion order */
    u64 *dead; /* one bit per dense entry */
    u32 n, dcap, live, head;
    u64 *idx; /* 0 = empty */
    u32 icap;
} Ord;

#define ORD_NONE UINT32_MAX
#define ORD_KEY(o, p) ((o)->kv[2 * (size_t)(p)])
#define ORD_VAL(o, p) ((o)->kv[2 * (size_t)(p) + 1])
#define TAG(h) ((h) & 0xFFFFFFFF00000000ULL)

static void ord_free(Ord *o)
{
    PyMem_RawFree(o->kv), PyMem_RawFree(o->dead), PyMem_RawFree(o->idx);
    memset(o, 0, sizeof(*o));
}

static size_t ord_bytes(const Ord *o)
{
    return (size_t)o->dcap * 2 * sizeof(u64) + ((size_t)o->dcap + 63) / 64 * sizeof(u64) +
           (size_t)o->icap * sizeof(u64);
}

static inline int ord_is_dead(const Ord *o, u32 pos) { return (o->dead[pos >> 6] >> (pos & 63)) & 1; }

static inline u32 ord_find(const Ord *o, u64 key) /* position, or ORD_NONE */
{
    if (!o->icap)
        return ORD_NONE;
    u64 h = mix64(key), tag = TAG(h);
    u32 mask = o->icap - 1, i = (u32)h & mask;
    for (;;) {
        u64 e = o->idx[i];
        if (!e)
            return ORD_NONE;
        if (TAG(e) == tag && ORD_KEY(o, (u32)e - 1) == key)
            return (u32)e - 1;
        i = (i + 1) & mask;
    }
}

static inline void ord_prefetch(const Ord *o, u64 key)
{
    if (o->icap)
        __builtin_prefetch(o->idx + ((u32)mix64(key) & (o->icap - 1)));
}

static inline void ord_index(u64 *idx, u32 mask, u64 key, u32 pos)
{
    u64 h = mix64(key);
    u32 i = (u32)h & mask;
    while (idx[i])
        i = (i + 1) & mask;
    idx[i] = TAG(h) | (pos + 1);
}

static int ord_reindex(Ord *o, u32 icap)
{
    u64 *idx = PyMem_RawCalloc(icap, sizeof(u64));
    if (!idx)
        return -1;
    for (u32 p = o->head; p < o->n; p++)
        if (!ord_is_dead(o, p))
            ord_index(idx, icap - 1, ORD_KEY(o, p), p);
    PyMem_RawFree(o->idx);
    o->idx = idx, o->icap = icap;
    return 0;
}

/* Squeeze out dead entries (order kept), or grow the dense arrays when few are dead. */
static int ord_make_room(Ord *o)
{
    u32 dead = o->n - o->live;
    if (dead * 2 >= o->n && o->n) {
        u32 w = 0;
        for (u32 p = o->head; p < o->n; p++) {
            if (ord_is_dead(o, p))
                continue;
            ORD_KEY(o, w) = ORD_KEY(o, p), ORD_VAL(o, w) = ORD_VAL(o, p);
            w++;
        }
        memset(o->dead, 0, ((size_t)o->dcap + 63) / 64 * sizeof(u64));
        o->n = w, o->head = 0;
        return ord_reindex(o, o->icap);
    }
    u32 dcap = o->dcap ? o->dcap + o->dcap / 2 : 8;
    u64 *kv = PyMem_RawRealloc(o->kv, (size_t)dcap * 2 * sizeof(u64));
    if (kv)
        o->kv = kv;
    size_t words = ((size_t)dcap + 63) / 64, old = ((size_t)o->dcap + 63) / 64;
    u64 *bits = PyMem_RawRealloc(o->dead, words * sizeof(u64));
    if (bits) {
        memset(bits + old, 0, (words - old) * sizeof(u64));
        o->dead = bits;
    }
    if (!kv || !bits)
        return -1;
    o->dcap = dcap;
    return 0;
}

/* Append key -> val; the key must be absent. -1: no memory. */
static int ord_append(Ord *o, u64 key, u64 val)
{
    if (o->n == o->dcap && ord_make_room(o) < 0)
        return -1;
    if ((!o->icap || FULL(o->live + 1, o->icap)) && ord_reindex(o, o->icap ? o->icap * 2 : MIN_CAP) < 0)
        return -1;
    u32 pos = o->n++;
    ORD_KEY(o, pos) = key, ORD_VAL(o, pos) = val;
    o->live++;
    ord_index(o->idx, o->icap - 1, key, pos);
    return 0;
}

static void ord_del_pos(Ord *o, u32 pos)
{
    u32 mask = o->icap - 1, i = (u32)mix64(ORD_KEY(o, pos)) & mask;
    while ((u32)o->idx[i] != pos + 1)
        i = (i + 1) & mask;
    for (u32 j = i;;) {
        j = (j + 1) & mask;
        u64 e = o->idx[j];
        if (!e)
            break;
        u32 home = (u32)mix64(ORD_KEY(o, (u32)e - 1)) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            o->idx[i] = e;
            i = j;
        }
    }
    o->idx[i] = 0;
    o->dead[pos >> 6] |= 1ULL << (pos & 63);
    o->live--;
}

static u32 ord_oldest(Ord *o) /* position of the oldest live entry, or ORD_NONE */
{
    while (o->head < o->n && ord_is_dead(o, o->head))
        o->head++;
    return o->head < o->n ? o->head : ORD_NONE;
}

#endif
