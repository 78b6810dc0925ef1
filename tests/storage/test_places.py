"""storage.places: every spelling of one place is recognised as the same place."""

import os
import subprocess

import pytest

from napari_tileshard.storage import places
from napari_tileshard.storage.places import file_system_type, in_memory_file_system, overlap, place_of


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "D.zarr" / "c").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "D.zarr", tmp_path / "link.zarr")
    return tmp_path


@pytest.mark.parametrize(
    "spelling, how",
    [
        ("{t}/D.zarr", "is the source"),
        ("{t}/D.zarr/", "is the source"),
        ("{t}/./D.zarr", "is the source"),
        ("{t}/other/../D.zarr", "is the source"),
        ("{t}//D.zarr", "is the source"),
        ("file://{t}/D.zarr", "is the source"),
        ("{t}/link.zarr", "is the source"),  # a symlink to the source
        ("{t}/link.zarr/new.zarr", "is inside the source"),
        ("{t}/D.zarr/new.zarr", "is inside the source"),  # a child that does not exist yet
        ("{t}/D.zarr/c", "is inside the source"),
        ("{t}", "contains the source"),
        ("{t}/..", "contains the source"),
        ("{t}/other", None),
        ("{t}/D.zarr2", None),  # a sibling whose name starts with the source's
        ("{t}/D", None),
        ("memory://D.zarr", None),
        ("s3://D.zarr", None),
    ],
)
def test_local_spellings(tree, spelling, how):
    assert overlap(tree / "D.zarr", spelling.format(t=tree)) == how


def test_a_relative_path_is_the_same_place_as_the_absolute_one(tree, monkeypatch):
    monkeypatch.chdir(tree / "other")
    assert overlap("../D.zarr", tree / "D.zarr") == "is the source"
    assert overlap(tree / "link.zarr", "../D.zarr/") == "is the source"


def test_a_zarr_local_store_is_its_root(tree):
    from zarr.storage import LocalStore

    assert overlap(LocalStore(tree / "D.zarr"), tree / "link.zarr") == "is the source"


def test_a_bind_mount_of_the_source_is_the_source(tree):
    """Different text, one directory: only the file system's identity of it tells."""
    (tree / "mnt").mkdir()
    done = subprocess.run(["mount", "--bind", str(tree / "D.zarr"), str(tree / "mnt")], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        assert overlap(tree / "D.zarr", tree / "mnt") == "is the source"
        assert overlap(tree / "D.zarr", tree / "mnt" / "c" / "x.zarr") == "is inside the source"
        assert overlap(tree / "mnt" / "c", tree / "D.zarr") == "contains the source"
    finally:
        subprocess.run(["umount", str(tree / "mnt")], check=True)


@pytest.mark.parametrize(
    "source, destination, how",
    [
        ("s3://bucket/D.zarr", "s3://bucket/D.zarr", "is the source"),
        ("s3://bucket/D.zarr", "s3://bucket/D.zarr/", "is the source"),
        ("s3://bucket/D.zarr", "s3://bucket//D.zarr", "is the source"),
        ("s3://bucket/D.zarr", "S3://bucket/./D.zarr", "is the source"),
        ("s3://bucket/D.zarr", "s3a://bucket/D.zarr", "is the source"),
        ("s3://bucket/D.zarr", "s3://bucket/D.zarr/0", "is inside the source"),
        ("s3://bucket/D.zarr", "s3://bucket", "contains the source"),
        ("s3://bucket/D.zarr", "s3://bucket/", "contains the source"),
        ("s3://bucket/D.zarr", "s3://bucket/D.zarr2", None),
        ("s3://bucket/D.zarr", "s3://other/D.zarr", None),
        ("s3://bucket/D.zarr", "gs://bucket/D.zarr", None),
        ("gs://b/x", "gcs://b/x", "is the source"),
        ("az://c/x", "abfs://c/x/y", "is inside the source"),
        ("memory://x", "memory://x", None),  # private to each store
    ],
)
def test_url_spellings(source, destination, how):
    assert overlap(source, destination) == how


def test_local_and_url_places_never_overlap(tmp_path):
    assert overlap(tmp_path, "s3://bucket" + str(tmp_path)) is None
    assert place_of(12) is None


def test_file_system_type_is_the_longest_mount_point_above_the_path(tmp_path, monkeypatch):
    """The mount whose point is the longest prefix of the resolved path, the latest of equal
    points (mounted over the others), with the kernel's octal escapes undone; None without a
    mount table (not Linux)."""
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "link")
    table = tmp_path / "mountinfo"
    base = os.path.realpath(tmp_path)
    table.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw\n"
        f"41 22 0:40 / {base}/da rw - xfs /dev/sdb rw\n"  # a prefix of the text, not of the path
        f"42 22 0:41 / {base}/data rw - tmpfs tmpfs rw\n"
        f"43 42 0:42 / {base}/data rw master:7 - nfs4 server:/export rw\n"  # over the one before
        "44 22 0:43 / /mnt/my\\040disk rw - btrfs /dev/sdc rw\n"
        "45 22 0:44 / /broken rw\n"  # no separator: skipped
    )
    monkeypatch.setattr(places, "MOUNT_TABLE", str(table))
    assert file_system_type("/dev/shm/rec.zarr") == "tmpfs" and in_memory_file_system("/dev/shm/rec.zarr")
    assert file_system_type(tmp_path / "link" / "a.zarr") == "nfs4"
    assert file_system_type(tmp_path / "dat") == "ext4" and not in_memory_file_system(tmp_path / "dat")
    assert file_system_type("/mnt/my disk/rec.zarr") == "btrfs"
    assert file_system_type("/broken/x") == "ext4"
    monkeypatch.setattr(places, "MOUNT_TABLE", str(tmp_path / "missing"))
    assert file_system_type("/dev/shm") is None and not in_memory_file_system("/dev/shm")
