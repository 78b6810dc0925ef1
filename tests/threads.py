"""Running test threads so that their races show: CPython switching between them as often as it can."""

import sys
import threading
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
