"""OME-Zarr 0.5 output: Writer(ome=True) with a pyramid computed by the backend while recording."""

import json

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from napari_tileshard import Dim, Layout, SyntheticCamera, verify
from napari_tileshard.engine.writer import Writer
from napari_tileshard.format.pyramid import plan_pyramid, reduce2

METHODS = ["mean", "max", "min", "decimate"]


def record(path, layout, frames, backend, **options):
    with Writer(path, layout, backend=backend, ome=True, **options) as writer:
        for frame in frames:
            writer.append(frame)
    return writer


def check_levels(path, writer, frames):
    """Every level, read with zarr-python, equals the NumPy reference reduction of level 0."""
    expected = writer.pyramid.reference(np.asarray(frames))
    group = zarr.open_group(path, mode="r")
    datasets = group.attrs["ome"]["multiscales"][0]["datasets"]
    assert [d["path"] for d in datasets] == [str(k) for k in range(writer.pyramid.levels)]
    for k, dataset in enumerate(datasets):
        level = group[dataset["path"]]
        np.testing.assert_array_equal(level[...], expected[k], err_msg=f"level {k}")
        assert verify(path / dataset["path"]).ok


@pytest.mark.parametrize("method", METHODS)
def test_levels_equal_the_numpy_reduction(tmp_path, backend, method):
    """Odd sizes (edge blocks), several shards per level, a partial last epoch (7 frames, tile 2)."""
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 37, 8, 2), Dim("x", 29, 8, 2)], "uint16")
    frames = SyntheticCamera((37, 29), "uint16", seed=3).stack(7)
    writer = record(tmp_path / "ome.zarr", layout, frames, backend, downsample=method)
    assert [lay.shape[1:] for lay in writer.pyramid.layouts] == [(37, 29), (19, 15), (10, 8), (5, 4)]
    check_levels(tmp_path / "ome.zarr", writer, frames)


@pytest.mark.parametrize("method", METHODS)
def test_reduction_along_time_and_z(tmp_path, backend, method):
    """The append dim halves too (tile 4 -> 2 -> 1), z as well; 11 frames leave partial blocks along t."""
    layout = Layout([Dim("t", 0, 4, 1), Dim("z", 5, 2, 2), Dim("y", 12, 4, 1), Dim("x", 10, 4, 2)], "uint8")
    frames = np.random.default_rng(1).integers(0, 255, (11, 5, 12, 10), dtype=np.uint8)
    writer = record(
        tmp_path / "tz.zarr", layout, frames, backend, downsample=method, downsample_dims=("t", "z", "y", "x")
    )
    assert writer.pyramid.factors[1] == (2, 2, 2, 2) and writer.pyramid.factors[2] == (4, 4, 4, 4)
    group = zarr.open_group(tmp_path / "tz.zarr", mode="r")
    assert [group[str(k)].shape[0] for k in range(writer.pyramid.levels)] == [11, 6, 3][: writer.pyramid.levels]
    check_levels(tmp_path / "tz.zarr", writer, frames)


@pytest.mark.parametrize("dtype", ["int16", "float32", "uint32"])
def test_mean_of_other_dtypes(tmp_path, backend, dtype):
    layout = Layout([Dim("t", 0, 1, 2), Dim("y", 9, 4, 1), Dim("x", 7, 4, 1)], dtype)
    frames = (np.random.default_rng(2).normal(0, 1000, (5, 9, 7))).astype(dtype)
    writer = record(tmp_path / "d.zarr", layout, frames, backend)
    check_levels(tmp_path / "d.zarr", writer, frames)


