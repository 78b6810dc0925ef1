"""How often pymmcore-plus's relay thread ends without delivering sequenceFinished (see README.md)."""

import sys
import time

from pymmcore_plus.mda import mda_listeners_connected
from pymmcore_plus.mda.events import MDASignaler


class Handler:
    def __init__(self):
        self.finished = 0

    def frameReady(self, *args):  # noqa: N802 (pymmcore-plus's signal names)
        pass

    def sequenceFinished(self, *args):  # noqa: N802
        self.finished += 1


runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
sys.setswitchinterval(1e-6)  # switch threads often: the window is two slots of one signal
lost = 0
for i in range(runs):
    events, handler = MDASignaler(), Handler()
    with mda_listeners_connected(handler, mda_events=events):
        events.sequenceStarted.emit(None, {})
        time.sleep(0.0049 + (i % 20) * 1e-5)  # about the relay's 5 ms idle sleep
        events.sequenceFinished.emit(None)
    lost += handler.finished == 0
print("lost", lost, "of", runs)
