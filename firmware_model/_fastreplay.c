/* Demand-fill replay of dense integer keys through LRU, plain LFU, ARC, S3-FIFO and Belady's OPT, in C.
 *
 * The twins of firmware_model/policies/{lru,lfu,arc,s3fifo,opt}.py driven by firmware_model.replay's
 * count_hits loop (announce the miss, evict when full, insert): the same decisions, checked
 * access by access by tests/test_fwmodel_fastreplay.py. Keys are dense ids 0 <= id < n_ids
 * (firmware_model._fast maps any keys to them), so every per-key field is an array slot and every
 * list is intrusive (prev / next arrays): no hashing, no allocation per access.
 *
 * Each function returns the hit count (or -1 when out of memory), stores the evictions, and
 * writes hit[i] = 1 / 0 per access when hit is not NULL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_fastreplay.h"

#define NIL (-1)

typedef struct {
    int64_t head, tail, size; /* head: oldest (LRU end), tail: newest */
} list_t;

/* One set of links for every list a key can be on (a key is on at most one at a time). */
typedef struct {
    int64_t *prev, *next;
} links_t;

static int links_init(links_t *l, int64_t n) {
    l->prev = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    l->next = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    return l->prev && l->next ? 0 : -1;
}

static void links_free(links_t *l) {
    free(l->prev);
    free(l->next);
}

static inline void list_push(list_t *q, links_t *l, int64_t k) {
    l->prev[k] = q->tail;
    l->next[k] = NIL;
    if (q->tail != NIL)
        l->next[q->tail] = k;
    else
        q->head = k;
    q->tail = k;
    q->size++;
}

static inline void list_unlink(list_t *q, links_t *l, int64_t k) {
    int64_t p = l->prev[k], n = l->next[k];
    if (p != NIL) l->next[p] = n; else q->head = n;
    if (n != NIL) l->prev[n] = p; else q->tail = p;
    q->size--;
}

static inline int64_t list_pop(list_t *q, links_t *l) {
    int64_t k = q->head;
    list_unlink(q, l, k);
    return k;
}

static const list_t EMPTY = {NIL, NIL, 0};

/* ---- dense ids: any int64 keys -> 0, 1, ... in order of first appearance -------------------- */

int64_t cxl_dense_ids(const int64_t *keys, int64_t n, int64_t *ids) {
    size_t size = 16;
    while (size < (size_t)n * 2) size <<= 1; /* load factor <= 1/2: open addressing, linear probe */
    int64_t *slot_key = malloc(sizeof(int64_t) * size), *slot_id = malloc(sizeof(int64_t) * size);
    if (!slot_key || !slot_id) { free(slot_key); free(slot_id); return -1; }
    for (size_t j = 0; j < size; j++) slot_id[j] = NIL;
    int64_t next = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = (uint64_t)keys[i] * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing */
        size_t j = (size_t)(h >> 32) & (size - 1);
        while (slot_id[j] != NIL && slot_key[j] != keys[i]) j = (j + 1) & (size - 1);
        if (slot_id[j] == NIL) { slot_key[j] = keys[i]; slot_id[j] = next++; }
        ids[i] = slot_id[j];
    }
    free(slot_key);
    free(slot_id);
    return next;
}

/* ---- LRU ---------------------------------------------------------------------------------- */

int64_t cxl_replay_lru(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions) {
    links_t l = {NULL, NULL};
    uint8_t *in = calloc((size_t)(n_ids ? n_ids : 1), 1);
    if (!in || links_init(&l, n_ids) < 0) { free(in); links_free(&l); return -1; }
    list_t q = EMPTY;
    int64_t hits = 0, ev = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        if (in[k]) {
            hits++;
            if (hit) hit[i] = 1;
            if (q.tail != k) { list_unlink(&q, &l, k); list_push(&q, &l, k); }
            continue;
        }
        if (hit) hit[i] = 0;
        if (q.size >= cap) { in[list_pop(&q, &l)] = 0; ev++; }
        list_push(&q, &l, k);
        in[k] = 1;
    }
    free(in);
    links_free(&l);
    *evictions = ev;
    return hits;
}

