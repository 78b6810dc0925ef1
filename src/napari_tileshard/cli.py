"""Command line: ``napari-tileshard record ...`` and ``napari-tileshard verify PATH``."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tqdm import tqdm

from . import codecs
from .camera import SyntheticCamera
from .layout import Dim, Layout
from .pyramid import DOWNSAMPLE
from .store import _OVERWRITE_HINT, StoreExistsError
from .verify import verify
from .writer import Writer

_SPATIAL_NAMES = ("c", "z", "y", "x")


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _axis_values(text: str, kind):
    """``"t=0.02,y=0.65"`` -> ``{"t": 0.02, "y": 0.65}`` (values converted with ``kind``)."""
    values = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE")
        try:
            values[name.strip()] = kind(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {value!r} is not a {kind.__name__}") from None
    return values


def build_layout(shape, tile, tiles_per_shard, dtype, names=None, scale=None, unit=None) -> Layout:
    """A Layout from per-dimension lists, as the CLI and the plugin take them.

    ``scale`` and ``unit`` map dim names to pixel size / frame interval and unit (OME-Zarr axes)."""
    rank = len(shape)
    if len(tile) != rank or len(tiles_per_shard) != rank:
        raise ValueError(f"--shape has {rank} values but --tile has {len(tile)} and --tiles-per-shard "
                         f"{len(tiles_per_shard)}: give one per dimension")
    if names is None:
        inner = rank - 1
        names = ["t"] + (list(_SPATIAL_NAMES[len(_SPATIAL_NAMES) - inner:]) if inner <= len(_SPATIAL_NAMES)
                         else [f"d{i}" for i in range(1, rank)])
    if len(names) != rank:
        raise ValueError(f"{len(names)} names for {rank} dimensions")
    scale, unit = dict(scale or {}), dict(unit or {})
    unknown = sorted((set(scale) | set(unit)) - set(names))
    if unknown:
        raise ValueError(f"--scale/--unit name {unknown[0]!r}, which is not one of the dims {list(names)}")
    return Layout([Dim(n, s, t, p, unit=unit.get(n), scale=scale.get(n, 1.0))
                   for n, s, t, p in zip(names, shape, tile, tiles_per_shard)], dtype=dtype)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="napari-tileshard", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the writer decides")
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="record a (synthetic) camera stream to a sharded Zarr v3 array")
    record.add_argument("output", help="output store path, e.g. demo.zarr")
    record.add_argument("--shape", type=_int_list, default=[0, 2048, 2048],
                        help="array shape, slowest first; 0 first = unbounded append dim (default 0,2048,2048)")
    record.add_argument("--tile", type=_int_list, default=[32, 256, 256], help="tile (chunk) shape")
    record.add_argument("--tiles-per-shard", type=_int_list, default=[1, 4, 4], help="tiles per shard per dim")
    record.add_argument("--names", type=lambda s: s.split(","), default=None, help="dimension names")
    record.add_argument("--dtype", default="uint16")
    record.add_argument("--frames", type=int, default=256, help="camera frames to record")
    record.add_argument("--codec", choices=codecs.names(), default="zstd")
    record.add_argument("--level", type=int, default=1, help="compression level (" + ", ".join(
        f"{c.name} {c.level_range[0]}..{c.level_range[1]}" for c in codecs.CODECS.values() if c.level_range) + ")")
    record.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    record.add_argument("--source", choices=("synthetic",), default="synthetic")
    record.add_argument("--seed", type=int, default=0)
    record.add_argument("--fps", type=float, default=None, help="pace the camera (default: as fast as possible)")
    record.add_argument("--ome", action="store_true",
                        help="write an OME-Zarr 0.5 group with a multiscale pyramid computed while recording")
    record.add_argument("--downsample", choices=DOWNSAMPLE, default="mean", help="pyramid reduction (with --ome)")
    record.add_argument("--downsample-dims", type=lambda s: s.split(","), default=None,
                        help="dims the pyramid halves (with --ome; default: the last two, e.g. y,x; t,y,x adds time)")
    record.add_argument("--max-levels", type=int, default=None,
                        help="pyramid levels including full resolution (default: until a level fits one tile)")
    record.add_argument("--scale", type=lambda s: _axis_values(s, float), default=None,
                        help="physical size per dim for OME-Zarr axes, e.g. t=0.02,y=0.65,x=0.65")
    record.add_argument("--unit", type=lambda s: _axis_values(s, str), default=None,
                        help="unit per dim, e.g. t=second,y=micrometer,x=micrometer")
    record.add_argument("--overwrite", action="store_true")
    record.add_argument("--no-progress", action="store_true")
    gui = sub.add_parser("gui", help="start napari with the Tile/Shard Recorder docked (synthetic camera selected)")
    gui.add_argument("--output", default=None, help="where recordings go (default: ./recording.zarr)")
    check = sub.add_parser("verify", help="check every shard's index, CRC32C and chunks")
    check.add_argument("path")
    return parser


def record(args) -> int:
    layout = build_layout(args.shape, args.tile, args.tiles_per_shard, args.dtype, args.names, args.scale, args.unit)
    frames_possible = None if layout.unbounded else layout.total_elements // layout.frame_elements
    frames = args.frames if frames_possible is None else min(args.frames, frames_possible)
    camera = SyntheticCamera(layout.frame_shape or (1,), layout.dtype, seed=args.seed, fps=args.fps)
    camera.prepare()  # render the frame bank before the clock starts
    pyramid = {"ome": True, "downsample": args.downsample, "downsample_dims": args.downsample_dims,
               "max_levels": args.max_levels} if args.ome else {}
    with Writer(args.output, layout, codec=args.codec, level=args.level, backend=args.backend,
                overwrite=args.overwrite, **pyramid) as writer:
        bar = tqdm(total=frames, unit="frame", disable=args.no_progress, file=sys.stderr,
                   desc=f"recording ({writer.stats.backend})")
        start = time.perf_counter()
        for frame in camera.frames(frames):
            writer.append(frame.reshape(layout.frame_shape))
            bar.update(1)
        bar.close()
    stats = writer.stats
    elapsed = time.perf_counter() - start
    print(f"recorded {stats.frames} frames ({stats.bytes_in / 1e9:.2f} GB) to {writer.location} in {elapsed:.2f} s: "
          f"{stats.bytes_in / elapsed / 1e9:.2f} GB/s, compression ratio {stats.compression_ratio:.2f}, "
          f"{stats.shards_written} shards, backend {stats.backend}"
          + (f", {writer.pyramid.levels} pyramid levels" if args.ome else ""))
    return 0


def gui(args) -> int:
    try:
        import napari
    except ImportError:
        print("napari-tileshard: the GUI needs the napari extra: pip install 'napari-tileshard[napari]'",
              file=sys.stderr)
        return 2
    viewer = napari.Viewer(title="napari-tileshard")
    _, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    if args.output:
        widget.output.setText(args.output)
    napari.run()
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.command == "record":
            return record(args)
        if args.command == "gui":
            return gui(args)
        bar = tqdm(unit="shard", desc="verifying", file=sys.stderr)

        def progress(done, total):
            bar.total = total
            bar.n = done
            bar.refresh()

        report = verify(args.path, progress)
        bar.close()
        print(report)
        return 0 if report.ok else 1
    except StoreExistsError as exc:  # the Python API's hint names overwrite=True; here it is a flag
        print(f"napari-tileshard: error: {str(exc).replace(_OVERWRITE_HINT, 'use --overwrite')}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"napari-tileshard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
