/* One-row MXFP4 dots, ours (kernels/cpu/block_dots.h's dot_mxfp4_rows) against llama.cpp's
 * ggml_vec_dot_mxfp4_q8_0 (libggml-cpu, the dot it takes where weights are not repacked), over a
 * 2880 x 2880 matrix (gpt-oss-20b's expert shape) of random codes, rows split over OpenMP threads,
 * MATRICES matrices rotated (40: ~176 MB, beyond the caches; 1: the matrix stays in cache). Not a
 * test; its output goes into tests/perf/results/cpu-moe.md with the command and machine.
 *
 *   gcc -O3 -march=native -fopenmp -Ikernels/cpu tests/perf/dot_mxfp4_vs_ggml.c -o /tmp/dotmx \
 *       -L$LIB -lggml-cpu -lggml-base -Wl,-rpath,$LIB        (LIB: llama.cpp's build/bin)
 *   OMP_NUM_THREADS=2 /tmp/dotmx MATRICES
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "block_dots.h"

void ggml_vec_dot_mxfp4_q8_0(int n, float *s, size_t bs, const void *vx, size_t bx, const void *vy,
                             size_t by, int nrc);
void quantize_row_q8_0(const float *x, void *y, int64_t k);
void ggml_cpu_init(void); /* fills the fp16 table its dots read */

enum { N = 2880, NB = N / 32, ROW = NB * 17, ITERS = 200 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    ggml_cpu_init();
    const int nm = argc > 1 ? atoi(argv[1]) : 40;
    const size_t mb = (size_t)ROW * N;
    uint8_t *w = malloc(mb * nm);
    for (size_t i = 0; i < mb * nm; i++) w[i] = (uint8_t)rand();
    for (size_t i = 0; i < mb * nm; i += 17) w[i] = 120 + rand() % 10; /* E8M0 scales near 1 */
    float x[N], out[N];
    for (int i = 0; i < N; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    uint8_t y[NB * 34]; /* llama.cpp's Q8_0 activations; ours the same codes and scales split */
    quantize_row_q8_0(x, y, N);
    int8_t q[N];
    float d[NB];
    int16_t sums[2 * NB] = {0};
    for (int b = 0; b < NB; b++) {
        d[b] = h2f(rd16(y + 34 * b));
        memcpy(q + 32 * b, y + 34 * b + 2, 32);
    }
    const int8_t *q8[1] = {q};
    const float *d8[1] = {d};
    const int16_t *bs[1] = {sums};
    for (int round = 0; round < 3; round++)
        for (int who = 0; who < 2; who++) {
            const double t0 = now();
            for (int k = 0; k < ITERS; k++) {
                const uint8_t *m = w + (size_t)(k % nm) * mb;
#pragma omp parallel for schedule(static)
                for (int r = 0; r < N; r++)
                    if (who == 0)
                        ggml_vec_dot_mxfp4_q8_0(N, out + r, 0, m + (size_t)r * ROW, 0, y, 0, 1);
                    else
                        dot_mxfp4_rows(m + (size_t)r * ROW, q8, d8, bs, NB, 1, out + r);
            }
            const double dt = (now() - t0) / ITERS;
            printf("%-9s %d matrices, %d threads: %6.1f us a matrix, %5.1f GB/s (out[0] %.4f)\n",
                   who ? "ours" : "llama.cpp", nm, omp_get_max_threads(), dt * 1e6, mb / dt / 1e9,
                   out[0]);
        }
    return 0;
}
