import sys, threading, time
from pymmcore_plus.mda import mda_listeners_connected
from pymmcore_plus.mda.events import MDASignaler


class H:
    def __init__(s):
        s.fin = 0

    def frameReady(s, *a):
        pass

    def sequenceFinished(s, *a):
        s.fin += 1


lost = 0
N = int(sys.argv[1])
sys.setswitchinterval(1e-6)
for i in range(N):
    ev = MDASignaler()
    h = H()
    with mda_listeners_connected(h, mda_events=ev):
        ev.sequenceStarted.emit(None, {})
        time.sleep(0.0049 + (i % 20) * 1e-5)
        ev.sequenceFinished.emit(None)
    lost += h.fin == 0
print("lost", lost, "of", N)
