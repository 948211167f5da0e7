/* AMX's tiles for the sources that multiply on them (quant_amx.c, paged_attention_cpu.c): the kernel's
 * permission and one tile layout for all eight, 16 rows of 64 bytes each (a bf16 A or B tile of 16 x 32
 * values, a float32 C tile of 16 x 16). Defined only where the build has AMX's bf16 tiles (AMX_BF16).
 *
 * Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it
 * the callers keep their other kernels. The configuration is a thread's own: each thread that multiplies
 * loads it first, and releases the tiles when it is done.
 */
#ifndef MATINEE_AMX_H
#define MATINEE_AMX_H

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define AMX_BF16 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_permitted(void) {
    static int state = 0;   /* 0 unknown, 1 granted, -1 refused; a request twice is harmless */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

static void configure_tiles(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A few-row product's accumulators -> out: tile 2i + j (x's tile i of mt, by the pair's group j) to rows 16i..16i + 15,
 * columns 16j..16j + 15 of out, 32 four-byte sums a row (float32 or int32). */
static inline __attribute__((always_inline)) void store_accumulators(int mt, void *out) {
    char *o = out;
    _tile_stored(0, o, 128);
    _tile_stored(1, o + 64, 128);
    if (mt > 1) {
        _tile_stored(2, o + 2048, 128);
        _tile_stored(3, o + 2048 + 64, 128);
    }
    if (mt > 2) {
        _tile_stored(4, o + 4096, 128);
        _tile_stored(5, o + 4096 + 64, 128);
    }
}
#endif
#endif
