"""Object storage (S3 and S3-compatible servers, Google Cloud Storage, Azure Blob) through obstore.

:class:`ObjectStoreSink` writes one object per shard and per ``zarr.json``:

* An object up to ``part_size`` bytes is one PUT; a larger one is a multipart upload whose parts
  go up concurrently (``max_concurrency`` per object) from the shard's own buffers: the pieces
  are handed to obstore as they are, never joined into one Python object first (obstore
  assembles each part from them in Rust, with the GIL released).  The part size grows so that
  no object needs more than S3's 10,000 parts; an object that cannot fit in 10,000 parts of
  5 GiB is refused before its upload starts.
* A PUT (and the completion of a multipart upload) is atomic: a reader sees the old object or
  the new one, never a torn one, so the Publisher's ordering (``zarr.json`` after the shards it
  covers) holds as on local disk.  A failed multipart upload is aborted by obstore (tested
  against a real S3 server: no upload is left listed); an upload cut off by a server that went
  away cannot be aborted and stays until a bucket lifecycle rule removes it.
* There is no rename and no lock: one writer per prefix is the caller's responsibility.
* Every write has a deadline (:func:`write_deadline`: ``io_timeout`` plus one second per MB) and
  can be cut off: the requests run as obstore coroutines on the sink's own event-loop thread, so a
  frozen endpoint (one that accepts connections and never answers) fails the write with
  :class:`~napari_tileshard.errors.StorageTimeoutError` instead of holding a thread for minutes,
  and :meth:`ObjectStoreSink.cancel` (the recording failed) cuts off the requests in flight: a
  single PUT at once (it leaves nothing behind), a multipart upload after a short grace
  (``_MULTIPART_GRACE_S``) in which it completes or fails on its own, so obstore aborts it.  An
  upload cut off after that (a frozen endpoint) cannot be aborted by us (obstore exposes no
  upload id) and stays listed until a bucket lifecycle rule (AbortIncompleteMultipartUpload)
  removes it.

Endpoint and credentials come from the standard environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP`` for a
plain-HTTP endpoint, ...) or from ``storage_options``: obstore's configuration keys
(``endpoint``, ``access_key_id``, ``secret_access_key``, ``region``, ...), its client options
(``allow_http``, ``timeout``, ``connect_timeout``, ...) and ``retry_config``.  Before anything is
written the prefix is listed once, so a missing bucket, rejected credentials or an unreachable
endpoint is one :class:`ObjectStoreError` naming the URL and the cause.

obstore is imported only when an object store URL is used (``pip install napari-tileshard[s3]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import threading
from datetime import timedelta
from typing import Any, cast

from .errors import StorageTimeoutError, WriteCancelledError
from .store import (
    _METADATA_CAP,
    _OVERWRITE_HINT,
    Sink,
    StoreExistsError,
    _deletion_order,
    _KeyTree,
    _recognise,
    _Unreadable,
)

log = logging.getLogger(__name__)

#: URL schemes written and read through obstore.
SCHEMES = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss", "azure"})
MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB  # S3: every part but the last
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * MIB
DEFAULT_MAX_CONCURRENCY = 8

# obstore's client options (ClientConfig); every other storage option is store configuration.
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "default_headers",
        "http1_only",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_url",
        "proxy_ca_certificate",
        "proxy_excludes",
        "randomize_addresses",
        "read_timeout",
        "root_certificate",
        "timeout",
        "user_agent",
    }
)
_ENV_PREFIX = {"gs": "GOOGLE_", "az": "AZURE_", "abfs": "AZURE_", "abfss": "AZURE_", "azure": "AZURE_"}
# Transient errors (503 SlowDown, resets) are retried with backoff for up to a minute; the
# listing before a recording gives up sooner, so a wrong endpoint is reported within seconds.
DEFAULT_RETRY = {"max_retries": 8, "retry_timeout": timedelta(seconds=60)}
_PREFLIGHT_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=10)}
_PREFLIGHT_CLIENT = {"connect_timeout": "5s", "timeout": "30s"}


#: seconds a write may take before it is cut off, besides one second per MB (a shard of a few MB
#: on a slow link); Writer(io_timeout=) sets it
DEFAULT_IO_TIMEOUT = 60.0
#: the deadline of writes after cancel() (the recording failed: zarr.json marked failed)
_AFTER_CANCEL_S = 5.0
#: after cancel(), a multipart upload in flight gets this long to end on its own (obstore aborts
#: an upload whose request fails; a cancelled one would stay listed, billed)
_MULTIPART_GRACE_S = 10.0


def write_deadline(io_timeout: float, nbytes: int) -> float:
    """Seconds a write of ``nbytes`` may take: ``io_timeout`` plus one second per MB, so that a
    frozen endpoint is noticed after ``io_timeout`` for shards of a few MB and a large shard on a
    slow (but working) link is not cut off."""
    return io_timeout + nbytes / 1e6


class ObjectStoreError(OSError):
    """An object store refused or could not be reached; the message names the URL and the cause."""

    def __str__(self):
        return self.strerror or super().__str__()


def is_object_store_url(url) -> bool:
    return isinstance(url, str) and "://" in url and url.split("://", 1)[0].lower() in SCHEMES


def part_size_for(nbytes: int, part_size: int = DEFAULT_PART_SIZE) -> int:
    """The part size for an object of ``nbytes``: ``part_size``, grown (to whole MiB) where the
    object would otherwise need more than S3's 10,000 parts.  ValueError when even 10,000 parts
    of 5 GiB cannot hold it."""
    if nbytes > MAX_PARTS * MAX_PART_SIZE:
        raise ValueError(
            f"an object of {nbytes} bytes cannot be uploaded: S3 allows at most {MAX_PARTS} parts of "
            f"{MAX_PART_SIZE} bytes; use smaller shards"
        )
    needed = -(-nbytes // MAX_PARTS)
    size = max(part_size, -(-needed // MIB) * MIB)
    return min(size, MAX_PART_SIZE)


def _check_part_size(part_size) -> int:
    if not isinstance(part_size, int) or isinstance(part_size, bool) or not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise ValueError(
            f"part_size must be an integer from {MIN_PART_SIZE} to {MAX_PART_SIZE} bytes, got {part_size!r}"
        )
    return part_size


def build_store(url: str, storage_options: dict | None = None, *, preflight: bool = False):
    """An obstore store for ``url`` (bucket and prefix from the URL), configured from the
    environment and ``storage_options``."""
    try:
        from obstore.store import from_url
    except ImportError:
        raise ImportError(
            f"writing or reading {url!r} needs obstore: pip install 'napari-tileshard[s3]' (or obstore)"
        ) from None
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    options = dict(storage_options or {})
    client = dict(options.pop("client_options", None) or {})
    retry = options.pop("retry_config", None) or DEFAULT_RETRY
    for key in list(options):
        if key in _CLIENT_KEYS:
            client[key] = options.pop(key)
    # Client options given to obstore replace those it reads from the environment (AWS_ALLOW_HTTP,
    # ...): carry the environment's over, under what the caller gave.
    env_prefix = _ENV_PREFIX.get(url.split("://", 1)[0].lower(), "AWS_")
    for key in _CLIENT_KEYS - client.keys():
        value = os.environ.get(env_prefix + key.upper())
        if value:
            client[key] = value
    if preflight:
        client = {**_PREFLIGHT_CLIENT, **client}
        retry = {**retry, **_PREFLIGHT_RETRY}
    try:
        return from_url(url, client_options=cast(Any, client) or None, retry_config=cast(Any, retry), **options)
    except Exception as exc:  # obstore: unknown key, malformed URL or value
        raise ValueError(f"cannot configure an object store for {url!r}: {_first_line(exc)}") from None


def reader_store(url: str, storage_options: dict | None = None, read_only: bool = True):
    """zarr's ``ObjectStore`` over obstore, for readers (verify, the napari reader, the inspector)."""
    from zarr.storage import ObjectStore

    return ObjectStore(build_store(url, storage_options), read_only=read_only)


