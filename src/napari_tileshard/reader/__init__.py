"""The reader layer: :class:`~napari_tileshard.reader.shard_reader.ShardReader` and its parts
(``levels``, ``collection``, ``settings``, ``plan``, ``fetch``, ``cache``, ``cpu``, ``gpu``, ``lazy``).  Import
from the modules; the package itself exports nothing, so importing it loads none of them."""

__all__: list[str] = []
