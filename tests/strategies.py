"""Hypothesis strategies shared by the tests of several layers."""

from hypothesis import strategies as st

from napari_tileshard import Dim, Layout


@st.composite
def layouts(draw, max_rank=4, unbounded=None):
    """Small layouts of 1 to ``max_rank`` dims (sizes, tiles and tiles per shard that do not divide)."""
    rank = draw(st.integers(1, max_rank))
    dims = []
    for d in range(rank):
        size = draw(st.integers(1, 13))
        dims.append(Dim(f"d{d}", size, draw(st.integers(1, 6)), draw(st.integers(1, 3))))
    return Layout(dims, dtype=draw(st.sampled_from(["uint8", "uint16", "float32"])))
