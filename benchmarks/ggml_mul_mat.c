// One ggml MUL_MAT timed on llama.cpp's CPU backend: y[M, N] = x[M, K] · W[N, K]ᵀ, W of a ggml type.
//
// test-backend-ops times MUL_MAT only at N=4096, K=14336 and M in {1..5, 8, 512}, with the weight in a plain buffer;
// this runs any shape, with the weight in the CPU backend's repacking buffers (as llama-bench and llama-cli load
// models: q4_0 into its 8x8 interleaved layout on AVX2) or in a plain one, and rotates weight copies so every call
// reads them from DRAM as a model's layers do.  Built and run by benchmarks/cpu_levels.py --llama-cpp.
//
// Usage: ggml_mul_mat TYPE N K M THREADS ROUNDS REPACK   (prints the median milliseconds of ROUNDS calls)
//        ROUNDS 0: serve calls one at a time: prints "ready" after the warm-up, then for each line read from stdin
//        runs one call and prints its milliseconds, so that a benchmark can take turns with it call by call.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#define ROTATED_BYTES (512ll << 20)  // weight copies in rotation: many times any last-level cache

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// The first of the CPU device's extra buffer types (the repacking one), or NULL when it has none.
static ggml_backend_buffer_type_t repacking_buffer(ggml_backend_t backend) {
    ggml_backend_dev_t device = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(device);
    ggml_backend_dev_get_extra_bufts_t extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t * types = extra ? extra(device) : NULL;
    return types && types[0] ? types[0] : NULL;
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s TYPE N K M THREADS ROUNDS REPACK\n", argv[0]);
        return 2;
    }
    enum ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * name = ggml_type_name((enum ggml_type) t);
        if (name && strcmp(name, argv[1]) == 0) type = (enum ggml_type) t;
    }
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "TYPE=%s: not a ggml type name (e.g. q4_0, q8_0, bf16)\n", argv[1]);
        return 2;
    }
    const int64_t n = atoll(argv[2]), k = atoll(argv[3]), m = atoll(argv[4]);
    const int threads = atoi(argv[5]), rounds = atoi(argv[6]), repack = atoi(argv[7]);

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_type_t weight_type = repack ? repacking_buffer(backend) : ggml_backend_get_default_buffer_type(backend);
    if (!weight_type) {
        fprintf(stderr, "this build's CPU backend has no repacking buffer\n");
        return 2;
    }

    const size_t weight_bytes = ggml_row_size(type, k) * n;
    int copies = (int) (ROTATED_BYTES / (long long) weight_bytes) + 1;
    struct ggml_init_params params = {ggml_tensor_overhead() * (3 * copies + 2) + ggml_graph_overhead() * copies, NULL, true};
    struct ggml_context * weights = ggml_init(params), * compute = ggml_init(params);
    struct ggml_tensor ** w = calloc(copies, sizeof *w);
    for (int c = 0; c < copies; c++) w[c] = ggml_new_tensor_2d(weights, type, k, n);
    struct ggml_tensor * x = ggml_new_tensor_2d(compute, GGML_TYPE_F32, k, m);
    struct ggml_cgraph ** graphs = calloc(copies, sizeof *graphs);
    for (int c = 0; c < copies; c++) {
        graphs[c] = ggml_new_graph(compute);
        ggml_build_forward_expand(graphs[c], ggml_mul_mat(compute, w[c], x));
    }
    if (!ggml_backend_alloc_ctx_tensors_from_buft(weights, weight_type) || !ggml_backend_alloc_ctx_tensors(compute, backend)) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }

    float * values = malloc(sizeof(float) * n * k);
    srand(0);
    for (int64_t i = 0; i < n * k; i++) values[i] = (rand() / (float) RAND_MAX - 0.5f) * 0.04f;
    void * codes = malloc(weight_bytes);
    ggml_quantize_chunk(type, values, codes, 0, n, k, NULL);
    for (int c = 0; c < copies; c++) ggml_backend_tensor_set(w[c], codes, 0, weight_bytes);
    float * activations = malloc(sizeof(float) * m * k);
    for (int64_t i = 0; i < m * k; i++) activations[i] = rand() / (float) RAND_MAX - 0.5f;
    ggml_backend_tensor_set(x, activations, 0, sizeof(float) * m * k);

    for (int c = 0; c < copies; c++) ggml_backend_graph_compute(backend, graphs[c]);  // warm-up
    if (rounds == 0) {
        printf("ready\n");
        fflush(stdout);
        char line[64];
        for (int r = 0; fgets(line, sizeof line, stdin); r++) {
            double start = now();
            ggml_backend_graph_compute(backend, graphs[r % copies]);
            printf("%.4f\n", (now() - start) * 1e3);
            fflush(stdout);
        }
        return 0;
    }
    double * seconds = calloc(rounds, sizeof *seconds);
    for (int r = 0; r < rounds; r++) {
        double start = now();
        ggml_backend_graph_compute(backend, graphs[r % copies]);
        seconds[r] = now() - start;
    }
    qsort(seconds, rounds, sizeof *seconds, by_value);
    printf("%.4f\n", seconds[rounds / 2] * 1e3);
    return 0;
}
