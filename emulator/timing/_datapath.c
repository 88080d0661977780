/*
 * cxlemu timed data path: the C core behind emulator.timing.DataPath (impl="c").
 *
 * Every timed transfer of n bytes in direction d is charged whole transactions
 * (dp->txn_bytes, aligned) and
 *
 *     start      = max(now, link_free[d])          (link_free: u64 ns in shared memory)
 *     link_free' = start + occ,  occ = charged * fs_per_byte[d] / 1e6   (rounded half up)
 *     completion = start + occ + lat_ns[d]
 *
 * so bandwidth is shared by everyone who maps the same link-state page (threads and
 * processes) while latency pipelines, as on a real link.  With a shared media block
 * (dp->media_link: several hosts on one device) the transfer also holds the media, from the
 * same start, for occ_m = charged * media_fs_per_byte[d] / 1e6:
 *     start = max(now, link_free[d], media_free[d]),  completion = start + max(occ, occ_m) + lat
 * (firmware_model/link.py's model; reserve_shared() below).  link_free is advanced with a
 * compare-and-swap; counters with atomic adds.  The pure-Python twin (_pyimpl.py)
 * implements the same arithmetic; tests compare the two on a simulated clock.
 *
 * Real time (now < 0): the caller waits, spinning on the TSC (GIL released by cffi), until
 *     max(t_copied + lat, start + occ + lat) - dp->comp_ps[path] / 1000
 * i.e. the configured latency is *added* to the emulator's own copy (a local access),
 * never overlapped with it, and the emulator's fixed bookkeeping cost (TSC reading, CAS,
 * counters, spin exit), measured once per process by calibration, is deducted.
 *
 *     transfers <= 4 KiB  short_transfer(): copy, one fenced TSC reading (= request time),
 *                         reserve, count, spin from that reading   (one clock access)
 *     longer ones         timed(): stamp, reserve, copy (overlapping the link time),
 *                         count, spin until link done + lat
 *     simulated time      timed() with now >= 0: nothing waits; same arithmetic as the twin
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_datapath.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define CPU_RELAX() __builtin_ia32_pause()
#define HAVE_TSC 1
/* lfence on both sides: the reading is taken after every earlier load has completed (the
 * copy's data has arrived) and before any later instruction starts. */
static inline uint64_t ticks_now(void)
{
    _mm_lfence();
    uint64_t t = __rdtsc();
    _mm_lfence();
    return t;
}
/* The spin's reading needs no fence: it only has to pass the target. */
static inline uint64_t ticks_spin(void) { return __rdtsc(); }
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#define HAVE_TSC 0
static inline uint64_t ticks_now(void) { return 0; }
static inline uint64_t ticks_spin(void) { return 0; }
#endif

/* Short waits spin on the invariant TSC (a read costs a few ns; clock_gettime costs 20-40 ns
 * on a VM, which would be the spin's granularity).  The link model stays in CLOCK_MONOTONIC
 * ns, shared across processes; the TSC only measures the wait relative to a reference
 * (clock, TSC) pair taken together.  Calibrated once per process by cxl_tsc_calibrate(). */
static double ticks_per_ns;
static int tsc_ok;

typedef struct {
    int64_t ns;
    uint64_t tsc;
} stamp_t;

/* Timer wake-ups on a virtual machine run 60-120 us late on average (milliseconds at worst),
 * so only waits far longer than that sleep, and the rest spins.  The spin never yields: on a
 * loaded host sched_yield() hands the core to another runnable task for a whole time slice,
 * which doubled 1 ms transfers in measurement. */
#define SLEEP_ABOVE_NS 20000000
#define SLEEP_MARGIN_NS 5000000

int64_t cxl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void cxl_wait_until(int64_t deadline)
{
    int64_t t = cxl_now();
    if (deadline - t > SLEEP_ABOVE_NS) {
        int64_t wake = deadline - SLEEP_MARGIN_NS;
        struct timespec ts = {wake / 1000000000LL, wake % 1000000000LL};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
            ;
    }
    while (cxl_now() < deadline)
        CPU_RELAX();
}

static void set_spin_ticks(void);

int cxl_tsc_calibrate(int64_t window_ns)
{
    if (!HAVE_TSC || window_ns <= 0) {
        tsc_ok = 0;
        return 0;
    }
    int64_t n0 = cxl_now();
    uint64_t t0 = ticks_now();
    while (cxl_now() - n0 < window_ns)
        CPU_RELAX();
    int64_t n1 = cxl_now();
    uint64_t t1 = ticks_now();
    ticks_per_ns = (double)(t1 - t0) / (double)(n1 - n0);
    tsc_ok = ticks_per_ns > 0.1;
    set_spin_ticks();
    return tsc_ok;
}

double cxl_ticks_per_ns(void) { return tsc_ok ? ticks_per_ns : 0.0; }

static uint64_t to_ticks(int64_t ns);

/* CLOCK_MONOTONIC ns from a TSC reading, through a per-thread anchor (a clock reading and a
 * TSC reading taken together) renewed every ANCHOR_NS: the critical path of a transfer reads
 * the TSC only, and the clock once per ANCHOR_NS.  Calibration error is a few ppm, so two
 * processes' stamps agree within tens of ns: far below any link time that matters. */
#define ANCHOR_NS 10000000
/* An anchor's clock reading is bracketed by two TSC readings and paired with their midpoint;
 * a bracket wider than this (the vCPU descheduled between the reads: microseconds to
 * milliseconds on a busy host) is taken again, or every stamp of the next ANCHOR_NS would be
 * off by the stall: a 5-us completion would then read as still 5 us + the stall ahead. */
