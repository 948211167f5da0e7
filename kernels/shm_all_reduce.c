/* The tensor-parallel all-reduce (and the LM head's all-gather) of the ranks of one host through a
 * shared-memory segment, in place of gloo's socket round trips (0.4-2.2 ms for one 2048-wide bf16 row on
 * a loaded 2-core VM, against 5.6-8.2 us here: bench/LOG.md). Built by cpu_native.py; shm_all_reduce.py maps the segment and
 * calls these.
 *
 * The segment: a page of counters (one cache line per rank), then two sets of slots, a slot per rank
 * in each. A round (one call, or one slot-sized piece of a larger tensor) has a number; in round s a
 * rank copies its piece into its slot of set s % 2, raises its counter to s (a release store), waits
 * until every counter reads at least s (acquire loads), and then reads every rank's slot: an all-reduce
 * sums them in rank order, in float32, rounding to the dtype once (every rank runs the same additions in
 * the same order, so every rank gets the same bits); an all-gather copies them out. The second barrier
 * before a slot is written again is the next round's own: a rank writes set s % 2 again in round s + 2
 * only after every other rank arrived at s + 1, which each did after it had finished reading round s.
 *
 * A waiting rank spins briefly (on a quiet machine the ranks arrive within microseconds of each other),
 * then sleeps on the counter (a futex, woken by the rank that raises it): where other work shares the
 * cores, a rank that is behind because it was descheduled gets them back instead of racing a spinner.
 * It never waits forever: it gives up at its deadline, or as soon as a rank it waits for holds no lock
 * on its byte of the segment file (each rank holds an open-file-description lock there, which the kernel
 * drops when the process dies, however it dies).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "bf16.h"

#define LINE 64
#define HEADER 4096                /* the counters' page: at most HEADER / LINE ranks */
#define BLOCK 512                  /* elements summed at a time, in a float32 buffer on the stack */
#define SPIN_S 50e-6               /* a wait this short spins; a longer one sleeps on the counter... */
#define CHECK_NS 2000000L          /* ...waking this often to look for dead ranks and the deadline */

enum { SHM_F32 = 0, SHM_BF16 = 1, SHM_F16 = 2 };
enum { SHM_OK = 0, SHM_TIMEOUT = 1, SHM_RANK_LOST = 2, SHM_OUT_OF_STEP = 3, SHM_BAD_ARGUMENT = 4 };

/* One rank's view of the group (shm_all_reduce.py's _Group). */
struct matinee_shm_group {
    char *base;          /* the mapped segment */
    long slot_bytes;     /* a multiple of LINE */
    long rounds;         /* rounds this rank has done: the next is rounds + 1 */
    double timeout_s;    /* the longest wait for the others in one round */
    int rank, size;
    int fd;              /* the segment file, where the ranks' locks are */
    int lost;            /* out: the rank a failed round waited for */
};

struct control {             /* a rank's cache line */
    uint32_t arrived;        /* the last round its slot was written for, modulo 2^32: a futex word */
    uint32_t sleepers;       /* ranks asleep on `arrived`, for the rank raising it to wake */
    uint64_t call[2];        /* by round parity: the call's numel * 4 + dtype, to catch ranks out of step */
};

long matinee_shm_bytes(int size, long slot_bytes) { return HEADER + 2L * size * slot_bytes; }

static struct control *control(const struct matinee_shm_group *g, int r) {
    return (struct control *)(g->base + (long)r * LINE);
}

