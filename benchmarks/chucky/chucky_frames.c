// Record camera frames with chucky's GPU pipeline (acquire-project/chucky), the way
// benchmarks/bench_write.py records them with ours: the same frame bank replayed frame by frame,
// the same tile and shard shapes, Zarr v3 sharded output, and a user's clock.
//
// chucky's own bench_stream_* programs fix their geometry (256^3 cubes, 4096x2304 "orca2"
// frames), make their data on the fly and need its S3, CPU and test libraries; this program calls
// the same public API the same way (bench/bench_util.c: run_bench), so the pipeline measured is
// theirs, with its defaults: 128 MiB staging, >= 2048 tiles per compress batch, page-aligned
// shards with O_DIRECT when writing to a disk.
//
//   chucky_frames --bank frames.u16 --height 2048 --width 2048 --frames 2048 --tile 2,256,256
//                 --shard-tiles 1,4,4 [-o store | (no -o: shards are counted, then discarded)]
//                 [--unbuffered 0|1] [--level 1] [--buffer-mib 128] [--batch-chunks 2048]
//                 [--frames-per-append K: K consecutive bank frames per writer_append (default 1)]
//                 [--plan: print chucky's memory plan for the layout and stop, no GPU needed]
//
// Prints one JSON line on stdout: frames, bytes, create_s (sink + stream create), stream_s (first
// frame to the last byte handed to the OS), user_s (both: as Writer(...) to close()), out_bytes,
// and chucky's per-stage metrics.
#define _POSIX_C_SOURCE 200809L // clock_gettime, sysconf under a strict -std=c17
#include "dimension.h"
#include "log/log.h"
#include "stream.gpu.h"
#include "zarr_fs_sink.h"

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double
now_s(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// --- A sink that counts shard bytes and drops them: chucky's pipeline without the disk
// (bench_util.c's discard_shard_sink). ---
struct counting_writer
{
  struct shard_writer base;
  size_t* total;
};

struct counting_sink
{
  struct shard_sink base;
  struct counting_writer writer;
  size_t total;
};

static int
counting_write(struct shard_writer* self,
               uint64_t offset,
               const void* beg,
               const void* end)
{
  (void)offset;
  struct counting_writer* w = (struct counting_writer*)self;
  *w->total += (size_t)((const char*)end - (const char*)beg);
  return 0;
}

static int
counting_finalize(struct shard_writer* self)
{
  (void)self;
  return 0;
}

static struct shard_writer*
counting_open(struct shard_sink* self, uint8_t level, uint64_t shard_index)
{
  (void)level;
  (void)shard_index;
  return &((struct counting_sink*)self)->writer.base;
}

static int
parse_triple(const char* s, uint64_t out[3])
{
  unsigned long long a, b, c;
  if (sscanf(s, "%llu,%llu,%llu", &a, &b, &c) != 3 || !a || !b || !c)
    return 1;
  out[0] = a;
  out[1] = b;
  out[2] = c;
  return 0;
}

static int
usage(const char* prog)
{
  fprintf(stderr,
          "usage: %s --bank FILE --height H --width W --frames N --tile T,Y,X "
          "--shard-tiles T,Y,X [-o STORE] [--unbuffered 0|1] [--level L] "
          "[--buffer-mib M] [--batch-chunks C] [--frames-per-append K] [--plan]\n",
          prog);
  return 2;
}

static void
print_stage(const char* name, const struct stream_metric* m, int* first)
{
  if (m->count <= 0)
    return;
  printf("%s\"%s\": {\"ms\": %.3f, \"count\": %d, \"in_bytes\": %.0f, "
         "\"out_bytes\": %.0f}",
         *first ? "" : ", ",
         name,
         (double)m->ms,
         m->count,
         m->input_bytes,
         m->output_bytes);
  *first = 0;
}

int
main(int argc, char* argv[])
{
  const char* bank_path = NULL;
  const char* out_path = NULL;
  uint64_t height = 0, width = 0, frames = 0;
  uint64_t tile[3] = { 0 }, shard_tiles[3] = { 0 };
  int unbuffered = -1, level = 1, plan_only = 0;
  size_t buffer_mib = 128;
  uint64_t per_append = 1;
  unsigned batch_chunks = 2048;

  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (!strcmp(a, "--plan")) {
      plan_only = 1;
      continue;
    }
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v)
      return usage(argv[0]);
    if (!strcmp(a, "--bank"))
      bank_path = v;
    else if (!strcmp(a, "-o"))
      out_path = v;
    else if (!strcmp(a, "--height"))
      height = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--width"))
      width = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--frames"))
      frames = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--tile")) {
      if (parse_triple(v, tile))
        return usage(argv[0]);
    } else if (!strcmp(a, "--shard-tiles")) {
      if (parse_triple(v, shard_tiles))
        return usage(argv[0]);
    } else if (!strcmp(a, "--unbuffered"))
      unbuffered = atoi(v);
    else if (!strcmp(a, "--level"))
      level = atoi(v);
    else if (!strcmp(a, "--buffer-mib"))
      buffer_mib = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--frames-per-append"))
      per_append = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--batch-chunks"))
      batch_chunks = (unsigned)strtoul(v, NULL, 10);
    else
      return usage(argv[0]);
    ++i;
  }
  if (!bank_path || !height || !width || !frames || !tile[0] || !shard_tiles[0] || !per_append)
    return usage(argv[0]);
  if (unbuffered < 0) // chucky's benchmark default: O_DIRECT whenever it writes
    unbuffered = out_path != NULL;
  log_set_level(LOG_WARN);

  // The frame bank, read before anything is timed (the camera's memory).
  const size_t frame_bytes = (size_t)(height * width * sizeof(uint16_t));
  FILE* f = fopen(bank_path, "rb");
  if (!f) {
    perror(bank_path);
    return 1;
  }
  fseek(f, 0, SEEK_END);
  const size_t bank_bytes = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  const size_t bank_frames = bank_bytes / frame_bytes;
  if (!bank_frames) {
    fprintf(stderr, "%s holds no whole %llux%llu uint16 frame\n", bank_path,
            (unsigned long long)height, (unsigned long long)width);
    return 1;
  }
  char* bank = (char*)malloc(bank_frames * frame_bytes);
  if (!bank || fread(bank, frame_bytes, bank_frames, f) != bank_frames) {
    fprintf(stderr, "could not read %s\n", bank_path);
    return 1;
  }
  fclose(f);
  if (bank_frames % per_append || frames % per_append) {
    fprintf(stderr, "--frames-per-append %llu must divide the bank (%zu) and --frames\n",
            (unsigned long long)per_append, bank_frames);
    return 1;
  }

  struct dimension dims[3];
  const uint64_t sizes[3] = { frames, height, width };
  dims_create(dims, "tyx", sizes);
  dims_set_chunk_sizes(dims, 3, tile);
  for (int d = 0; d < 3; ++d)
    dims[d].chunks_per_shard = shard_tiles[d];
  dims[0].ngff.type = dimension_axis_time;
  if (dims_validate(dims, 3)) {
    fprintf(stderr, "chucky refused the dimensions\n");
    return 1;
  }

  const struct codec_config codec = { .id = CODEC_ZSTD, .level = (uint8_t)level };
  struct tile_stream_configuration config = {
    .buffer_capacity_bytes = buffer_mib << 20,
    .dtype = dtype_u16,
    .rank = 3,
    .dimensions = dims,
    .codec = codec,
    .reduce_method = lod_reduce_mean,
    .append_reduce_method = lod_reduce_mean,
    .target_batch_chunks = batch_chunks,
    .shard_alignment = out_path && unbuffered ? (size_t)sysconf(_SC_PAGESIZE) : 0,
  };
  // The device's primary context (the one CuPy and the runtime use), made current before the
  // clock starts, as the Python side has CuPy's before Writer(...).
  // nvCOMP's temp-size query in the memory estimate below wants the device current too.
  CUdevice dev = 0;
  CUcontext ctx;
  if (!plan_only && (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS)) {
    fprintf(stderr, "no CUDA device/context\n");
    return 1;
  }

  struct tile_stream_memory_info mem = { 0 };
  if (tile_stream_gpu_memory_estimate(&config, &mem)) {
    fprintf(stderr, "chucky could not plan this layout\n");
    if (!plan_only)
      cuDevicePrimaryCtxRelease(dev);
    return 1;
  }

  if (plan_only) { // the layout chucky chose, without a GPU (no nvCOMP scratch: it asks the GPU)
    printf("{\"device_bytes\": %zu, \"pinned_bytes\": %zu, \"epochs_per_batch\": %u, "
           "\"chunks_per_epoch\": %llu, \"max_output_size\": %zu}\n",
           mem.device_bytes, mem.host_pinned_bytes, mem.epochs_per_batch,
           (unsigned long long)mem.chunks_per_epoch, mem.max_output_size);
    free(bank);
    return 0;
  }

  struct counting_sink counter = { 0 };
  counter.base.open = counting_open;
  counter.writer.base.write = counting_write;
  counter.writer.base.finalize = counting_finalize;
  counter.writer.total = &counter.total;

  int rc = 1;
  struct zarr_fs_sink* zsink = NULL;
  struct tile_stream_gpu* stream = NULL;
  const double t0 = now_s();
  struct shard_sink* sink = &counter.base;
  if (out_path) {
    const struct zarr_config zcfg = {
      .store_path = out_path,
      .array_name = "0",
      .data_type = dtype_u16,
      .fill_value = 0,
      .rank = 3,
      .dimensions = dims,
      .unbuffered = unbuffered,
      .codec = codec,
    };
    zsink = zarr_fs_sink_create(&zcfg);
    if (!zsink) {
      fprintf(stderr, "zarr_fs_sink_create(%s) failed\n", out_path);
      goto Done;
    }
    sink = zarr_fs_sink_as_shard_sink(zsink);
  }
  stream = tile_stream_gpu_create(&config, sink);
  if (!stream) {
    fprintf(stderr, "tile_stream_gpu_create failed\n");
    goto Done;
  }
  const double t1 = now_s();
  struct writer* w = tile_stream_gpu_writer(stream);
  for (uint64_t i = 0; i < frames; i += per_append) {
    // Consecutive bank frames are contiguous: K frames go in one call, as a camera's ring would.
    const char* frame = bank + (i % bank_frames) * frame_bytes;
    struct writer_result r = writer_append_wait(
      w, (struct slice){ frame, frame + per_append * frame_bytes });
    if (r.error) {
      fprintf(stderr, "append of frame %llu failed\n", (unsigned long long)i);
      goto Done;
    }
  }
  const double t_appended = now_s();
  if (writer_flush(w).error) {
    fprintf(stderr, "writer_flush failed\n");
    goto Done;
  }
  size_t out_bytes = counter.total;
  if (zsink) {
    zarr_fs_sink_flush(zsink); // every shard handed to the OS: what close() means on our side
    out_bytes = 0;
  }
  const double t2 = now_s();
  const size_t in_bytes = frames * frame_bytes;
  struct stream_metrics m = tile_stream_gpu_get_metrics(stream);
  printf("{\"engine\": \"chucky\", \"frames\": %llu, \"bytes\": %zu, \"out_bytes\": %zu, "
         "\"create_s\": %.6f, \"append_s\": %.6f, \"stream_s\": %.6f, \"user_s\": %.6f, "
         "\"user_gbps\": %.4f, \"stream_gbps\": %.4f, \"unbuffered\": %d, "
         "\"frames_per_append\": %llu, "
         "\"device_bytes\": %zu, \"pinned_bytes\": %zu, \"epochs_per_batch\": %u, "
         "\"chunks_per_epoch\": %llu, \"stages\": {",
         (unsigned long long)frames,
         in_bytes,
         out_bytes,
         t1 - t0,
         t_appended - t1,
         t2 - t1,
         t2 - t0,
         (double)in_bytes / (t2 - t0) / 1e9,
         (double)in_bytes / (t2 - t1) / 1e9,
         unbuffered,
         (unsigned long long)per_append,
         mem.device_bytes,
         mem.host_pinned_bytes,
         mem.epochs_per_batch,
         (unsigned long long)mem.chunks_per_epoch);
  int first = 1;
  print_stage("memcpy", &m.memcpy, &first);
  print_stage("h2d", &m.h2d, &first);
  print_stage("scatter", &m.scatter, &first);
  print_stage("compress", &m.compress, &first);
  print_stage("aggregate", &m.aggregate, &first);
  print_stage("d2h", &m.d2h, &first);
  print_stage("sink", &m.sink, &first);
  printf("}}\n");
  fflush(stdout);
  rc = 0;

Done:
  // The sink is flushed before the stream goes: pending direct writes point into its pinned
  // buffers (bench_util.c does the same).
  if (zsink)
    zarr_fs_sink_flush(zsink);
  if (stream)
    tile_stream_gpu_destroy(stream);
  zarr_fs_sink_destroy(zsink);
  cuDevicePrimaryCtxRelease(dev);
  free(bank);
  return rc;
}
