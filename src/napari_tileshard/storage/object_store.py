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
* Every write has a deadline: obstore's own per-request ``timeout`` and retry budget are set from
  the Writer's ``io_timeout`` (half of it each, unless ``storage_options`` set them), so a frozen
  endpoint (one that accepts connections and never answers) fails the write with an error within
  ``io_timeout`` instead of holding a thread for minutes, and a failed multipart upload is
  aborted by obstore.  Writes use obstore's blocking functions on the Writer's own I/O threads:
  no obstore (tokio) thread ever calls into Python, which at interpreter exit aborts the process
  (see :class:`ThreadedObjectStore`).  After :meth:`ObjectStoreSink.cancel` (the recording
  failed) writes in flight end within their deadline and later ones (``zarr.json`` marked failed)
  get a short one (``_AFTER_CANCEL_S``).

Endpoint and credentials come from the standard environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP`` for a
plain-HTTP endpoint, ...) or from ``storage_options``: obstore's configuration keys
(``endpoint``, ``access_key_id``, ``secret_access_key``, ``region``, ...), its client options
(``allow_http``, ``timeout``, ``connect_timeout``, ...) and ``retry_config``.  Before anything is
written the prefix is listed once, so a missing bucket, rejected credentials or an unreachable
endpoint is one :class:`ObjectStoreError` naming the URL and the cause.

obstore is imported only when an object store URL is used (:data:`INSTALL_OBSTORE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from zarr.storage import ObjectStore

from .errors import StoreExistsError
from .overwrite import METADATA_CAP as _METADATA_CAP
from .overwrite import OVERWRITE_HINT as _OVERWRITE_HINT
from .overwrite import KeyTree as _KeyTree
from .overwrite import Unreadable as _Unreadable
from .overwrite import deletion_order as _deletion_order
from .overwrite import recognise as _recognise
from .sinks import Sink, byte_views, check_key

__all__ = [
    "DEFAULT_IO_TIMEOUT",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "DEFAULT_RETRY",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIB",
    "MIN_PART_SIZE",
    "OBJECT_STORE_THREADS",
    "ObjectStoreError",
    "ObjectStoreSink",
    "SCHEMES",
    "ThreadedObjectStore",
    "build_store",
    "describe_failure",
    "is_object_store_url",
    "part_size_for",
    "reader_store",
]

if TYPE_CHECKING:
    from zarr.abc.buffer import Buffer, BufferPrototype
    from zarr.abc.store import ByteRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

#: URL schemes written and read through obstore.
SCHEMES = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss", "azure"})
#: How to get obstore, for the errors that find it missing (the package is installed from a checkout).
INSTALL_OBSTORE = 'pip install obstore, or from a napari-tileshard checkout: pip install -e ".[s3]" (the s3 extra)'
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


#: seconds one write may take (Writer(io_timeout=) sets it): half per request, half for retries
DEFAULT_IO_TIMEOUT = 60.0
#: the deadline of writes after cancel() (the recording failed: zarr.json marked failed)
_AFTER_CANCEL_S = 5.0


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


def build_store(url: str, storage_options: dict | None = None, *, preflight: bool = False, deadline=None):
    """An obstore store for ``url`` (bucket and prefix from the URL), configured from the
    environment and ``storage_options``.  ``deadline`` (seconds): unless the options set them,
    each request times out after half of it and retries stop after the other half, so one
    operation ends within about ``deadline`` whatever the endpoint does."""
    try:
        from obstore.store import from_url
    except ImportError:
        raise ImportError(
            f"writing or reading {url!r} needs obstore, which is not installed: {INSTALL_OBSTORE}"
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
    if deadline is not None:
        if "retry_config" not in (storage_options or {}):
            retry = {**retry, "retry_timeout": timedelta(seconds=deadline / 2)}
        client.setdefault("timeout", f"{deadline / 2:g}s")
        client.setdefault("connect_timeout", f"{min(5.0, deadline / 4):g}s")
    if preflight:
        client = {**_PREFLIGHT_CLIENT, **client}
        retry = {**retry, **_PREFLIGHT_RETRY}
    try:
        return from_url(url, client_options=cast(Any, client) or None, retry_config=cast(Any, retry), **options)
    except Exception as exc:  # obstore: unknown key, malformed URL or value
        raise ValueError(f"cannot configure an object store for {url!r}: {_first_line(exc)}") from None


def reader_store(url: str, storage_options: dict | None = None, read_only: bool = True):
    """A zarr ``ObjectStore`` over obstore, for readers (verify, the napari reader, the inspector)
    and for zarr-python: a :class:`ThreadedObjectStore` (see there why not zarr's own)."""
    return ThreadedObjectStore(build_store(url, storage_options), read_only=read_only)


# -- a zarr Store whose requests never make obstore's threads call into Python -------------------
#
# zarr's ObjectStore awaits obstore's ``*_async`` functions.  Each of those completes on a tokio
# thread (pyo3-async-runtimes' ``set_result``) that attaches to the interpreter and calls the
# event loop's ``call_soon_threadsafe``: the callback is queued, then the loop is woken by a
# ``socket.send`` that releases the GIL.  The awaiting coroutine can finish, ``sync()`` return and
# the program end while that thread still waits to take the GIL back.  If the interpreter has begun
# to finalize by then, CPython ends the thread with ``pthread_exit``; glibc's forced unwind cannot
# pass obstore's Rust frames and calls ``abort()``: "Fatal Python error: Aborted", no Python frame,
# after the command had printed its result (core dumps: the aborting thread is a tokio blocking
# thread in pyo3_async_runtimes::generic::set_result -> sock_send -> take_gil -> pthread_exit).
# No Python code can wait for that thread: it is not Python's, it is not listed, and its last step
# happens after the result it delivers is visible.
#
# So every request goes through obstore's blocking functions instead, on threads of a Python
# thread pool (``run_in_executor`` from zarr's loop).  Rust then only runs on Python's own threads
# (``block_on`` with the GIL released); tokio's threads do pure Rust I/O and never touch the
# interpreter.  The pool's threads are joined by ``threading._shutdown`` before ``atexit`` and
# finalization, as every ThreadPoolExecutor's are, so none is inside obstore when the interpreter
# finalizes.  ObjectStoreSink (the Writer's sink) already uses the blocking functions on the
# Writer's threads.

#: requests in flight at once through ThreadedObjectStore (zarr's ``async.concurrency`` is 10)
OBJECT_STORE_THREADS = 32
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_ALLOWED_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)  # zarr: "no such key"


def _object_store_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(OBJECT_STORE_THREADS, thread_name_prefix="tileshard-obstore")
        return _pool


def _forget_pool_after_fork() -> None:  # the child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


async def _blocking(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` (an obstore blocking call) on a thread of the pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_object_store_pool(), functools.partial(function, *args, **kwargs))