#define ANCHOR_SLACK_NS 2000
#define ANCHOR_TRIES 8
static __thread int64_t anchor_ns;
static __thread uint64_t anchor_tsc;

static void reanchor(void)
{
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < ANCHOR_TRIES; i++) {
        uint64_t t0 = ticks_now();
        int64_t ns = cxl_now();
        uint64_t t1 = ticks_now();
        if (t1 - t0 < best) {  /* the tightest bracket so far */
            best = t1 - t0;
            anchor_ns = ns;
            anchor_tsc = t0 + (t1 - t0) / 2;
        }
        if (best <= to_ticks(ANCHOR_SLACK_NS))
            return;
    }
}

static int64_t ticks_to_ns(uint64_t t)
{
    if (anchor_tsc == 0 || (int64_t)(t - anchor_tsc) > (int64_t)to_ticks(ANCHOR_NS))
        reanchor();
    return anchor_ns + (int64_t)((double)(int64_t)(t - anchor_tsc) / ticks_per_ns);
}

static stamp_t stamp_now(void)
{
    stamp_t s;
    if (tsc_ok) {
        s.tsc = ticks_now();
        s.ns = ticks_to_ns(s.tsc);
    } else {
        s.ns = cxl_now();
        s.tsc = 0;
    }
    return s;
}

static uint64_t to_ticks(int64_t ns) { return ns > 0 ? (uint64_t)((double)ns * ticks_per_ns) : 0; }
static uint64_t ps_to_ticks(int64_t ps) { return ps > 0 ? (uint64_t)((double)ps * ticks_per_ns * 1e-3) : 0; }
/* The compensation of the longer path, in whole ns (its link time dwarfs the fraction). */
static int64_t comp_long_ns(const cxl_dp *dp) { return (dp->comp_ps[1] + 500) / 1000; }

/* Spin until the TSC passes target.  PAUSE costs 10-140 cycles depending on the core (it is
 * a hint for the sibling hyperthread), so a loop of PAUSE + RDTSC exits up to one such step
 * late, and where in that step depends on the code before the loop rather than on the target.
 * The last stretch is a bare RDTSC loop (a few ns a turn): on the 2-vCPU host this took the
 * +1000 ns probe from +24..27 to +15..20 ns over, and its p99 jitter from 4-6 % to 2-4 %. */
#define SPIN_FINE_NS 200
/* The bare loop still exits up to one of its turns (~10 ns on a VM) past the target, and where
 * in that turn depends on the phase of its readings against the target: in a loop of identical
 * accesses (a pointer chase) the phase repeats, so every access ended the same few ns late or
 * early, a bias that moved with the configured latency and the calibration (15-30 ns between
 * processes, 3-10 % of a 100-ns latency).  Error feedback removes it: each spin aims earlier by
 * what the last one of this thread ended past its aim, so consecutive lateness telescopes and
 * the mean lands on the target (each access within one turn of it).  Only a turn's remainder is
 * carried, never a preemption's lateness, and nothing after a wait that was already over. */
#define SPIN_CARRY_MAX_NS 40
static __thread uint64_t spin_late;
/* SPIN_FINE_NS and SPIN_CARRY_MAX_NS in ticks, set with ticks_per_ns: after the spin's exit
 * every instruction is the emulator's own cost (not absorbed by the wait), so the exit path
 * does no floating point and no call: the thread-local carry's address (a __tls_get_addr
 * call in a shared library) is taken before the wait. */
static uint64_t spin_fine_ticks, spin_carry_max_ticks;
static void set_spin_ticks(void)
{
    spin_fine_ticks = to_ticks(SPIN_FINE_NS);
    spin_carry_max_ticks = to_ticks(SPIN_CARRY_MAX_NS);
}
static inline void spin_to(uint64_t target)
{
    uint64_t *carry = &spin_late;
    __asm__("" : "+r"(carry)); /* keep the address in a register: not recomputed after the exit */
    uint64_t aim = target - (*carry < target ? *carry : 0);
    uint64_t t = ticks_spin();
    if (t >= aim) {
        *carry = 0;
        return;
    }
    while (t + spin_fine_ticks < aim) {
        CPU_RELAX();
        t = ticks_spin();
    }
    while (t < aim) {
        __asm__ __volatile__("" ::: "memory");
        t = ticks_spin();
    }
    uint64_t late = t - aim;
    *carry = late < spin_carry_max_ticks ? late : 0;
}

/* Now on the clock the link model stamps requests with (this thread's TSC anchor, or
 * CLOCK_MONOTONIC): whether a completion has passed is asked of this clock, not of a
 * slightly different one. */
int64_t cxl_link_now(void) { return stamp_now().ns; }

/* A request stamp for cxl_read_from (this thread's clock and TSC, taken together). */
void cxl_stamp(int64_t *ns, uint64_t *tsc)
{
    stamp_t s = stamp_now();
    *ns = s.ns;
    *tsc = s.tsc;
}

/* When a transfer is done: max(link_done, the moment the copy finished) + lat - comp, as a
 * TSC target.  Called right after the copy, so "now" is when the copy finished.  Returns 0
 * when there is no TSC (or the wait is long): then finish_wait() uses the clock. */