/* ---- ARC (Megiddo & Modha 2003, Fig. 4; see policies/arc.py) ------------------------------ */

enum { A_NONE = 0, A_T1, A_T2, A_B1, A_B2 };

typedef struct {
    list_t q[5]; /* indexed by A_T1..A_B2 */
    links_t l;
    uint8_t *where;
    double p;
    int64_t c;
} arc_t;

static inline void arc_move(arc_t *a, int64_t k, int to) {
    if (a->where[k] != A_NONE) list_unlink(&a->q[a->where[k]], &a->l, k);
    if (to != A_NONE) list_push(&a->q[to], &a->l, k);
    a->where[k] = (uint8_t)to;
}

static inline void arc_replace(arc_t *a, int in_b2) {
    int64_t t1 = a->q[A_T1].size;
    int from_t1 = (t1 > 0 && ((double)t1 > a->p || (in_b2 && (double)t1 == a->p))) || a->q[A_T2].size == 0;
    if (from_t1)
        arc_move(a, a->q[A_T1].head, A_B1);
    else
        arc_move(a, a->q[A_T2].head, A_B2);
}

int64_t cxl_replay_arc(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions) {
    arc_t a;
    a.l.prev = a.l.next = NULL;
    a.where = calloc((size_t)(n_ids ? n_ids : 1), 1);
    if (!a.where || links_init(&a.l, n_ids) < 0) { free(a.where); links_free(&a.l); return -1; }
    for (int j = 0; j < 5; j++) a.q[j] = EMPTY;
    a.p = 0.0;
    a.c = cap;
    int64_t hits = 0, ev = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        int w = a.where[k];
        if (w == A_T1 || w == A_T2) {
            hits++;
            if (hit) hit[i] = 1;
            arc_move(&a, k, A_T2);
            continue;
        }
        if (hit) hit[i] = 0;
        /* on_miss: cases II and III adapt p and take the key off its ghost list */
        if (w == A_B1) {
            double b1 = (double)a.q[A_B1].size, b2 = (double)a.q[A_B2].size;
            double d = b2 / b1 > 1.0 ? b2 / b1 : 1.0;
            a.p = a.p + d < (double)cap ? a.p + d : (double)cap;
            arc_move(&a, k, A_NONE);
        } else if (w == A_B2) {
            double b1 = (double)a.q[A_B1].size, b2 = (double)a.q[A_B2].size;
            double d = b1 / b2 > 1.0 ? b1 / b2 : 1.0;
            a.p = a.p - d > 0.0 ? a.p - d : 0.0;
            arc_move(&a, k, A_NONE);
        }
        if (a.q[A_T1].size + a.q[A_T2].size >= cap) {
            ev++;
            if (w == A_B1 || w == A_B2) {
                arc_replace(&a, w == A_B2);
            } else if (a.q[A_T1].size + a.q[A_B1].size >= cap) { /* case IV(A) */
                if (a.q[A_B1].size) {
                    arc_move(&a, a.q[A_B1].head, A_NONE);
                    arc_replace(&a, 0);
                } else {
                    arc_move(&a, a.q[A_T1].head, A_NONE);
                }
            } else {
                if (a.q[A_T1].size + a.q[A_T2].size + a.q[A_B1].size + a.q[A_B2].size >= 2 * cap &&
                    a.q[A_B2].size)
                    arc_move(&a, a.q[A_B2].head, A_NONE); /* case IV(B) */
                arc_replace(&a, 0);
            }
        }
        arc_move(&a, k, (w == A_B1 || w == A_B2) ? A_T2 : A_T1);
        /* _trim_ghosts: a no-op under demand fill (ARC's bounds hold), kept as the twin does */
        while (a.q[A_B1].size && a.q[A_T1].size + a.q[A_B1].size > cap)
            arc_move(&a, a.q[A_B1].head, A_NONE);
        while (a.q[A_T1].size + a.q[A_T2].size + a.q[A_B1].size + a.q[A_B2].size > 2 * cap)
            arc_move(&a, a.q[A_B2].size ? a.q[A_B2].head : a.q[A_B1].head, A_NONE);
    }
    free(a.where);
    links_free(&a.l);
    *evictions = ev;
    return hits;
}

