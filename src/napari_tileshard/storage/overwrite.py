"""What ``overwrite`` may replace: only a store this recorder writes.

A store is recognised before anything is deleted: a Zarr v3 array of ours (``zarr.json`` and
``c/`` chunk keys), an OME-Zarr group of such arrays, or a collection of them; anything else in
it (a user's file, a foreign array, a symlink, a FIFO) makes the overwrite a refusal naming it.
Deletion then removes exactly the recognised keys, data before ``zarr.json`` (so an interrupted
overwrite is recognised again), never a whole tree.  The same rules serve local directories
(:class:`LocalTree`, read without following symlinks) and object stores (:class:`KeyTree`).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..format.metadata import METADATA_KEY
from ..format.ome import COLLECTION_KEY, is_collection, multiscale_paths

__all__ = [
    "CONVERT_MANIFEST_NAME",
    "LOCK_NAME",
    "METADATA_CAP",
    "OVERWRITE_HINT",
    "TAKEOVER_NAME",
    "TEMP_NAME",
    "KeyTree",
    "LocalTree",
    "Unreadable",
    "delete_local",
    "deletion_order",
    "overwrite_refusal",
    "path_depth",
    "read_capped",
    "recognise",
]


LOCK_NAME = ".tileshard.lock"


#: the manifest of a conversion (napari_tileshard.apps.convert): which shard epochs are done
CONVERT_MANIFEST_NAME = ".tileshard-convert.json"
TAKEOVER_NAME = LOCK_NAME + ".takeover"  # serialises takers-over of a stale lock


METADATA_CAP = 16 << 20


#: the name of a write's temporary file (DirectorySink: ``.<name>.<12 hex digits>.tmp``, renamed onto <name>)
TEMP_NAME = re.compile(r"\.[^/]+\.[0-9a-f]{12}\.tmp")


_CHUNK_NAME = re.compile(r"[0-9]+")


OVERWRITE_HINT = "use overwrite=True (--overwrite on the command line)"


class Unreadable(Exception):
    """A metadata or lock object that cannot be trusted; the message says why."""


def read_capped(path, cap: int) -> bytes:
    """A regular file's bytes; never follows a symlink nor blocks on a FIFO (raises Unreadable)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable("is not a regular file")
    if st.st_size > cap:
        raise Unreadable(f"is larger than {cap >> 20} MiB")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        raise Unreadable(f"cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise Unreadable("was replaced while being read")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise Unreadable(f"is larger than {cap >> 20} MiB")
    return data


def parse_metadata(data: bytes) -> dict:
    if not data.strip():
        raise Unreadable("is empty")
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise Unreadable("is not JSON") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") not in ("array", "group"):
        raise Unreadable("is not Zarr v3 metadata")
    return meta


class _Plan:
    """What an overwrite may delete (``files``, then ``dirs`` once empty) or why it may not."""

    def __init__(self):
        self.files: list[str] = []
        self.dirs: list[str] = []
        self.foreign: list[str] = []
        self.problems: list[str] = []

    def reasons(self) -> str | None:
        """Why an overwrite is refused (``it holds 'thesis.tex' which this recorder did not
        write``), or None when it may go ahead."""
        parts = list(self.problems)
        if self.foreign:
            names = ", ".join(repr(n) for n in self.foreign[:5])
            if len(self.foreign) > 5:
                names += f" and {len(self.foreign) - 5} more"
            parts.append(f"it holds {names} which this recorder did not write")
        return "; ".join(parts) if parts else None

    def refusal(self, location: str) -> str | None:
        reasons = self.reasons()
        return f"refusing to overwrite {location!r}: {reasons}" if reasons else None

    def exists_message(self, location: str) -> str:
        """What to say when ``location`` exists, is not empty and overwrite was not asked for:
        the overwrite hint only where an overwrite would go ahead, never for a store it refuses
        (a folder with someone's thesis in it)."""
        reasons = self.reasons()
        if reasons is None:
            return f"output {location!r} already exists and is not empty; {OVERWRITE_HINT} to replace it"
        return (
            f"output {location!r} already exists and is not a store this recorder may replace: {reasons}; "
            "choose another output"
        )


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def recognise(tree) -> _Plan:
    """Classify a store's tree (``tree.entries(rel)`` -> {name: "file"|"dir"|"other"},
    ``tree.read(rel)`` -> bytes) as a Zarr v3 array, an OME-Zarr group of arrays, or a collection
    of those (:class:`~napari_tileshard.engine.multi_writer.MultiWriter`), as written here."""
    plan = _Plan()
    top = tree.entries("")
    meta = _node_metadata(tree, "", top, plan, "its zarr.json")
    if meta is None and METADATA_KEY not in top and any(_foreign_name(n, k, True) for n, k in top.items()):
        plan.problems.append("it is not a zarr store (no zarr.json)")
    _members(tree, "", top, _node_members(meta, "", plan, collection=True), plan, root=True)
    return plan


def _node_members(meta: dict | None, rel: str, plan: _Plan, collection: bool = False) -> dict:
    """What the node described by ``meta`` may hold: its chunks (an array), its levels (an
    OME-Zarr image) or, at the root, its streams (a collection)."""
    if meta is None:
        return {}
    if meta["node_type"] == "array":
        return {"c": _chunks}

    attributes = meta.get("attributes") or {}
    if collection and is_collection(attributes):
        members = {"OME": _series_group}
        for path in attributes[COLLECTION_KEY]["streams"].values():
            if _plain_name(path, plan, "stream"):
                members[path] = _image
        return members
    try:
        paths = multiscale_paths(attributes)
    except ValueError as exc:
        plan.problems.append(f"{_join(rel, METADATA_KEY)!r}: {exc}" if rel else f"its zarr.json: {exc}")
        return {}
    if paths is None:
        where = f"{_join(rel, METADATA_KEY)!r}" if rel else "its zarr.json"
        plan.problems.append(f"{where} describes a group without OME-Zarr multiscales")
        return {}
    return {path: _dataset for path in paths if _plain_name(path, plan, "OME-Zarr dataset")}


def _plain_name(path, plan: _Plan, what: str) -> bool:
    if not isinstance(path, str) or "/" in path or path in ("", ".", "..", METADATA_KEY) or path.startswith("."):
        plan.problems.append(f"its {what} path {path!r} is not one this recorder writes")
        return False
    return True


def _image(tree, rel, plan) -> None:
    """One stream of a collection: an OME-Zarr image group, or a bare array."""
    entries = tree.entries(rel)
    meta = _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    if meta is None and METADATA_KEY not in entries:
        plan.problems.append(f"stream {rel!r} has no zarr.json")
    _members(tree, rel, entries, _node_members(meta, rel, plan), plan)
    plan.dirs.append(rel)


def _series_group(tree, rel, plan) -> None:
    """The collection's ``OME/`` group: its zarr.json only."""
    entries = tree.entries(rel)
    _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    _members(tree, rel, entries, {}, plan)
    plan.dirs.append(rel)


def _foreign_name(name: str, kind: str, root: bool) -> bool:
    if root and name in (LOCK_NAME, TAKEOVER_NAME, CONVERT_MANIFEST_NAME):
        return kind != "file"
    return not (kind == "file" and TEMP_NAME.fullmatch(name))


def _node_metadata(tree, rel, entries, plan, what) -> dict | None:
    key = _join(rel, METADATA_KEY)
    kind = entries.get(METADATA_KEY)
    if kind is None:
        return None
    try:
        if kind != "file":
            raise Unreadable("is not a regular file")
        meta = parse_metadata(tree.read(key))
    except Unreadable as exc:
        plan.problems.append(f"{what} {exc}")
        return None
    except FileNotFoundError:
        plan.problems.append(f"{what} vanished while being read")
        return None
    plan.files.append(key)
    return meta


def _members(tree, rel, entries, members, plan, root=False) -> None:
    for name, kind in entries.items():
        path = _join(rel, name)
        if name == METADATA_KEY:  # classified by _node_metadata
            continue
        if kind == "dir" and name in members:
            members[name](tree, path, plan)
        elif not _foreign_name(name, kind, root):
            if name not in (LOCK_NAME, TAKEOVER_NAME):  # the lock is the overwriter's own now
                plan.files.append(path)
        else:
            plan.foreign.append(path + "/" if kind == "dir" else path)


def _dataset(tree, rel, plan) -> None:
    entries = tree.entries(rel)
    meta = _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    if meta is not None and meta["node_type"] != "array":
        plan.problems.append(f"{_join(rel, METADATA_KEY)!r} is not array metadata")
        plan.files.remove(_join(rel, METADATA_KEY))
        meta = None
    elif meta is None and METADATA_KEY not in entries:
        plan.problems.append(f"dataset {rel!r} has no zarr.json")
    _members(tree, rel, entries, {"c": _chunks} if meta is not None else {}, plan)
    plan.dirs.append(rel)


def _chunks(tree, rel, plan) -> None:
    for name, kind in tree.entries(rel).items():
        path = _join(rel, name)
        if _CHUNK_NAME.fullmatch(name) and kind == "dir":
            _chunks(tree, path, plan)
        elif (_CHUNK_NAME.fullmatch(name) or TEMP_NAME.fullmatch(name)) and kind == "file":
            plan.files.append(path)
        else:
            plan.foreign.append(path + "/" if kind == "dir" else path)
    plan.dirs.append(rel)


def overwrite_refusal(path) -> str | None:
    """Why ``overwrite=True`` would refuse the local directory ``path`` (it holds something this
    recorder did not write), or None when it may be replaced (or does not exist / is empty).
    Read-only: what a form checks before Start, by the same rules the Writer applies."""
    root = Path(path).expanduser()
    if not root.exists():
        return None
    if not root.is_dir():
        return f"output path {str(root)!r} exists and is not a directory"
    if not any(root.iterdir()):
        return None
    return recognise(LocalTree(root.resolve())).refusal(str(root))


class LocalTree:
    def __init__(self, root: Path):
        self.root = root

    def entries(self, rel: str) -> dict:
        result = {}
        try:
            with os.scandir(self.root / rel) as it:
                for entry in it:
                    if entry.is_symlink():
                        kind = "other"
                    elif entry.is_dir(follow_symlinks=False):
                        kind = "dir"
                    else:
                        kind = "file" if entry.is_file(follow_symlinks=False) else "other"
                    result[entry.name] = kind
        except FileNotFoundError:
            pass
        return dict(sorted(result.items()))

    def read(self, rel: str) -> bytes:
        return read_capped(self.root / rel, METADATA_CAP)


def _open_dir(root_fd: int, rel: str) -> int:
    """A descriptor of ``rel`` under ``root_fd``, refusing any symlink on the way."""
    fd = os.dup(root_fd)
    for part in filter(None, rel.split("/")):
        try:
            fd_next = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = fd_next
    return fd


def deletion_order(paths: list[str]) -> tuple[list[str], list[str]]:
    """Data, then ``zarr.json`` files (deepest first): an interrupted overwrite leaves a store that
    the next overwrite still recognises."""
    meta = [p for p in paths if p.rpartition("/")[2] == METADATA_KEY]
    return [p for p in paths if p.rpartition("/")[2] != METADATA_KEY], sorted(meta, key=path_depth, reverse=True)


def path_depth(path: str) -> int:
    return path.count("/")


def delete_local(root: Path, plan: _Plan) -> None:
    data, meta = deletion_order(plan.files)
    dirs = sorted(plan.dirs, key=path_depth, reverse=True)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Dataset directories empty only once their zarr.json is gone: a second pass over dirs.
        for step, remove in ((data, os.unlink), (dirs, os.rmdir), (meta, os.unlink), (dirs, os.rmdir)):
            for parent, paths in itertools.groupby(step, key=lambda p: p.rpartition("/")[0]):
                try:
                    fd = _open_dir(root_fd, parent)
                except FileNotFoundError:
                    continue
                try:
                    for path in paths:
                        try:
                            remove(path.rpartition("/")[2], dir_fd=fd)
                        except OSError as exc:  # gone, or a directory with something new in it: kept
                            if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                                raise
                finally:
                    os.close(fd)
    finally:
        os.close(root_fd)


class KeyTree:
    """A zarr Store's keys seen as a directory tree, for :func:`recognise`."""

    def __init__(self, keys, read):
        self.nodes: dict = {}
        for key in keys:
            node = self.nodes
            *dirs, name = key.split("/")
            for part in dirs:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node.setdefault(name, None)
        self.read = read

    def entries(self, rel: str) -> dict:
        node: Any = self.nodes
        for part in filter(None, rel.split("/")):
            node = node.get(part)
        return {name: "dir" if isinstance(sub, dict) else "file" for name, sub in sorted(node.items())}
