"""Recording to S3: a real S3 server (moto in server mode on 127.0.0.1, a random port) spoken to
over HTTP by the real clients (obstore, zarr-python's ObjectStore, tensorstore, boto3 to look)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import zarr

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
moto_server = pytest.importorskip("moto.server", reason="the test extra (moto[s3], flask) is not installed")
pytest.importorskip("boto3", reason="the test extra (boto3) is not installed")

from s3_server import KEY, REGION, SECRET  # noqa: E402  (the s3 fixtures: conftest.py)

from napari_tileshard import Dim, Layout, StoreExistsError, Writer, WriterError  # noqa: E402
from napari_tileshard.apps.verify import verify  # noqa: E402
from napari_tileshard.storage.object_store import (  # noqa: E402
    MAX_PART_SIZE,
    MAX_PARTS,
    ObjectStoreError,
    ObjectStoreSink,
    part_size_for,
)
from napari_tileshard.storage.urls import open_sink, resolve_store  # noqa: E402

FAST_RETRY = {"max_retries": 1, "retry_timeout": timedelta(seconds=3)}
LAYOUT = Layout([Dim("t", 0, 2, 2), Dim("y", 64, 32, 2), Dim("x", 64, 32, 1)], "uint16")
FRAMES = np.random.default_rng(1).integers(0, 4000, (12, 64, 64), dtype=np.uint16)


def test_round_trip_through_zarr_python_and_verify(s3):
    url = f"s3://{s3.bucket}/run/a.zarr"
    with Writer(url, LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    keys = s3.keys(s3.bucket)
    assert "run/a.zarr/zarr.json" in keys and "run/a.zarr/c/0/0/0" in keys
    assert not any(k.rsplit("/", 1)[-1].startswith(".") for k in keys)  # no temporary objects
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url), mode="r")[:], FRAMES)
    report = verify(url)
    assert report.ok, report.problems
    assert report.shards == len([k for k in keys if "/c/" in k])


def test_round_trip_through_tensorstore_s3_kvstore(s3):
    ts = pytest.importorskip("tensorstore", reason="tensorstore is not installed")
    with Writer(f"s3://{s3.bucket}/b.zarr", LAYOUT, backend="cpu", codec="blosc-lz4") as writer:
        writer.append(FRAMES)
    spec = {
        "driver": "zarr3",
        "kvstore": {
            "driver": "s3",
            "bucket": s3.bucket,
            "path": "b.zarr/",
            "endpoint": s3.endpoint,
            "aws_region": REGION,
            "aws_credentials": {"type": "environment"},
        },
    }
    np.testing.assert_array_equal(ts.open(spec, read=True).result().read().result(), FRAMES)


BIG = Layout([Dim("t", 0, 1, 4), Dim("y", 1024, 1024, 1), Dim("x", 1024, 1024, 1)], "uint16")  # 8 MiB shards


def big_frames(count: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 65535, (count, 1024, 1024), dtype=np.uint16)


def test_shards_above_the_part_size_go_up_as_multipart_uploads(s3):
    url = f"s3://{s3.bucket}/big.zarr"
    frames = big_frames(8)
    sink = ObjectStoreSink(url, part_size=5 << 20, max_concurrency=4)
    with Writer(sink, BIG, backend="cpu", codec="none") as writer:
        writer.append(frames)
    # A multipart object's ETag ends in "-<parts>": 8 MiB of chunks + the index in 5 MiB parts.
    etag = s3.client.head_object(Bucket=s3.bucket, Key="big.zarr/c/0/0/0")["ETag"]
    assert etag.strip('"').endswith("-2"), etag
    small = s3.client.head_object(Bucket=s3.bucket, Key="big.zarr/zarr.json")["ETag"]
    assert "-" not in small  # a single PUT
    assert sink.stats["multipart_objects"] == 2 and sink.stats["parts"] == 4
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url), mode="r")[:], frames)
    assert s3.uploads_in_progress(s3.bucket) == []


def test_part_size_keeps_every_object_within_10000_parts():
    assert part_size_for(100 << 20, 16 << 20) == 16 << 20
    grown = part_size_for(1 << 40, 16 << 20)  # 1 TiB would need 65,536 parts of 16 MiB
    assert grown % (1 << 20) == 0 and -(-(1 << 40) // grown) <= MAX_PARTS
    assert part_size_for(MAX_PARTS * MAX_PART_SIZE) == MAX_PART_SIZE
    with pytest.raises(ValueError, match="at most 10000 parts"):
        part_size_for(MAX_PARTS * MAX_PART_SIZE + 1)
    with pytest.raises(ValueError, match="part_size must be"):
        ObjectStoreSink("s3://bucket/x.zarr", part_size=1 << 20)


def test_overwrite_replaces_only_a_recording_of_ours(s3):
    url = f"s3://{s3.bucket}/o.zarr"
    with Writer(url, LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        Writer(url, LAYOUT, backend="cpu")
    with Writer(url, LAYOUT, backend="cpu", overwrite=True) as writer:
        writer.append(FRAMES[:4])
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url), mode="r")[:], FRAMES[:4])
    assert not any(k.startswith("o.zarr/c/1/") for k in s3.keys(s3.bucket))  # the old shards went too

    s3.client.put_object(Bucket=s3.bucket, Key="o.zarr/notes.txt", Body=b"mine")
    before = s3.keys(s3.bucket)
    with pytest.raises(StoreExistsError, match="notes.txt"):
        Writer(url, LAYOUT, backend="cpu", overwrite=True)
    assert s3.keys(s3.bucket) == before

    s3.client.put_object(Bucket=s3.bucket, Key="thesis/chapter1.txt", Body=b"mine")
    with pytest.raises(StoreExistsError, match="not a zarr store"):
        Writer(f"s3://{s3.bucket}/thesis", LAYOUT, backend="cpu", overwrite=True)
    with pytest.raises(StoreExistsError, match="chapter1.txt.*choose another output") as info:
        Writer(f"s3://{s3.bucket}/thesis", LAYOUT, backend="cpu")
    assert "overwrite=True" not in str(info.value)  # not offered: it would be refused
    assert "thesis/chapter1.txt" in s3.keys(s3.bucket)


def test_explicit_storage_options_without_environment(s3, monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(var)
    options = {
        "endpoint": s3.endpoint,
        "access_key_id": KEY,
        "secret_access_key": SECRET,
        "region": REGION,
        "allow_http": True,
    }
    url = f"s3://{s3.bucket}/explicit.zarr"
    with Writer(open_sink(url, storage_options=options), LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url, storage_options=options), mode="r")[:], FRAMES)
    with pytest.raises(ValueError, match="no_such_option"):
        open_sink(url, storage_options={**options, "no_such_option": 1})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_missing_bucket_wrong_credentials_and_unreachable_endpoint_fail_before_writing(s3, monkeypatch):
    with pytest.raises(ObjectStoreError, match=r"'s3://no-such-bucket/x.zarr'.*bucket 'no-such-bucket' does not exist"):
        Writer("s3://no-such-bucket/x.zarr", LAYOUT, backend="cpu")

    port = free_port()
    with pytest.raises(ObjectStoreError, match=rf"endpoint http://127.0.0.1:{port} cannot be reached"):
        open_sink(f"s3://{s3.bucket}/x.zarr", storage_options={"endpoint": f"http://127.0.0.1:{port}"})

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    s3.require_credentials(True)
    try:
        with pytest.raises(ObjectStoreError, match=r"credentials were rejected.*InvalidAccessKeyId"):
            Writer(f"s3://{s3.bucket}/x.zarr", LAYOUT, backend="cpu")
    finally:
        s3.require_credentials(False)
    assert s3.keys(s3.bucket) == []


def published_rows(s3, bucket: str, prefix: str) -> int:
    meta = json.loads(s3.client.get_object(Bucket=bucket, Key=f"{prefix}/zarr.json")["Body"].read())
    return meta["shape"][0]


def test_server_stopped_mid_recording_is_a_writer_error_and_nothing_unwritten_is_claimed(s3):
    # A second server process-wide shares moto's state: stop it mid-recording, read through the first.
    doomed = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    doomed.start()
    host, port = doomed.get_host_and_port()
    options = {"endpoint": f"http://{host}:{port}", "retry_config": FAST_RETRY}
    url = f"s3://{s3.bucket}/stop.zarr"
    writer = Writer(open_sink(url, storage_options=options), LAYOUT, backend="cpu")
    writer.append(FRAMES[:4])
    writer.flush()
    doomed.stop()
    with pytest.raises(WriterError, match=r"stop.zarr.*cannot be reached"):
        writer.append(FRAMES[4:])
        writer.close()
    with contextlib.suppress(WriterError):
        writer.close()
    assert published_rows(s3, s3.bucket, "stop.zarr") == 4
    report = verify(url)
    assert report.ok, report.problems
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url), mode="r")[:], FRAMES[:4])


class FaultProxy:
    """An HTTP proxy in front of the S3 server that answers chosen requests with an error itself
    (as a server under load or failing would), and forwards every other request unchanged."""

    def __init__(self, endpoint: str):
        self.target = endpoint.removeprefix("http://").split(":")
        self.rules: list[tuple] = []  # (method, path substring, status, S3 code, remaining count or None)
        self.injected = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                error = proxy.match(self.command, self.path)
                if error is not None:
                    status, code = error
                    payload = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(status)
                else:
                    conn = http.client.HTTPConnection(proxy.target[0], int(proxy.target[1]), timeout=30)
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    answer = conn.getresponse()
                    payload = answer.read()
                    self.send_response(answer.status)
                    for name, value in answer.getheaders():
                        if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(name, value)
                    conn.close()
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, method: str, path_part: str, status: int, code: str, times: int | None = None) -> None:
        with self.lock:
            self.rules.append([method, path_part, status, code, times])

    def match(self, method: str, path: str):
        with self.lock:
            for rule in self.rules:
                if rule[0] == method and rule[1] in path and (rule[4] is None or rule[4] > 0):
                    if rule[4] is not None:
                        rule[4] -= 1
                    self.injected += 1
                    return rule[2], rule[3]
        return None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(s3):
    proxy = FaultProxy(s3.endpoint)
    yield proxy
    proxy.close()


def test_a_failed_multipart_upload_is_aborted_and_never_claimed(s3, proxy):
    url = f"s3://{s3.bucket}/fail.zarr"
    options = {"endpoint": proxy.endpoint, "retry_config": FAST_RETRY}
    frames = big_frames(8)
    # Every attempt at part 2 of a shard of the second shard epoch fails: that upload cannot complete.
    proxy.fail("PUT", "fail.zarr/c/1/0/0?partNumber=2&", 500, "InternalError")
    writer = Writer(ObjectStoreSink(url, storage_options=options, part_size=5 << 20), BIG, backend="cpu", codec="none")
    writer.append(frames[:4])
    writer.flush()  # the first shard epoch is published
    with pytest.raises(WriterError, match=r"writing 's3://[^']*/fail.zarr/c/1/0/0' failed.*InternalError"):
        writer.append(frames[4:])
        writer.close()
    with contextlib.suppress(WriterError):
        writer.close()
    assert proxy.injected >= 1
    assert s3.uploads_in_progress(s3.bucket) == []  # aborted: no parts left billed
    assert "fail.zarr/c/1/0/0" not in s3.keys(s3.bucket)
    assert published_rows(s3, s3.bucket, "fail.zarr") == 4  # the first shard epoch, not the failed one
    report = verify(url)
    assert report.ok, report.problems


def test_transient_slowdown_responses_are_retried(s3, proxy):
    url = f"s3://{s3.bucket}/slow.zarr"
    options = {"endpoint": proxy.endpoint, "retry_config": {"max_retries": 4, "retry_timeout": timedelta(seconds=20)}}
    frames = big_frames(8)
    proxy.fail("PUT", "partNumber=", 503, "SlowDown", times=3)
    proxy.fail("PUT", "slow.zarr/zarr.json", 503, "SlowDown", times=1)
    sink = ObjectStoreSink(url, storage_options=options, part_size=5 << 20)
    with Writer(sink, BIG, backend="cpu", codec="none") as writer:
        writer.append(frames)
    assert proxy.injected == 4
    np.testing.assert_array_equal(zarr.open_array(resolve_store(url), mode="r")[:], frames)
    assert s3.uploads_in_progress(s3.bucket) == []


def test_cli_records_and_verifies_an_s3_url_and_ome_groups_work(s3):
    from napari_tileshard.apps.cli import main

    url = f"s3://{s3.bucket}/cli.zarr"
    small = ["--shape", "0,32,32", "--tile", "2,16,16", "--tiles-per-shard", "1,1,1", "--backend", "cpu"]
    assert main(["record", url, *small, "--frames", "6", "--no-progress"]) == 0
    assert main(["verify", url]) == 0
    assert zarr.open_array(resolve_store(url), mode="r").shape == (6, 32, 32)

    ome_url = f"s3://{s3.bucket}/ome.zarr"
    frames = FRAMES[:8]
    with Writer(ome_url, LAYOUT, backend="cpu", ome=True, overwrite=True) as writer:
        writer.append(frames)
    group = zarr.open_group(resolve_store(ome_url), mode="r")
    np.testing.assert_array_equal(group["0"][:], frames)
    assert verify(ome_url).ok
    with Writer(ome_url, LAYOUT, backend="cpu", ome=True, overwrite=True) as writer:  # our OME group: replaced
        writer.append(frames[:4])
    assert zarr.open_group(resolve_store(ome_url), mode="r")["0"].shape[0] == 4


def test_napari_reader_and_inspector_open_an_s3_url(s3):
    from napari_tileshard.apps.inspect_shards import inspect_array
    from napari_tileshard.apps.napari_reader import napari_get_reader

    url = f"s3://{s3.bucket}/view.zarr"
    with Writer(url, LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    reader = napari_get_reader(url)
    assert reader is not None
    [(data, meta, kind)] = reader(url)
    assert kind == "image" and meta["name"] == "view" and meta["metadata"]["path"] == url
    np.testing.assert_array_equal(np.asarray(data), FRAMES)
    assert napari_get_reader(f"s3://{s3.bucket}/nothing.zarr") is None
    inspection = inspect_array(url)
    assert len(inspection.shards) == len([k for k in s3.keys(s3.bucket) if "/c/" in k])


def test_sigkill_while_recording_to_s3_leaves_only_complete_claimed_shards(s3):
    import os
    import signal
    import subprocess
    import sys
    import time

    from napari_tileshard import SyntheticCamera

    url = f"s3://{s3.bucket}/killed.zarr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "napari_tileshard", "record", url, "--shape", "0,64,48", "--tile", "4,32,16"]
        + ["--tiles-per-shard", "2,1,2", "--frames", "100000", "--fps", "400", "--backend", "cpu", "--seed", "7"]
        + ["--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until several shard epochs are published
            time.sleep(0.2)
            with contextlib.suppress(Exception):  # not created yet
                if published_rows(s3, s3.bucket, "killed.zarr") >= 40:
                    break
        time.sleep(0.37)  # land somewhere inside the next epochs
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    array = zarr.open_array(resolve_store(url), mode="r")
    rows = array.shape[0]
    assert rows >= 40 and rows % 8 == 0  # whole shard epochs only
    np.testing.assert_array_equal(array[:], SyntheticCamera((64, 48), "uint16", seed=7).stack(rows))
    report = verify(url)
    assert report.ok, report.problems


def test_dispatch_faults_against_s3_lose_nothing_and_match_the_fault_free_recording(s3):
    """Seeded faults (a 10x slow worker, stalls, 503 SlowDown) through the public seam, on the real
    client and server: the objects are byte for byte those of a fault-free recording."""
    from napari_tileshard.testing import FaultInjectingSink, StorageFaults

    frames = np.random.default_rng(5).integers(0, 4000, (40, 64, 64), dtype=np.uint16)

    def record(store) -> Writer:
        with Writer(store, LAYOUT, backend="cpu", batch_bytes=LAYOUT.epoch_bytes, io_threads=3) as writer:
            writer.append(frames)
        return writer

    record(f"s3://{s3.bucket}/clean.zarr")
    faults = StorageFaults(seed=4, service_s=0.002, slow_worker=0, slow_factor=10.0, stall_every=8, slowdown_rate=0.1)
    sink = FaultInjectingSink(f"s3://{s3.bucket}/faulty.zarr", faults=faults)
    stats = record(sink).stats
    assert sink.injected["slow"] and sink.injected["stall"] and sink.injected["slowdown"]
    assert stats.retries > 0 and stats.duplicate_bytes <= 0.05 * stats.bytes_out + 1

    def objects(prefix: str) -> dict[str, bytes]:
        keys = [k for k in s3.keys(s3.bucket) if k.startswith(prefix + "/")]
        return {k[len(prefix) :]: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in keys}

    assert objects("faulty.zarr") == objects("clean.zarr")
    assert verify(f"s3://{s3.bucket}/faulty.zarr").ok
    from napari_tileshard import ShardReader

    np.testing.assert_array_equal(ShardReader(f"s3://{s3.bucket}/faulty.zarr")[...], frames)  # the URL, as typed


class TcpForwarder:
    """A TCP forwarder on 127.0.0.1 in front of the S3 server.  ``kill()`` closes it and every
    connection (the endpoint dies); ``freeze()`` keeps accepting and holding connections but
    never forwards another byte (a frozen endpoint, as a SIGSTOPped server or a dead link)."""

    def __init__(self, endpoint: str):
        host, port = endpoint.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # killed
            self.sockets.append(client)
            if self.frozen.is_set():
                continue  # accepted, held, never answered
            upstream = socket.create_connection(self.target)
            self.sockets.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket):
        try:
            while data := source.recv(65536):
                while self.frozen.is_set():
                    time.sleep(3600)  # the byte never arrives
                sink.sendall(data)
        except OSError:
            pass

    def freeze(self):
        self.frozen.set()

    def kill(self):
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def claimed_rows(s3, bucket: str, prefix: str) -> int:
    meta = json.loads(s3.client.get_object(Bucket=bucket, Key=f"{prefix}/zarr.json")["Body"].read())
    return meta["attributes"]["tileshard"]["rows_written"]


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_recording_stops_promptly_when_its_endpoint_dies_or_freezes(s3, fault, tmp_path):
    """The evidence (shared/evidence/s3_dead_endpoint_log.txt): the recorder kept running for
    minutes after the endpoint died, writing queued shards with obstore's full retry budget."""
    forwarder = TcpForwarder(s3.endpoint)
    url = f"s3://{s3.bucket}/h.zarr"
    env = {**os.environ, "AWS_ENDPOINT_URL": forwarder.endpoint}
    command = [sys.executable, "-m", "napari_tileshard", "record", url, "--shape", "0,64,48", "--tile", "4,32,16"]
    command += ["--tiles-per-shard", "2,1,2", "--fps", "400", "--backend", "cpu", "--io-timeout", "3", "--no-progress"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until some shard epochs are published
            with contextlib.suppress(Exception):
                if claimed_rows(s3, s3.bucket, "h.zarr") >= 16:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the recording published nothing")
        {"killed": forwarder.kill, "frozen": forwarder.freeze}[fault]()
        broken = time.monotonic()
        out, err = process.communicate(timeout=60)
        ended = time.monotonic() - broken
    finally:
        if process.poll() is None:
            process.kill()
        forwarder.kill()
    print(f"stopped {ended:.1f} s after the endpoint was {fault}")
    assert ended < 3 + 20, f"the recorder took {ended:.0f} s to stop after its endpoint {fault}"
    assert process.returncode == 1, (process.returncode, err[-2000:])
    assert "frozen or unreachable" in err or "cannot be reached" in err, err[-2000:]
    assert "Traceback" not in err
    rows = claimed_rows(s3, s3.bucket, "h.zarr")
    assert rows >= 16 and rows % 8 == 0  # whole shard epochs only
    report = verify(url)  # through the server itself: every claimed row is there
    assert report.ok, report.problems
    assert zarr.open_array(resolve_store(url), mode="r").shape[0] == rows


# -- exiting: obstore's threads must never be inside the interpreter when it finalizes -------------
# obstore's *_async functions complete on a tokio thread that calls the event loop's
# call_soon_threadsafe and, inside it, gives up the GIL to wake the loop; an interpreter that
# finalizes before that thread takes the GIL back ends it with pthread_exit, which aborts the
# process in obstore's Rust frames ("Fatal Python error: Aborted" after verify's report).  The
# hook keeps such a thread away from the GIL until the interpreter finalizes: the worst case of
# that scheduling, certain instead of rare.  See object_store.ThreadedObjectStore.
HOLD_HOOK = """
import sys, threading, time, asyncio.selector_events as _se
_write_to_self, _said = _se.BaseSelectorEventLoop._write_to_self, []
def _held(self):
    _write_to_self(self)
    if threading.get_ident() not in threading._active:  # a thread Python did not start
        if not _said:
            _said.append(sys.stderr.write("HOOK: foreign thread in the event loop\\n"))
        while True:
            time.sleep(0.002)
_se.BaseSelectorEventLoop._write_to_self = _held
"""


@pytest.fixture
def foreign_loop_calls(monkeypatch):
    """Counts calls into an asyncio loop's wake-up made by threads that Python did not start."""
    import asyncio.selector_events

    calls = []
    original = asyncio.selector_events.BaseSelectorEventLoop._write_to_self

    def recording(loop):
        original(loop)
        if threading.get_ident() not in threading._active:  # type: ignore[attr-defined]
            calls.append(threading.get_ident())

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "_write_to_self", recording)
    return calls


