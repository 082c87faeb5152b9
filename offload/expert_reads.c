/* Expert reads that a GPU asks for: a service thread polls a mailbox in page-locked host memory
 * that GPU kernels write (offload/expert_reads.py), preads the requested experts' bytes from
 * the GGUF into page-locked staging buffers, and answers in the same mailbox. A decode step
 * whose experts all sit in device slots never involves the host; a miss costs one round trip.
 *
 * Mailbox (int64 words): [0] request number (written by the GPU after the rest), [1] the last
 * request answered (written here after the reads), [2] layer, [3] experts, [4] error (0: none;
 * an errno, or -1 for a request that makes no sense), [8 ..] expert ids. Reads of one request
 * run on up to `threads` OpenMP threads in chunks of about equal size.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { BOX_REQ = 0, BOX_DONE = 1, BOX_LAYER = 2, BOX_N = 3, BOX_ERR = 4, BOX_JOBS = 8 };
enum { PARTS = 3 };                    /* gate, up, down: each experts back to back */
static const int64_t SPIN_NS = 20000000; /* poll without sleeping this long after a request */
static const long NAP_NS = 50000;      /* then sleep this long between polls ... */
static const int64_t DOZE_NS = 1000000000; /* ... and after this long without one, */
static const long LONG_NAP_NS = 2000000;   /* this long (an idle model: few wake-ups) */
static const int64_t MIN_CHUNK = 65536; /* no pread is cut smaller */

typedef struct {
    int fd;
    int64_t base, per; /* expert e's bytes: [base + e * per, + per) */
} Part;

typedef struct {
    int64_t *box;
    uint8_t *staging;
    int64_t stride, cap, chunk;
    int n_layers, threads;
    Part *parts;       /* [n_layers * PARTS]; fd < 0: the layer is not read here */
    int64_t *n_expert; /* [n_layers] */
    volatile int stop;
    int running;
    pthread_t thread;
    int64_t stats[4]; /* requests answered, experts read, bytes read, nanoseconds reading */
} Reader;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Every segment i: `len[i]` bytes at `off[i]` of `fd[i]` into `dst[i]`, cut into chunks of at
 * most `chunk` bytes read on up to `threads` threads. 0, or the first error's errno (EIO for a
 * file that ends early). */
int read_segments(const int *fd, const int64_t *off, const int64_t *len, uint8_t *const *dst,
                  int64_t n, int threads, int64_t chunk) {
    int64_t pieces = 0;
    if (chunk < 4096) chunk = 4096;
    for (int64_t i = 0; i < n; i++) pieces += (len[i] + chunk - 1) / chunk;
    int err = 0;
    int nt = threads < 1 ? 1 : threads;
    if (nt > pieces) nt = (int)(pieces < 1 ? 1 : pieces);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t p = 0; p < pieces; p++) {
        int64_t i = 0, q = p; /* piece p is piece q of segment i */
        while (q >= (len[i] + chunk - 1) / chunk) q -= (len[i] + chunk - 1) / chunk, i++;
        int64_t start = q * chunk, end = start + chunk < len[i] ? start + chunk : len[i];
        while (start < end) {
            ssize_t got = pread(fd[i], dst[i] + start, (size_t)(end - start), off[i] + start);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                int e = got < 0 ? errno : EIO;
                __atomic_store_n(&err, e, __ATOMIC_RELAXED);
                break;
            }
            start += got;
        }
    }
    return err;
}

void *reader_new(int64_t *box, uint8_t *staging, int64_t stride, int64_t cap,
                 const int64_t *table, int n_layers, int threads, int64_t chunk) {
    /* table: per layer, n_expert then PARTS x (fd, base, per) */
    Reader *r = calloc(1, sizeof(Reader));
    if (!r) return NULL;
    r->parts = calloc((size_t)n_layers * PARTS, sizeof(Part));
    r->n_expert = calloc((size_t)n_layers, sizeof(int64_t));
    if (!r->parts || !r->n_expert) {
        free(r->parts), free(r->n_expert), free(r);
        return NULL;
    }
    r->box = box, r->staging = staging, r->stride = stride, r->cap = cap, r->chunk = chunk;
    r->n_layers = n_layers, r->threads = threads;
    for (int l = 0; l < n_layers; l++) {
        const int64_t *row = table + (int64_t)l * (1 + 3 * PARTS);
        r->n_expert[l] = row[0];
        for (int p = 0; p < PARTS; p++) {
            Part *part = &r->parts[l * PARTS + p];
            part->fd = (int)row[1 + 3 * p], part->base = row[2 + 3 * p], part->per = row[3 + 3 * p];
        }
    }
    return r;
}

