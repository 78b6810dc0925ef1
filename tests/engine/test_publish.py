"""The publisher: what zarr.json claims advances with completed shard writes, and an interrupt
raised while it publishes (Ctrl-C or SIGTERM on the main thread) reaches the caller."""

from concurrent.futures import Future

import pytest
import zarr

from napari_tileshard import Dim, Layout
from napari_tileshard.engine.publish import Publisher
from napari_tileshard.format.pyramid import Pyramid
from napari_tileshard.testing import FaultInjectingSink


def publisher_on(sink) -> tuple[Publisher, list]:
    """A publisher of a one-level array of 16 x 16 frames, and the list its errors go to."""
    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 16, 16, 1), Dim("x", 16, 16, 1)], "uint16")
    errors: list = []
    return Publisher(sink, Pyramid.single(layout), "zstd", 1, {}, [""], on_error=errors.append), errors


def claimed(root) -> int:
    return zarr.open_array(root, mode="r").attrs["tileshard"]["rows_written"]


def test_an_interrupt_during_a_zarr_json_write_reaches_the_caller_and_publishing_goes_on(tmp_path):
    """convert's main thread completes its epochs' futures itself: the publisher's callback runs
    there, so Ctrl-C or SIGTERM can land inside the zarr.json write.  It must propagate (it used to
    be recorded as a storage error and swallowed, so convert heard it only when every epoch was
    done, and never while a source read hung) and leave the publisher able to publish."""
    interrupts = [KeyboardInterrupt()]

    def interrupted_once(key):
        if key == "zarr.json" and interrupts:
            raise interrupts.pop()

    sink = FaultInjectingSink(tmp_path / "a.zarr")
    publisher, errors = publisher_on(sink)
    publisher.begin()  # rows 0: before the hook is armed
    sink.before_write = interrupted_once
    first, second = Future(), Future()
    publisher.track([first], 1)
    publisher.track([second], 2)
    with pytest.raises(KeyboardInterrupt):
        first.set_result(None)  # the callback publishes row 1: interrupted
    assert publisher.error is None and errors == []  # no storage failure
    assert claimed(tmp_path / "a.zarr") == 0  # the previous zarr.json stays
    assert publisher.pending == 2
    second.set_result(None)  # the next advance publishes both groups
    assert claimed(tmp_path / "a.zarr") == 2 and publisher.pending == 0
    publisher.finish(2)
    assert publisher.state == "complete" and errors == []


def test_a_storage_failure_during_a_zarr_json_write_stops_publishing(tmp_path):
    sink = FaultInjectingSink(tmp_path / "a.zarr")
    publisher, errors = publisher_on(sink)
    publisher.begin()
    sink.fail["zarr.json"] = OSError(28, "No space left on device")
    done = Future()
    publisher.track([done], 1)
    done.set_result(None)  # swallowed into the publisher's error, not raised into the callback
    assert isinstance(publisher.error, OSError) and errors == [publisher.error]
    publisher.wait()  # returns: a failed publisher has nothing pending to wait for
    assert claimed(tmp_path / "a.zarr") == 0


@pytest.mark.parametrize(
    "failure, said",
    [
        (TimeoutError("the write got no answer within 5 s"), "got no answer in time (the write got no answer"),
        (OSError("Generic S3 error: operation timed out"), "the mark may still land"),
        (OSError(28, "No space left on device"), "could not mark"),
    ],
)
def test_marking_failed_says_what_is_known_of_the_mark(tmp_path, caplog, failure, said):
    """A frozen endpoint's timeout used to print 'could not mark ... as failed', and the mark
    landed later: a write without an answer may have been stored."""
    sink = FaultInjectingSink(tmp_path / "a.zarr")
    publisher, _ = publisher_on(sink)
    publisher.begin()
    sink.fail["zarr.json"] = failure
    publisher.mark_failed()
    assert said in caplog.text
    if isinstance(failure, TimeoutError) or "timed out" in str(failure):
        assert "could not mark" not in caplog.text


@pytest.mark.parametrize("unbounded", [True, False])
@pytest.mark.parametrize("attributes", [{}, {"note": "9182736450918273", "count": 9182736450918273}])
def test_each_zarr_json_is_the_full_rendering_of_its_metadata(tmp_path, unbounded, attributes):
    """zarr.json is rendered once per level and state and only the rows are put in after: the
    bytes are what the full rendering (array_metadata, then metadata_bytes) gives, for every
    level of a pyramid, every state and rows of any size, also where an attribute holds the
    number the first rendering stands in with (then every one is rendered in full)."""
    from napari_tileshard.format.metadata import STATE_KEY, metadata_bytes
    from napari_tileshard.format.pyramid import plan_pyramid
    from napari_tileshard.format.shard_spec import array_metadata

    frames = 0 if unbounded else 40
    layout = Layout([Dim("t", frames, 2, 2), Dim("y", 64, 16, 2), Dim("x", 48, 16, 2)], "uint16")
    pyramid = plan_pyramid(layout, "mean")
    assert pyramid.levels > 1
    publisher = Publisher(
        FaultInjectingSink(tmp_path / "a.zarr"), pyramid, "zstd", 3, attributes, [""] * pyramid.levels, print
    )
    for k, level in enumerate(pyramid.layouts):
        for state in ("recording", "complete", "failed"):
            for rows in (0, 1, 7, 40, 123456789012):
                shape0 = rows if level.unbounded else level.shape[0]
                expected = metadata_bytes(
                    array_metadata(
                        level, "zstd", 3, shape0, {**attributes, STATE_KEY: {"rows_written": rows, "state": state}}
                    )
                )
                assert publisher.metadata_of(k, rows, state) == expected
