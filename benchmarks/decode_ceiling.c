// The compute ceiling of an M=1 int4 GEMV inner loop on one core, weights in L1 (no memory stalls): how many
// int4 weights per second each way of multiplying them with the activations can take.  Driven (compiled with
// -march=native, run, compared with one core's DRAM read rate) by benchmarks/decode_ceiling.py.
//
// Every variant reads bitkern's tile16 int4 layout: a 64-byte word holds 16 columns x 8 k, nibble pairs at
// (bit 4j, bit 16+4j) of each 32-bit lane for k pair j; TILES words (one per 16-column tile) per k step, as the
// tuned direct kernel (n_tiles=8) does.
//   bf16_dot:  bitkern's direct AVX512-BF16 kernel: per k pair a shift, a vpternlogd (nibble | 0x4300: the bf16
//              value 128 + q) and a vdpbf16ps against the broadcast bf16 activation pair.
//   int8_vnni: llama.cpp's approach (activations quantized to int8 per 32 k): per word two masks and two
//              vpdpbusd (u8 nibbles x s8 activations, 4 k per lane), and per 32 k one int32->float conversion
//              and one FMA with the block's activation scale.
//   int8x2_vnni: activations as two int8 parts per 32-k block (x ~ (hi*2^8 + lo) * scale, ~15 bits relative
//              to the block's largest element): twice vnni's vpdpbusd, the same masks and conversions.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TILES 8
#define WORDS 64  // k steps of 8 per pass: 8 tiles x 64 words x 64 bytes = 32 KiB, in L1
#define BLOCK_WORDS 4  // 32 k per activation block

static uint32_t w[TILES][WORDS][16] __attribute__((aligned(64)));
static uint32_t x_bf16[WORDS * 4] __attribute__((aligned(64)));
static uint32_t x_int8[2][WORDS * 2] __attribute__((aligned(64)));
static float x_scale[WORDS / BLOCK_WORDS];
static volatile float sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) static void bf16_dot(long passes) {
    __m512 acc[TILES];
    for (int t = 0; t < TILES; t++) acc[t] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi32(0x000F000F), magic = _mm512_set1_epi32(0x43004300);
    for (long p = 0; p < passes; p++)
        for (int i = 0; i < WORDS; i++) {
            __m512i x[4];
            for (int j = 0; j < 4; j++) x[j] = _mm512_set1_epi32(x_bf16[4 * i + j]);
            for (int t = 0; t < TILES; t++) {
                __m512i v = _mm512_load_si512(w[t][i]);
                for (int j = 0; j < 4; j++) {
                    __m512i pair = _mm512_ternarylogic_epi32(j ? _mm512_srli_epi32(v, 4 * j) : v, mask, magic, 0xF8);
                    acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)pair, (__m512bh)x[j]);
                }
            }
        }
    __m512 s = acc[0];
    for (int t = 1; t < TILES; t++) s = _mm512_add_ps(s, acc[t]);
    sink = _mm512_reduce_add_ps(s);
}

__attribute__((noinline)) static void int8_vnni(long passes, int parts) {
    __m512 acc[TILES];
    for (int t = 0; t < TILES; t++) acc[t] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (long p = 0; p < passes; p++)
        for (int b = 0; b < WORDS / BLOCK_WORDS; b++) {
            __m512i sum[2][TILES];
            for (int q = 0; q < parts; q++)
                for (int t = 0; t < TILES; t++) sum[q][t] = _mm512_setzero_si512();
            for (int i = b * BLOCK_WORDS; i < (b + 1) * BLOCK_WORDS; i++)
                for (int t = 0; t < TILES; t++) {
                    __m512i v = _mm512_load_si512(w[t][i]);
                    __m512i low = _mm512_and_si512(v, mask), high = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
                    for (int q = 0; q < parts; q++) {
                        sum[q][t] = _mm512_dpbusd_epi32(sum[q][t], low, _mm512_set1_epi32(x_int8[q][2 * i]));
                        sum[q][t] = _mm512_dpbusd_epi32(sum[q][t], high, _mm512_set1_epi32(x_int8[q][2 * i + 1]));
                    }
                }
            for (int t = 0; t < TILES; t++) {
                __m512i total = parts == 2 ? _mm512_add_epi32(_mm512_slli_epi32(sum[0][t], 8), sum[1][t]) : sum[0][t];
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(x_scale[b]), acc[t]);
            }
        }
    __m512 s = acc[0];
    for (int t = 1; t < TILES; t++) s = _mm512_add_ps(s, acc[t]);
    sink = _mm512_reduce_add_ps(s);
}

int main(int argc, char **argv) {
    long passes = argc > 1 ? atol(argv[1]) : 20000;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    for (int t = 0; t < TILES; t++)
        for (int i = 0; i < WORDS; i++)
            for (int l = 0; l < 16; l++) w[t][i][l] = (uint32_t)((t * 7919u + i * 31u + l) * 2654435761u);
    for (int i = 0; i < WORDS * 4; i++) x_bf16[i] = 0x3f803f80u;
    for (int i = 0; i < WORDS * 2; i++) x_int8[0][i] = x_int8[1][i] = 0x01020304u;
    for (int b = 0; b < WORDS / BLOCK_WORDS; b++) x_scale[b] = 1.0f / 127;
    double weights = (double)passes * WORDS * TILES * 128;
    for (int r = 0; r < rounds; r++) {  // interleaved: a round times each variant once
        double t0 = now();
        bf16_dot(passes);
        double t1 = now();
        int8_vnni(passes, 1);
        double t2 = now();
        int8_vnni(passes, 2);
        double t3 = now();
        printf("{\"bf16_dot\": %.4g, \"int8_vnni\": %.4g, \"int8x2_vnni\": %.4g}\n", weights / (t1 - t0),
               weights / (t2 - t1), weights / (t3 - t2));
    }
    return 0;
}