def test_no_obstore_thread_calls_into_python_when_recording_verifying_or_reading_s3(s3, foreign_loop_calls):
    from napari_tileshard import ShardReader
    from napari_tileshard.apps.napari_reader import napari_get_reader
    from napari_tileshard.storage.object_store import ThreadedObjectStore

    url = f"s3://{s3.bucket}/quiet.zarr"
    with Writer(url, LAYOUT, backend="cpu", ome=True) as writer:
        writer.append(FRAMES)
    assert verify(url).ok
    store = resolve_store(url)
    assert isinstance(store, ThreadedObjectStore)
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["0"][:], FRAMES)
    np.testing.assert_array_equal(ShardReader(url, pyramid_level=0)[...], FRAMES)
    [(data, _, _)] = napari_get_reader(url)(url)
    np.testing.assert_array_equal(np.asarray(data[0]), FRAMES)
    assert foreign_loop_calls == []


def test_threaded_object_store_answers_as_zarrs_object_store(s3, foreign_loop_calls):
    """The same answers as zarr's ObjectStore (ranges, missing keys, listings relative to the
    prefix, idempotent deletes, read-only refusal), none of them delivered by obstore's threads."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
    from zarr.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    url = f"s3://{s3.bucket}/kv"
    store, proto = resolve_store(url, read_only=False), default_buffer_prototype()
    buf, data = proto.buffer.from_bytes, bytes(range(100))
    for key, value in {"a/zarr.json": b"{}", "a/c/0": data, "b": b"x", "d/e/f": b""}.items():
        sync(store.set(key, buf(value)))
    sync(store.set_if_not_exists("b", buf(b"not written")))

    def get(key, request=None):
        found = sync(store.get(key, proto, request))
        return None if found is None else found.to_bytes()

    async def collect(method, *args):
        return sorted([k async for k in getattr(store, method)(*args)])

    assert get("b") == b"x" and get("d/e/f") == b"" and get("missing") is None
    assert get("a/c/0", RangeByteRequest(10, 20)) == data[10:20]
    assert get("a/c/0", OffsetByteRequest(95)) == data[95:]
    assert get("a/c/0", SuffixByteRequest(7)) == data[-7:]
    partial = sync(store.get_partial_values(proto, [("b", None), ("a/c/0", RangeByteRequest(0, 2)), ("no", None)]))
    assert [p if p is None else p.to_bytes() for p in partial] == [b"x", data[:2], None]
    assert sync(store.exists("b")) and not sync(store.exists("c"))
    assert sync(store.getsize("a/c/0")) == 100 and sync(store.getsize_prefix("a")) == 102
    assert sync(collect("list")) == ["a/c/0", "a/zarr.json", "b", "d/e/f"]
    assert sync(collect("list_prefix", "a/")) == ["a/c/0", "a/zarr.json"]
    assert sync(collect("list_dir", "")) == ["a", "b", "d"]
    assert sync(collect("list_dir", "a")) == sync(collect("list_dir", "a/")) == ["c", "zarr.json"]
    sync(store.delete("b"))
    sync(store.delete("b"))  # a missing key is no error
    sync(store.delete_dir("a"))
    assert sync(collect("list")) == ["d/e/f"]
    with pytest.raises(ValueError, match="read-only"):
        sync(resolve_store(url).set("x", buf(b"1")))
    assert store.with_read_only(True).read_only and type(store.with_read_only(True)) is type(store)
    assert foreign_loop_calls == []


@pytest.mark.slow
def test_verify_s3_exits_with_its_verdict_even_when_obstore_threads_are_late_in_20_runs(s3):
    """Fresh interpreters, the hook making the exit race certain: every run prints its report and
    exits with the verdict's code (0, or 1 for the damaged store), never SIGABRT."""
    import os
    import subprocess
    import sys

    good, bad = f"s3://{s3.bucket}/exit.zarr", f"s3://{s3.bucket}/exit-bad.zarr"
    for url in (good, bad):
        with Writer(url, LAYOUT, backend="cpu") as writer:
            writer.append(FRAMES)
    damaged = bytearray(s3.client.get_object(Bucket=s3.bucket, Key="exit-bad.zarr/c/0/0/0")["Body"].read())
    damaged[10] ^= 0xFF
    s3.client.put_object(Bucket=s3.bucket, Key="exit-bad.zarr/c/0/0/0", Body=bytes(damaged))
    code = (
        "import runpy\n"
        + HOLD_HOOK
        + "runpy.run_module('napari_tileshard.apps.cli', run_name='__main__', alter_sys=True)"
    )
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    outcomes = []
    for run in range(20):
        url, verdict = (good, 0) if run % 2 == 0 else (bad, 1)
        proc = subprocess.run([sys.executable, "-c", code, "verify", url], env=env, capture_output=True, text=True)
        assert "chunks checked" in proc.stdout, proc.stderr[-2000:]
        outcomes.append((proc.returncode, verdict, "HOOK:" in proc.stderr, proc.stderr[-1500:]))
    failures = [o for o in outcomes if o[0] != o[1]]
    assert not failures, f"{len(failures)} of 20 runs did not exit with the verdict: {failures[0]}"
    assert not any(o[2] for o in outcomes)  # no thread but Python's called into the event loop