/* The experts of one layer into staging buffers 0.. in order: 0 or an error (see the top). */
int reader_read(void *h, int64_t layer, const int64_t *experts, int64_t n) {
    Reader *r = h;
    if (layer < 0 || layer >= r->n_layers || n < 0 || n > r->cap) return -1;
    Part *parts = &r->parts[layer * PARTS];
    if (parts[0].fd < 0) return -1;
    int fd[64 * PARTS];
    int64_t off[64 * PARTS], len[64 * PARTS];
    uint8_t *dst[64 * PARTS];
    int64_t t0 = now_ns(), bytes = 0;
    for (int64_t done = 0; done < n; done += 64) { /* at most 64 experts per batch of reads */
        int64_t m = n - done < 64 ? n - done : 64, k = 0;
        for (int64_t i = 0; i < m; i++) {
            int64_t e = experts[done + i], pos = 0;
            if (e < 0 || e >= r->n_expert[layer]) return -1;
            for (int p = 0; p < PARTS; p++, k++) {
                fd[k] = parts[p].fd, off[k] = parts[p].base + e * parts[p].per;
                len[k] = parts[p].per, dst[k] = r->staging + (done + i) * r->stride + pos;
                pos += parts[p].per, bytes += parts[p].per;
            }
        }
        int64_t chunk = r->chunk;
        int64_t total = 0;
        for (int64_t i = 0; i < k; i++) total += len[i];
        int64_t share = total / (r->threads > 0 ? r->threads : 1);
        if (share < chunk) chunk = share < MIN_CHUNK ? MIN_CHUNK : share; /* every thread a share */
        int err = read_segments(fd, off, len, dst, k, r->threads, chunk);
        if (err) return err;
    }
    __atomic_add_fetch(&r->stats[1], n, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->stats[2], bytes, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->stats[3], now_ns() - t0, __ATOMIC_RELAXED);
    return 0;
}

static void *serve(void *h) {
    Reader *r = h;
    int64_t *box = r->box;
    int64_t last = __atomic_load_n(&box[BOX_DONE], __ATOMIC_ACQUIRE);
    int64_t active = now_ns();
    unsigned polls = 0;
    int idle = 0; /* no request for SPIN_NS: nap between polls */
    while (!r->stop) {
        int64_t req = __atomic_load_n(&box[BOX_REQ], __ATOMIC_ACQUIRE);
        if (req != last) {
            int64_t layer = __atomic_load_n(&box[BOX_LAYER], __ATOMIC_RELAXED);
            int64_t n = __atomic_load_n(&box[BOX_N], __ATOMIC_RELAXED);
            int err = n > r->cap || n < 0 ? -1 : reader_read(r, layer, box + BOX_JOBS, n);
            if (err) __atomic_store_n(&box[BOX_ERR], err, __ATOMIC_RELAXED);
            last = req;
            __atomic_add_fetch(&r->stats[0], 1, __ATOMIC_RELAXED);
            __atomic_store_n(&box[BOX_DONE], req, __ATOMIC_RELEASE);
            active = now_ns(), idle = 0;
            continue;
        }
        if (!idle && (++polls % 1024 || now_ns() - active < SPIN_NS)) {
            relax();
            continue;
        }
        idle = 1;
        struct timespec nap = {0, now_ns() - active < DOZE_NS ? NAP_NS : LONG_NAP_NS};
        nanosleep(&nap, NULL);
    }
    return NULL;
}

int reader_start(void *h) {
    Reader *r = h;
    if (r->running) return 0;
    r->stop = 0;
    int err = pthread_create(&r->thread, NULL, serve, r);
    r->running = err == 0;
    return err;
}

void reader_stop(void *h) {
    Reader *r = h;
    if (!r->running) return;
    r->stop = 1;
    pthread_join(r->thread, NULL);
    r->running = 0;
}

void reader_stats(void *h, int64_t *out) {
    Reader *r = h;
    for (int i = 0; i < 4; i++) out[i] = __atomic_load_n(&r->stats[i], __ATOMIC_RELAXED);
}

void reader_free(void *h) {
    Reader *r = h;
    if (!r) return;
    reader_stop(r);
    free(r->parts), free(r->n_expert), free(r);
}
