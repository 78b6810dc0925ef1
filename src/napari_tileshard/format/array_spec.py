"""What a recording writes, validated once: the array's tiling, codec, OME pyramid and attributes.

:class:`ArraySpec` is the format half of a writer's settings (the engine half, how it is written,
is :class:`napari_tileshard.engine.options.EngineOptions`).  Every entry point (the Writer,
MultiWriter, the recorder, the pymmcore-plus sink, convert, the napari writer, the CLI and the
dock) builds one with :meth:`ArraySpec.of` and passes the object on, instead of forwarding a dozen
keywords by hand; the codec is resolved to its configured object here, once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .codecs import Codec, get
from .layout import Layout
from .metadata import check_attributes
from .pyramid import Pyramid, check_method, plan_pyramid

__all__ = ["ARRAY_KEYWORDS", "ArraySpec", "OmeOptions"]


@dataclass(frozen=True)
class OmeOptions:
    """An OME-Zarr 0.5 group with a multiscale pyramid computed while recording: ``downsample``
    (mean, max, min, decimate) over ``downsample_dims`` (default the last two dims), up to
    ``max_levels``; ``image_name`` names the image (default: the store's name); ``fields`` are
    further keys of the group's ``ome`` object (``omero`` channel names, say)."""

    downsample: str = "mean"
    downsample_dims: tuple[str, ...] | None = None
    max_levels: int | None = None
    image_name: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_method(self.downsample)
        if self.downsample_dims is not None:
            if isinstance(self.downsample_dims, str) or not all(isinstance(d, str) for d in self.downsample_dims):
                raise TypeError(f"downsample_dims must be dim names, got {self.downsample_dims!r}")
            object.__setattr__(self, "downsample_dims", tuple(self.downsample_dims))
        if self.max_levels is not None and (
            not isinstance(self.max_levels, int) or isinstance(self.max_levels, bool) or self.max_levels < 1
        ):
            raise ValueError(f"max_levels must be a positive integer or None, got {self.max_levels!r}")
        if self.image_name is not None and not isinstance(self.image_name, str):
            raise TypeError(f"image_name must be a string, got {self.image_name!r}")
        if not isinstance(self.fields, Mapping):
            raise TypeError(f"ome_fields must be a dict, got {type(self.fields).__name__}")


#: the keywords :meth:`ArraySpec.of` takes besides the layout (what the Writer's shorthand accepts)
ARRAY_KEYWORDS = (
    "codec",
    "level",
    "ome",
    "downsample",
    "downsample_dims",
    "max_levels",
    "image_name",
    "ome_fields",
    "attributes",
)


@dataclass(frozen=True)
class ArraySpec:
    """The array a recording writes: ``layout`` (tiling and sharding), ``codec`` (a configured
    codec object), ``ome`` (None: a bare array) and user ``attributes`` (JSON; in the array's or,
    with OME, the group's ``zarr.json``)."""

    layout: Layout
    codec: Codec
    ome: OmeOptions | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise TypeError(f"layout must be a Layout, got {type(self.layout).__name__}")
        if not isinstance(self.codec, Codec):
            raise TypeError(f"codec must be a codec object (ArraySpec.of resolves names), got {self.codec!r}")
        if self.ome is not None and not isinstance(self.ome, OmeOptions):
            raise TypeError(f"ome must be OmeOptions or None, got {type(self.ome).__name__}")
        object.__setattr__(self, "attributes", check_attributes(dict(self.attributes)))
        self.pyramid  # noqa: B018 - a pyramid the layout cannot have is refused here, not at recording

    @classmethod
    def of(
        cls,
        layout: Layout,
        codec: str | Codec = "zstd",
        level: int = 1,
        *,
        ome: bool | OmeOptions = False,
        downsample: str = "mean",
        downsample_dims=None,
        max_levels: int | None = None,
        image_name: str | None = None,
        ome_fields: Mapping | None = None,
        attributes: Mapping | None = None,
    ) -> ArraySpec:
        """The spec from the keywords users know (the Writer's): ``codec`` by name (or object)
        at ``level``, ``ome=True`` with the pyramid options (or an :class:`OmeOptions`).

        What the layout's tiling costs (:meth:`Layout.tiling_notes`: tiles larger than their
        dimension, chunks under 4 KiB, over 10,000 files per GB) is warned here, as a
        :class:`~napari_tileshard.format.layout.TilingWarning` per note, since every entry point
        that writes a layout a user chose builds its spec here (once per layout object:
        :meth:`Layout.warn_tiling`)."""
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
        if not isinstance(ome, (bool, OmeOptions)):
            raise TypeError(f"ome must be True, False or OmeOptions, got {ome!r}")
        configured = get(codec).configure(level, layout.dtype)
        if ome is True:
            ome = OmeOptions(downsample, downsample_dims, max_levels, image_name, dict(ome_fields or {}))
        spec = cls(layout, configured, ome or None, dict(attributes or {}))
        layout.warn_tiling(stacklevel=2)  # once the spec is valid: a refusal comes without them
        return spec

    @functools.cached_property
    def pyramid(self) -> Pyramid:
        """The levels written: level 0 alone without OME."""
        if self.ome is None:
            return Pyramid.single(self.layout)
        return plan_pyramid(self.layout, self.ome.downsample, self.ome.downsample_dims, self.ome.max_levels)

    @property
    def level(self) -> int:
        """The codec's compression level."""
        return self.codec.level

    def with_layout(self, layout: Layout) -> ArraySpec:
        """The same codec, OME options and attributes over another ``layout``."""
        return ArraySpec(layout, self.codec.configure(self.codec.level, layout.dtype), self.ome, self.attributes)