def _first_line(exc: BaseException) -> str:
    text = str(exc).split("\n\nDebug source", 1)[0].strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _endpoint(storage_options: dict | None) -> str:
    options = storage_options or {}
    for key in ("endpoint", "aws_endpoint", "endpoint_url", "aws_endpoint_url"):
        if options.get(key):
            return str(options[key])
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        if os.environ.get(var):
            return os.environ[var]
    return "the provider's default endpoint"


_CODE = re.compile(r"<Code>([^<]+)</Code>")
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken"})
# reqwest/hyper's words for a request that never got an answer (refused, reset, timed out, DNS)
_UNREACHABLE = re.compile(
    r"error sending request|connection (refused|reset|closed)|timed out|dns error|tcp connect", re.IGNORECASE
)


def describe_failure(url: str, action: str, exc: BaseException, storage_options: dict | None = None) -> str:
    """One sentence: what failed on which URL, and why (bucket, credentials, endpoint, server)."""
    text = str(exc)
    code = _CODE.search(text)
    code_name = code.group(1) if code else ""
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    endpoint = _endpoint(storage_options)
    if code_name == "NoSuchBucket" or ("404 Not Found" in text and not code_name):
        cause = f"the bucket {bucket!r} does not exist at {endpoint}"
    elif code_name in _CREDENTIAL_CODES or re.search(r"\b403 Forbidden\b|Unauthenticated|PermissionDenied", text):
        cause = (
            f"the credentials were rejected by {endpoint} ({code_name or '403 Forbidden'}); "
            "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options"
        )
    elif _UNREACHABLE.search(text):
        cause = f"the endpoint {endpoint} cannot be reached ({_first_line(exc).rsplit(' - ', 1)[-1]})"
    else:
        cause = _first_line(exc)
    return f"{action} {url!r} failed: {cause}"


