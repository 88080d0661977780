/* Quest's page choice for hot-page attention (driver.kv.selectors.QuestSelector's C path): one
 * call a layer instead of a dozen tensor operations, which cost the decode step more than the
 * arithmetic.
 *
 * Row r (one KV head of one sequence) has `groups` queries of `dim` channels (q + r * q_row) and
 * per page p its keys' per-channel min and max (kmin / kmax + r * meta_row + p * meta_page).
 * Page p's bound for query g is sum_d max(q_d * kmin_d, q_d * kmax_d) = q+ . kmax + q- . kmin
 * (Quest's upper bound of q . k over the page's box); its score is the largest over the row's
 * queries. Of the candidates [c0, c1), the k with the highest (score, hot count, page) are
 * written ascending to out + r * k. A NaN score ranks above every number, as torch.topk's.
 * `score` and `order` are scratch of c1 - c0 entries. Returns 0, or -1 for bad sizes (groups x dim
 * above QUEST_MAX_QUERY included). */
#pragma GCC optimize("O3") /* vectorise row_bound's lanes (-O2 keeps them scalar) */
#include <math.h>
#include <stdint.h>

#include "_fastreplay.h"

#define QUEST_MAX_QUERY 4096 /* groups x dim of one row: 32 query heads of 128 channels */

typedef struct {
    const float *score;
    const int64_t *hot;
} rank_t;

/* a ranks above b: higher score (NaN highest), then hotter, then the later page */
static inline int above(const rank_t *rk, int64_t a, int64_t b)
{
    float sa = rk->score[a], sb = rk->score[b];
    int na = isnan(sa), nb = isnan(sb);
    if (na != nb)
        return na;
    if (!na && sa != sb)
        return sa > sb;
    if (rk->hot[a] != rk->hot[b])
        return rk->hot[a] > rk->hot[b];
    return a > b;
}

static inline void swap(int64_t *x, int64_t i, int64_t j)
{
    int64_t t = x[i];
    x[i] = x[j];
    x[j] = t;
}

/* order[0 .. k) := the k top-ranked of order[0 .. n) (any order among them): quickselect,
 * median of three, Lomuto partition (the ranking is strict: no two candidates tie) */
static void select_top(const rank_t *rk, int64_t *order, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (above(rk, order[mid], order[lo]))
            swap(order, mid, lo);
        if (above(rk, order[hi], order[lo]))
            swap(order, hi, lo);
        if (above(rk, order[mid], order[hi]))
            swap(order, mid, hi);
        /* order[hi] is now the median of the three: the pivot */
        int64_t pivot = order[hi], store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (above(rk, order[i], pivot))
                swap(order, i, store++);
        swap(order, store, hi);
        if (store == k - 1 || store == k)
            return;
        if (store < k)
            lo = store + 1;
        else
            hi = store - 1;
    }
}

/* q+ . hi + q- . lo in LANES partial sums a channel apart (a fixed order the compiler can keep in
 * vector registers; a float sum in one accumulator cannot be vectorised without reassociation) */
#define LANES 8
static inline float row_bound(const float *qp, const float *qn, const float *lo, const float *hi, int64_t dim)
{
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += qp[d + j] * hi[d + j] + qn[d + j] * lo[d + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++)
        sum += acc[j];
    for (; d < dim; d++)
        sum += qp[d] * hi[d] + qn[d] * lo[d];
    return sum;
}

static void sort_pages(int64_t *x, int64_t n)
{
    for (int64_t i = 1; i < n; i++) {
        int64_t v = x[i], j = i - 1;
        while (j >= 0 && x[j] > v) {
            x[j + 1] = x[j];
            j--;
        }
        x[j + 1] = v;
    }
}

int64_t cxl_quest_topk(const float *q, int64_t groups, int64_t dim, int64_t q_row, const float *kmin,
                       const float *kmax, int64_t meta_row, int64_t meta_page, const int64_t *hot,
                       int64_t hot_row, int64_t nrows, int64_t c0, int64_t c1, int64_t k, float *score,
                       int64_t *order, int64_t *out)
{
    int64_t n = c1 - c0;
    if (groups < 1 || dim < 1 || nrows < 0 || c0 < 0 || n < 0 || k < 0 || k > n)
        return -1;
    float qpos[QUEST_MAX_QUERY], qneg[QUEST_MAX_QUERY];  /* a row's q+ and q-, branch-free sums below */
    if (groups * dim > QUEST_MAX_QUERY)
        return -1;
    for (int64_t r = 0; r < nrows; r++) {
        const float *qr = q + r * q_row;
        for (int64_t i = 0; i < groups * dim; i++) {
            qpos[i] = qr[i] > 0.0f ? qr[i] : 0.0f;
            qneg[i] = qr[i] > 0.0f ? 0.0f : qr[i];
        }
        for (int64_t c = 0; c < n; c++) {
            const float *lo = kmin + r * meta_row + (c0 + c) * meta_page;
            const float *hi = kmax + r * meta_row + (c0 + c) * meta_page;
            float best = -INFINITY;
            for (int64_t g = 0; g < groups; g++) {
                const float *qp = qpos + g * dim, *qn = qneg + g * dim;
                float bound = row_bound(qp, qn, lo, hi, dim);
                if (isnan(bound))
                    best = bound;
                else if (!isnan(best) && bound > best)
                    best = bound;
            }
            score[c] = best;
            order[c] = c;
        }
        rank_t rk = {score, hot + r * hot_row + c0};
        if (k < n)
            select_top(&rk, order, n, k);
        int64_t *dst = out + r * k;
        for (int64_t i = 0; i < k; i++)
            dst[i] = c0 + order[i];
        sort_pages(dst, k);
    }
    return 0;
}
