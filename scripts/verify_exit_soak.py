"""Soak: ``napari-tileshard verify s3://...`` run many times in a row, each a fresh interpreter; counts
how many exited cleanly with the verdict's exit code (0: no problems, 1: problems) and how many
did not (a signal such as SIGABRT, another exit code, or no report printed).

    python scripts/verify_exit_soak.py --runs 200
    python scripts/verify_exit_soak.py --runs 200 --problems      # a damaged store: exit code 1
    python scripts/verify_exit_soak.py --runs 100 --contend       # on one CPU shared with a busy loop
    python scripts/verify_exit_soak.py --runs 30 --hold           # the race made certain (see HOLD_HOOK)
    python scripts/verify_exit_soak.py --src /path/to/other/src   # the same soak against another tree

A moto S3 server runs in this process on 127.0.0.1 (a random port), as tests/storage/test_s3.py starts
it; a small recording is written to it once (the Writer, CPU backend) and every run verifies it
through the standard AWS_* variables, with ``PYTHONFAULTHANDLER=1`` so that a crash prints what
the issue saw ("Fatal Python error: Aborted").

The crash this soak was written for: obstore's ``*_async`` functions complete on a tokio thread
that calls ``loop.call_soon_threadsafe`` and, inside it, releases the GIL to wake the loop; when
the command had finished and the interpreter was finalizing before that thread took the GIL
back, CPython ended the thread with ``pthread_exit`` and the unwind through obstore's Rust frames
aborted the process (see ``napari_tileshard.storage.object_store.ThreadedObjectStore``).  It needs that
thread to be descheduled at the wrong moment, so it is rare on an idle machine: ``--contend``
pins each run to one CPU shared with a busy loop (as a loaded machine does), and ``--hold``
keeps every such thread away from the GIL until the interpreter finalizes (the worst case of
that scheduling, certain instead of rare): with the cause present every run aborts, without it
none does, and the hook reports whether any thread Python did not start called into the loop.

Measured (2 shared cores, 200 runs each; before: zarr's ObjectStore, after: ThreadedObjectStore):
plain 200/200 clean before and after (the race is rare on its own); --contend 196/200 before
(3 SIGABRT, 1 SIGBUS: faulthandler faulting while it dumps the aborting thread), 200/200 after;
--hold 0/200 before (170 SIGABRT, 30 SIGBUS), 200/200 after, and 200/200 with --problems (exit 1).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

#: Run in each verify process with --hold, before the CLI: a thread that Python did not start
#: (obstore's tokio threads) that wakes an asyncio loop is kept from re-taking the GIL until the
#: interpreter finalizes, the moment at which it aborts the process if it is still there.
HOLD_HOOK = """
import sys, threading, time, asyncio.selector_events as _se
_write_to_self, _said = _se.BaseSelectorEventLoop._write_to_self, []
def _held(self):
    _write_to_self(self)  # socket.send: the GIL is released and taken back here
    if threading.get_ident() not in threading._active:  # a thread Python did not start
        if not _said:
            _said.append(sys.stderr.write("soak-hook: a thread Python did not start called into the event loop\\n"))
        while True:  # each sleep gives the GIL up and takes it back: at finalization, pthread_exit
            time.sleep(0.002)
_se.BaseSelectorEventLoop._write_to_self = _held
"""
HOOK_LINE = "soak-hook: a thread Python did not start"
KEY, SECRET, REGION = "soak-key", "soak-secret", "us-east-1"


def _start_server():
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
    )
    return server, endpoint, client


def _environment(endpoint: str, src: Path) -> dict:
    env = dict(os.environ)
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_REGION=REGION,
        AWS_ALLOW_HTTP="true",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    return env


def _write_store(url: str, env: dict, problems: bool, client, bucket: str, prefix: str) -> None:
    """A small recording (12 frames of 64 x 64, 6 shards), written once by a child process so that
    the ``--src`` tree writes it; ``problems``: one byte of a chunk flipped (verify exits 1)."""
    code = (
        "import sys, numpy as np\n"
        "from napari_tileshard import Dim, Layout, Writer\n"
        "layout = Layout([Dim('t', 0, 2, 2), Dim('y', 64, 32, 2), Dim('x', 64, 32, 1)], 'uint16')\n"
        "frames = np.random.default_rng(1).integers(0, 4000, (12, 64, 64), dtype=np.uint16)\n"
        "with Writer(sys.argv[1], layout, backend='cpu') as writer:\n"
        "    writer.append(frames)\n"
    )
    subprocess.run([sys.executable, "-c", code, url], env=env, check=True)
    if problems:
        key = f"{prefix}/c/0/0/0"
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[10] ^= 0xFF  # inside the first chunk's compressed bytes
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def _busy_competitor(cpu: int) -> subprocess.Popen:
    """A process spinning on ``cpu``: each verify pinned there shares it (a loaded machine)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
        stdin=subprocess.DEVNULL,
    )


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


def soak(runs: int, src: Path, *, problems: bool = False, hold: bool = False, contend: bool = False) -> dict:
    server, endpoint, client = _start_server()
    competitor = None
    try:
        bucket = f"soak-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/soak.zarr"
        env = _environment(endpoint, src)
        _write_store(url, env, problems, client, bucket, "soak.zarr")
        expected = 1 if problems else 0
        head = "import runpy\n" + (HOLD_HOOK if hold else "")
        command = [
            sys.executable,
            "-c",
            head + "runpy.run_module('napari_tileshard.apps.cli', run_name='__main__', alter_sys=True)",
            "verify",
            url,
        ]
        cpu = sorted(os.sched_getaffinity(0))[0]
        preexec = (lambda: os.sched_setaffinity(0, {cpu})) if contend else None
        if contend:
            competitor = _busy_competitor(cpu)
        outcomes: collections.Counter = collections.Counter()
        hooked = 0
        first_failure = None
        started = time.perf_counter()
        for run in range(runs):
            proc = subprocess.run(command, env=env, capture_output=True, text=True, preexec_fn=preexec)
            reported = f"{url}: " in proc.stdout and "chunks checked" in proc.stdout
            clean = proc.returncode == expected and reported
            hooked += HOOK_LINE in proc.stderr
            outcomes["clean" if clean else _describe(proc.returncode) + ("" if reported else ", no report")] += 1
            if not clean and first_failure is None:
                first_failure = {
                    "run": run,
                    "returncode": proc.returncode,
                    "stdout": proc.stdout[-1000:],
                    "stderr_tail": proc.stderr[-2000:],
                }
            if (run + 1) % 25 == 0 or run + 1 == runs:
                print(f"  {run + 1}/{runs}: {dict(outcomes)}", file=sys.stderr, flush=True)
        return {
            "runs": runs,
            "expected_exit_code": expected,
            "clean": outcomes["clean"],
            "failed": runs - outcomes["clean"],
            "outcomes": dict(outcomes),
            "runs_where_a_foreign_thread_called_into_the_loop": hooked if hold else None,
            "hold": hold,
            "contend": contend,
            "src": str(src),
            "seconds": round(time.perf_counter() - started, 1),
            "first_failure": first_failure,
        }
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--problems", action="store_true", help="damage one chunk: the verdict's exit code is 1")
    parser.add_argument("--hold", action="store_true", help="make the exit race certain (HOLD_HOOK)")
    parser.add_argument("--contend", action="store_true", help="pin each run to one CPU shared with a busy loop")
    parser.add_argument(
        "--src",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "src",
        help="the napari_tileshard source tree to run (default: this checkout's)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = soak(args.runs, args.src.resolve(), problems=args.problems, hold=args.hold, contend=args.contend)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