static char *slot(const struct matinee_shm_group *g, long round, int r) {
    return g->base + HEADER + ((round & 1) * g->size + r) * g->slot_bytes;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int lock_byte(int fd, int cmd, int r, struct flock *fl) {
    memset(fl, 0, sizeof *fl);
    fl->l_type = F_WRLCK;
    fl->l_whence = SEEK_SET;
    fl->l_start = r;
    fl->l_len = 1;
    return fcntl(fd, cmd, fl);
}

/* Takes this rank's lock (held until the file's last descriptor in this process closes, or it dies):
 * 0, or the errno of the failure. */
int matinee_shm_hold(const struct matinee_shm_group *g) {
    struct flock fl;
    return lock_byte(g->fd, F_OFD_SETLK, g->rank, &fl) == 0 ? 0 : errno;
}

/* Whether rank r still holds its lock; where the lock cannot be read, assumed alive (the deadline stays). */
static int alive(const struct matinee_shm_group *g, int r) {
    struct flock fl;
    if (lock_byte(g->fd, F_OFD_GETLK, r, &fl) != 0)
        return 1;
    return fl.l_type != F_UNLCK;
}

/* Whether a counter reads round `round` or later (modulo 2^32: no two ranks are 2^31 rounds apart). */
static int reached(const uint32_t *arrived, uint32_t round) {
    return (int32_t)(__atomic_load_n(arrived, __ATOMIC_ACQUIRE) - round) >= 0;
}

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);   /* not PRIVATE: the word is shared */
}

static int wait_for(struct matinee_shm_group *g, int r, uint32_t round) {
    struct control *c = control(g, r);
    double start = now_s();
    for (unsigned spins = 1; !reached(&c->arrived, round); spins++) {
        _mm_pause();
        if (spins % 64 == 0 && now_s() - start > SPIN_S)
            break;
    }
    const struct timespec check = {0, CHECK_NS};
    while (!reached(&c->arrived, round)) {
        /* Announced before the last look, which the raising rank's store and its look at `sleepers`
         * mirror (both sequentially consistent): either it sees a sleeper and wakes it, or this sees
         * its round and does not sleep; a round raised in between fails the futex's compare. */
        __atomic_add_fetch(&c->sleepers, 1, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&c->arrived, __ATOMIC_SEQ_CST);
        if ((int32_t)(seen - round) < 0)
            futex(&c->arrived, FUTEX_WAIT, seen, &check);
        __atomic_sub_fetch(&c->sleepers, 1, __ATOMIC_SEQ_CST);
        if (reached(&c->arrived, round))
            break;
        if (!alive(g, r) && !reached(&c->arrived, round)) {
            g->lost = r;
            return SHM_RANK_LOST;
        }
        if (now_s() - start > g->timeout_s) {
            g->lost = r;
            return SHM_TIMEOUT;
        }
    }
    return SHM_OK;
}

static void load_f32(float *acc, const char *src, long n, int dtype) {
    if (dtype == SHM_F32) {
        memcpy(acc, src, n * sizeof(float));
    } else if (dtype == SHM_BF16) {
        const uint16_t *h = (const uint16_t *)src;
        for (long j = 0; j < n; j++)
            acc[j] = bf16_to_f32(h[j]);
    } else {
        const uint16_t *h = (const uint16_t *)src;
        long j = 0;
        for (; j + 8 <= n; j += 8)
            _mm256_storeu_ps(acc + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
        for (; j < n; j++)
            acc[j] = _cvtsh_ss(h[j]);
    }
}

static void add_f32(float *acc, const char *src, long n, int dtype) {
    if (dtype == SHM_F32) {
        const float *f = (const float *)src;
        for (long j = 0; j < n; j++)
            acc[j] += f[j];
    } else if (dtype == SHM_BF16) {
        const uint16_t *h = (const uint16_t *)src;
        for (long j = 0; j < n; j++)
            acc[j] += bf16_to_f32(h[j]);
    } else {
        float tmp[BLOCK];
        load_f32(tmp, src, n, dtype);
        for (long j = 0; j < n; j++)
            acc[j] += tmp[j];
    }
}

/* acc rounded to the dtype once, as torch's casts round (to nearest even). */
static void store(char *dst, const float *acc, long n, int dtype) {
    if (dtype == SHM_F32) {
        memcpy(dst, acc, n * sizeof(float));
    } else if (dtype == SHM_BF16) {
        uint16_t *h = (uint16_t *)dst;
        for (long j = 0; j < n; j++)
            h[j] = f32_to_bf16(acc[j]);
    } else {
        uint16_t *h = (uint16_t *)dst;
        long j = 0;
        for (; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i *)(h + j), _mm256_cvtps_ph(_mm256_loadu_ps(acc + j), _MM_FROUND_TO_NEAREST_INT));
        for (; j < n; j++)
            h[j] = _cvtss_sh(acc[j], _MM_FROUND_TO_NEAREST_INT);
    }
}

