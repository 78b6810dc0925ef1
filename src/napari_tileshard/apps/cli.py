"""Command line: napari-tileshard gui | record | verify."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tqdm import tqdm

from ..engine.backends import BACKENDS
from ..engine.options import writer_settings
from ..engine.writer import CloseAbandoned, Writer, WriterError
from ..format import codecs
from ..format.layout import SUPPORTED_DTYPES, Layout, TilingWarning
from ..format.pyramid import DOWNSAMPLE
from ..format.shard_spec import array_metadata
from ..storage.errors import StoreExistsError, StoreLockedError
from ..storage.overwrite import OVERWRITE_HINT as _OVERWRITE_HINT
from ..storage.sinks import check_store_path
from .camera import SyntheticCamera
from .convert import ConvertInterrupted, ResumeMismatch, convert
from .units import data_size, duration, plural
from .verify import missing_store, verify

__all__ = ["FAILURE", "USAGE_ERROR", "build_layout", "convert_command", "gui", "main", "record"]

_SPATIAL_NAMES = ("c", "z", "y", "x")
#: exit statuses: a usage error (a bad option or value, an existing store), a runtime failure
#: (disk full, unreachable storage, a store with problems); 128 + signal after Ctrl-C / SIGTERM
USAGE_ERROR, FAILURE = 2, 1


def _int_at_least(low: int):
    """An argparse type: an integer of at least ``low``, refused naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _store_path(text: str) -> str:
    """A store path or URL argument; an empty one is refused (it would mean the current directory)."""
    try:
        check_store_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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

    ``scale`` and ``unit`` map dim names to pixel size / frame interval and unit (OME-Zarr axes);
    ``tile`` / ``tiles_per_shard``: the sizes asked for, checked and clamped by the one tiling
    (:meth:`Layout.default_for`), its default where None."""
    rank = len(shape)
    if names is None:
        inner = rank - 1
        names = ["t"] + (
            list(_SPATIAL_NAMES[len(_SPATIAL_NAMES) - inner :])
            if inner <= len(_SPATIAL_NAMES)
            else [f"d{i}" for i in range(1, rank)]
        )
    if len(names) != rank:
        raise ValueError(f"{len(names)} names for {rank} dimensions")
    for flag, values in (("--tile", tile), ("--tiles-per-shard", tiles_per_shard)):
        if values is not None and len(values) != rank:
            raise ValueError(f"--shape has {rank} values but {flag} has {len(values)}: give one per dimension")
    scale, unit = dict(scale or {}), dict(unit or {})
    unknown = sorted((set(scale) | set(unit)) - set(names))
    if unknown:
        raise ValueError(f"--scale/--unit name {unknown[0]!r}, which is not one of the dims {list(names)}")
    layout = Layout.default_for(shape, dtype, names, tile=tile, tiles_per_shard=tiles_per_shard)
    return Layout([replace(d, unit=unit.get(d.name), scale=scale.get(d.name, 1.0)) for d in layout.dims], dtype)


#: a synthetic camera's frame bank larger than this says that it renders while recording (64 frames
#: of 2048x2048 take seconds; small frames are rendered before anyone notices)
_SAY_RENDERING_BYTES = 64 << 20


class _Interrupted(Exception):
    """SIGTERM while recording (Ctrl-C arrives as KeyboardInterrupt)."""


def _package_version() -> str:
    try:
        return version("napari-tileshard")
    except PackageNotFoundError:  # running from a source tree
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """argparse with the command's one-line error format (its own prints the usage block first)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"napari-tileshard: error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    # -v works before and after the subcommand: each subparser knows it too, without a default of
    # its own so that it never resets a -v given before the subcommand.
    verbose = _Parser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what the writer decides"
    )
    parser = _Parser(
        prog="napari-tileshard",
        formatter_class=formatter,
        description="Record camera streams into sharded Zarr v3 arrays (GPU or CPU), check them, "
        "or start napari with the recorder docked.",
        epilog=f"exit status: 0 success; {FAILURE} a runtime failure (disk full, unreachable or frozen storage, "
        f"a store with problems); {USAGE_ERROR} a usage error (a bad option or value, an existing store without "
        "--overwrite); 130 / 143 after Ctrl-C / SIGTERM (the store is finished first).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the writer decides")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{gui,record,verify,convert}")
    gui = sub.add_parser(
        "gui",
        parents=[verbose],
        formatter_class=formatter,
        help="start napari with the Tile/Shard Recorder docked (synthetic camera selected)",
    )
    gui.add_argument("--output", type=_store_path, default=None, help="where recordings go (default: ./recording.zarr)")
    record = sub.add_parser(
        "record",
        parents=[verbose],
        formatter_class=formatter,
        help="record a (synthetic) camera stream to a sharded Zarr v3 array",
        description="Record the synthetic camera into a sharded Zarr v3 array. An unbounded array (shape "
        "starting with 0) records until Ctrl-C, --frames, --duration or --max-bytes; Ctrl-C or "
        "SIGTERM finish the store and print the summary.",
    )
    record.add_argument("output", type=_store_path, help="output store path or URL, e.g. demo.zarr")
    record.add_argument(
        "--shape",
        type=_int_list,
        default=[0, 2048, 2048],
        help="array shape, slowest first; 0 first = unbounded append dim",
    )
    record.add_argument(
        "--tile",
        type=_int_list,
        default=None,
        help="tile (chunk) shape (default: tiles of up to 256 px a frame dim, ~256 KiB deep along dim 0)",
    )
    record.add_argument(
        "--tiles-per-shard",
        type=_int_list,
        default=None,
        help="tiles per shard per dim (default: up to 4 per frame dim, ~16 MiB shards)",
    )
    record.add_argument(
        "--names",
        type=lambda s: s.split(","),
        default=None,
        help="dimension names (default: t then c,z,y,x as many as needed)",
    )
    record.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="uint16", help="pixel type")
    record.add_argument(
        "--frames",
        type=_positive_int,
        default=None,
        help="frames to record (default: fill a bounded shape; unbounded: until Ctrl-C)",
    )
    record.add_argument(
        "--duration", type=_positive_float, default=None, metavar="SECONDS", help="stop after this many seconds"
    )
    record.add_argument(
        "--max-bytes",
        type=_positive_int,
        default=None,
        help="stop before the frames given exceed this many (uncompressed) bytes",
    )
    record.add_argument("--codec", choices=codecs.names(), default="zstd", help="chunk codec")
    record.add_argument(
        "--level",
        type=int,
        default=1,
        help="compression level ("
        + ", ".join(f"{c.name} {c.level_range[0]}..{c.level_range[1]}" for c in codecs.CODECS.values() if c.level_range)
        + ")",
    )
    record.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: the GPU when CuPy, nvCOMP and a device are usable",
    )
    record.add_argument("--source", choices=("synthetic",), default="synthetic", help="frame source")
    record.add_argument("--seed", type=int, default=0, help="seed of the synthetic camera")
    record.add_argument(
        "--fps", type=_positive_float, default=None, help="pace the camera (default: as fast as possible)"
    )
    record.add_argument(
        "--ome",
        action="store_true",
        help="write an OME-Zarr 0.5 group with a multiscale pyramid computed while recording",
    )
    record.add_argument("--downsample", choices=DOWNSAMPLE, default="mean", help="pyramid reduction (with --ome)")
    record.add_argument(
        "--downsample-dims",
        type=lambda s: s.split(","),
        default=None,
        help="dims the pyramid halves (with --ome; default: the last two, e.g. y,x; t,y,x adds time)",
    )
    record.add_argument(
        "--max-levels",
        type=_positive_int,
        default=None,
        help="pyramid levels including full resolution (default: until a level fits one tile)",
    )
    record.add_argument(
        "--scale",
        type=lambda s: _axis_values(s, float),
        default=None,
        help="physical size per dim for OME-Zarr axes (with --ome), e.g. t=0.02,y=0.65,x=0.65",
    )
    record.add_argument(
        "--unit",
        type=lambda s: _axis_values(s, str),
        default=None,
        help="unit per dim (with --ome), e.g. t=second,y=micrometer,x=micrometer",
    )
    record.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing recording (only an array or OME group this tool writes)",
    )
    record.add_argument(
        "--io-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="a shard write with no answer for this long (plus 1 s per MB) stops the recording; "
        "after a storage failure the command ends within about this time",
    )
    record.add_argument("--no-progress", action="store_true", help="no progress bar")
    check = sub.add_parser(
        "verify", parents=[verbose], formatter_class=formatter, help="check every shard's index, CRC32C and chunks"
    )
    check.add_argument("path", type=_store_path, help="store path or URL")
    conv = sub.add_parser(
        "convert",
        parents=[verbose],
        formatter_class=formatter,
        help="re-tile / recompress / add a pyramid to existing data (zarr v2/v3, OME-Zarr, TIFF) on Dask",
        description="Convert SRC (a zarr v2/v3 array or OME-Zarr, a TIFF/OME-TIFF file or a folder of TIFF "
        "frames) into a sharded Zarr v3 array or OME-Zarr at DST. One Dask task per shard epoch: no shard is "
        "written by two tasks; zarr.json only ever covers finished shard epochs; --resume continues an "
        "interrupted conversion of the same SRC with the options it started with (an option given with "
        "--resume must agree with them; --backend may change). Ctrl-C or SIGTERM stop it cleanly.",
    )
    conv.add_argument("src", type=_store_path, help="input path or URL")
    conv.add_argument("dst", type=_store_path, help="output path or URL")
    conv.add_argument("--tile", default=None, help="tile size per dim, e.g. 2,256,256 (default: as record's)")
    conv.add_argument("--tiles-per-shard", default=None, help="tiles per shard per dim (default: as record's)")
    conv.add_argument("--codec", default=None, help="tile codec (default: zstd)")
    conv.add_argument("--level", type=int, default=None, help="codec level (default: 1)")
    conv.add_argument("--backend", default=None, help="auto, gpu or cpu, per task (default: auto)")
    conv.add_argument("--ome", action="store_true", default=None, help="write OME-Zarr with a pyramid")
    conv.add_argument("--downsample", default=None, help="pyramid method: mean, max, min, decimate (default: mean)")
    where = conv.add_mutually_exclusive_group()
    where.add_argument("--scheduler", default=None, help="address of a running Dask scheduler (tcp://...)")
    where.add_argument(
        "--local", type=_positive_int, default=None, help="workers of a local Dask cluster (default: cores/2, max 4)"
    )
    where.add_argument(
        "--devices",
        default=None,
        help="a local cluster of one worker per GPU: 'all', a count, or GPU numbers such as 0,1 (default: none)",
    )
    conv.add_argument(
        "--resume", action="store_true", help="continue an interrupted conversion of SRC into DST, with its options"
    )
    conv.add_argument("--overwrite", action="store_true", help="replace DST (only data this tool wrote)")
    conv.add_argument("--no-verify", action="store_true", help="skip verifying the output")
    conv.add_argument(
        "--retries", type=_non_negative_int, default=2, help="reruns of a shard epoch whose task failed (default: 2)"
    )
    conv.add_argument(
        "--worker-timeout",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="stop with an error when the cluster has had no worker this long (default: 60)",
    )
    return parser


