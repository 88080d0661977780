/* Demand-fill replay in C: see _fastreplay.c; Quest's page choice: see _hotpages.c. */
#include <stdint.h>

int64_t cxl_dense_ids(const int64_t *keys, int64_t n, int64_t *ids);
int64_t cxl_replay_lru(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions);
int64_t cxl_replay_lfu(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions);
int64_t cxl_replay_arc(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap, uint8_t *hit,
                       int64_t *evictions);
int64_t cxl_replay_s3fifo(const int64_t *ids, int64_t n, int64_t n_ids, int64_t cap,
                          int64_t small_target, int64_t ghost_limit, int fill_main_first,
                          uint8_t *hit, int64_t *evictions);
int64_t cxl_replay_opt(const int64_t *ids, const int64_t *next_use, int64_t n, int64_t n_ids,
                       int64_t cap, uint8_t *hit, int64_t *evictions);
int64_t cxl_quest_topk(const float *q, int64_t groups, int64_t dim, int64_t q_row, const float *kmin,
                       const float *kmax, int64_t meta_row, int64_t meta_page, const int64_t *hot,
                       int64_t hot_row, int64_t nrows, int64_t c0, int64_t c1, int64_t k, float *score,
                       int64_t *order, int64_t *out);
