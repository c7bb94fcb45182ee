/* One loop body, compiled for each vector width the kernels use, and the widest this CPU runs
 * picked at run time (specdec/engine/kernels): `VECTOR_PATHS(body, kernel_type, (params), (args))`
 * defines body_avx512, body_avx2 and body_baseline, each calling the always-inline `body`, and
 * `body_pick()`. The build's -ffp-contract=off keeps the float operations the same in all three,
 * so every path gives the same bits; the wider ones only do them more at a time. */
#ifndef SPECDEC_VECTOR_PATHS_H
#define SPECDEC_VECTOR_PATHS_H

#if defined(__x86_64__)
#define VECTOR_PATHS(body, kernel_type, params, args)                                                                  \
    __attribute__((target("avx512f"))) static void body##_avx512 params { body args; }                                 \
    __attribute__((target("avx2"))) static void body##_avx2 params { body args; }                                      \
    static void body##_baseline params { body args; }                                                                 \
    static kernel_type body##_pick(void) {                                                                             \
        __builtin_cpu_init();                                                                                          \
        if (__builtin_cpu_supports("avx512f")) return body##_avx512;                                                   \
        if (__builtin_cpu_supports("avx2")) return body##_avx2;                                                        \
        return body##_baseline;                                                                                        \
    }
#else
#define VECTOR_PATHS(body, kernel_type, params, args)                                                                  \
    static void body##_baseline params { body args; }                                                                  \
    static kernel_type body##_pick(void) { return body##_baseline; }
#endif

#endif
