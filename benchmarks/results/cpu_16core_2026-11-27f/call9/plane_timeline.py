"""One-off probe: a timeline of single-plane reads (where the wall time goes), 50 random planes."""
import sys, time, threading, statistics, collections
import numpy as np
from napari_tileshard import ShardReader
from napari_tileshard.reader import cpu, shard_reader
from napari_tileshard.format import codecs

path = sys.argv[1]
workers = int(sys.argv[2]) if len(sys.argv) > 2 else None
events = []
lock = threading.Lock()
def log(name, t0, t1):
    with lock:
        events.append((name, threading.get_ident(), t0, t1))
def wrap(obj, attr, name):
    real = getattr(obj, attr)
    def f(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            log(name, t0, time.perf_counter())
    setattr(obj, attr, f)
wrap(shard_reader.ShardReader, "_plan", "plan")
wrap(shard_reader.ShardReader, "_fetch", "fetch")
wrap(cpu.CpuReadPath, "_start_block", "start_block")
wrap(cpu.CpuReadPath, "_decode_task_unit", "unit")
wrap(codecs.Zstd, "_decoded_runs", "decode_batch")
wrap(cpu, "untile_into", "untile")
wrap(cpu.BlockSource, "__init__", "blocksource")
r = ShardReader(path, backend="cpu", workers=workers)
r.read((0,))
rng = np.random.default_rng(3)
per = collections.defaultdict(list)
walls = []
for t in rng.integers(0, r.shape[0], 50).tolist():
    events.clear()
    s = time.perf_counter(); r.read((t,)); e = time.perf_counter()
    walls.append(e - s)
    ev = list(events)
    for name, tid, a, b in ev:
        per[name + " dur"].append((b - a) * 1e3)
    starts = {}
    for name, tid, a, b in ev:
        starts.setdefault(name, []).append((a - s) * 1e3)
    for name, v in starts.items():
        per[name + " first start"].append(min(v))
        per[name + " last end"].append(max((b - s) * 1e3 for n2, _, a2, b2 in ev if n2 == name for b in [b2]))
    threads = {tid for _, tid, _, _ in ev}
    per["threads"].append(len(threads))
print(f"wall median {statistics.median(walls)*1e3:.2f} ms")
for k in sorted(per):
    v = per[k]
    print(f"{k:28s} median {statistics.median(v):7.3f}  n/plane {len(v)/50:5.1f}")