class ObjectStoreSink(Sink):
    """Shards and ``zarr.json`` as objects under ``url`` (``s3://bucket/prefix.zarr``, ``gs://``,
    ``az://``); see the module docstring for the guarantees.  ``stats`` counts objects, bytes,
    multipart uploads and requests."""

    def __init__(
        self,
        url: str,
        overwrite: bool = False,
        storage_options: dict | None = None,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        io_timeout: float | None = DEFAULT_IO_TIMEOUT,
    ):
        if not is_object_store_url(url):
            raise ValueError(f"not an object store URL (schemes {sorted(SCHEMES)}): {url!r}")
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        self.part_size = _check_part_size(part_size)
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive integer, got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        if io_timeout is not None and not (
            isinstance(io_timeout, (int, float)) and not isinstance(io_timeout, bool) and 0 < io_timeout < float("inf")
        ):
            raise ValueError(f"io_timeout must be a positive number of seconds or None, got {io_timeout!r}")
        self.io_timeout = io_timeout
        self._loop: _EventLoopThread | None = None
        self._requests: dict[concurrent.futures.Future, bool] = {}  # request -> multipart
        self._cancelled = False
        self.url = url.rstrip("/")
        self._options = storage_options
        self._store = build_store(self.url, storage_options)
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self.stats = {"objects": 0, "bytes": 0, "multipart_objects": 0, "parts": 0, "requests": 0}
        self._prepare(overwrite)

    def __repr__(self):
        return f"ObjectStoreSink({self.url!r})"

    @property
    def location(self) -> str:
        return self.url

    # -- before the recording ---------------------------------------------------------------
    def _prepare(self, overwrite: bool) -> None:
        import obstore

        probe = build_store(self.url, self._options, preflight=True)
        try:
            keys = [meta["path"] for batch in obstore.list(probe, chunk_size=1000) for meta in batch]
        except Exception as exc:
            raise ObjectStoreError(
                describe_failure(self.url, "listing", exc, self._options) + " (nothing was written)"
            ) from exc
        if not keys:
            return
        if not overwrite:
            raise StoreExistsError(f"{self.url!r} already holds {len(keys)} objects; {_OVERWRITE_HINT} to replace them")
        plan = _recognise(_KeyTree(keys, self._read_capped))
        refusal = plan.refusal(self.url)
        if refusal:
            raise StoreExistsError(refusal)
        data, meta = _deletion_order(plan.files)
        try:
            for group in (data, meta):  # zarr.json last: an interrupted overwrite is recognised again
                for start in range(0, len(group), 1000):
                    obstore.delete(self._store, group[start : start + 1000])
        except Exception as exc:
            raise ObjectStoreError(describe_failure(self.url, "overwriting", exc, self._options)) from exc

    def _read_capped(self, key: str) -> bytes:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(key)
        if len(data) > _METADATA_CAP:
            raise _Unreadable(f"is larger than {_METADATA_CAP >> 20} MiB")
        return data

    # -- writing ------------------------------------------------------------------------------
    def write(self, key: str, buffers) -> None:
        import obstore

        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if v.nbytes]
        nbytes = sum(v.nbytes for v in views)
        if nbytes <= self.part_size:
            payload: Any = views[0] if len(views) == 1 else views
            body = payload if views else b""

            def request():
                return obstore.put_async(self._store, key, body, use_multipart=False)

            parts = 0
        else:
            part_size = part_size_for(nbytes, self.part_size)  # before the upload starts

            def request():
                return obstore.put_async(
                    self._store,
                    key,
                    views,
                    use_multipart=True,
                    chunk_size=part_size,
                    max_concurrency=self.max_concurrency,
                )

            parts = -(-nbytes // part_size)
        self._run(request, f"{self.url}/{key}", nbytes)
        with self._lock:
            self._written.add(key)
            self.stats["objects"] += 1
            self.stats["bytes"] += nbytes
            self.stats["multipart_objects"] += parts > 0
            self.stats["parts"] += parts
            self.stats["requests"] += parts + 2 if parts else 1  # create + parts + complete

    def _run(self, request, what: str, nbytes: int) -> None:
        """Run ``request()`` (an obstore coroutine, made on the loop) under the write deadline."""
        with self._lock:
            if self._loop is None:
                self._loop = _EventLoopThread(f"tileshard-s3-{id(self):x}")
            future = self._loop.submit(request)
            self._requests[future] = nbytes > self.part_size
            cancelled = self._cancelled
        if cancelled:
            deadline: float | None = _AFTER_CANCEL_S
        else:
            deadline = None if self.io_timeout is None else write_deadline(self.io_timeout, nbytes)
        try:
            future.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StorageTimeoutError(
                f"writing {what!r} got no answer within {deadline:g} s (io_timeout): {_endpoint(self._options)} "
                "is frozen or unreachable"
            ) from None
        except concurrent.futures.CancelledError:
            raise WriteCancelledError(f"writing {what!r} was cut off: the recording had already failed") from None
        except ValueError:
            raise
        except Exception as exc:
            raise ObjectStoreError(describe_failure(what, "writing", exc, self._options)) from exc
        finally:
            with self._lock:
                self._requests.pop(future, None)

    def cancel(self) -> None:
        """Cut off the requests in flight (they raise WriteCancelledError): single PUTs at once,
        multipart uploads after a grace in which obstore can finish or abort them; later writes
        get a short deadline (zarr.json marked failed)."""
        with self._lock:
            self._cancelled = True
            requests = dict(self._requests)
            loop = self._loop
        for future, multipart in requests.items():
            if multipart and loop is not None:
                loop.cancel_later(future, _MULTIPART_GRACE_S)
            else:
                future.cancel()

    def release(self) -> None:
        """The recording ended: stop the sink's event loop (requests still in flight are cancelled)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    def read(self, key: str) -> bytes | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return obstore.get(self._store, key).bytes().to_bytes()
        except (NotFoundError, FileNotFoundError):
            return None

    def discard(self) -> None:
        import obstore

        with self._lock:
            written, self._written = sorted(self._written), set()
        try:
            for start in range(0, len(written), 1000):
                obstore.delete(self._store, written[start : start + 1000])
        except Exception as exc:  # best effort: the original error matters more
            log.warning("%s", describe_failure(self.url, "removing what was written to", exc, self._options))


class _EventLoopThread:
    """An asyncio loop on a daemon thread: a request given to it can be waited on with a deadline
    and cancelled from any thread (a blocking ``obstore.put`` can be neither)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, request) -> concurrent.futures.Future:
        """Run ``request()``'s awaitable on the loop (obstore makes its futures on a running loop)."""

        async def run():
            return await request()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def cancel_later(self, future: concurrent.futures.Future, seconds: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.call_later, seconds, future.cancel)

    def close(self, timeout: float = 5.0) -> None:
        async def stop():
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("requests of an object store sink did not stop within %s s", timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
