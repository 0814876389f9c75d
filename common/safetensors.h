/*
 * safetensors.h - reading and writing safetensors files (the Hugging Face
 * format: u64 little-endian header length N, N bytes of JSON header
 * {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str:
 * str}}, then the data). moe's own checkpoints hold F32 tensors; a Hugging
 * Face model directory may hold BF16, F16 and F32 (and other dtypes, read
 * only with ST_OPEN_ANY_DTYPE), and st_writer_add_typed writes any of them.
 *
 * Writes are durable: the file goes to "<path>.tmp", is fsynced, renamed
 * over <path>, and the directory is fsynced. Each file written here carries
 * "moe.checksum" (FNV-1a 64 of the data section) in its metadata, and the
 * reader verifies it when present, so a corrupt or truncated file is
 * refused instead of loaded.
 */
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/moe.h"

#define ST_MAX_DIMS 4

/* st_dtype: the element types this code converts (ST_OTHER: any other
 * safetensors dtype, kept by name and size only) */
typedef enum st_dtype { ST_F32 = 0, ST_BF16, ST_F16, ST_OTHER } st_dtype;

typedef struct st_tensor {
    char *name; /* owned by the writer / reader */
    st_dtype dtype;
    const char *dtype_name; /* "F32", "BF16", ... (static, or into the reader's header) */
    size_t esize;           /* bytes per element */
    int ndim;               /* 0 (a scalar) only with ST_OPEN_ANY_DTYPE */
    int64_t shape[ST_MAX_DIMS];
    const void *data; /* writer: caller memory (not copied); reader: into the file map,
                       * possibly unaligned: copy it out (memcpy), never cast */
    size_t nbytes;
} st_tensor;

/* ---- writer ---- */
typedef struct st_writer st_writer;
moe_err st_writer_new(st_writer **out);
/* st_writer_add records a tensor; data must stay valid until st_writer_save. */
moe_err st_writer_add(st_writer *w, const char *name, int ndim, const int64_t *shape,
                      const float *data);
/* st_writer_add_typed records a tensor of any dtype (its safetensors name,
 * e.g. "BF16", and element size); data (numel * esize bytes) must stay valid
 * until st_writer_save. ndim 0..ST_MAX_DIMS. */
moe_err st_writer_add_typed(st_writer *w, const char *name, const char *dtype_name, size_t esize,
                            int ndim, const int64_t *shape, const void *data);
moe_err st_writer_meta(st_writer *w, const char *key, const char *value);
/* st_writer_save writes the file durably (see above); err gets the reason. */
moe_err st_writer_save(st_writer *w, const char *path, char *err, size_t errlen);
void st_writer_free(st_writer *w);

/* ---- reader ---- */
typedef struct st_file st_file;
/* st_open maps and validates a whole file: header size and JSON, every
 * tensor's dtype F32, shape and offsets within the data, and the checksum.
 * Errors: MOE_EIO (cannot open), MOE_EINVAL (corrupt/truncated) with err. */
moe_err st_open(const char *path, st_file **out, char *err, size_t errlen);
/* st_open_flags: st_open with ST_OPEN_* flags. ST_OPEN_ANY_DTYPE accepts
 * every safetensors dtype (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3
 * F8_E5M2 ...) and scalars; ST_OPEN_NO_CHECKSUM skips the moe.checksum
 * check (which reads every byte): only the header is read then, the data
 * stays mapped and is paged in as it is touched. Errors name the file and
 * the tensor. */
#define ST_OPEN_ANY_DTYPE   1u
#define ST_OPEN_NO_CHECKSUM 2u
moe_err st_open_flags(const char *path, unsigned flags, st_file **out, char *err, size_t errlen);
/* st_prefetch asks the kernel to read t's bytes ahead (madvise WILLNEED on
 * the mapping): a loader that prefetches every tensor it will read keeps
 * the disk busy while it converts the first ones. A hint only. */
void st_prefetch(const st_tensor *t);
/* st_to_f32 converts a tensor of dtype F32, BF16 or F16 to n floats (the
 * tensor's element count must be n); MOE_EINVAL for any other dtype. */
moe_err st_to_f32(const st_tensor *t, float *out, size_t n);
/* st_to_f32_range converts elements [i0, i1) of t into out[i0, i1) (the
 * same bits as st_to_f32: a loader splits a tensor over threads).
 * MOE_EINVAL for an unknown dtype or a range past the tensor. */
moe_err st_to_f32_range(const st_tensor *t, float *out, size_t i0, size_t i1);
/* st_f16_to_f32 converts one IEEE half (bits) to float, exactly. */
float st_f16_to_f32(uint16_t h);
void st_close(st_file *f);
/* st_find returns the tensor `name` or NULL. Valid until st_close. */
const st_tensor *st_find(const st_file *f, const char *name);
/* st_meta returns the metadata value for key, or NULL. */
const char *st_meta(const st_file *f, const char *key);
int st_count(const st_file *f);
const st_tensor *st_at(const st_file *f, int i);

/* fnv1a64 of n bytes (chained from h; start with ST_FNV_INIT). */
#define ST_FNV_INIT 0xcbf29ce484222325ull
uint64_t st_fnv1a64(uint64_t h, const void *data, size_t n);

/* st_mkdir_p creates dir and its parents (existing ones are fine). */
moe_err st_mkdir_p(const char *dir);

/* st_write_durable writes len bytes to path via tmp + fsync + rename +
 * directory fsync. */
moe_err st_write_durable(const char *path, const void *data, size_t len, char *err, size_t errlen);

#endif
