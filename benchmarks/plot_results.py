"""Plot a bench_write.py JSON: GB/s per engine and tile size, one panel per frame size.

python benchmarks/plot_results.py benchmarks/results/2026-11-21-h200-shm.json docs/benchmarks.png
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["nvcomp-ceiling", "tileshard-gpu", "tileshard-cpu", "tensorstore", "acquire-zarr", "zarr-python"]


def main(source, target):
    data = json.load(open(source))
    frames = sorted({tuple(r["frame"]) for r in data["results"]})
    fig, axes = plt.subplots(1, len(frames), figsize=(6 * len(frames), 4), sharey=True)
    axes = [axes] if len(frames) == 1 else axes
    for ax, frame in zip(axes, frames):
        series = defaultdict(dict)
        for r in data["results"]:
            if tuple(r["frame"]) == frame and r["engine"] in ORDER:
                series[r["engine"]][r["tile_kib"]] = r["gbps"]
        tiles = sorted({k for s in series.values() for k in s})
        width = 0.8 / len(series)
        for i, engine in enumerate(e for e in ORDER if e in series):
            ax.bar(
                [t + i * width for t in range(len(tiles))],
                [series[engine].get(k, 0) for k in tiles],
                width,
                label=engine,
                hatch="//" if engine == "nvcomp-ceiling" else None,
                color=None if engine != "nvcomp-ceiling" else "white",
                edgecolor="black" if engine == "nvcomp-ceiling" else None,
            )
        ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tiles))], [f"{k} KiB" for k in tiles])
        ax.set_title(f"{frame[0]}x{frame[1]} uint16 frames, 4 GiB, zstd 1")
        ax.set_xlabel("tile size")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (frames in -> closed store)")
    axes[0].legend(fontsize=8)
    fig.suptitle(data["machine"], fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=90)


if __name__ == "__main__":
    main(*sys.argv[1:3])
