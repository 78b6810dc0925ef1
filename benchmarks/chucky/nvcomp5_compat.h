// chucky is written against nvCOMP 5, whose batched compressors' temp-size query is
// ...GetTempSizeAsync(num_chunks, max_chunk_bytes, opts, &temp_bytes, max_total_bytes).
// nvCOMP 6 (the nvidia-libnvcomp-cu13 wheel our GPU backend uses) renamed it ...GetTempSize and
// added a stream argument; the query only sizes a buffer, so the default stream serves.
// Force-included (-include) into chucky's gpu/compress.cu by CMakeLists.txt: its source stays
// as fetched.
#pragma once
#include <nvcomp/lz4.h>
#include <nvcomp/version.h>
#include <nvcomp/zstd.h>

#if NVCOMP_VER_MAJOR >= 6
#define nvcompBatchedZstdCompressGetTempSizeAsync(n, chunk, opts, temp, total)                   \
  nvcompBatchedZstdCompressGetTempSize((n), (chunk), (opts), (temp), (total), 0)
#define nvcompBatchedLZ4CompressGetTempSizeAsync(n, chunk, opts, temp, total)                    \
  nvcompBatchedLZ4CompressGetTempSize((n), (chunk), (opts), (temp), (total), 0)
#endif