def _get_bytes(store, key: str, byte_range) -> Any:
    """The bytes of ``key`` (a ``zarr.abc.store.ByteRequest`` or None), as zarr's ObjectStore
    asks obstore for them, through the blocking functions; FileNotFoundError if it is missing."""
    import obstore
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if byte_range is None:
        return obstore.get(store, key).bytes()
    if isinstance(byte_range, RangeByteRequest):
        return obstore.get_range(store, key, start=byte_range.start, end=byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return obstore.get(store, key, options={"range": {"offset": byte_range.offset}}).bytes()
    if isinstance(byte_range, SuffixByteRequest):
        try:
            return obstore.get(store, key, options={"range": {"suffix": byte_range.suffix}}).bytes()
        except obstore.exceptions.NotSupportedError:  # Azure: no suffix requests
            size = obstore.head(store, key)["size"]
            if size == 0 or byte_range.suffix == 0:
                return b""
            start = max(0, size - byte_range.suffix)
            return obstore.get_range(store, key, start=start, end=size)
    raise ValueError(f"Unexpected byte_range, got {byte_range}")


def _next_batch(stream) -> list | None:
    return next(stream, None)  # StopIteration cannot cross a Future


def _relative(path: str, prefix: str) -> str:
    if not prefix:
        return path
    if not path.startswith(prefix + "/"):
        raise ValueError(f"the listing of {prefix!r} returned {path!r}, which is not under it")
    return path[len(prefix) + 1 :]


class ThreadedObjectStore(ObjectStore):
    """zarr-python's ``ObjectStore``, each request made with obstore's blocking functions on a
    Python thread pool instead of awaiting obstore's ``*_async`` functions, so that obstore's own
    threads never call into the interpreter (see the comment above: they can abort the process as
    it exits).  Same results and errors as zarr's ``ObjectStore``."""

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        try:
            data = await _blocking(_get_bytes, self.store, key, byte_range)
        except _ALLOWED_MISSING:
            return None
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(key, prototype, byte_range) for key, byte_range in key_ranges)))

    async def exists(self, key: str) -> bool:
        import obstore

        try:
            await _blocking(obstore.head, self.store, key)
        except FileNotFoundError:
            return False
        return True

    async def set(self, key: str, value: Buffer) -> None:
        import obstore

        self._check_writable()
        await _blocking(obstore.put, self.store, key, value.as_buffer_like())

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        import obstore

        self._check_writable()
        with contextlib.suppress(obstore.exceptions.AlreadyExistsError):
            await _blocking(obstore.put, self.store, key, value.as_buffer_like(), mode="create")

    async def delete(self, key: str) -> None:
        import obstore

        self._check_writable()
        with contextlib.suppress(FileNotFoundError):  # as zarr's: a missing key is no error
            await _blocking(obstore.delete, self.store, key)

    async def delete_dir(self, prefix: str) -> None:
        import obstore

        self._check_writable()
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        keys = [meta["path"] async for meta in self._list(prefix)]
        for start in range(0, len(keys), 1000):
            with contextlib.suppress(FileNotFoundError):
                await _blocking(obstore.delete, self.store, keys[start : start + 1000])

    async def _list(self, prefix: str | None = None) -> AsyncGenerator[Any, None]:
        import obstore

        stream = await _blocking(obstore.list, self.store, prefix=prefix, chunk_size=1000)
        while (batch := await _blocking(_next_batch, stream)) is not None:
            for meta in batch:
                yield meta

    def list_dir(self, prefix: str) -> AsyncGenerator[str, None]:
        return self._list_dir(prefix)

    async def _list_dir(self, prefix: str) -> AsyncGenerator[str, None]:
        import obstore

        result = await _blocking(obstore.list_with_delimiter, self.store, prefix=prefix)
        prefix = prefix.rstrip("/")
        for path in [*result["common_prefixes"], *(meta["path"] for meta in result["objects"])]:
            yield _relative(path, prefix)

    async def getsize(self, key: str) -> int:
        import obstore

        return (await _blocking(obstore.head, self.store, key))["size"]


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
        self.url = url.rstrip("/")
        self._options = storage_options
        self._store = build_store(self.url, storage_options, deadline=io_timeout)
        self._cancelled = False
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
        plan = _recognise(_KeyTree(keys, self._read_capped))
        if not overwrite:  # the hint to overwrite only where an overwrite would go ahead
            if plan.reasons() is None:
                raise StoreExistsError(
                    f"{self.url!r} already holds {len(keys)} objects; {_OVERWRITE_HINT} to replace them"
                )
            raise StoreExistsError(plan.exists_message(self.url))
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

        views = byte_views(check_key(key), buffers)
        nbytes = sum(v.nbytes for v in views)
        store = self._after_cancel if self._cancelled else self._store
        try:
            if nbytes <= self.part_size:
                payload: Any = views[0] if len(views) == 1 else views
                obstore.put(store, key, payload if views else b"", use_multipart=False)
                parts = 0
            else:
                part_size = part_size_for(nbytes, self.part_size)  # before the upload starts
                obstore.put(
                    store, key, views, use_multipart=True, chunk_size=part_size, max_concurrency=self.max_concurrency
                )
                parts = -(-nbytes // part_size)
        except ValueError:
            raise
        except Exception as exc:
            raise ObjectStoreError(describe_failure(f"{self.url}/{key}", "writing", exc, self._options)) from exc
        with self._lock:
            self._written.add(key)
            self.stats["objects"] += 1
            self.stats["bytes"] += nbytes
            self.stats["multipart_objects"] += parts > 0
            self.stats["parts"] += parts
            self.stats["requests"] += parts + 2 if parts else 1  # create + parts + complete

    def cancel(self) -> None:
        """The recording failed: writes in flight end within their deadline (obstore's requests
        cannot be interrupted from Python without a thread of its calling into the interpreter);
        later writes (``zarr.json`` marked failed) get a short deadline of their own."""
        with self._lock:
            if not self._cancelled:
                self._after_cancel = build_store(self.url, self._options, deadline=_AFTER_CANCEL_S)
                self._cancelled = True

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