def test_metadata_axes_scales_units_and_attributes(tmp_path, backend):
    layout = Layout(
        [
            Dim("t", 0, 2, 1, unit="second", scale=0.1),
            Dim("c", 2, 1, 1),
            Dim("y", 32, 8, 2, unit="micrometer", scale=0.65),
            Dim("x", 24, 8, 2, unit="micrometer", scale=0.65),
        ],
        "uint16",
    )
    frames = np.random.default_rng(0).integers(0, 4000, (4, 2, 32, 24), dtype=np.uint16)
    path = tmp_path / "meta.zarr"
    writer = record(path, layout, frames, backend, attributes={"sample": "beads", "objective": {"na": 1.4}})
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["node_type"] == "group"
    attrs = meta["attributes"]
    assert attrs["sample"] == "beads" and attrs["objective"] == {"na": 1.4}
    ome = attrs["ome"]
    assert ome["version"] == "0.5"
    multiscale = ome["multiscales"][0]
    assert multiscale["axes"] == [
        {"name": "t", "type": "time", "unit": "second"},
        {"name": "c", "type": "channel"},
        {"name": "y", "type": "space", "unit": "micrometer"},
        {"name": "x", "type": "space", "unit": "micrometer"},
    ]
    for k, dataset in enumerate(multiscale["datasets"]):
        transform = dataset["coordinateTransformations"]
        assert transform == [{"type": "scale", "scale": pytest.approx([0.1, 1.0, 0.65 * 2**k, 0.65 * 2**k])}]
        level = zarr.open_array(path / dataset["path"], mode="r")
        assert level.metadata.dimension_names == ("t", "c", "y", "x")
        assert level.shape == (4, 2, -(-32 // 2**k), -(-24 // 2**k))
    assert writer.pyramid.levels == 3  # 32x24 -> 16x12 -> 8x6 fits one 8x8 tile
    check_levels(path, writer, frames)


def test_pyramid_levels_published_with_level_0(tmp_path, backend):
    """While recording (flush), every level's shape covers the rows level 0 publishes."""
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 16, 4, 2), Dim("x", 16, 4, 2)], "uint16")
    frames = SyntheticCamera((16, 16), "uint16", seed=5).stack(9)
    path = tmp_path / "live.zarr"
    writer = Writer(path, layout, backend=backend, ome=True)
    try:
        for frame in frames[:5]:
            writer.append(frame)
        writer.flush()
        expected = writer.pyramid.reference(frames[:5])
        for k in range(writer.pyramid.levels):
            np.testing.assert_array_equal(zarr.open_array(path / str(k), mode="r")[...], expected[k])
        for frame in frames[5:]:
            writer.append(frame)
    finally:
        writer.close()
    check_levels(path, writer, frames)


def test_ome_zarr_py_reads_the_pyramid(tmp_path):
    pytest.importorskip("ome_zarr")
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Multiscales, Reader

    layout = Layout(
        [
            Dim("t", 0, 2, 1),
            Dim("y", 40, 16, 2, unit="micrometer", scale=0.5),
            Dim("x", 36, 16, 2, unit="micrometer", scale=0.5),
        ],
        "uint16",
    )
    frames = SyntheticCamera((40, 36), "uint16", seed=1).stack(6)
    path = tmp_path / "ome-py.zarr"
    writer = record(path, layout, frames, "cpu")
    nodes = list(Reader(parse_url(str(path)))())
    image = nodes[0]
    assert image.load(Multiscales) is not None
    expected = writer.pyramid.reference(frames)
    assert len(image.data) == writer.pyramid.levels == 3
    for level, reference in zip(image.data, expected):
        np.testing.assert_array_equal(np.asarray(level), reference)
    axes = image.metadata["axes"]
    assert [a["name"] for a in axes] == ["t", "y", "x"] and axes[1]["unit"] == "micrometer"
    scales = [t[0]["scale"] for t in image.metadata["coordinateTransformations"]]
    assert scales == [pytest.approx([1.0, 0.5 * 2**k, 0.5 * 2**k]) for k in range(3)]


def test_napari_ome_zarr_reader_gets_a_multiscale_layer(tmp_path):
    napari_get_reader = pytest.importorskip("napari_ome_zarr").napari_get_reader

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 40, 16, 2), Dim("x", 36, 16, 2)], "uint8")
    frames = SyntheticCamera((40, 36), "uint8", seed=2).stack(4)
    path = tmp_path / "napari-ome.zarr"
    writer = record(path, layout, frames, "cpu", downsample="max")
    reader = napari_get_reader(str(path))
    assert reader is not None
    (data, meta, kind), *_ = reader(str(path))
    assert kind == "image" and len(data) == writer.pyramid.levels > 1  # a list of levels: multiscale
    assert [tuple(level.shape) for level in data] == [(4,) + lay.shape[1:] for lay in writer.pyramid.layouts]
    np.testing.assert_array_equal(np.asarray(data[-1]), writer.pyramid.reference(frames)[-1])


def test_zarr_store_target(backend):
    """Any zarr Store works as an OME target (keys 0/..., 1/..., zarr.json)."""
    from zarr.storage import MemoryStore

    store = MemoryStore()
    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 20, 8, 1), Dim("x", 20, 8, 1)], "uint16")
    frames = SyntheticCamera((20, 20), "uint16", seed=9).stack(3)
    with Writer(store, layout, backend=backend, ome=True, downsample="min") as writer:
        writer.append(frames)
    group = zarr.open_group(store, mode="r")
    for k, reference in enumerate(writer.pyramid.reference(frames)):
        np.testing.assert_array_equal(group[str(k)][...], reference)