static uint64_t done_target(stamp_t ref, int64_t link_done, int64_t lat, int64_t comp)
{
    if (!tsc_ok || link_done - ref.ns > SLEEP_ABOVE_NS)
        return 0;
    uint64_t target = ref.tsc + to_ticks(link_done - ref.ns);
    if (lat) {
        uint64_t copied = ticks_now();
        if (copied > target)
            target = copied;
    }
    if (lat >= comp)
        return target + to_ticks(lat - comp);
    uint64_t back = to_ticks(comp - lat), room = target - ref.tsc;
    return target - (back < room ? back : room);
}

/* Spin to the target (the bookkeeping between done_target() and here overlaps the wait). */
static void finish_wait(uint64_t target, int64_t link_done, int64_t lat, int64_t comp)
{
    if (target) {
        spin_to(target);
        return;
    }
    int64_t copied = lat ? cxl_now() : 0;
    cxl_wait_until((link_done > copied ? link_done : copied) + lat - comp);
}

static uint64_t charged_bytes(const cxl_dp *dp, uint64_t dpa, uint64_t n)
{
    uint64_t mask = dp->txn_bytes - 1;
    return ((dpa + n + mask) & ~mask) - (dpa & ~mask);
}

/* 64-bit arithmetic whenever charged * fs_per_byte fits (every short transfer does: 4 KiB at
 * 1 MB/s is 4.1e12 fs): a division by the constant 1e6 compiles to a multiply and a shift, where
 * the 128-bit one is a call into libgcc that runs a DIV (tens of cycles, on a divider the SMT
 * sibling shares). */
static uint64_t occupancy_ns(uint64_t charged, uint64_t fs_per_byte)
{
    uint64_t fs64;
    if (!__builtin_mul_overflow(charged, fs_per_byte, &fs64) && fs64 <= UINT64_MAX - 500000u)
        return (fs64 + 500000u) / 1000000u;
    unsigned __int128 fs = (unsigned __int128)charged * fs_per_byte;
    return (uint64_t)((fs + 500000u) / 1000000u);
}

static unsigned hist_bucket(uint64_t ns)
{
    unsigned b = ns ? 63u - (unsigned)__builtin_clzll(ns) : 0u;
    return b < CXL_LS_HIST_BUCKETS ? b : CXL_LS_HIST_BUCKETS - 1;
}

static uint64_t *dir_word(const cxl_dp *dp, int dir, unsigned word)
{
    return dp->link + CXL_LS_DIR_WORD(dir) + word;
}