/* ---- S3-FIFO (libCacheSim's S3FIFO; see policies/s3fifo.py) ------------------------------- */

enum { S_NONE = 0, S_SMALL, S_MAIN, S_GHOST };

static inline void s3_move(list_t *q, links_t *l, uint8_t *where, int64_t k, int to) {
    if (where[k] != S_NONE) list_unlink(&q[where[k]], l, k);
    if (to != S_NONE) list_push(&q[to], l, k);
    where[k] = (uint8_t)to;
}
#define S_MOVE(k, to) s3_move(q, &l, where, (k), (to))

int64_t cxl_replay_s3fifo(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap,
                          int64_t small_target, int64_t ghost_limit, int fill_main_first,
                          uint8_t *hit, int64_t *evictions) {
    links_t l = {NULL, NULL};
    uint8_t *where = calloc((size_t)(n_ids ? n_ids : 1), 1);
    uint8_t *freq = calloc((size_t)(n_ids ? n_ids : 1), 1);
    if (!where || !freq || links_init(&l, n_ids) < 0) {
        free(where); free(freq); links_free(&l); return -1;
    }
    list_t q[4] = {EMPTY, EMPTY, EMPTY, EMPTY};
    int64_t main_target = cap - small_target, hits = 0, ev = 0;
    int has_evicted = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        int w = where[k];
        if (w == S_SMALL || w == S_MAIN) {
            hits++;
            if (hit) hit[i] = 1;
            if (freq[k] < 3) freq[k]++;
            continue;
        }
        if (hit) hit[i] = 0;
        int was_ghost = w == S_GHOST;
        if (was_ghost) S_MOVE(k, S_NONE);
        if (q[S_SMALL].size + q[S_MAIN].size >= cap) {
            int64_t victim = NIL;
            has_evicted = 1;
            ev++;
            if (!(q[S_MAIN].size > main_target || q[S_SMALL].size == 0)) {
                while (q[S_SMALL].size) { /* small: promote the reused, ghost the first other */
                    int64_t s = q[S_SMALL].head;
                    if (freq[s] >= 2) {
                        S_MOVE(s, S_MAIN);
                        freq[s] = 0;
                    } else {
                        S_MOVE(s, S_NONE);
                        if (ghost_limit) {
                            S_MOVE(s, S_GHOST);
                            if (q[S_GHOST].size > ghost_limit) S_MOVE(q[S_GHOST].head, S_NONE);
                        }
                        victim = s;
                        break;
                    }
                }
            }
            while (victim == NIL) { /* main: CLOCK with a 2-bit counter */
                int64_t m = q[S_MAIN].head;
                list_unlink(&q[S_MAIN], &l, m);
                if (freq[m] > 0) {
                    freq[m]--;
                    list_push(&q[S_MAIN], &l, m);
                } else {
                    where[m] = S_NONE;
                    victim = m;
                }
            }
        }
        int to_main = was_ghost || (fill_main_first && !has_evicted && q[S_SMALL].size >= small_target);
        S_MOVE(k, to_main ? S_MAIN : S_SMALL);
        freq[k] = 0;
    }
    free(where);
    free(freq);
    links_free(&l);
    *evictions = ev;
    return hits;
}

/* ---- plain LFU (see policies/lfu.py): a FIFO per count, the smallest count's oldest goes ---- */

