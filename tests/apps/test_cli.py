"""The command line behaves like one: signals finish the store, options are checked, help is plain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from napari_tileshard import SyntheticCamera
from napari_tileshard.apps.cli import main

SMALL = ["--shape", "0,32,32", "--tile", "2,16,16", "--tiles-per-shard", "1,1,1", "--backend", "cpu"]


def cli(*args):
    return [sys.executable, "-m", "napari_tileshard", *args]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_finishes_the_store_and_says_interrupted(tmp_path, signum, code):
    out = tmp_path / "sig.zarr"
    proc = subprocess.Popen(
        cli("record", str(out), *SMALL, "--fps", "200", "--no-progress"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                if zarr.open_array(out, mode="r").shape[0] >= 10:
                    break
            except Exception:  # noqa: BLE001 - not created yet
                pass
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert "until Ctrl-C" in stderr  # the first line says how it stops
    assert "recorded" in stdout and "(interrupted)" in stdout
    array = zarr.open_array(out, mode="r")
    assert array.attrs["tileshard"]["state"] == "complete"
    frames = int(stdout.split("recorded ")[1].split(" frames")[0])
    assert array.shape[0] == frames  # every frame it counted is in the store
    np.testing.assert_array_equal(array[:], SyntheticCamera((32, 32), "uint16", seed=0).stack(frames))


def test_a_default_recording_starts_at_once_and_ctrl_c_while_the_camera_renders_exits_130(tmp_path):
    """The default 2048x2048 camera renders its frames while the recording starts (it used to
    render 64 of them, 8-9 s on a 2-core box, before printing anything, whatever --frames said),
    says so first, and Ctrl-C in that window finishes cleanly: 130, no traceback."""
    out = tmp_path / "default.zarr"
    proc = subprocess.Popen(
        cli("record", str(out), "--frames", "16", "--backend", "cpu", "--no-progress"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stderr.readline()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert first.startswith("the synthetic camera renders its 16 distinct 2048x2048 frames while recording"), first
    assert proc.returncode == 130, first + stderr
    assert "Traceback" not in stderr
    assert "(interrupted)" in stdout or "interrupted before the recording started" in stderr, (stdout, stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--frames", "0"], "must be at least 1, got 0"),
        (["--frames", "-5"], "must be at least 1, got -5"),
        (["--dtype", "uint61"], "invalid choice: 'uint61' (choose from 'uint8', 'uint16'"),
        (["--duration", "0"], "must be positive"),
    ],
)
def test_bad_options_are_refused_by_the_parser(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["record", str(tmp_path / "x.zarr"), *SMALL, *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "4,32,32", "--frames", "5"], "--frames 5 is more than the 4 frames --shape 4,32,32 holds"),
        (["--scale", "y=0.5"], "--scale and --unit describe OME-Zarr axes: add --ome"),
        (["--max-bytes", "100"], "--max-bytes 100 is less than one frame (2048 bytes)"),
    ],
)
def test_inconsistent_options_are_errors_not_silently_changed(tmp_path, capsys, args, message):
    assert main(["record", str(tmp_path / "x.zarr"), *SMALL, "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.zarr").exists()


def test_duration_and_max_bytes_stop_an_unbounded_recording(tmp_path, capsys):
    out = tmp_path / "d.zarr"
    start = time.monotonic()
    assert main(["record", str(out), *SMALL, "--fps", "100", "--duration", "0.5", "--no-progress"]) == 0
    assert time.monotonic() - start < 10
    assert 10 <= zarr.open_array(out, mode="r").shape[0] <= 80
    assert main(["record", str(tmp_path / "m.zarr"), *SMALL, "--max-bytes", str(7 * 2048), "--no-progress"]) == 0
    assert zarr.open_array(tmp_path / "m.zarr", mode="r").shape[0] == 7


def test_verbose_after_the_subcommand_version_and_plain_help(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "none.zarr"), "-v"]) == 2  # -v accepted after it (2: no store)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "napari-tileshard" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "{gui,record,verify,convert}" in text and "``" not in text
    with pytest.raises(SystemExit):
        main(["record", "--help"])
    text = capsys.readouterr().out
    assert "Ctrl-C" in text and "(default: 1)" in text  # defaults are shown


def test_verify_counts_problems_in_words_and_shows_no_empty_bar(tmp_path, capsys):
    out = tmp_path / "empty.zarr"
    assert main(["record", str(out), *SMALL, "--frames", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    captured = capsys.readouterr()
    assert "0 problems" in captured.out and "verifying" in captured.err
    (out / "c" / "0" / "0" / "0").write_bytes(b"garbage")
    assert main(["verify", str(out)]) == 1
    assert "1 problem\n" in capsys.readouterr().out + "\n"
    bare = tmp_path / "bare.zarr"
    assert main(["record", str(bare), *SMALL, "--max-bytes", "2048", "--frames", "1", "--no-progress"]) == 0
    for shard in (bare / "c").rglob("*"):
        if shard.is_file():
            shard.unlink()
    capsys.readouterr()
    main(["verify", str(bare)])
    assert "verifying" not in capsys.readouterr().err  # no shards: no progress bar


def test_refuses_to_start_without_room_for_one_shard_epoch(tmpfs, capsys):
    mount_point = tmpfs("256k", "small")
    # the default layout: one shard epoch of 2048x2048x32 uint16 tiles needs ~256 MiB
    assert main(["record", str(mount_point / "big.zarr"), "--backend", "cpu", "--no-progress"]) == 1  # runtime
    assert "bytes free, but one shard epoch" in capsys.readouterr().err
    assert not (mount_point / "big.zarr").exists()


def test_a_disk_that_fills_up_mid_recording_exits_1_not_2(tmpfs, capsys):
    mount_point = tmpfs("3m", "fills")
    args = ["record", str(mount_point / "a.zarr"), "--shape", "0,256,256", "--tile", "2,128,128"]
    args += ["--tiles-per-shard", "1,2,2", "--codec", "none", "--backend", "cpu", "--frames", "200", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err
    assert main(["record", str(mount_point / "b.zarr"), "--shape", "0,2,2", "--tile", "1,2"]) == 2  # a usage error


def test_no_option_of_any_subcommand_says_default_none(capsys):
    from napari_tileshard.apps.cli import _parser

    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps its subparsers there
    texts = [parser.format_help()] + [command.format_help() for command in commands.values()]
    assert len(texts) == 5
    for text in texts:
        assert "(default: None)" not in text and "(default: False)" not in text
    record = commands["record"].format_help()
    assert "(default: ./recording.zarr)" in commands["gui"].format_help()
    assert "(default: 0,2048,2048)" in record and "(default: zstd)" in record  # real defaults still shown


def test_a_half_filled_bounded_recording_says_which_rows_were_never_written(tmp_path, capsys):
    bounded = ["--tile", "10,16,16", "--tiles-per-shard", "1,1,1", "--backend", "cpu", "--no-progress"]
    out = tmp_path / "half.zarr"
    assert main(["record", str(out), "--shape", "100,32,32", "--frames", "50", *bounded]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("recorded 50 frames")
    assert lines[1] == "rows 50..99 of 100 were not written and read as the fill value 0"
    assert zarr.open_array(out, mode="r")[50:].max() == 0
    full = tmp_path / "full.zarr"
    assert main(["record", str(full), "--shape", "20,32,32", *bounded]) == 0
    assert "not written" not in capsys.readouterr().out
    stack = tmp_path / "stack.zarr"  # t,z,y,x: 4 frames a row
    args = ["--shape", "5,4,32,32", "--tile", "1,2,16,16", "--tiles-per-shard", "1,1,1,1", "--frames", "6"]
    assert main(["record", str(stack), *args, "--backend", "cpu", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "frames 6..19 of 20 (rows 1..4 of 5, row 1 partly) were not written and read as the fill value 0"
    )


def test_an_output_that_overwrite_would_refuse_is_not_offered_for_overwriting(tmp_path, capsys):
    thesis = tmp_path / "mythesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("precious")
    assert main(["record", str(thesis), *SMALL, "--frames", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'thesis.tex' which this recorder did not write" in err and "choose another output" in err
    assert "--overwrite" not in err and "overwrite=True" not in err
    ours = tmp_path / "ours.zarr"
    assert main(["record", str(ours), *SMALL, "--frames", "1", "--no-progress"]) == 0
    assert main(["record", str(ours), *SMALL, "--frames", "1", "--no-progress"]) == 2
    assert "use --overwrite to replace it" in capsys.readouterr().err  # here it would go ahead


@pytest.mark.parametrize("command", [["verify", "nope.zarr"], ["convert", "nope.zarr", "new.zarr", "--local", "1"]])
def test_a_store_that_does_not_exist_is_the_same_usage_error_in_every_command(tmp_path, capsys, monkeypatch, command):
    """verify exited 1 ("nope.zarr does not exist"), convert 2 ("no such file or directory")."""
    pytest.importorskip("distributed", reason="the convert extra is not installed")
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.err == "napari-tileshard: error: nope.zarr does not exist\n" and captured.out == ""
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv, said",
    [
        (["convert", "a.zarr", "b.zarr", "--local", "0"], "argument --local: must be at least 1, got 0"),
        (["record", "a.zarr", "--frames", "x"], "argument --frames: 'x' is not an integer"),
        (["verify"], "the following arguments are required: path"),
        (["bogus"], "invalid choice: 'bogus' (choose from 'gui', 'record', 'verify', 'convert')"),
    ],
)
def test_option_errors_are_one_line_in_every_command(capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("napari-tileshard: error: ") and said in err and err.count("\n") == 1, err
    assert "(see: napari-tileshard" in err and "--help)" in err


def test_gui_without_a_display_is_one_line_not_a_qt_abort(monkeypatch, capsys):
    """Qt aborted the process (status 134) with its xcb messages."""
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("only Linux runs without a display server")
    assert main(["gui"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("napari-tileshard: error: the GUI needs a display") and "xvfb-run" in err
    assert err.count("\n") == 1


# -- the tiling: checked once, the same way as convert's --------------------------------------------
def test_record_refuses_an_impossible_tile_naming_it_as_convert_does(tmp_path, capsys):
    out = tmp_path / "x.zarr"
    assert main(["record", str(out), "--shape", "0,32,32", "--tile", "0,-5,32", "--frames", "1"]) == 2
    assert capsys.readouterr().err == "napari-tileshard: error: dimension 't': tile_size must be >= 1, got 0\n"
    assert main(["record", str(out), "--shape", "0,32,32", "--tiles-per-shard", "1,1", "--frames", "1"]) == 2
    assert "--shape has 3 values but --tiles-per-shard has 2" in capsys.readouterr().err
    assert not out.exists()


def test_record_clamps_a_tile_larger_than_the_frame_as_convert_does_with_a_note(tmp_path, capsys):
    out = tmp_path / "big-tile.zarr"
    args = ["--shape", "0,64,48", "--tile", "2,1000,1000", "--frames", "2", "--backend", "cpu", "--no-progress"]
    assert main(["record", str(out), *args]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [
        "napari-tileshard: warning: tile 1000 along 'y' is larger than the dimension (64): using 64",
        "napari-tileshard: warning: tile 1000 along 'x' is larger than the dimension (48): using 48",
    ]
    assert zarr.open_array(out).metadata.codecs[0].chunk_shape == (2, 64, 48)


def test_record_warns_with_numbers_before_it_starts_a_tiling_that_explodes(tmp_path, capsys):
    """1x1x1 tiles of 512x512 frames once wrote 131,072 files for 20 frames in 371 s, silently."""
    out = tmp_path / "t6.zarr"
    args = ["--shape", "0,32,32", "--tile", "1,1,1", "--tiles-per-shard", "1,4,4", "--frames", "1"]
    assert main(["record", str(out), *args, "--backend", "cpu", "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("napari-tileshard: warning: chunks of 1x1x1 uint16 are 2 bytes, under 4 KiB")
    assert err[1].startswith(
        "napari-tileshard: warning: shards of 1x4x4 uint16 make 31,250,000 files per GB of data (over 10,000"
    )
    assert err[2].startswith("recording to")  # said before the first frame