/* Round s begins: this rank's `bytes` into its slot, its arrival announced, every other rank's awaited. */
static int arrive(struct matinee_shm_group *g, const char *data, long bytes, uint64_t call) {
    uint32_t round = (uint32_t)++g->rounds;
    struct control *mine = control(g, g->rank);
    memcpy(slot(g, g->rounds, g->rank), data, bytes);
    mine->call[round & 1] = call;
    __atomic_store_n(&mine->arrived, round, __ATOMIC_SEQ_CST);   /* releases the slot's bytes */
    if (__atomic_load_n(&mine->sleepers, __ATOMIC_SEQ_CST))
        futex(&mine->arrived, FUTEX_WAKE, INT_MAX, NULL);
    for (int r = 0; r < g->size; r++) {
        if (r == g->rank)
            continue;
        int status = wait_for(g, r, round);
        if (status != SHM_OK)
            return status;
        if (control(g, r)->call[round & 1] != call) {
            g->lost = r;
            return SHM_OUT_OF_STEP;
        }
    }
    return SHM_OK;
}

static int valid(const struct matinee_shm_group *g, long count) {
    return count >= 0 && g->size >= 1 && g->size <= HEADER / LINE && g->slot_bytes > 0 && g->slot_bytes % LINE == 0;
}

/* data[numel] (contiguous, `dtype`) summed over the ranks in place, a slot-sized piece per round; every
 * rank must make the same calls in the same order. SHM_OK, or why not (g->lost: the rank waited for). */
int matinee_shm_all_reduce(struct matinee_shm_group *g, void *data, long numel, int dtype) {
    if (!valid(g, numel) || dtype < SHM_F32 || dtype > SHM_F16)
        return SHM_BAD_ARGUMENT;
    long esize = dtype == SHM_F32 ? 4 : 2;
    long piece = g->slot_bytes / esize;
    uint64_t call = (uint64_t)numel * 4 + (uint64_t)dtype;
    float acc[BLOCK];
    for (long start = 0; start < numel; start += piece) {
        long n = numel - start < piece ? numel - start : piece;
        char *mine = (char *)data + start * esize;
        int status = arrive(g, mine, n * esize, call);
        if (status != SHM_OK)
            return status;
        for (long i = 0; i < n; i += BLOCK) {
            long m = n - i < BLOCK ? n - i : BLOCK;
            load_f32(acc, slot(g, g->rounds, 0) + i * esize, m, dtype);
            for (int r = 1; r < g->size; r++)
                add_f32(acc, slot(g, g->rounds, r) + i * esize, m, dtype);
            store(mine + i * esize, acc, m, dtype);
        }
    }
    return SHM_OK;
}

/* src[bytes] of every rank into out[size][bytes], in rank order (the LM head's vocabulary slices). */
int matinee_shm_all_gather(struct matinee_shm_group *g, const void *src, void *out, long bytes) {
    if (!valid(g, bytes))
        return SHM_BAD_ARGUMENT;
    uint64_t call = (uint64_t)bytes * 4 + 3;   /* never an all-reduce's: its dtypes are 0-2 */
    for (long start = 0; start < bytes; start += g->slot_bytes) {
        long n = bytes - start < g->slot_bytes ? bytes - start : g->slot_bytes;
        int status = arrive(g, (const char *)src + start, n, call);
        if (status != SHM_OK)
            return status;
        for (int r = 0; r < g->size; r++)
            memcpy((char *)out + r * bytes + start, slot(g, g->rounds, r), n);
    }
    return SHM_OK;
}
