"""Running test threads so that their races show: CPython switching between them as often as it can."""

import sys
import threading
import time
from collections.abc import Callable, Iterable


def run_switching_often(target: Callable, args: Iterable[tuple]) -> None:
    """One thread per item of ``args`` running ``target(*item)``, all started together and
    joined, with the interpreter's switch interval at its smallest meanwhile (restored after)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=item) for item in args]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)


def threads_left(before: set, prefix: str = "", wait_s: float = 5.0) -> list[str]:
    """The names of the threads (named ``prefix``...) started since ``before``, a set of Thread
    objects, still alive after up to ``wait_s``.  Objects, not idents: the ident of a thread that
    ended is reused by a new one, and threads of earlier tests may end meanwhile."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith(prefix)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)
