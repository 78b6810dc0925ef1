"""Soak: many short recorder runs at high rates; each must end within --limit x its nominal duration.

    python benchmarks/soak_recorder.py --runs 30 --rates 300:600 --seconds 3 --frame 2304x2304 \\
        --backend gpu --processes 3 --log /tmp/soak.log

Each process (``--processes``, started fresh: a stall seen once came in a fresh process) prepares
what the recorder dock prepares before Start (the camera's frames, ``Writer.warm_up``), then runs
its share of the runs one after the other: the Qt-free ``Recorder`` with its synthetic camera at a
rate between the two of ``--rates`` (frames/s, spread over the runs), policy drop, into a sink
that counts and discards the shards.  A run's time is Start to the store closed; its nominal
duration is frames / rate.  A run still going at ``--limit`` x nominal is reported slow; one still
going ``--stall-s`` later is a stall: the stacks of every thread are dumped (faulthandler) into
the log, and the process ends with status 3 if the run does not end within another minute.
One line per run; the last line of the parent sums up (exit status 1 if any run was slow or stalled).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's code, unless PYTHONPATH names another copy of the package (an A/B against the
# code before runs this same script with PYTHONPATH=/path/to/before/src)
if not any((Path(p) / "napari_tileshard").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def rates_for(spec: str, runs: int) -> list[float]:
    low, high = (float(v) for v in spec.split(":"))
    if runs == 1:
        return [low]
    order = [(k * 7) % runs for k in range(runs)]  # spread, not ascending: neighbours differ
    return [round(low + (high - low) * k / (runs - 1)) for k in order]


def child(args) -> int:
    from bench_recorder import DiscardSink

    from napari_tileshard import Layout, SyntheticCamera, Writer
    from napari_tileshard.apps.recorder import Recorder, RecorderSettings
    from napari_tileshard.engine.backends import gpu_unavailable_reason

    h, w = (int(v) for v in args.frame.split("x"))
    layout = Layout.default_for((0, h, w), "uint16", ("t", "y", "x"))
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - faulthandler writes into it too
    started = time.perf_counter()
    SyntheticCamera((h, w), "uint16", seed=0).prepare()
    base = RecorderSettings(output="unused", layout=layout, backend=args.backend, policy="drop", overwrite=True)
    if args.backend in ("gpu", "auto") and gpu_unavailable_reason() is None:
        Writer.warm_up(base.array_spec(), base.engine_options())
    print(f"# process {args.child}: prepared in {time.perf_counter() - started:.1f} s", file=log)
    status = 0
    for rate in (float(r) for r in args.child_rates.split(",")):
        frames = int(rate * args.seconds)
        nominal = frames / rate
        settings = RecorderSettings(
            output="unused", layout=layout, backend=args.backend, fps=rate, policy="drop", overwrite=True
        )
        sink = DiscardSink()
        finished = threading.Event()  # the store is closed
        recorder = Recorder(settings, on_finished=lambda _, done=finished: done.set(), store=sink)
        begun = time.perf_counter()
        recorder.start(synthetic_frames=frames)
        verdict = "ok"
        if not finished.wait(begun + args.limit * nominal - time.perf_counter()):
            verdict = "slow"
            if not finished.wait(args.stall_s):
                verdict = "STALL"
                print(f"# STALL at {rate:g} frames/s: every thread's stack follows", file=log)
                faulthandler.dump_traceback(file=log, all_threads=True)
                if not finished.wait(60):
                    print("# still stalled after another minute: ending the process", file=log)
                    log.flush()
                    return 3
        recorder.join()
        wall = time.perf_counter() - begun
        s = recorder.stats
        row = {
            "process": args.child,
            "fps": rate,
            "frames": s.frames,
            "dropped": s.dropped,
            "nominal_s": round(nominal, 3),
            "wall_s": round(wall, 3),
            "x_nominal": round(wall / nominal, 3),
            "arm_s": round(s.arm_s, 3),
            "verdict": verdict,
            "error": s.error,
            "shards": sink.objects,
        }
        print(json.dumps(row), file=log)
        if verdict != "ok" or s.error:
            status = 1
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--rates", default="300:600", help="low:high frames/s")
    parser.add_argument("--seconds", type=float, default=3.0, help="nominal seconds per run")
    parser.add_argument("--frame", default="2304x2304")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--limit", type=float, default=1.5)
    parser.add_argument("--stall-s", type=float, default=20.0)
    parser.add_argument("--log", default="/tmp/soak_recorder.log")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-rates", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child(args)
    Path(args.log).write_text("")
    rates = rates_for(args.rates, args.runs)
    shares = [rates[k :: args.processes] for k in range(args.processes)]
    started = time.perf_counter()
    codes = []
    for number, share in enumerate(shares):
        if not share:
            continue
        command = [sys.executable, __file__, "--child", str(number), "--child-rates", ",".join(map(str, share))]
        for name in ("seconds", "frame", "backend", "limit", "stall_s", "log"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        codes.append(subprocess.run(command).returncode)
    rows = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line.startswith("{")]
    worst = max((r["x_nominal"] for r in rows), default=float("nan"))
    bad = [r for r in rows if r["verdict"] != "ok" or r["error"]]
    print(Path(args.log).read_text(), end="")
    print(
        f"# soak: {len(rows)} of {args.runs} runs at {args.rates} frames/s of {args.frame}, {args.seconds:g} s each, "
        f"in {len(codes)} processes, {time.perf_counter() - started:.0f} s; worst {worst:.2f}x nominal "
        f"(limit {args.limit:g}x); {len(bad)} slow, stalled or failed; dropped "
        f"{sum(r['dropped'] for r in rows)} of {sum(r['frames'] + r['dropped'] for r in rows)} frames; "
        f"process exit codes {codes}"
    )
    return 0 if not bad and len(rows) == args.runs and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
