/*
 * blas_pick.h - which OpenBLAS kernels ("core type") the CPU backend runs.
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's libopenblas0-pthread) picks its
 * kernels from the CPU's model number when the library loads. A CPU newer
 * than the library (Debian 12's 0.3.21 on some current Xeons) is not in its
 * table and gets the generic SSE3 "Prescott" kernels: 3.9-5.7x slower on an
 * AVX-512 machine, same results. The library reads OPENBLAS_CORETYPE only
 * while it loads, so the fix has to happen before main() runs any BLAS: the
 * worker sets OPENBLAS_CORETYPE from the CPU's features and re-executes
 * itself once (blas_pick_reexec). An OPENBLAS_CORETYPE the user set is never
 * overridden; a core of the AVX2 class or better (Haswell, Zen, SkylakeX,
 * Cooperlake, ...) is left as the library chose it.
 *
 * Ownership: every function here returns static strings or writes into the
 * caller's buffer; nothing is allocated.
 */
#ifndef MOE_WKR_BLAS_PICK_H
#define MOE_WKR_BLAS_PICK_H

#include <stddef.h>

/* Environment variable the re-executed process finds: the core name the
 * library chose before the re-exec (so the start line can say it, and so
 * the worker never re-executes twice). */
#define BLAS_PICK_MARKER "MOE_BLAS_REEXEC"

/* blas_pick_core_for: the OpenBLAS core type for a CPU with these features:
 * avx512 (F, BW, VL, DQ and CD) -> "SkylakeX", avx2_fma (AVX2 and FMA) ->
 * "Haswell", avx -> "Sandybridge", none -> NULL (the library's choice
 * stands). Pure; static strings. */
const char *blas_pick_core_for(int avx512, int avx2_fma, int avx);

/* blas_pick_core_rank: the instruction class of an OpenBLAS core name
 * (case-insensitive): 3 AVX-512 (SkylakeX, Cooperlake, SapphireRapids), 2
 * AVX2 (Haswell, Zen, Excavator), 1 AVX (Sandybridge, Bulldozer, Piledriver,
 * Steamroller), 0 SSE-only or "Unknown" (Prescott, Core2, Nehalem, ...), -1
 * for a name not in this list (a newer or non-x86 core: left alone). Pure. */
int blas_pick_core_rank(const char *core);

/* blas_pick_decide: the core to re-execute with, or NULL to keep the
 * library's. NULL when env_core (OPENBLAS_CORETYPE) is set (the user's
 * choice, or ours after the re-exec), when marker is set (never twice), when
 * config lacks DYNAMIC_ARCH (the library would ignore the variable), when
 * lib_core's rank is -1 or >= 2, or when the features allow no better core
 * than lib_core. Pure. */
const char *blas_pick_decide(const char *env_core, const char *marker, const char *config,
                             const char *lib_core, int avx512, int avx2_fma, int avx);

/* blas_pick_reexec: call first thing in main(), before any BLAS call. If
 * blas_pick_decide (on this process's environment, library and CPU) names a
 * core, re-executes with it (blas_pick_exec_core): does not return on
 * success. Returns 0 when nothing was to be done, -1 when the exec failed
 * (reported on stderr; the process goes on with the library's kernels, and
 * blas_pick_describe says so). */
int blas_pick_reexec(int argc, char **argv);

/* blas_pick_exec_core: sets OPENBLAS_CORETYPE to core and BLAS_PICK_MARKER
 * to lib_core, then execv("/proc/self/exe", argv) (argv NULL-terminated, as
 * main's). Returns only on failure: -1, reported on stderr, the two
 * variables removed again. */
int blas_pick_exec_core(const char *core, const char *lib_core, char **argv);

/* blas_pick_format: the start line's BLAS description from its parts:
 *   "openblas 0.3.21 core Cooperlake (library's choice), 2 threads"
 *   "openblas 0.3.21 core SkylakeX (chosen from cpu features; library said
 *    Prescott), 2 threads"
 *   "openblas 0.3.21 core Haswell (OPENBLAS_CORETYPE=Haswell from the
 *    environment), 2 threads"
 * config/corename as openblas_get_config/openblas_get_corename return them,
 * env_core and marker as the environment holds them (NULL if unset),
 * failed_core the core a failed re-exec asked for (NULL if none),
 * threads <= 0 to leave the count out. Writes at most len bytes (always
 * terminated when len > 0); returns buf. Pure. */
const char *blas_pick_format(char *buf, size_t len, const char *config, const char *corename,
                             const char *env_core, const char *marker, const char *failed_core,
                             int threads);

/* blas_pick_describe: blas_pick_format for this process (its library, its
 * environment, its OpenBLAS thread count). Call after the thread count is
 * set. Returns buf. */
const char *blas_pick_describe(char *buf, size_t len);

#endif
