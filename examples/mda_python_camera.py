"""Record a pymmcore-plus MDA into sharded OME-Zarr, offline: no Micro-Manager installation needed.

A ``UniMMCore`` gets pure-Python devices (``napari_tileshard.apps.mmcore.demo``: a camera whose frames
come from ``SyntheticCamera``, a Z stage, an XY stage, a shutter, a ``Channel`` group), runs a
t × c × z sequence and hands every frame to ``TileShardSink``; the result opens in napari.

    python examples/mda_python_camera.py                    # records, then shows it in napari
    python examples/mda_python_camera.py --no-viewer out.ome.zarr
"""

from __future__ import annotations

import argparse
import logging

import useq

from napari_tileshard.apps.mmcore import TileShardSink
from napari_tileshard.apps.mmcore.demo import demo_core


def record(output: str, *, frame=(512, 512), timepoints=4, backend="auto", overwrite=True) -> TileShardSink:
    core = demo_core(frame, pixel_size_um=0.325, channels={"DAPI": 10.0, "FITC": 30.0})
    sequence = useq.MDASequence(
        time_plan={"interval": 0.05, "loops": timepoints},
        channels=["DAPI", "FITC"],
        z_plan={"range": 4.0, "step": 0.5},
        axis_order="tcz",
    )
    sink = TileShardSink(output, backend=backend, overwrite=overwrite)
    core.mda.run(sequence, output=sink)  # blocks; core.run_mda(...) runs it on a thread
    return sink


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="mda_python_camera.ome.zarr")
    parser.add_argument("--frame", type=int, nargs=2, default=(512, 512), metavar=("HEIGHT", "WIDTH"))
    parser.add_argument("--timepoints", type=int, default=4)
    parser.add_argument("--backend", default="auto", help="auto, cpu or gpu")
    parser.add_argument("--no-viewer", action="store_true", help="record only (CI, tests)")
    args = parser.parse_args(argv)
    logging.getLogger("pymmcore-plus").setLevel(logging.CRITICAL)  # "no Micro-Manager installation found"

    sink = record(args.output, frame=tuple(args.frame), timepoints=args.timepoints, backend=args.backend)
    s = sink.stats
    print(
        f"{args.output}: axes {''.join(sink.axes)}, {s.written} frames written, {s.dropped} dropped, "
        f"{s.skipped} skipped; MDA thread spent {s.append_s * 1e3:.1f} ms in append"
    )
    if args.no_viewer:
        return
    import napari

    viewer = napari.Viewer()
    viewer.open(args.output, plugin="napari-tileshard")  # every image of the collection, a layer per channel
    napari.run()


if __name__ == "__main__":
    main()
