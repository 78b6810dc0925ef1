"""The stages of a backend, one module each, with the same names for both devices.

A batch of whole tile epochs goes through:

* :mod:`.tile` - lift/transpose into tiles (``tile_cpu``: one shard's tiles with NumPy;
  ``tile_gpu``: the tile-major pool of a batch with a generated CUDA kernel).  The numbers of
  the lift come from :func:`napari_tileshard.format.layout.lifted_strides` in both.
* :mod:`.reduce` - the pyramid levels of a batch (``reduce_cpu``: :func:`pyramid.reduce2`;
  ``reduce_gpu``: a generated kernel per step).
* :mod:`.compress` - codec encode of tiles (``compress_cpu``: the codec object;
  ``compress_gpu``: one nvCOMP call for every tile of a batch).
* :mod:`.aggregate` - group the compressed tiles by shard (``aggregate_cpu``: sizes into the
  padded shard-major slots, per-shard lists; ``aggregate_gpu``: permute sizes by ``P``,
  exclusive scan, gather into one packed buffer, then ``split_packed`` on the host).

Stages compute and nothing else: the backends (``cpu.py``, ``gpu.py``) own threads, streams,
buffers, events and tickets.  No stage imports CuPy at import time; the GPU functions import it
when they are called.
"""

__all__: list[str] = []
