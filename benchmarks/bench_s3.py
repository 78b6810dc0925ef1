"""Write the same frames to a local S3 server (moto, in its own process) with this project and
its peers; print GB/s and requests per GB.

Engines: ``tileshard-cpu`` (ObjectStoreSink: obstore, concurrent multipart parts),
``tileshard-cpu-s3fs`` (the same Writer through zarr's FsspecStore over s3fs: the client
comparison), ``tileshard-gpu`` (when a GPU is usable), ``tensorstore`` (its ``s3`` kvstore) and
``acquire-zarr`` (``S3Settings``).  Every engine gets the same chunk (tile) shape, shard shape
and zstd level, and is timed from the first frame until its store is closed; requests are
counted from the server's request log (every HTTP request the engine made, listing included).
moto keeps objects in memory (spilled to temporary files above 1 MiB), so this measures the
clients and the protocol, not a disk.

Example (the command in docs/benchmarks.md):
    python benchmarks/bench_s3.py --mib 256 --repeat 3 --clients
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_write import layout_for, slabs  # noqa: E402

from napari_tileshard import SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.backends import is_available  # noqa: E402

BUCKET = "bench"
REGION = "us-east-1"
ENGINES = ("tileshard-cpu", "tileshard-cpu-s3fs", "tileshard-gpu", "tensorstore", "acquire-zarr")


class MotoProcess:
    """``moto_server`` on 127.0.0.1 in a child process, its request log in a file."""

    def __init__(self, log_path: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("moto server did not start")

    def requests(self) -> int:
        self.log.flush()
        return sum(1 for line in self.log_path.read_text(errors="replace").splitlines() if '" 2' in line)

    def stop(self):
        self.process.terminate()
        self.process.wait()
        self.log.close()


def stored_bytes(client, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sum(obj["Size"] for page in pages for obj in page.get("Contents", []))


def setup(engine, camera, frames, tile, prefix, level, endpoint):
    url = f"s3://{BUCKET}/{prefix}"
    layout = layout_for(camera.shape, tile)
    if engine.startswith("tileshard-"):
        backend = engine.split("-")[1]
        store = url
        if engine.endswith("-s3fs"):
            from zarr.storage import FsspecStore

            store = FsspecStore.from_url(url, storage_options={"endpoint_url": endpoint}, read_only=False)
        writer = Writer(store, layout, codec="zstd", level=level, backend=backend)

        def run():
            with writer:
                for frame in camera.frames(frames):
                    writer.append(frame)

        return run
    if engine == "tensorstore":
        import tensorstore as ts

        bounded = layout_for(camera.shape, tile, unbounded=False, frames=frames)
        spec = {
            "driver": "zarr3",
            "kvstore": {
                "driver": "s3",
                "bucket": BUCKET,
                "path": prefix + "/",
                "endpoint": endpoint,
                "aws_region": REGION,
                "aws_credentials": {"type": "environment"},
            },
            "metadata": {
                "shape": [frames, *camera.shape],
                "data_type": "uint16",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(bounded.shard_shape)}},
                "codecs": [
                    {
                        "name": "sharding_indexed",
                        "configuration": {
                            "chunk_shape": list(tile),
                            "codecs": [
                                {"name": "bytes", "configuration": {"endian": "little"}},
                                {"name": "zstd", "configuration": {"level": level}},
                            ],
                            "index_codecs": [
                                {"name": "bytes", "configuration": {"endian": "little"}},
                                {"name": "crc32c"},
                            ],
                        },
                    }
                ],
            },
            "create": True,
        }
        store = ts.open(spec).result()

        def run():
            pending = None
            for start, slab in slabs(camera, frames, bounded.shard_epoch_rows):
                future = store[start : start + len(slab)].write(slab)
                if pending is not None:
                    pending.result()
                pending = future
            if pending is not None:
                pending.result()

        return run
    if engine == "acquire-zarr":
        import acquire_zarr as az

        settings = az.StreamSettings(store_path=prefix, overwrite=True, max_threads=os.cpu_count())
        settings.s3 = az.S3Settings(endpoint=endpoint, bucket_name=BUCKET, region=REGION)
        settings.arrays = [
            az.ArraySettings(
                output_key="0",
                data_type=az.DataType.UINT16,
                dimensions=[
                    az.Dimension(
                        name=d.name,
                        kind=kind,
                        array_size_px=d.size,
                        chunk_size_px=d.tile_size,
                        shard_size_chunks=d.tiles_per_shard,
                    )
                    for d, kind in zip(
                        layout.dims, (az.DimensionType.TIME, az.DimensionType.SPACE, az.DimensionType.SPACE)
                    )
                ],
                compression=az.CompressionSettings(
                    compressor=az.Compressor.ZSTD, codec=az.CompressionCodec.ZSTD, level=level, shuffle=0
                ),
            )
        ]
        stream = az.ZarrStream(settings)

        def run():
            for frame in camera.frames(frames):
                stream.append(frame)
            stream.close()

        return run
    raise ValueError(f"unknown engine {engine!r}")


def child(args) -> None:
    """One engine's timed run, in its own process (a peer that crashes takes only itself down)."""
    camera = SyntheticCamera(tuple(args.frame), "uint16", seed=0)
    frames = args.frames
    for _ in camera.frames(min(frames, 4)):  # the camera's frame bank is made before the clock
        pass
    run = setup(args.child, camera, frames, tuple(args.tile), args.prefix, args.level, os.environ["AWS_ENDPOINT_URL"])
    start = time.perf_counter()
    run()
    print(json.dumps({"seconds": time.perf_counter() - start}))