def test_mean_rounding_is_half_to_even():
    frames = np.array([[[1, 2], [2, 2]], [[0, 1], [0, 1]]], dtype=np.uint8)  # means 1.75 and 0.5
    np.testing.assert_array_equal(reduce2(frames, (1, 2), "mean")[:, 0, 0], [2, 0])


@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from(METHODS), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_reduce2_against_a_loop(h, w, method, valid_rows):
    """reduce2 equals the definition written as plain loops over blocks (valid rows along t too)."""
    array = np.random.default_rng(h * 10 + w).integers(0, 50, (4, h, w)).astype(np.int16)
    got = reduce2(array, (0, 1, 2), method, valid_rows=valid_rows)
    expected = np.zeros(got.shape, dtype=np.int16)
    for index in np.ndindex(*got.shape):
        block = array[tuple(slice(2 * i, 2 * i + 2) for i in index)]
        block = block[: max(0, valid_rows - 2 * index[0])]
        if block.size == 0:
            continue
        if method == "decimate":
            value = array[tuple(2 * i for i in index)]
        else:
            value = {"mean": lambda b: np.rint(b.mean()), "max": np.max, "min": np.min}[method](block)
        expected[index] = value
    np.testing.assert_array_equal(got, expected)


def test_bad_options(tmp_path):
    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint8")
    with pytest.raises(ValueError, match="downsample 'median'"):
        Writer(tmp_path / "a.zarr", layout, ome=True, downsample="median", backend="cpu")
    with pytest.raises(ValueError, match="downsample dim 'q'"):
        Writer(tmp_path / "b.zarr", layout, ome=True, downsample_dims=["q"], backend="cpu")
    with pytest.raises(ValueError, match="even tile size"):
        Writer(tmp_path / "c.zarr", layout, ome=True, downsample_dims=["t", "y", "x"], backend="cpu")
    with pytest.raises(ValueError, match="may not contain 'ome'"):
        Writer(tmp_path / "d.zarr", layout, ome=True, attributes={"ome": {}}, backend="cpu")
    with pytest.raises(TypeError):
        Writer(tmp_path / "e.zarr", layout, ome=True, attributes={"bad": object()}, backend="cpu")
    with pytest.raises(ValueError, match="max_levels"):
        Writer(tmp_path / "f.zarr", layout, ome=True, max_levels=0, backend="cpu")
    with pytest.raises(ValueError, match="kind 'spatial'"):
        Dim("y", 8, 4, kind="spatial")
    with pytest.raises(ValueError, match="scale must be a positive"):
        Dim("y", 8, 4, scale=float("nan"))
    assert not any(p.exists() for p in tmp_path.iterdir())  # refusals leave nothing behind
    assert plan_pyramid(layout, max_levels=1).levels == 1


@st.composite
def pyramid_cases(draw):
    """Random small layouts, dtypes, reduced dims (t too when its tile is even), methods, frame counts."""
    rank = draw(st.integers(3, 4))
    names = ["t", "z", "y", "x"][4 - rank :] if rank == 4 else ["t", "y", "x"]
    t_tile = draw(st.sampled_from([1, 2, 4]))
    dims = [Dim("t", 0, t_tile, draw(st.integers(1, 2)))]
    for name in names[1:]:
        size = draw(st.integers(1, 40))
        dims.append(Dim(name, size, draw(st.integers(1, 16)), draw(st.integers(1, 3))))
    dtype = draw(st.sampled_from(["uint8", "uint16", "int16", "int32", "float32"]))
    candidates = names[1:] + (["t"] if t_tile % 2 == 0 else [])
    reduced = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=len(candidates), unique=True))
    method = draw(st.sampled_from(METHODS))
    frames = draw(st.integers(1, 9))
    return Layout(dims, dtype), tuple(reduced), method, frames, draw(st.integers(0, 2**31))


@given(pyramid_cases())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_pyramid_equals_the_reference(tmp_path_factory, backend, case):
    layout, reduced, method, count, seed = case
    frames = np.random.default_rng(seed).integers(-100, 200, (count,) + layout.shape[1:]).astype(layout.dtype)
    path = tmp_path_factory.mktemp("pyr") / "p.zarr"
    writer = record(path, layout, frames, backend, downsample=method, downsample_dims=reduced, max_levels=4)
    for k, expected in enumerate(writer.pyramid.reference(frames)):
        np.testing.assert_array_equal(zarr.open_array(path / str(k), mode="r")[...], expected, err_msg=f"level {k}")