int64_t cxl_replay_lfu(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions) {
    links_t l;
    l.prev = l.next = NULL;
    int64_t *count = calloc((size_t)(n_ids ? n_ids : 1), sizeof(int64_t)); /* 0: not resident */
    list_t *bucket = malloc(sizeof(list_t) * (size_t)(n + 2)); /* a count never exceeds n */
    if (!count || !bucket || links_init(&l, n_ids) < 0) {
        free(count); free(bucket); links_free(&l); return -1;
    }
    for (int64_t c = 0; c < n + 2; c++) bucket[c] = EMPTY;
    int64_t resident = 0, min_count = 1, hits = 0, ev = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i], c = count[k];
        if (c) {
            hits++;
            if (hit) hit[i] = 1;
            list_unlink(&bucket[c], &l, k);
            if (c == min_count && bucket[c].size == 0) min_count = c + 1;
            list_push(&bucket[c + 1], &l, k);
            count[k] = c + 1;
            continue;
        }
        if (hit) hit[i] = 0;
        if (resident >= cap) {
            while (bucket[min_count].size == 0) min_count++;
            count[list_pop(&bucket[min_count], &l)] = 0;
            resident--;
            ev++;
        }
        list_push(&bucket[1], &l, k);
        count[k] = 1;
        min_count = 1;
        resident++;
    }
    free(count);
    free(bucket);
    links_free(&l);
    *evictions = ev;
    return hits;
}

/* ---- Belady's OPT (see policies/opt.py): a max-heap of (next use, access index) ------------ */

typedef struct {
    int64_t nxt, i, k;
} opt_item;

static inline int opt_before(const opt_item *x, const opt_item *y) {
    return x->nxt > y->nxt || (x->nxt == y->nxt && x->i < y->i);
}

static void opt_push(opt_item *h, int64_t *len, opt_item it) {
    int64_t j = (*len)++;
    while (j > 0) {
        int64_t parent = (j - 1) / 2;
        if (!opt_before(&it, &h[parent])) break;
        h[j] = h[parent];
        j = parent;
    }
    h[j] = it;
}

static opt_item opt_pop(opt_item *h, int64_t *len) {
    opt_item top = h[0], last = h[--(*len)];
    int64_t j = 0, n = *len;
    for (;;) {
        int64_t c = 2 * j + 1;
        if (c >= n) break;
        if (c + 1 < n && opt_before(&h[c + 1], &h[c])) c++;
        if (!opt_before(&h[c], &last)) break;
        h[j] = h[c];
        j = c;
    }
    if (n) h[j] = last;
    return top;
}

int64_t cxl_replay_opt(const int64_t *ids, const int64_t *next_use, int64_t n, int64_t n_ids,
                       int64_t cap, uint8_t *hit, int64_t *evictions) {
    int64_t *resident_next = malloc(sizeof(int64_t) * (size_t)(n_ids ? n_ids : 1));
    opt_item *heap = malloc(sizeof(opt_item) * (size_t)(n ? n : 1));
    if (!resident_next || !heap) { free(resident_next); free(heap); return -1; }
    for (int64_t k = 0; k < n_ids; k++) resident_next[k] = NIL;
    int64_t len = 0, count = 0, hits = 0, ev = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = ids[i];
        if (resident_next[k] != NIL) {
            hits++;
            if (hit) hit[i] = 1;
        } else {
            if (hit) hit[i] = 0;
            if (count >= cap) {
                for (;;) {
                    opt_item top = opt_pop(heap, &len);
                    if (resident_next[top.k] == top.nxt) {
                        resident_next[top.k] = NIL;
                        count--;
                        ev++;
                        break;
                    }
                }
            }
            count++;
        }
        resident_next[k] = next_use[i];
        opt_item it = {next_use[i], i, k};
        opt_push(heap, &len, it); /* one entry per access: at most n, never reallocated */
    }
    free(resident_next);
    free(heap);
    *evictions = ev;
    return hits;
}