def clients(endpoint: str, objects: int = 16, mib: int = 9) -> None:
    """The clients alone: ``objects`` PUTs of ``mib`` MiB from 1 and 4 threads (no encoding)."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import obstore
    import s3fs
    from obstore.store import from_url

    data = os.urandom(mib << 20)
    store = from_url(f"s3://{BUCKET}/clients")
    pieces = [memoryview(data)[: len(data) // 2], memoryview(data)[len(data) // 2 :]]
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    client = boto3.client("s3", endpoint_url=endpoint)
    cases = {
        "obstore (1 buffer)": lambda i: obstore.put(store, f"o{i}", data, use_multipart=False),
        "obstore (2 pieces)": lambda i: obstore.put(store, f"p{i}", pieces, use_multipart=False),
        "boto3 put_object": lambda i: client.put_object(Bucket=BUCKET, Key=f"clients/b{i}", Body=data),
        "s3fs pipe_file": lambda i: fs.pipe_file(f"{BUCKET}/clients/s{i}", data),
    }
    print(f"{'client':<20} {'threads':>7} {'MB/s':>7}   ({objects} objects of {mib} MiB)")
    for name, put in cases.items():
        for threads in (1, 4):
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(put, range(objects)))
            print(f"{name:<20} {threads:>7} {objects * len(data) / (time.perf_counter() - start) / 1e6:7.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="MiB of frames per engine and run")
    parser.add_argument("--frame", type=int, nargs=2, default=[2048, 2048])
    parser.add_argument("--tile", type=int, nargs=3, default=[8, 256, 256], help="tile (t, y, x); shards 1024x1024")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the engines' order alternates")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--log", type=Path, default=Path("/tmp/tileshard-bench-s3.log"))
    parser.add_argument("--clients", action="store_true", help="also time the S3 clients alone (PUTs, no encoding)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    import boto3

    server = MotoProcess(args.log)
    os.environ.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION=REGION,
        AWS_DEFAULT_REGION=REGION,
        AWS_ALLOW_HTTP="true",
    )
    client = boto3.client("s3", endpoint_url=server.endpoint)
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="warm-up", Body=os.urandom(8 << 20))  # the server's first request is slow
    if args.clients:
        clients(server.endpoint)
    frame_bytes = args.frame[0] * args.frame[1] * 2
    frames = max(args.tile[0], (args.mib << 20) // frame_bytes // args.tile[0] * args.tile[0])
    gpu = is_available("gpu") is None
    engines = [e for e in args.engines if e != "tileshard-gpu" or gpu]
    print(f"{frames} frames of {args.frame[0]}x{args.frame[1]} uint16 ({frames * frame_bytes / 1e9:.2f} GB) per run,")
    print(f"tile {args.tile}, shards 1024x1024 px, zstd {args.level}, server {server.endpoint} (moto, own process)")
    print(f"{'engine':<20} {'run':>3} {'GB/s':>6} {'s':>6} {'stored MB':>9} {'requests':>8} {'req/GB':>7}")
    common = ["--frame", *map(str, args.frame), "--tile", *map(str, args.tile), "--level", str(args.level)]
    try:
        for repeat in range(args.repeat):
            for engine in engines if repeat % 2 == 0 else engines[::-1]:
                prefix = f"{engine}-{repeat}.zarr"
                before = server.requests()
                done = subprocess.run(
                    [sys.executable, __file__, "--child", engine, "--prefix", prefix, "--frames", str(frames), *common],
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                    print(f"{engine:<20} {repeat:>3} failed (exit status {done.returncode}): {reason[:160]}")
                    continue
                seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
                time.sleep(0.5)  # the server's log lines land after the responses
                requests = server.requests() - before
                stored = stored_bytes(client, prefix)
                gb = frames * frame_bytes / 1e9
                print(
                    f"{engine:<20} {repeat:>3} {gb / seconds:6.3f} {seconds:6.2f} {stored / 1e6:9.1f} "
                    f"{requests:>8} {requests / max(stored / 1e9, 1e-9):7.0f}",
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
