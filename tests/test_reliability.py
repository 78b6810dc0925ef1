"""Faults: a recording killed mid-way leaves every completed shard epoch readable."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from conftest import read_tensorstore
from napari_tileshard import SyntheticCamera, verify


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_sigkill_mid_recording_leaves_completed_epochs(tmp_path):
    out = tmp_path / "killed.zarr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "napari_tileshard.cli", "record", str(out), "--shape", "0,64,48",
         "--tile", "4,32,16", "--tiles-per-shard", "2,1,2", "--frames", "100000", "--fps", "400",
         "--backend", "cpu", "--seed", "7", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until several shard epochs are complete
            time.sleep(0.2)
            try:
                if zarr.open_array(out, mode="r").shape[0] >= 40:
                    break
            except Exception:  # noqa: BLE001 - the store may not exist yet
                pass
        time.sleep(0.37)  # land somewhere inside the next epochs
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    array = zarr.open_array(out, mode="r")
    rows = array.shape[0]
    assert rows >= 40 and rows % 8 == 0  # whole shard epochs (2 tiles x 4 frames) only
    expected = SyntheticCamera((64, 48), "uint16", seed=7).stack(rows)
    np.testing.assert_array_equal(array[:], expected)
    np.testing.assert_array_equal(read_tensorstore(out), expected)
    report = verify(out)
    assert report.ok, str(report)
