"""Interrupts aimed at every place of a piece of code: what a Ctrl-C landing anywhere does.

:class:`InterruptAt` sends the process SIGINT at the ``k``-th place executed in named functions
of the main thread; a test runs the same operation for k = 1, 2, ... until it completes with no
interrupt, so every place between two lines, and every return from a built-in call (the moment
``os.open`` has created a file), has seen an interrupt once.  Python runs the signal's handler
where it would for a real Ctrl-C arriving there: at its next check for signals.
"""

from __future__ import annotations

import linecache
import signal
import sys

__all__ = ["InterruptAt"]


class InterruptAt:
    """Sends this process SIGINT at the ``k``-th place in ``functions`` (code names) of the
    calling thread, counting each line about to run and each return from a built-in call.  A
    context manager (sys.settrace and sys.setprofile of this thread; the main thread's handler
    raises KeyboardInterrupt); :attr:`seen` counts the places passed."""

    def __init__(self, k: int, functions: set[str]):
        self.k, self.functions, self.seen = k, set(functions), 0

    def _count(self) -> None:
        self.seen += 1
        if self.seen == self.k:
            signal.raise_signal(signal.SIGINT)

    def _line(self, frame, event, arg):
        if frame.f_code.co_name not in self.functions:
            return None
        # Not at a `try:` line: under a trace function CPython checks for signals at its NOP, which
        # lies outside the range of the try's own handlers; untraced code never checks there.
        if event == "line" and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "try:":
            self._count()
        return self._line

    def _call(self, frame, event, arg):
        if event == "c_return" and frame.f_code.co_name in self.functions:
            self._count()  # e.g. os.open returned: the file exists, the next bytecode has not run

    def __enter__(self) -> InterruptAt:
        sys.settrace(self._line)
        sys.setprofile(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        sys.setprofile(None)