def test_verify_and_convert_name_a_missing_bucket_an_empty_prefix_and_a_dead_endpoint(s3, monkeypatch, capsys):
    """A missing bucket said "no zarr.json at 'zarr.json'"; a dead endpoint printed obstore's
    39-line debug dump.  Each is one line naming what is wrong, verify exits 1, convert 2 or 1."""
    from napari_tileshard.apps.cli import main as cli_main

    for url, said in (
        ("s3://no-such-bucket/x.zarr", "the bucket 'no-such-bucket' does not exist at http://127.0.0.1:"),
        (f"s3://{s3.bucket}/missing.zarr", "nothing is stored there (no zarr.json and no other object"),
    ):
        assert cli_main(["verify", url]) == 1
        out = capsys.readouterr().out
        assert said in out and len(out.strip().splitlines()) == 2, out
        assert cli_main(["convert", url, "/nonexistent-dir/out.zarr", "--local", "1"]) == 2
        ours = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("127.0.0.1 - -")]
        assert len(ours) == 1 and said in ours[0], ours  # (the other lines: the S3 server's request log)
    with Writer(f"s3://{s3.bucket}/r.zarr", LAYOUT, backend="cpu") as writer:
        writer.append(FRAMES)
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    assert cli_main(["verify", f"s3://{s3.bucket}/r.zarr"]) == 1
    out = capsys.readouterr().out
    assert f"the endpoint http://127.0.0.1:{port} cannot be reached" in out
    assert "Debug source" not in out and len(out.strip().splitlines()) == 2, out
