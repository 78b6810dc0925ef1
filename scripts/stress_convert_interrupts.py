"""Interrupts aimed at convert's own writes (the manifest and zarr.json), in a loop.

Two kinds of trials, alternating until ``--minutes`` have passed:

* **aimed in-process**: one conversion (plain array or OME-Zarr) on a thread cluster with a
  Ctrl-C sent at one place of the coordinator's publishing code
  (:class:`napari_tileshard.testing.InterruptAt`); a first run without an interrupt counts the
  places, then each trial picks one of them at random (every place, in a long enough run).
* **real signals**: ``napari-tileshard convert SRC DST --local 1`` as a process; inotify watches
  DST and the moment a temporary file of the manifest or a ``zarr.json`` is created, SIGINT or
  SIGTERM goes to the process.

After each interrupted trial: no temporary file of the coordinator is left, the summary's "claims
its first N of M rows" (or the report's ``rows_claimed``) equals what level 0's ``zarr.json``
says, and ``--resume`` finishes a conversion that verifies, equals the source, and leaves no
temporary file at all.  Prints one line per 20 trials and a summary; exit status 1 on the first
violation (with what was seen).  Linux only (inotify).

    python scripts/stress_convert_interrupts.py --minutes 20
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zarr

from napari_tileshard import Dim, Layout
from napari_tileshard.apps.convert import ConvertInterrupted, convert
from napari_tileshard.testing import InterruptAt

PUBLISHING = {"finished_epoch", "_write_manifest", "_advance", "_write_metadata", "_write", "_writev_all", "begin"}
COORDINATOR_TEMPS = (".zarr.json.", ".tileshard-convert.json.")
IN_CREATE, IN_ISDIR = 0x100, 0x40000000


def coordinator_temps(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp") if p.name.startswith(COORDINATOR_TEMPS))


def all_temps(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


def level0_rows(root: Path, ome: bool) -> int:
    path = root / ("0/zarr.json" if ome else "zarr.json")
    return json.loads(path.read_text())["attributes"]["tileshard"]["rows_written"] if path.exists() else 0


def source_array(shape=(24, 40, 48), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 200, shape) + np.arange(shape[-1])).astype(np.uint16)


def layout_for(a: np.ndarray) -> Layout:
    return Layout([Dim("t", a.shape[0], 2, 2), Dim("y", a.shape[1], 16, 2), Dim("x", a.shape[2], 16, 2)], "uint16")


class Violation(AssertionError):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Violation(what)


# -- aimed in-process -----------------------------------------------------------------------------
def aimed_trial(client, workdir: Path, k: int, ome: bool, a: np.ndarray) -> tuple[bool, int]:
    """One conversion with a Ctrl-C at place ``k``; (interrupted, places seen)."""
    out = workdir / f"aimed-{k}-{int(ome)}.zarr"
    injector = InterruptAt(k, PUBLISHING)
    try:
        with injector:
            convert(a, out, layout_for(a), client=client, backend="cpu", ome=ome, verify=False)
    except ConvertInterrupted as stop:
        check(coordinator_temps(out) == [], f"aimed place {k} ome={ome}: temporary files {coordinator_temps(out)}")
        if stop.started:
            claimed = level0_rows(out, ome)
            said = stop.report.rows_claimed
            check(said == claimed, f"aimed place {k}: report {said}, zarr.json {claimed}")
        deadline = time.monotonic() + 20
        while any(client.processing().values()) and time.monotonic() < deadline:
            time.sleep(0.02)  # the stopped conversion's running tasks finish
        report = convert(a, out, resume=True, client=client)
        check(report.verified.ok, f"aimed place {k}: resumed store does not verify: {report.verified}")
        check(all_temps(out) == [], f"aimed place {k}: after resume {all_temps(out)}")
        np.testing.assert_array_equal(zarr.open_array(out / ("0" if ome else ""))[...], a)
        shutil.rmtree(out)
        return True, injector.seen
    shutil.rmtree(out)
    return False, injector.seen


# -- real signals through inotify ---------------------------------------------------------------------
class Inotify:
    """The creation of files under a directory tree (new directories are watched as they appear)."""

    def __init__(self, root: Path):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, Path] = {}
        self.add(root)

    def add(self, path: Path) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), IN_CREATE)
        if wd >= 0:
            self.dirs[wd] = path

    def created(self, timeout: float) -> list[Path]:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        found, offset = [], 0
        while offset < len(data):
            wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
            name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
            offset += 16 + length
            path = self.dirs.get(wd, Path("?")) / name
            if mask & IN_ISDIR:
                self.add(path)
            found.append(path)
        return found

    def close(self) -> None:
        os.close(self.fd)


def signal_trial(workdir: Path, source: Path, a: np.ndarray, ome: bool, signum: int, nth: int) -> bool:
    """``convert`` as a process, ``signum`` sent when the ``nth`` coordinator temporary file appears."""
    out = workdir / f"signal-{signum}-{nth}-{int(ome)}.zarr"
    out.mkdir()
    watch = Inotify(out)
    argv = [sys.executable, "-m", "napari_tileshard.apps.cli", "convert", str(source), str(out), "--local", "1",
            "--tile", "2,16,16", "--tiles-per-shard", "2,2,2", "--backend", "cpu", "--overwrite"]  # fmt: skip
    if ome:
        argv.append("--ome")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, sent = 0, False
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not sent:
        for path in watch.created(0.05):
            if path.name.startswith(COORDINATOR_TEMPS):
                seen += 1
                if seen == nth:
                    proc.send_signal(signum)
                    sent = True
                    break
    watch.close()
    stdout, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:
        shutil.rmtree(out)
        return False  # finished before the nth write
    check(proc.returncode == 128 + signum, f"signal {signum} at write {nth}: exit {proc.returncode}: {stderr[-2000:]}")
    check(coordinator_temps(out) == [], f"signal {signum} at write {nth}: temporary files {coordinator_temps(out)}")
    said = re.search(r"claims its first (\d+) of (\d+) rows", stderr)
    if said:
        claimed = level0_rows(out, ome)
        check(int(said.group(1)) == claimed, f"signal {signum} at write {nth}: {said.group(0)!r}, zarr.json {claimed}")
    resume_argv = [sys.executable, "-m", "napari_tileshard.apps.cli", "convert", str(source), str(out), "--local", "1"]
    resume = subprocess.run([*resume_argv, "--resume"], capture_output=True, text=True, timeout=300)
    if "nothing to resume" in resume.stderr and not said:
        shutil.rmtree(out)  # stopped before the manifest existed: nothing was claimed
        return True
    check(resume.returncode == 0, f"resume after signal {signum} at write {nth}: {resume.stderr[-2000:]}")
    check(all_temps(out) == [], f"after resume: {all_temps(out)}")
    np.testing.assert_array_equal(zarr.open_array(out / ("0" if ome else ""))[...], a)
    shutil.rmtree(out)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import dask
    import distributed

    random.seed(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="stress-convert-"))
    a = source_array()
    source = workdir / "source.zarr"
    zarr.create_array(source, shape=a.shape, chunks=(4, 40, 48), dtype=a.dtype)[...] = a
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    client = distributed.Client(cluster)
    end = time.monotonic() + args.minutes * 60
    counts = {"aimed": 0, "aimed_interrupted": 0, "signals": 0, "signals_interrupted": 0}
    places: dict[bool, int] = {}
    tried: dict[bool, set] = {False: set(), True: set()}
    for ome in (False, True):  # count the places: a run that no interrupt reaches
        places[ome] = aimed_trial(client, workdir, 10**9, ome, a)[1]
    try:
        while time.monotonic() < end:
            ome = random.random() < 0.5
            if random.random() < 0.5:
                untried = sorted(set(range(1, places[ome] + 1)) - tried[ome])
                k = random.choice(untried or range(1, places[ome] + 1))
                interrupted, _ = aimed_trial(client, workdir, k, ome, a)
                tried[ome].add(k)
                counts["aimed"] += 1
                counts["aimed_interrupted"] += interrupted
            else:
                signum = random.choice([signal.SIGINT, signal.SIGTERM])
                interrupted = signal_trial(workdir, source, a, ome, signum, random.randint(1, 12))
                counts["signals"] += 1
                counts["signals_interrupted"] += interrupted
            done = counts["aimed"] + counts["signals"]
            if done % 20 == 0:
                left = (end - time.monotonic()) / 60
                covered = {ome: f"{len(tried[ome])}/{places[ome]}" for ome in places}
                print(f"{done} trials: {counts}, places tried (plain, ome) {covered}, {left:.1f} min left", flush=True)
    except Violation as exc:
        print(f"VIOLATION: {exc}", flush=True)
        return 1
    finally:
        client.close()
        cluster.close()
        threading.Thread(target=shutil.rmtree, args=(workdir, True), daemon=True).start()
    covered = {ome: f"{len(tried[ome])}/{places[ome]}" for ome in places}
    print(f"done: {counts}; places tried (plain, ome) {covered}; no violation", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
