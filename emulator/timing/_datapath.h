/* cxlemu timed data path: shared declarations (C core and the cffi cdef in _build.py).
 * The link-state word layout mirrors emulator/timing/linkstate.py; a test checks they agree. */
#ifndef CXLEMU_DATAPATH_H
#define CXLEMU_DATAPATH_H
#include <stdint.h>

/* Bumped when a declaration below changes: cimpl refuses a stale build of the extension. */
#define CXL_ABI_VERSION 7

#define CXL_DIR_READ 0
#define CXL_DIR_WRITE 1

#define CXL_E_RANGE (-1)
#define CXL_E_POISON (-2)
#define CXL_E_GONE (-3)      /* the device's firmware stopped, died or was restarted since open */
#define CXL_E_DISABLED (-4)  /* media disabled (sanitize, secure erase, activation that needs it) */
#define CXL_E_NO_EXTENT (-5) /* a Dynamic Capacity block this host accepted no extent for */

/* The device state word (emulator/liveness.py, in the link-state page at CXL_LS_STATE_WORD):
 * bits 0-31 the boot generation (one more at every serve), CXL_ST_UP while a firmware serves it,
 * CXL_ST_MEDIA while its media is enabled.  A data path opened at generation g accesses the
 * media only while the word reads g | UP | MEDIA. */
#define CXL_LS_STATE_WORD 160
#define CXL_ST_GEN_MASK 0xFFFFFFFF
#define CXL_ST_UP 0x100000000
#define CXL_ST_MEDIA 0x200000000

/* Transfers up to this many bytes take the short path (see _datapath.c). */
#define CXL_SHORT_BYTES 4096

/* Link-state page: u64 words.  Word 0 magic, 1 layout version; per direction a block of
 * 64 words at CXL_LS_DIR_WORD(d); the copy counters after them. */
#define CXL_LS_DIR_WORD(d) (8 + (d) * 64)
#define CXL_LS_COPY_WORD 136
#define CXL_LS_FREE 0
#define CXL_LS_BYTES 1
#define CXL_LS_TRANSFERS 2
#define CXL_LS_BUSY_NS 3
#define CXL_LS_LATENCY_NS 4
#define CXL_LS_ERRORS 5
#define CXL_LS_HIST 8
#define CXL_LS_HIST_BUCKETS 40

typedef struct {
    uint8_t *media;
    uint64_t media_size;
    const uint8_t *poison;   /* 1 bit per 64-B line; NULL = no poison tracking */
    uint64_t poison_size;    /* bytes */
    uint64_t *link;          /* link-state page, 8-byte aligned */
    int64_t lat_ns[2];       /* per direction, time scale applied */
    uint64_t fs_per_byte[2]; /* femtoseconds per byte, time scale applied; 0 = unthrottled */
    uint64_t txn_bytes;      /* power of two, 64..4096 */
    int64_t comp_ps[2];      /* emulator's own per-access cost in picoseconds, deducted from
                                real-time waits: [0] short transfers (<= 4 KiB), [1] longer ones */
    int untimed;             /* all of lat_ns and fs_per_byte are 0: count, never read the clock */
    const uint64_t *state;   /* the device state word; NULL = not checked (a bare data path) */
    uint64_t state_ok;       /* the value it must hold for media access (generation | UP | MEDIA) */
    uint64_t *media_link;    /* the device's shared media block (media.link, the link-state page's
                                layout: FREE and counters per direction), mapped by every host;
                                NULL = no shared media limit (then media_fs_per_byte is unused) */
    uint64_t media_fs_per_byte[2]; /* the media's aggregate bandwidth; 0 = that direction unlimited */
    const uint8_t *access;   /* this host's access bitmap over the Dynamic Capacity range: 1 bit per
                                DC block from access_base (block i: byte i>>3, bit i&7), set = an
                                accepted extent covers it; NULL = no check (no DC) */
    uint64_t access_size;    /* bytes; a block past them counts as clear */
    uint64_t access_base;    /* the DC range's first DPA: below it (static capacity) never checked */
    uint32_t access_shift;   /* log2 of the DC block size (>= 12) */
} cxl_dp;

/* One scatter-gather element for cxl_issue_batch (the DMA engine's C path). */
typedef struct {
    int32_t dir;             /* CXL_DIR_READ: media -> host; CXL_DIR_WRITE: host -> media */
    uint64_t dpa;
    uint8_t *host;
    uint64_t len;
} cxl_desc;

int64_t cxl_now(void);
void cxl_stamp(int64_t *ns, uint64_t *tsc);
int cxl_state_cas(uint64_t *word, uint64_t expect, uint64_t value);
int64_t cxl_read_from(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n, int64_t ref_ns,
                      uint64_t ref_tsc, uint64_t *err_dpa);
int64_t cxl_link_now(void);
int cxl_tsc_calibrate(int64_t window_ns);
double cxl_ticks_per_ns(void);
void cxl_wait_until(int64_t deadline);
int64_t cxl_check_range(const cxl_dp *dp, uint64_t dpa, uint64_t n);
uint64_t cxl_first_poison(const cxl_dp *dp, uint64_t dpa, uint64_t n);
uint64_t cxl_first_no_extent(const cxl_dp *dp, uint64_t dpa, uint64_t n);
int64_t cxl_read(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n, int64_t now, int wait,
                 uint64_t *err_dpa);
int64_t cxl_write(const cxl_dp *dp, uint64_t dpa, const uint8_t *src, uint64_t n, int64_t now,
                  int wait, uint64_t *err_dpa);
int64_t cxl_copy(const cxl_dp *dp, uint64_t src, uint64_t dst, uint64_t n, int64_t now, int wait,
                 uint64_t *err_dpa);
int64_t cxl_read_untimed(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n,
                         uint64_t *err_dpa);
int64_t cxl_write_untimed(const cxl_dp *dp, uint64_t dpa, const uint8_t *src, uint64_t n,
                          uint64_t *err_dpa);
int64_t cxl_issue(const cxl_dp *dp, const cxl_desc *d, int64_t now, uint64_t *err_dpa);
int64_t cxl_issue_batch(const cxl_dp *dp, cxl_desc *const *descs, uint64_t n, int64_t now,
                        int64_t *results, uint64_t *err_dpas);
int64_t cxl_issue_array(const cxl_dp *dp, const cxl_desc *descs, uint64_t n, int64_t now,
                        int64_t *results, uint64_t *err_dpas, uint64_t *failed);
int64_t cxl_plan_runs(const int64_t *blocks, const int64_t *chunks, uint64_t n, uint64_t num_chunks,
                      const uint64_t *bases, const uint64_t *sizes, const int64_t *strides,
                      const int64_t *offsets, const int64_t *pages, uint64_t nbuf, int32_t dir,
                      cxl_desc *out, uint64_t *total);
int64_t cxl_chase(const cxl_dp *dp, uint64_t dpa, uint64_t hops, int timed_hops,
                  int64_t *samples, uint64_t nsamples, uint64_t *end_dpa);
#endif