/* Reserve the link for occ ns from max(req, link_free); returns the start. */
static uint64_t reserve(const cxl_dp *dp, int dir, uint64_t req, uint64_t occ)
{
    uint64_t *free_ns = dir_word(dp, dir, CXL_LS_FREE);
    uint64_t old = __atomic_load_n(free_ns, __ATOMIC_ACQUIRE), start;
    if (occ == 0)
        return req;
    do {
        start = old > req ? old : req;
    } while (!__atomic_compare_exchange_n(free_ns, &old, start + occ, 1,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return start;
}

/* Reserve the host's link (occ ns) and the shared media (occ_m > 0 ns) from one start,
 * max(req, link_free if occ, media_free); returns the start.  Two words in two pages cannot be
 * swapped together, so the media is claimed first and the host's link at the same start after:
 * - a process that finds media_free moved since it read it fails its media CAS and recomputes
 *   the start from both words afresh (nothing of it is claimed yet);
 * - once the media is claimed, [start, start + occ_m) is ours: the host word's CAS then only
 *   retries while link_free stays <= start (another transfer of this host that ends before our
 *   start), which leaves our start valid;
 * - if this host's link was taken past our start meanwhile (a second thread of the same host),
 *   the media claim is taken back with a CAS from our own end to the value we replaced, which
 *   succeeds only if nobody claimed the media after us: then no trace is left and we start over;
 *   otherwise the claim stays as a gap the media idles, and we start over after it.
 * So at every moment each word's claims never overlap and each transfer holds both resources
 * from one start; uncontended (one thread per host, and every simulated-clock run) it is the
 * model's arithmetic exactly.  Media claims are only advanced or rolled back by their owner. */
static uint64_t reserve_shared(const cxl_dp *dp, int dir, uint64_t req, uint64_t occ, uint64_t occ_m)
{
    uint64_t *host = dir_word(dp, dir, CXL_LS_FREE);
    uint64_t *media = dp->media_link + CXL_LS_DIR_WORD(dir) + CXL_LS_FREE;
    for (;;) {
        uint64_t h = __atomic_load_n(host, __ATOMIC_ACQUIRE);
        uint64_t m = __atomic_load_n(media, __ATOMIC_ACQUIRE);
        uint64_t start = occ && h > req ? h : req;
        if (m > start)
            start = m;
        if (!__atomic_compare_exchange_n(media, &m, start + occ_m, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        if (occ == 0)
            return start;
        while (h <= start) {
            if (__atomic_compare_exchange_n(host, &h, start + occ, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
                return start;
        }
        uint64_t mine = start + occ_m;
        __atomic_compare_exchange_n(media, &mine, m, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
}

/* The media's occupancy of a transfer, 0 without a shared media block (one predictable branch
 * on every timed transfer: the cost of the feature to a device without it). */
static inline uint64_t media_occ(const cxl_dp *dp, int dir, uint64_t charged)
{
    return dp->media_link ? occupancy_ns(charged, dp->media_fs_per_byte[dir]) : 0;
}

/* reserve_shared() and the media's counters (bytes and transfers of host transfers; a copy,
 * n == 0 here, counts its busy time only, as on the host's page); *held = how long the transfer
 * holds a resource, the longer of its two occupancies. */
static uint64_t reserve_media(const cxl_dp *dp, int dir, uint64_t req, uint64_t n, uint64_t occ,
                              uint64_t occ_m, uint64_t *held)
{
    uint64_t *w = dp->media_link + CXL_LS_DIR_WORD(dir);
    *held = occ_m > occ ? occ_m : occ;
    if (n) {
        __atomic_fetch_add(w + CXL_LS_BYTES, n, __ATOMIC_RELAXED);
        __atomic_fetch_add(w + CXL_LS_TRANSFERS, 1, __ATOMIC_RELAXED);
    }
    __atomic_fetch_add(w + CXL_LS_BUSY_NS, occ_m, __ATOMIC_RELAXED);
    return reserve_shared(dp, dir, req, occ, occ_m);
}

static void account(const cxl_dp *dp, int dir, uint64_t n, uint64_t occ, uint64_t total)
{
    __atomic_fetch_add(dir_word(dp, dir, CXL_LS_BYTES), n, __ATOMIC_RELAXED);
    __atomic_fetch_add(dir_word(dp, dir, CXL_LS_TRANSFERS), 1, __ATOMIC_RELAXED);
    if (occ)
        __atomic_fetch_add(dir_word(dp, dir, CXL_LS_BUSY_NS), occ, __ATOMIC_RELAXED);
    __atomic_fetch_add(dir_word(dp, dir, CXL_LS_LATENCY_NS), total, __ATOMIC_RELAXED);
    __atomic_fetch_add(dir_word(dp, dir, CXL_LS_HIST + hist_bucket(total)), 1, __ATOMIC_RELAXED);
}

static void count_error(const cxl_dp *dp, int dir)
{
    __atomic_fetch_add(dir_word(dp, dir, CXL_LS_ERRORS), 1, __ATOMIC_RELAXED);
}

int64_t cxl_check_range(const cxl_dp *dp, uint64_t dpa, uint64_t n)
{
    if (dpa > dp->media_size || n > dp->media_size - dpa)
        return CXL_E_RANGE;
    return 0;
}

/* First poisoned 64-B line in [dpa, dpa+n), as its DPA, or UINT64_MAX.  Skips clean
 * bitmap bytes eight at a time: a 2 MiB read scans 4 KiB of bitmap. */
uint64_t cxl_first_poison(const cxl_dp *dp, uint64_t dpa, uint64_t n)
{
    if (n == 0 || dp->poison == NULL)
        return UINT64_MAX;
    uint64_t first = dpa >> 6, last = (dpa + n - 1) >> 6;
    if ((last >> 3) >= dp->poison_size)
        last = dp->poison_size * 8 - 1;
    uint64_t line = first;
    while (line <= last) {
        if ((line & 63) == 0 && line + 63 <= last) {
            uint64_t w;
            memcpy(&w, dp->poison + (line >> 3), 8);
            if (w == 0) {
                line += 64;
                continue;
            }
        }
        if (dp->poison[line >> 3] & (1u << (line & 7)))
            return line << 6;
        line++;
    }
    return UINT64_MAX;
}

/* First DPA of [dpa, dpa+n) (within the media) in a Dynamic Capacity block whose access bit is
 * clear, or past the bitmap: the block's start, or dpa when the transfer starts inside it; or
 * UINT64_MAX.  Static capacity (below access_base) is never checked.  Skips whole bytes of set
 * bits; a 2 MiB transfer in 2 MiB blocks looks at one or two bits.  The bitmap is read at every
 * transfer (the firmware clears bits before it answers a release), never cached. */
uint64_t cxl_first_no_extent(const cxl_dp *dp, uint64_t dpa, uint64_t n)
{
    if (n == 0 || dp->access == NULL || dpa + n <= dp->access_base)
        return UINT64_MAX;
    uint64_t lo = dpa > dp->access_base ? dpa : dp->access_base;
    uint64_t first = (lo - dp->access_base) >> dp->access_shift;
    uint64_t last = (dpa + n - 1 - dp->access_base) >> dp->access_shift;
    uint64_t nbits = dp->access_size * 8, block = first;
    while (block <= last) {
        if (block >= nbits)
            break;
        uint8_t byte = __atomic_load_n(dp->access + (block >> 3), __ATOMIC_ACQUIRE);
        if ((block & 7) == 0 && block + 7 <= last && byte == 0xFF) {
            block += 8;
            continue;
        }
        if (!(byte & (1u << (block & 7))))
            break;
        block++;
    }
    if (block > last)
        return UINT64_MAX;
    uint64_t at = dp->access_base + (block << dp->access_shift);
    return at > dpa ? at : dpa;
}

/* Whether the device may be accessed now: its state word (one load, in shared memory) holds
 * what it held at open.  A generation or UP bit that differs is a gone device; only the media
 * bit differing is disabled media.  Checked before every transfer, untimed ones included, so a
 * dead, restarted or sanitizing device never hands out bytes. */
static int64_t check_state(const cxl_dp *dp)
{
    if (dp->state == NULL)
        return 0;
    uint64_t s = __atomic_load_n(dp->state, __ATOMIC_ACQUIRE);
    if (s == dp->state_ok)
        return 0;
    uint64_t key = CXL_ST_GEN_MASK | CXL_ST_UP;
    return (s & key) == (dp->state_ok & key) ? CXL_E_DISABLED : CXL_E_GONE;
}

int cxl_state_cas(uint64_t *word, uint64_t expect, uint64_t value)
{
    return __atomic_compare_exchange_n(word, &expect, value, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static int64_t validate(const cxl_dp *dp, int dir, uint64_t dpa, uint64_t n, int check_poison,
                        uint64_t *err_dpa)
{
    int64_t st = check_state(dp);
    if (st) {
        count_error(dp, dir);
        return st;
    }
    if (cxl_check_range(dp, dpa, n)) {
        count_error(dp, dir);
        return CXL_E_RANGE;
    }
    if (dp->access) {  /* before poison: a host learns nothing of a block it holds no extent for */
        uint64_t hole = cxl_first_no_extent(dp, dpa, n);
        if (hole != UINT64_MAX) {
            *err_dpa = hole;
            count_error(dp, dir);
            return CXL_E_NO_EXTENT;
        }
    }
    if (check_poison) {
        uint64_t bad = cxl_first_poison(dp, dpa, n);
        if (bad != UINT64_MAX) {
            *err_dpa = bad;
            count_error(dp, dir);
            return CXL_E_POISON;
        }
    }
    return 0;
}

/* Reserve the link from max(req, link_free) for occ ns, even for occ == 0 (then the CAS
 * changes nothing): the short path's cost must not depend on the configuration, since one
 * calibrated compensation covers it. */
static uint64_t reserve_always(const cxl_dp *dp, int dir, uint64_t req, uint64_t occ)
{
    uint64_t *free_ns = dir_word(dp, dir, CXL_LS_FREE);
    uint64_t old = __atomic_load_n(free_ns, __ATOMIC_ACQUIRE), start;
    do {
        start = old > req ? old : req;
    } while (!__atomic_compare_exchange_n(free_ns, &old, start + occ, 1,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return start;
}

/* The short path: a real-time transfer of at most SHORT_BYTES, whose copy takes a few ns.  Its
 * request time is taken after the copy (one fenced TSC reading, the only clock access on the
 * critical path), so the link is reserved after the copy rather than before: a difference of
 * the copy's duration, below the clock's own resolution on a VM.  The reservation and the
 * counters then run inside the wait, which is measured from that reading, so the wait absorbs
 * them; what it cannot absorb (the reading's fence, the spin's exit, the return) is measured once
 * per process and deducted as comp_ps[0] (to the picosecond: the calibration resolves a
 * fraction of a ns, and 1 ns is 1 % of a 100-ns latency).
 *
 * Everything before that reading and after the spin's exit is the emulator's own cost, and
 * costs more whenever the core's SMT sibling is busy, so the path keeps both short:
 * - the counters sit inside the wait: after the spin, their four or five atomics made the cost
 *   per access depend on the wait's length (24.4-31 ns over waits of 60-100 ns on the 2-vCPU
 *   host), so one calibrated figure could not fit every configured latency;
 * - the link arithmetic comes after the reading: its 128-bit division by 1e6 (a libgcc call and
 *   a DIV) used to run before the copy; occupancy_ns() now divides in 64 bits, a multiply and a
 *   shift;
 * - the exit path takes no call and no floating point (see spin_to).
 * With the last two, the calibration's spells of +4-7 ns (one process in three or four, before)
 * went: it reads 14.8-15.1 ns on 256-KiB rings, 48 calibrations in 8 processes without one. */
#define SHORT_BYTES CXL_SHORT_BYTES

static int64_t short_transfer(const cxl_dp *dp, int dir, uint64_t dpa, uint8_t *dst,
                              const uint8_t *src, uint64_t n)
{
    memcpy(dst, src, n);
    uint64_t copied = ticks_now();
    uint64_t charged = charged_bytes(dp, dpa, n);
    uint64_t occ = occupancy_ns(charged, dp->fs_per_byte[dir]), occ_m = media_occ(dp, dir, charged);
    int64_t lat = dp->lat_ns[dir];
    uint64_t req = (uint64_t)ticks_to_ns(copied);
    uint64_t held = occ;
    uint64_t start = occ_m ? reserve_media(dp, dir, req, n, occ, occ_m, &held)
                           : reserve_always(dp, dir, req, occ);
    uint64_t completion = start + held + (uint64_t)lat;
    account(dp, dir, n, occ, completion - req);
    int64_t wait_ps = (int64_t)(completion - req) * 1000 - dp->comp_ps[0];
    if (wait_ps > 0)
        spin_to(copied + ps_to_ticks(wait_ps));
    return (int64_t)completion;
}

static int64_t timed_from(const cxl_dp *dp, int dir, uint64_t dpa, uint8_t *dst, const uint8_t *src,
                          uint64_t n, stamp_t ref, int real, int wait);

/* Reserve, copy, account, and (real time, wait) spin until done.  The copy happens
 * between the reservation and the wait so a bandwidth-bound transfer overlaps its own
 * memcpy with its link time. */
static int64_t timed(const cxl_dp *dp, int dir, uint64_t dpa, uint8_t *dst, const uint8_t *src,
                     uint64_t n, int64_t now, int wait)
{
    int real = now < 0;
    if (dp->untimed) {
        /* No clock read at all: an untimed device costs exactly a local copy. */
        if (n == 0)
            return real ? 0 : now;
        memcpy(dst, src, n);
        __atomic_fetch_add(dir_word(dp, dir, CXL_LS_BYTES), n, __ATOMIC_RELAXED);
        __atomic_fetch_add(dir_word(dp, dir, CXL_LS_TRANSFERS), 1, __ATOMIC_RELAXED);
        return real ? 0 : now;
    }
    if (real && wait && tsc_ok && n && n <= SHORT_BYTES)
        return short_transfer(dp, dir, dpa, dst, src, n);  /* its link arithmetic after the copy */
    stamp_t ref = {now, 0};
    if (real)
        ref = stamp_now();
    return timed_from(dp, dir, dpa, dst, src, n, ref, real, wait);
}

/* The timed transfer from a request time already taken (ref): the longer path, and the
 * simulated one.  A caller that stamps the request before its own work (MemDev.read allocating
 * the bytes it returns) passes that stamp, so the work runs inside the link time. */
static int64_t timed_from(const cxl_dp *dp, int dir, uint64_t dpa, uint8_t *dst, const uint8_t *src,
                          uint64_t n, stamp_t ref, int real, int wait)
{
    uint64_t charged = charged_bytes(dp, dpa, n);
    uint64_t occ = occupancy_ns(charged, dp->fs_per_byte[dir]), occ_m = media_occ(dp, dir, charged);
    int64_t lat = dp->lat_ns[dir];
    uint64_t req = (uint64_t)ref.ns;
    if (n == 0)
        return (int64_t)req;
    uint64_t held = occ;
    uint64_t start = occ_m ? reserve_media(dp, dir, req, n, occ, occ_m, &held) : reserve(dp, dir, req, occ);
    uint64_t completion = start + held + (uint64_t)lat;
    memcpy(dst, src, n);
    account(dp, dir, n, occ, completion - req);
    if (real && wait)
        finish_wait(done_target(ref, (int64_t)(start + held), lat, comp_long_ns(dp)),
                    (int64_t)(start + held), lat, comp_long_ns(dp));
    return (int64_t)completion;
}

/* A transfer as the host asks for it: validated, then timed.  A real-time one longer than the
 * short path is stamped first, when the call begins, so its validation runs inside the link
 * time as the device's own work rather than before it: a 2 MiB read scans 4 KiB of poison
 * bitmap, which the previous 2 MiB copy has evicted from the cache: 7-8 us on the 2-vCPU Xeon
 * host, which a caller measured on top of the link time.  The short path keeps its stamp after
 * the copy (its calibrated compensation covers what comes before). */
static int64_t transfer(const cxl_dp *dp, int dir, uint64_t dpa, uint8_t *dst, const uint8_t *src,
                        uint64_t n, int64_t now, int wait, uint64_t *err_dpa)
{
    int check_poison = dir == CXL_DIR_READ;
    if (now < 0 && n > SHORT_BYTES && !dp->untimed) {
        stamp_t ref = stamp_now();
        int64_t rc = validate(dp, dir, dpa, n, check_poison, err_dpa);
        return rc ? rc : timed_from(dp, dir, dpa, dst, src, n, ref, 1, wait);
    }
    int64_t rc = validate(dp, dir, dpa, n, check_poison, err_dpa);
    return rc ? rc : timed(dp, dir, dpa, dst, src, n, now, wait);
}

int64_t cxl_read(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n, int64_t now, int wait,
                 uint64_t *err_dpa)
{
    return transfer(dp, CXL_DIR_READ, dpa, out, dp->media + dpa, n, now, wait, err_dpa);
}

/* A real-time read whose request time the caller stamped (cxl_stamp) before its own work;
 * transfers of the short path, and untimed devices, go the usual way (the short path's latency
 * counts from its copy, as read_into's does). */
int64_t cxl_read_from(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n, int64_t ref_ns,
                      uint64_t ref_tsc, uint64_t *err_dpa)
{
    int64_t rc = validate(dp, CXL_DIR_READ, dpa, n, 1, err_dpa);
    if (rc)
        return rc;
    if (dp->untimed || ref_ns < 0 || n <= SHORT_BYTES || n == 0)
        return timed(dp, CXL_DIR_READ, dpa, out, dp->media + dpa, n, -1, 1);
    stamp_t ref = {ref_ns, ref_tsc};
    return timed_from(dp, CXL_DIR_READ, dpa, out, dp->media + dpa, n, ref, 1, 1);
}

int64_t cxl_write(const cxl_dp *dp, uint64_t dpa, const uint8_t *src, uint64_t n, int64_t now,
                  int wait, uint64_t *err_dpa)
{
    return transfer(dp, CXL_DIR_WRITE, dpa, dp->media + dpa, src, n, now, wait, err_dpa);
}

/* One direction of a copy: reserve its link (and the media, if it holds it); when it is done. */
static uint64_t hold(const cxl_dp *dp, int dir, uint64_t req, uint64_t occ, uint64_t occ_m)
{
    if (occ_m == 0)
        return reserve(dp, dir, req, occ) + occ;
    uint64_t held;
    uint64_t start = reserve_media(dp, dir, req, 0, occ, occ_m, &held);
    return start + held;
}

/* Device-internal copy: the device reads src and writes dst, streaming, so it holds both
 * directions of the link for their occupancy and pays both latencies once:
 *     completion = max(start_r + occ_r, start_w + occ_w) + lat_r + lat_w            */
int64_t cxl_copy(const cxl_dp *dp, uint64_t src, uint64_t dst, uint64_t n, int64_t now, int wait,
                 uint64_t *err_dpa)
{
    int64_t rc = validate(dp, CXL_DIR_READ, src, n, 1, err_dpa);
    if (rc == 0)
        rc = validate(dp, CXL_DIR_WRITE, dst, n, 0, err_dpa);
    if (rc)
        return rc;
    int real = now < 0;
    if (dp->untimed) {
        if (n == 0)
            return real ? 0 : now;
        memmove(dp->media + dst, dp->media + src, n);
        __atomic_fetch_add(dp->link + CXL_LS_COPY_WORD + CXL_LS_BYTES, n, __ATOMIC_RELAXED);
        __atomic_fetch_add(dp->link + CXL_LS_COPY_WORD + CXL_LS_TRANSFERS, 1, __ATOMIC_RELAXED);
        return real ? 0 : now;
    }
    stamp_t ref = {now, 0};
    if (real)
        ref = stamp_now();
    uint64_t req = (uint64_t)ref.ns;
    if (n == 0)
        return (int64_t)req;
    uint64_t charged_r = charged_bytes(dp, src, n), charged_w = charged_bytes(dp, dst, n);
    uint64_t occ_r = occupancy_ns(charged_r, dp->fs_per_byte[CXL_DIR_READ]);
    uint64_t occ_w = occupancy_ns(charged_w, dp->fs_per_byte[CXL_DIR_WRITE]);
    uint64_t end_r = hold(dp, CXL_DIR_READ, req, occ_r, media_occ(dp, CXL_DIR_READ, charged_r));
    uint64_t end_w = hold(dp, CXL_DIR_WRITE, req, occ_w, media_occ(dp, CXL_DIR_WRITE, charged_w));
    uint64_t lat = (uint64_t)(dp->lat_ns[CXL_DIR_READ] + dp->lat_ns[CXL_DIR_WRITE]);
    uint64_t link_done = end_r > end_w ? end_r : end_w;
    memmove(dp->media + dst, dp->media + src, n);
    __atomic_fetch_add(dp->link + CXL_LS_COPY_WORD + CXL_LS_BYTES, n, __ATOMIC_RELAXED);
    __atomic_fetch_add(dp->link + CXL_LS_COPY_WORD + CXL_LS_TRANSFERS, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(dir_word(dp, CXL_DIR_READ, CXL_LS_BUSY_NS), occ_r, __ATOMIC_RELAXED);
    __atomic_fetch_add(dir_word(dp, CXL_DIR_WRITE, CXL_LS_BUSY_NS), occ_w, __ATOMIC_RELAXED);
    if (real && wait)
        finish_wait(done_target(ref, (int64_t)link_done, (int64_t)lat, comp_long_ns(dp)),
                    (int64_t)link_done, (int64_t)lat, comp_long_ns(dp));
    return (int64_t)(link_done + lat);
}

int64_t cxl_read_untimed(const cxl_dp *dp, uint64_t dpa, uint8_t *out, uint64_t n,
                         uint64_t *err_dpa)
{
    int64_t rc = validate(dp, CXL_DIR_READ, dpa, n, 1, err_dpa);
    if (rc == 0)
        memcpy(out, dp->media + dpa, n);
    return rc;
}

int64_t cxl_write_untimed(const cxl_dp *dp, uint64_t dpa, const uint8_t *src, uint64_t n,
                          uint64_t *err_dpa)
{
    int64_t rc = validate(dp, CXL_DIR_WRITE, dpa, n, 0, err_dpa);
    if (rc == 0)
        memcpy(dp->media + dpa, src, n);
    return rc;
}

/* Issue one scatter-gather element without waiting (the DMA engine waits for the latest
 * completion of a submission): its completion time, or its error code (*err_dpa the poisoned
 * line's DPA, or the first DPA without a Dynamic Capacity extent). */
int64_t cxl_issue(const cxl_dp *dp, const cxl_desc *d, int64_t now, uint64_t *err_dpa)
{
    return d->dir == CXL_DIR_READ ? cxl_read(dp, d->dpa, d->host, d->len, now, 0, err_dpa)
                                  : cxl_write(dp, d->dpa, d->host, d->len, now, 0, err_dpa);
}

/* Issue a scatter-gather list in order without waiting: results[i] is descriptor i's
 * completion time or its error code (err_dpas[i] the poisoned line's DPA).  Returns the
 * latest completion, 0 if none. */
/* Descriptor i of a list: its result and poisoned DPA stored, the latest completion kept. */
static inline int64_t issue_into(const cxl_dp *dp, const cxl_desc *d, int64_t now, int64_t *result,
                                 uint64_t *err_dpa, int64_t latest)
{
    *err_dpa = 0;
    int64_t rc = cxl_issue(dp, d, now, err_dpa);
    *result = rc;
    return rc > latest ? rc : latest;
}

int64_t cxl_issue_batch(const cxl_dp *dp, cxl_desc *const *descs, uint64_t n, int64_t now,
                        int64_t *results, uint64_t *err_dpas)
{
    int64_t latest = 0;
    for (uint64_t i = 0; i < n; i++)
        latest = issue_into(dp, descs[i], now, &results[i], &err_dpas[i], latest);
    return latest;
}

/* cxl_issue_batch over a contiguous array of descriptors (DescriptorArray's records, built
 * with numpy: no pointer list to build); *failed gets how many failed, so the caller looks at
 * the codes only when one did. */
int64_t cxl_issue_array(const cxl_dp *dp, const cxl_desc *descs, uint64_t n, int64_t now,
                        int64_t *results, uint64_t *err_dpas, uint64_t *failed)
{
    int64_t latest = 0;
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        latest = issue_into(dp, &descs[i], now, &results[i], &err_dpas[i], latest);
        bad += results[i] < 0;
    }
    *failed = bad;
    return latest;
}

/* Descriptors for moving blocks blocks[i] <-> chunks chunks[i] (i < n) of nbuf buffers at once
 * (a paged KV cache: one buffer per layer, block b of buffer t at host bases[t] + b * strides[t],
 * chunk c of it on the device at offsets[t] + c * pages[t], pages[t] bytes each): one record per
 * run where both lists advance by one (only where strides[t] == pages[t] for every buffer: a
 * padded block is moved alone) and buffer, buffer-major (all of buffer 0's runs, then buffer
 * 1's), into out (room for n * nbuf).  A driver's descriptor ring filled in one call: what took
 * a dozen numpy calls per job.  *total gets the bytes they move.  Returns the records
 * written, or -1 - i when blocks[i] or
 * chunks[i] is out of range (negative, chunk >= num_chunks, or the block's bytes past a
 * buffer of sizes[t] bytes): nothing is half-planned, the caller gets the index to name. */
int64_t cxl_plan_runs(const int64_t *blocks, const int64_t *chunks, uint64_t n, uint64_t num_chunks,
                      const uint64_t *bases, const uint64_t *sizes, const int64_t *strides,
                      const int64_t *offsets, const int64_t *pages, uint64_t nbuf, int32_t dir,
                      cxl_desc *out, uint64_t *total)
{
    int merge = 1;
    for (uint64_t t = 0; t < nbuf; t++)
        if (strides[t] != pages[t])
            merge = 0;
    uint64_t top = 0; /* the index of the largest block: if any block is past a buffer, it is */
    for (uint64_t i = 0; i < n; i++) {
        if (blocks[i] < 0 || chunks[i] < 0 || (uint64_t)chunks[i] >= num_chunks)
            return -1 - (int64_t)i;
        if (blocks[i] > blocks[top])
            top = i;
    }
    for (uint64_t t = 0; n && t < nbuf; t++) {  /* b * stride + page <= size, without overflow */
        uint64_t page = (uint64_t)pages[t], stride = (uint64_t)strides[t];
        if (page > sizes[t] || (stride && (uint64_t)blocks[top] > (sizes[t] - page) / stride))
            return -1 - (int64_t)top;
    }
    /* the runs once (start index, length), then each buffer's records from them */
    uint64_t runs = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (!merge || i == 0 || blocks[i] != blocks[i - 1] + 1 || chunks[i] != chunks[i - 1] + 1) {
            out[runs].dpa = (uint64_t)i; /* scratch: the run's first index, overwritten below */
            out[runs].len = 1;
            runs++;
        } else {
            out[runs - 1].len++;
        }
    }
    /* buffer-major from the last buffer down, so buffer 0's records (over the scratch) go last */
    *total = 0;
    for (uint64_t t = nbuf; t-- > 0;) {
        *total += (uint64_t)n * (uint64_t)pages[t];
        cxl_desc *rec = out + t * runs;
        for (uint64_t r = runs; r-- > 0;) {
            uint64_t first = out[r].dpa, len = out[r].len;
            rec[r].dir = dir;
            rec[r].dpa = (uint64_t)offsets[t] + (uint64_t)chunks[first] * (uint64_t)pages[t];
            rec[r].host = (uint8_t *)(uintptr_t)(bases[t] + (uint64_t)blocks[first] * (uint64_t)strides[t]);
            rec[r].len = len * (uint64_t)pages[t];
        }
    }
    return (int64_t)(runs * nbuf);
}

/* MLC-style dependent chase: each hop reads the u64 at dpa (through the timed path when
 * timed != 0; otherwise through the same path with timing off, the local baseline an
 * untimed device would give) and jumps to it.  While per-hop samples are taken (the first
 * nsamples hops) there is one clock read per hop in both modes, so they compare like with
 * like; beyond them the loop reads no clock.  Returns total ns; *end_dpa gets the last DPA (defeats dead-code removal). */
int64_t cxl_chase(const cxl_dp *dp, uint64_t dpa, uint64_t hops, int timed_hops,
                  int64_t *samples, uint64_t nsamples, uint64_t *end_dpa)
{
    uint64_t err = 0, next = 0;
    uint64_t scratch_link[CXL_LS_COPY_WORD + 8] = {0};
    cxl_dp local = *dp; /* the same device with timing off, counting into a scratch page */
    local.untimed = 1;
    local.link = scratch_link;
    /* per-hop stamps from the TSC when calibrated (finer than the clock), in ns */
    int64_t t0 = tsc_ok ? (int64_t)((double)ticks_now() / ticks_per_ns) : cxl_now(), prev = t0;
    for (uint64_t i = 0; i < hops; i++) {
        if (dpa > dp->media_size - 8)
            return CXL_E_RANGE;
        if (timed_hops) {
            int64_t rc = cxl_read(dp, dpa, (uint8_t *)&next, 8, -1, 1, &err);
            if (rc < 0)
                return rc;
        } else {
            int64_t rc = cxl_read(&local, dpa, (uint8_t *)&next, 8, -1, 1, &err);
            if (rc < 0)
                return rc;
        }
        dpa = next;
        if (i < nsamples) {
            int64_t t = tsc_ok ? (int64_t)((double)ticks_now() / ticks_per_ns) : cxl_now();
            samples[i] = t - prev;
            prev = t;
        }
    }
    if (nsamples < hops)
        prev = tsc_ok ? (int64_t)((double)ticks_now() / ticks_per_ns) : cxl_now();
    *end_dpa = dpa;
    return prev - t0;
}
