"""The warm 64 KiB GPU read A/B of this folder's README, as run (PYTHONPATH: one version's src).

python gpu_read64k_ab.py write /dev/shm/g64.zarr 0          # once, with the new code
python gpu_read64k_ab.py read /dev/shm/g64.zarr 5           # per version, alternating
"""

import json
import sys
import time

from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer

mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "write":
    cam = SyntheticCamera((2048, 2048), "uint16")
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 2048, 128, 8), Dim("x", 2048, 128, 8)], "uint16")
    with Writer(path, layout, backend=("gpu" if len(sys.argv) < 5 else sys.argv[4])) as w:
        for i in range(256):
            w.append(cam.frame(i))
    sys.exit()
import cupy as cp  # noqa: E402

out = {}
for device in (False, True):
    r = ShardReader(path, backend="gpu")
    r.read(..., device=device)  # warm
    best = []
    for _ in range(n):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        a = r.read(..., device=device)
        if device:
            cp.cuda.Device().synchronize()
        best.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    out["device" if device else "numpy"] = [round(x, 2) for x in best]
    r.close()
print(json.dumps(out))