def _ints(text: str | None, what: str):
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def _devices(text: str | None):
    if text is None or text == "all":
        return text
    numbers = _ints(text, "--devices")
    return numbers[0] if len(numbers) == 1 else numbers


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, where they say something: an option whose default is None (decided
    later: convert's options take on --resume the value the conversion started with) says its
    default in its own words, and an on/off flag is off unless given; neither gets "(default: None)"
    or "(default: False)"."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help
        if isinstance(action.default, list):  # as it is typed: 0,2048,2048
            return f"{action.help} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


class _Terminated(KeyboardInterrupt):
    """SIGTERM during convert: it stops the conversion as Ctrl-C does (exit status 143)."""

    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise _Terminated()


#: convert's Python-API wording in its errors -> the command line's
_CLI_WORDING = (
    (
        "to start over, convert with overwrite=True (--overwrite on the command line) instead of resuming",
        "to start over, run it with --overwrite instead of --resume",
    ),
    ("convert without resume=True (--resume) to start a conversion", "run it without --resume to start a conversion"),
    ("resume=True (--resume on the command line)", "--resume"),
    (_OVERWRITE_HINT, "use --overwrite"),
    ("overwrite=True (--overwrite on the command line)", "--overwrite"),
)
_CONVERT_FLAGS = {"tile": "--tile", "tiles_per_shard": "--tiles-per-shard", "codec": "--codec", "level": "--level"}
_CONVERT_FLAGS.update(backend="--backend", ome="--ome", downsample="--downsample")


def _cli_wording(text: str) -> str:
    for api, cli in _CLI_WORDING:
        text = text.replace(api, cli)
    return text


def _cli_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _resume_mismatch(exc) -> str:
    """``--level 3, but this conversion used 1`` (what to do next on the same line)."""
    flag = _CONVERT_FLAGS.get(exc.option)
    if flag is None:  # only the Python API has it
        return str(exc)
    if exc.option == "ome":
        head = "--ome, but this conversion was started without --ome"
    else:
        head = f"{flag} {_cli_value(exc.given)}, but this conversion used {_cli_value(exc.used)}"
    return f"{head} (leave {flag} out to continue it, or start over with --overwrite instead of --resume)"


def _quiet_dask() -> None:
    """Dask's INFO lines (cluster start and stop, scheduler chatter, "stale lock file" purges) and
    its shutdown noise (a CRITICAL "Closed comm" traceback when a Ctrl-C closes the client while
    the scheduler still sends to it) are not for the user of convert: what goes wrong reaches them
    as convert's own one-line error.  ``-v`` shows everything."""
    with contextlib.suppress(ImportError):
        import distributed  # noqa: F401 - it sets its loggers' levels when imported: first, then ours
    for name in ("distributed", "tornado", "bokeh"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _resume_command(args) -> str:
    import shlex

    words = ["napari-tileshard", "convert", args.src, args.dst, "--resume"]
    if args.scheduler:
        words += ["--scheduler", args.scheduler]
    elif args.devices:
        words += ["--devices", args.devices]
    elif args.local:
        words += ["--local", str(args.local)]
    return shlex.join(words)


def _interrupted_summary(exc) -> str:
    report = exc.report
    if not exc.started:
        return "interrupted before the conversion started: nothing was written"
    if report.epochs and report.epochs_done >= report.epochs:
        return f"interrupted after all {report.epochs} shard epochs were converted into {report.destination}"
    return (
        f"interrupted: {report.epochs_done} of {report.epochs} shard epochs are done ({report.epochs_written} by "
        f"this run: {plural(report.shards, 'shard')}, {data_size(report.bytes_in)} in {duration(report.seconds)}); "
        f"{report.destination} claims its first {report.rows_claimed} of {report.rows} rows"
    )


def _is_usage_error(exc: BaseException) -> bool:
    """An error about what was asked (exit status 2) rather than one met while doing it (1)."""
    if isinstance(exc, StoreLockedError):
        return False
    return isinstance(exc, (ValueError, TypeError, StoreExistsError, FileNotFoundError, NotADirectoryError))


def convert_command(args) -> int:
    """``napari-tileshard convert``: exit status 0, 1 (failed while converting, e.g. storage), 2
    (usage: options, source, destination), 130 / 143 (stopped by SIGINT / SIGTERM)."""
    if not getattr(args, "verbose", False):
        _quiet_dask()
    bars: list = []  # made when the work starts, so an error before it shows no progress bar

    def progress(done, total):
        if not bars:
            bars.append(tqdm(total=total, initial=done, unit="shard epoch", desc="converting", file=sys.stderr))
        bars[0].total = total
        bars[0].n = done
        bars[0].refresh()

    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    client = None
    try:
        try:
            if args.scheduler:
                from distributed import Client

                client = Client(args.scheduler)
                print(f"dashboard: {client.dashboard_link}", file=sys.stderr)
            report = convert(
                args.src,
                args.dst,
                tile=_ints(args.tile, "--tile"),
                tiles_per_shard=_ints(args.tiles_per_shard, "--tiles-per-shard"),
                codec=args.codec,
                level=args.level,
                backend=args.backend,
                ome=args.ome,
                downsample=args.downsample,
                client=client,
                local_workers=args.local,
                devices=_devices(args.devices),
                announce=None if client is not None else lambda link: print(f"dashboard: {link}", file=sys.stderr),
                resume=args.resume,
                overwrite=args.overwrite,
                verify=not args.no_verify,
                progress=progress,
                retries=args.retries,
                worker_timeout=args.worker_timeout,
            )
        finally:
            for bar in bars:
                bar.close()
            if client is not None:
                client.close()
    except ConvertInterrupted as exc:
        print(_interrupted_summary(exc), file=sys.stderr)
        if exc.started:
            print(f"continue with: {_resume_command(args)}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt as exc:  # while connecting to the scheduler or closing the client
        print("napari-tileshard: interrupted", file=sys.stderr)
        return 128 + int(getattr(exc, "signum", signal.SIGINT))
    except ResumeMismatch as exc:
        print(f"napari-tileshard: error: {_resume_mismatch(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, no traceback; -v logs it
        logging.getLogger(__name__).info("convert failed", exc_info=True)
        print(f"napari-tileshard: error: {_cli_wording(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 1 if bars or not _is_usage_error(exc) else 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if report.epochs_written == 0 and report.epochs_skipped:
        print(f"nothing left to convert in {report.destination}: all {report.epochs} shard epochs were done")
    else:
        pyramid = report.pyramid_bytes_out
        ratio = f", compression ratio {report.compression_ratio:.2f}" if report.bytes_out else ""
        ratio += " (full resolution)" if pyramid else ""
        stored = f" ({data_size(report.bytes_out - pyramid)}" + (
            f" + {data_size(pyramid)} of pyramid levels)" if pyramid else ")"
        )
        print(
            f"converted into {report.destination}: {data_size(report.bytes_in)} in {duration(report.seconds)}, "
            f"{data_size(report.gbps * 1e9)}/s{ratio}, {plural(report.shards, 'shard')}{stored}"
            + (f" ({report.epochs_skipped} shard epochs were already done)" if report.epochs_skipped else "")
        )
    if report.verified is not None:
        print(report.verified)
    return 0


def _free_bytes(output: str) -> int | None:
    """Free bytes on the file system that will hold ``output`` (None for URLs)."""
    if "://" in output and not output.startswith("file://"):
        return None
    path = Path(output.removeprefix("file://")).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def record(args) -> int:
    layout = build_layout(args.shape, args.tile, args.tiles_per_shard, args.dtype, args.names, args.scale, args.unit)
    if (args.scale or args.unit) and not args.ome:
        raise ValueError("--scale and --unit describe OME-Zarr axes: add --ome")
    frame_bytes = layout.frame_elements * layout.itemsize
    frames_possible = None if layout.total_elements is None else layout.total_elements // layout.frame_elements
    if frames_possible is not None and args.frames is not None and args.frames > frames_possible:
        raise ValueError(
            f"--frames {args.frames} is more than the {frames_possible} frames --shape "
            f"{','.join(map(str, layout.shape))} holds"
        )
    frames = args.frames if args.frames is not None else frames_possible  # None: until stopped
    if args.max_bytes is not None:
        by_bytes = args.max_bytes // frame_bytes
        if by_bytes < 1:
            raise ValueError(f"--max-bytes {args.max_bytes} is less than one frame ({frame_bytes} bytes)")
        frames = by_bytes if frames is None else min(frames, by_bytes)
    # Refuse to start what cannot even finish one shard epoch (worst case) on this disk; pyramid
    # levels add at most a third.
    needed = int(
        layout.tiles_per_shard[0]
        * layout.tiles_per_epoch
        * layout.compressed_tile_bound(args.codec)
        * (4 / 3 if args.ome else 1)
    ) + (1 << 16)
    free = _free_bytes(args.output)
    if free is not None and free < needed:
        raise OSError(
            28, f"{args.output}: only {free} bytes free, but one shard epoch with its metadata can take {needed} bytes"
        )
    pyramid = (
        {
            "ome": True,
            "downsample": args.downsample,
            "downsample_dims": args.downsample_dims,
            "max_levels": args.max_levels,
        }
        if args.ome
        else {}
    )
    # Every setting checked before the camera renders its frames (seconds for large frames).
    spec, options = writer_settings(
        layout, codec=args.codec, level=args.level, backend=args.backend, io_timeout=args.io_timeout, **pyramid
    )
    camera = SyntheticCamera(layout.frame_shape or (1,), layout.dtype, seed=args.seed, fps=args.fps)
    stops = [f"{frames} frames" if frames is not None else None, f"{args.duration:g} s" if args.duration else None]
    until = " or ".join(filter(None, stops)) or "Ctrl-C"
    interrupted = None
    writer: Writer | None = None
    previous = signal.signal(signal.SIGTERM, _raise_interrupted) if _main_thread() else None
    try:
        try:
            # Rendering the bank takes seconds for large frames: it goes on while the recording
            # starts, and frames come as fast as they are rendered until it is done.
            if not camera.prepared and camera.bank_frames * camera.frame_bytes > _SAY_RENDERING_BYTES:
                print(
                    f"the synthetic camera renders its {min(frames or camera.bank_frames, camera.bank_frames)} "
                    f"distinct {'x'.join(map(str, camera.shape))} frames while recording: until they are "
                    "rendered it delivers frames at its rendering speed",
                    file=sys.stderr,
                    flush=True,
                )
            camera.render_in_background(frames)
            writer = Writer(args.output, spec, options, overwrite=args.overwrite)
        except (KeyboardInterrupt, _Interrupted) as exc:  # the Writer removed what it had created
            signum = signal.SIGTERM if isinstance(exc, _Interrupted) else signal.SIGINT
            print("napari-tileshard: interrupted before the recording started; nothing was written", file=sys.stderr)
            return 128 + int(signum)
        with writer:
            bar = None
            start = time.perf_counter()
            try:
                print(
                    f"recording to {writer.location} ({writer.stats.backend}) until {until}"
                    + ("" if until == "Ctrl-C" else " (Ctrl-C stops earlier)"),
                    file=sys.stderr,
                    flush=True,
                )
                bar = tqdm(total=frames, unit="frame", disable=args.no_progress, file=sys.stderr, desc="recording")
                start = time.perf_counter()
                deadline = None if args.duration is None else time.monotonic() + args.duration
                for frame in camera.frames(frames):
                    writer.append(frame.reshape(layout.frame_shape))
                    bar.update(1)
                    if deadline is not None and time.monotonic() >= deadline:
                        break
            except KeyboardInterrupt:
                interrupted = signal.SIGINT
            except _Interrupted:
                interrupted = signal.SIGTERM
            finally:
                if bar is not None:
                    bar.close()
                # The store is finished below (close), which handles Ctrl-C itself: the first says
                # what it waits for, a second abandons.  SIGTERM counts as Ctrl-C there.
                if _main_thread():
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    except WriterError as exc:
        if isinstance(exc.__cause__, CloseAbandoned):
            print(f"napari-tileshard: {exc.__cause__}; {_claimed(writer)}", file=sys.stderr)
            return 128 + int(interrupted or signal.SIGINT)
        raise
    finally:
        if _main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    stats = writer.stats
    elapsed = time.perf_counter() - start
    print(_recorded(stats, writer.location, elapsed, writer.pyramid.levels) + (" (interrupted)" if interrupted else ""))
    unwritten = _unwritten(layout, stats.frames, array_metadata(layout, args.codec, args.level, 0)["fill_value"])
    if unwritten:
        print(unwritten)
    if interrupted:
        return 128 + int(interrupted)
    return 0


def _unwritten(layout: Layout, frames: int, fill) -> str | None:
    """What of a bounded array was not recorded (``--frames`` fewer than ``--shape`` holds, or an
    interruption): those rows exist in the array's shape and read as the fill value."""
    rows = layout.shape[0]
    if not rows or layout.total_elements is None:
        return None  # unbounded: the array is as long as what was recorded
    possible = layout.total_elements // layout.frame_elements
    if frames >= possible:
        return None
    per_row = possible // rows
    first_row = frames // per_row
    if per_row == 1:
        what = f"rows {first_row}..{rows - 1} of {rows}"
    else:  # several frames per row along dim 0 (e.g. t,z,y,x): name both
        partly = f", row {first_row} partly" if frames % per_row else ""
        what = f"frames {frames}..{possible - 1} of {possible} (rows {first_row}..{rows - 1} of {rows}{partly})"
    return f"{what} were not written and read as the fill value {fill}"


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _recorded(stats, location, elapsed: float, levels: int) -> str:
    """The record command's summary line.  The compression ratio is the full-resolution array's
    (what the codec does to the data); an OME pyramid's levels are counted apart."""
    shards = f"{plural(stats.shards_written, 'shard')} ({data_size(stats.full_resolution_bytes_out)}"
    if levels > 1:
        shards += f" + {data_size(stats.pyramid_bytes_out)} of pyramid levels 1-{levels - 1}"
    return (
        f"recorded {plural(stats.frames, 'frame')} ({data_size(stats.bytes_in)}) to {location} in {duration(elapsed)}: "
        f"{data_size(stats.bytes_in / elapsed if elapsed > 0 else 0)}/s, compression ratio "
        f"{stats.compression_ratio:.2f}{' (full resolution)' if levels > 1 else ''}, {shards}), "
        f"backend {stats.backend}" + (f", {levels} pyramid levels" if levels > 1 else "")
    )


def _claimed(writer: Writer | None) -> str:
    if writer is None:
        return "nothing was recorded"
    return f"{writer.location} claims {writer.stats.rows_complete} rows, all of them on disk"


def display_missing() -> str | None:
    """Why no window can open here (Linux without ``DISPLAY`` or ``WAYLAND_DISPLAY``, and Qt not
    told to draw offscreen), or None.  Qt would abort the process (status 134) with its xcb
    plugin's messages instead."""
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    if os.environ.get("QT_QPA_PLATFORM", "").split(":")[0] in ("offscreen", "minimal", "vnc", "eglfs", "linuxfb"):
        return None
    return (
        "the GUI needs a display, and neither DISPLAY nor WAYLAND_DISPLAY is set: run it on a desktop "
        "session, over 'ssh -X', or under 'xvfb-run napari-tileshard gui'; without a screen, record with "
        "'napari-tileshard record'"
    )


def gui(args) -> int:
    missing = display_missing()
    if missing:
        print(f"napari-tileshard: error: {missing}", file=sys.stderr)
        return USAGE_ERROR
    try:
        import napari
    except ImportError:
        hint = 'from the checkout, pip install -e ".[napari]"'
        print(f"napari-tileshard: error: the GUI needs napari: {hint}", file=sys.stderr)
        return 2
    viewer = napari.Viewer(title="napari-tileshard")
    _, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    if args.output:
        widget.form.output_text = args.output
    napari.run()
    return 0


@contextlib.contextmanager
def _tiling_warnings_on_stderr():
    """Each TilingWarning (a clamped tile, tiny chunks, too many files) as one line on stderr when
    it comes, before the work starts (Python's own display names a source line, not the option)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", TilingWarning)
        show = warnings.showwarning

        def print_or_show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, TilingWarning):
                print(f"napari-tileshard: warning: {message}", file=sys.stderr, flush=True)
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = print_or_show  # catch_warnings puts the original back
        yield


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING, format="%(message)s"
    )
    with _tiling_warnings_on_stderr():
        return _run(args)


def _run(args) -> int:
    try:
        if args.command == "record":
            return record(args)
        if args.command == "gui":
            return gui(args)
        if args.command == "convert":
            return convert_command(args)
        bars: list = []  # made at the first shard, so a store without shards shows no empty bar

        def progress(done, total):
            if not total:
                return
            if not bars:
                bars.append(tqdm(total=total, unit="shard", desc="verifying", file=sys.stderr))
            bars[0].total = total
            bars[0].n = done
            bars[0].refresh()

        missing = missing_store(args.path)
        if missing:  # nothing to check: a usage error, as a missing source is for convert
            print(f"napari-tileshard: error: {missing}", file=sys.stderr)
            return USAGE_ERROR
        report = verify(args.path, progress)
        for bar in bars:
            bar.close()
        print(report)
        return 0 if report.ok else 1
    except KeyboardInterrupt:  # before a command took over Ctrl-C (starting, or a command without a summary)
        print("napari-tileshard: interrupted", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    except StoreExistsError as exc:  # the Python API's hint names overwrite=True; here it is a flag
        print(f"napari-tileshard: error: {str(exc).replace(_OVERWRITE_HINT, 'use --overwrite')}", file=sys.stderr)
        return USAGE_ERROR
    except (ValueError, TypeError) as exc:  # a value the command refused before doing anything
        print(f"napari-tileshard: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except (OSError, RuntimeError) as exc:  # storage, a device or the data failed while working
        print(f"napari-tileshard: error: {exc}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
