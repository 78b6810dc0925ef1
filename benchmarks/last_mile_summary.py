"""Summaries for benchmarks/last_mile_device.sh.

    python benchmarks/last_mile_summary.py spy FILE      # py-spy raw stacks: active samples per role
    python benchmarks/last_mile_summary.py logs DIR      # the figures of a run, with their ratios

``spy`` sorts each sampled stack (py-spy ``--format raw``: frames joined by ``;``, the count last)
into the role of its thread, by the functions on it: the camera, the recording loop (and within
it the staging copy and the waits for the pipeline), the copy helpers, the collector, the shard
writes, the preview reads, pinning, the benchmark's own thread; and lists the hottest leaves.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ROLES = [  # (role, any of these on the stack); the first that matches wins
    ("camera render", ("SyntheticCamera.prepare", "_Bank.render_all", "_render_into", "SyntheticCamera._render")),
    ("camera thread (pace, push)", ("feed_synthetic", "run_layer")),
    ("recording loop: staging copy", ("StagingRing._copy", "StagingRing.copy_in")),
    ("recording loop: submit/wait", ("Writer._submit_current", "staging_free", "StagingRing.acquire")),
    ("recording loop: other", ("Recorder.run",)),
    ("preview reads", ("PreviewReader", "read_newest", "read_first")),
    ("collector", ("Collector._run",)),
    ("shard writes", ("Dispatcher._work", "DirectorySink")),
    ("pinning", ("_fault_in", "PinnedRecycler", "pin (")),
    ("writer setup/close", ("Writer.__init__", "Writer.close", "Writer._finish", "warm_up")),
    ("verify", ("_ShardChecker", "verify (napari_tileshard")),
    ("copy helpers / pools", ("_WorkItem.run", "_worker")),
    ("benchmark thread", ("run_writer", "run_path", "<module>")),
]


def role_of(frames: list[str]) -> str:
    text = ";".join(frames)
    for role, marks in ROLES:
        if any(mark in text for mark in marks):
            return role
    return "other"


def spy(path: Path) -> None:
    roles: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        roles[role_of(frames)] += n
        leaves[frames[-1].split(" (")[0] + " (" + frames[-1].split(" (")[-1]] += n
    print(f"# {path.name}: {total} active samples (250/s, every thread)")
    for role, n in roles.most_common():
        print(f"{n / 250:8.2f} s  {100 * n / max(total, 1):5.1f} %  {role}")
    print("# hottest leaves")
    for leaf, n in leaves.most_common(15):
        print(f"{n / 250:8.2f} s  {leaf[:140]}")


def rows(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def logs(directory: Path) -> None:
    for name in ("info.txt", "parts.txt", "skipped.txt"):
        if (directory / name).exists():
            print(f"## {name}\n{(directory / name).read_text().rstrip()}")
    for name in ("discard.log", "discard_10s.log", "shm.log", "issue_setting_base.log", "issue_setting_new.log"):
        path = directory / name
        if path.exists():
            table = [line for line in path.read_text().splitlines() if not line.startswith("{")]
            print(f"## {name}\n" + "\n".join(table[-14:]))
    for name in ("discard.json", "discard_10s.json", "shm.json", "disk_recorder.json"):
        found = rows(directory / name)
        if not found:
            continue
        print(f"## {name}: where the time goes (seconds over the run; per frame in ms)")
        for r in found:
            if r.get("search"):
                print(
                    f"  search {r['fps']:g} f/s: dropped {r['dropped']}, {r['gbps']:.2f} GB/s, append p99 "
                    f"{r.get('append_p99_ms')} ms, GC {r.get('gc_full')} full, "
                    f"longest {r.get('gc_longest_ms', 0):.1f} ms"
                )
                continue
            n = max(r["frames"], 1)
            parts = {k: r.get(k) for k in ("append_s", "copy_s", "queue_wait_s", "source_s", "io_busy_s", "sync_s")}
            per = ", ".join(f"{k} {v:.2f} ({1e3 * v / n:.3f})" for k, v in parts.items() if isinstance(v, float))
            print(
                f"  {r['path']:9s} {r['fps']:g} f/s: {r['frames']} frames, dropped {r['dropped']}, "
                f"{r['gbps']:.2f} GB/s, CPU {r.get('cpu_s_per_gb', 0):.2f} s/GB, arm {r.get('arm_s')}, "
                f"max queue {r.get('max_queue')}; {per}; GC: {r.get('gc_full')} full of {r.get('gc_collections')}, "
                f"longest {r.get('gc_longest_ms', 0):.1f} ms"
            )
    texts = (
        "hashes.log",
        "hashes_diff.txt",
        "copy_paths.log",
        "soak.log",
        "mda.log",
        "mda_cpu_big_buffer.log",
        "mda_base.log",
        "disk_bandwidth.json",
        "disk_cli.log",
    )
    for name in texts:
        path = directory / name
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if not line.startswith("{") or "json" in name]
            print(f"## {name}\n" + "\n".join(lines[-12:]))
    disk = rows(directory / "disk_bandwidth.json") if (directory / "disk_bandwidth.json").exists() else None
    recorded = rows(directory / "disk_recorder.json")
    if isinstance(disk, dict) and recorded:
        bandwidth = disk["direct_gbps"]
        for r in recorded:
            input_bytes = r["gbps"] * r["clock_s"] * 1e9
            compression = input_bytes / r["bytes_out"] if r.get("bytes_out") else float("nan")
            durable = input_bytes / (r["clock_s"] + r.get("close_s", 0) + r.get("sync_s", 0)) / 1e9
            print(
                f"## disk: {r['path']} {r['gbps']:.2f} GB/s in (compression {compression:.2f}); disk direct "
                f"{bandwidth:.2f} GB/s x ratio = {bandwidth * compression:.2f} GB/s; "
                f"x {r['gbps'] / (bandwidth * compression):.2f} of it; with close and sync {durable:.2f} GB/s "
                f"(sync {r.get('sync_s', 0):.2f} s)"
            )
    path = directory / "pytest_gpu.log"
    if path.exists():
        print("## pytest -m gpu\n" + "\n".join(path.read_text().splitlines()[-6:]))
    for path in sorted(directory.glob("spy_*.summary")):
        print(f"## {path.name}\n{path.read_text().rstrip()}")


def main() -> None:
    mode, target = sys.argv[1], Path(sys.argv[2])
    spy(target) if mode == "spy" else logs(target)


if __name__ == "__main__":
    main()
