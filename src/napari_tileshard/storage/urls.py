"""Which sink or zarr Store a path, URL or Store means: the one routing for writers
(:func:`open_sink`) and readers (:func:`resolve_store`).

A local path or ``file://`` URL is a :class:`~.sinks.DirectorySink`; ``s3://``, ``gs://``,
``az://`` go through obstore (:mod:`.object_store`) when it is installed; any other URL through
an installed fsspec filesystem; ``memory://`` a private MemoryStore.  A URL that nothing installed
handles is an error, never a local directory named after the URL.
"""

from __future__ import annotations

import importlib.util
import os

from ._zarr_sync import sync
from .object_store import INSTALL_OBSTORE, SCHEMES, ObjectStoreSink, is_object_store_url, reader_store
from .sinks import DirectorySink, Sink, ZarrStoreSink, check_store_path

__all__ = ["list_shard_keys", "open_sink", "resolve_store"]


def open_sink(
    store, overwrite: bool = False, storage_options: dict | None = None, io_timeout: float | None = 60.0
) -> Sink:
    """A sink for ``store``: a local path, a ``file://`` URL, ``memory://``, an object store URL
    (``s3://``, ``gs://``, ``az://`` through obstore: :class:`~napari_tileshard.storage.object_store.ObjectStoreSink`),
    any URL an installed fsspec filesystem handles, a zarr v3 ``Store``, or a :class:`Sink`
    (returned as it is).  ``storage_options`` configure URL stores (endpoint, credentials, ...).
    A URL that no installed store handles is an error, never a local directory named after the URL.
    ``io_timeout``: the deadline of one object-store write (see ``object_store.write_deadline``)."""
    from zarr.storage import LocalStore

    if isinstance(store, Sink):
        return store
    check_store_path(store)
    if isinstance(store, str) and "://" in store:
        return _url_sink(store, overwrite, storage_options, io_timeout)
    if isinstance(store, (str, os.PathLike)):
        return DirectorySink(store, overwrite)
    if isinstance(store, LocalStore):
        if store.read_only:
            raise PermissionError(f"store {store!r} is read-only")
        return DirectorySink(store.root, overwrite)
    if hasattr(store, "set") and hasattr(store, "get"):
        return ZarrStoreSink(store, overwrite)
    raise TypeError(f"store must be a path, a store URL or a zarr v3 Store, got {type(store).__name__}")


def resolve_store(store, *, read_only: bool = True, storage_options: dict | None = None):
    """The zarr Store (or local path) that readers use for the same inputs as :func:`open_sink`."""
    check_store_path(store)
    if isinstance(store, str) and "://" in store:
        scheme = store.split("://", 1)[0].lower()
        if scheme == "file":
            return store[len("file://") :]
        if _through_obstore(store):
            return reader_store(store, storage_options, read_only=read_only)
        _check_scheme(scheme)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(store, storage_options=storage_options, read_only=read_only)
    return store


def _through_obstore(url: str) -> bool:
    """S3, GCS and Azure URLs go through obstore when it is installed (object_store.py), else
    through fsspec (s3fs, gcsfs, adlfs) as any other URL."""
    return is_object_store_url(url) and importlib.util.find_spec("obstore") is not None


def _check_scheme(scheme: str) -> None:
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        if scheme in SCHEMES:
            # fsspec's own hint ("Install s3fs to access S3") names the fallback, not the client
            # this package records with.
            hint = f"{scheme}:// URLs are written and read through obstore, which is not installed: {INSTALL_OBSTORE}"
        else:
            from fsspec.registry import known_implementations

            known = known_implementations.get(scheme, {})
            hint = known.get("err") or ("" if known else "no fsspec filesystem is registered for it")
        raise ValueError(f"no installed store handles {scheme!r} URLs: {hint or exc}") from None


def _url_sink(url: str, overwrite: bool, storage_options: dict | None, io_timeout: float | None) -> Sink:
    scheme = url.split("://", 1)[0].lower()
    if scheme == "file":  # a local directory: keep the lock, atomic renames and safe overwrite
        return DirectorySink(url[len("file://") :], overwrite)
    if scheme == "memory":
        from zarr.storage import MemoryStore

        return ZarrStoreSink(MemoryStore(), overwrite, private=True)
    # Object stores: each object is one PUT (atomic); there is no rename and no lock, so one
    # writer per prefix is the caller's responsibility.
    if _through_obstore(url):
        return ObjectStoreSink(url, overwrite, storage_options, io_timeout=io_timeout)
    return ZarrStoreSink(resolve_store(url, read_only=False, storage_options=storage_options), overwrite)


def list_shard_keys(store, prefix: str = "") -> list[str]:
    """Keys (relative to ``prefix``) of the shard objects under ``c/`` that exist in a zarr Store,
    skipping hidden temporary files; never walks a declared grid."""

    async def collect():
        base = f"{prefix}/c/" if prefix else "c/"
        return [key[len(prefix) + 1 :] if prefix else key async for key in store.list_prefix(base)]

    return [k for k in sync(collect()) if not k.rsplit("/", 1)[-1].startswith(".")]
