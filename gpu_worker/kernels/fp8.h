// Every fp8 byte's value, for the kernels that read fp8 entries: e4m3fn (table.v[0], no infinities, the
// all-ones pattern is NaN) and e5m2 (table.v[1], IEEE-like), subnormals included.
#pragma once
#include <math.h>

struct Fp8Table {
    float v[2][256];

    static float value(int byte, int exp_bits, int man_bits, int bias, bool has_inf) {
        const int sign = byte >> 7, e = (byte >> man_bits) & ((1 << exp_bits) - 1), m = byte & ((1 << man_bits) - 1);
        float x;
        if (e == (1 << exp_bits) - 1 && (has_inf || m == (1 << man_bits) - 1))
            x = has_inf && m == 0 ? INFINITY : NAN;
        else if (e == 0)
            x = ldexpf((float)m, 1 - bias - man_bits);
        else
            x = ldexpf((float)(m + (1 << man_bits)), e - bias - man_bits);
        return sign ? -x : x;
    }

    Fp8Table() {
        for (int b = 0; b < 256; ++b) {
            v[0][b] = value(b, 4, 3, 7, false);
            v[1][b] = value(b, 5, 2, 15, true);
        }
    }
};

inline const Fp8Table fp8_table{};
