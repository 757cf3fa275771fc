// What every AMX kernel here shares: the target string, the tile configuration's layout, and leaving
// another library's tiles as they were found.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#define PSQ_AMX_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16"

namespace {

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads a configuration. GCC's _tile_loadconfig tells the compiler it reads only a pointer's worth of the
// struct, so without the barrier the stores of rows and column widths were dropped as dead (the tiles
// then faulted); the empty asm makes every byte of `c` live.
__attribute__((target(PSQ_AMX_TARGET))) inline void load_tiles(const TileConfig& c) {
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// Another library's tiles (oneDNN, torch) are left as they were found: each thread saves the
// configuration before the kernel and restores it (or releases the tiles) after.
__attribute__((target(PSQ_AMX_TARGET), noinline)) void tiles_save(TileConfig* c) { _tile_storeconfig(c); }
__attribute__((target(PSQ_AMX_TARGET), noinline)) void tiles_restore(const TileConfig* c) {
    if (c->palette) load_tiles(*c);
    else _tile_release();
}

}  // namespace
