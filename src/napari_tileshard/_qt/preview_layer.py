"""The recording's preview layer: when to reopen the store, what the layer shows, where the slider goes.

Policy, in order of the recording:

* on Start, a placeholder of zeros (multiscale when the recording is) takes the layer's place, so
  creating the layer costs the GUI a moment on the click rather than mid-recording;
* per completed shard epoch, the store is reopened limited to the complete rows
  (:func:`napari_tileshard.apps.preview.preview_data`), at most every 200 ms: progress can arrive tens of
  times a second, faster than the GUI thread can redraw a pyramid;
* the slider follows the newest frame unless the user moved it away from the last one;
* on the end of the recording, every written row.

A store that cannot be opened or displayed (e.g. a ``zarr.json`` replaced by something hostile) is
reported once and never stops the recording.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from qtpy.QtCore import QObject, QTimer

from ..apps.preview import RecentFrames, contrast_limits, preview_data, shape_of, warm_up_dask_in_background
from ..apps.recorder import RecorderSettings
from ..apps.recorder_form import OWN_LAYER_KEY
from ..format.pyramid import Pyramid

__all__ = ["COALESCE_MS", "PreviewLayer"]

COALESCE_MS = 200


class PreviewLayer(QObject):
    def __init__(self, viewer, parent=None):
        super().__init__(parent)
        self.viewer = viewer
        #: the napari layer, or None before the first recording
        self.layer = None
        #: True while the layer shows zeros because no shard epoch is complete yet
        self.placeholder = False
        #: why the store could not be shown, until it can again
        self.error: str | None = None
        #: the levels of the recording shown (level 0 only without OME)
        self.pyramid: Pyramid | None = None
        self._settings: RecorderSettings | None = None
        self._name = "preview"
        self._recording = False
        self._follow = True
        self._recent = RecentFrames()
        self._pending = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(COALESCE_MS)
        self._timer.timeout.connect(self._apply_pending)
        warm_up_dask_in_background()  # now: Start comes much later, with both cores busy

    def begin(self, settings: RecorderSettings, placeholder: bool = True) -> None:
        """Follow the recording of ``settings`` from now on."""
        shown = settings.preview_settings()  # with several streams: the first one's image
        self._settings = shown
        self._name = f"preview: {Path(settings.output).name}"
        if settings.streams:
            self._name += f" [{next(iter(settings.streams))}]"
        self.pyramid = pyramid = shown.pyramid()
        self._recent = RecentFrames()
        self._follow = True
        self._recording = True
        if placeholder:
            layout = shown.checked_layout()
            zeros = [np.zeros((1,) + tuple(level.shape[1:]), layout.dtype) for level in pyramid.layouts]
            self._add(zeros if settings.ome else zeros[0], list(layout.names), placeholder=True)

    def on_progress(self, stats, newest=None, first=None) -> None:
        """A shard epoch completed: show it within :data:`COALESCE_MS`, together with any later one.
        ``first`` (row 0 of every level, with the first read-back only) is kept at once: a later
        progress may replace this one before it is shown."""
        if first:
            self._recent.add(first)
        self._pending = (stats.rows_complete, newest)
        if not self._timer.isActive():
            self._timer.start()

    def _apply_pending(self) -> None:
        if self._pending is not None and self._recording:
            rows, newest = self._pending
            self._pending = None
            self.update(rows, newest=newest)

    def finish(self, rows: int) -> None:
        """The recording ended with ``rows`` rows: show all of them, from the finalized store.
        Without any, the placeholder goes: there is nothing to preview (and no store)."""
        self._timer.stop()
        self._pending = None
        self._recording = False
        if rows <= 0 and self.placeholder and self.layer is not None:
            if self.layer in self.viewer.layers:
                self.viewer.layers.remove(self.layer)
            self.layer, self.placeholder = None, False
            return
        self.update(rows, final=True)

    def update(self, rows: int, final: bool = False, newest=None) -> None:
        """Reopen the store and show its first ``rows`` complete rows (every written row if ``final``)."""
        settings, pyramid = self._settings, self.pyramid
        if rows <= 0 or settings is None or pyramid is None:
            return
        if newest:
            self._recent.add(newest)
        try:
            data, names = preview_data(
                settings.output, rows, pyramid, ome=settings.ome, final=final, recent=self._recent
            )
        except Exception as exc:  # noqa: BLE001 - never let the preview take the viewer down
            if not self.error:
                self.error = str(exc)
                from napari.utils.notifications import show_warning

                show_warning(f"preview unavailable: {exc}")
            return
        self.error = None
        if data is None:
            return
        with _synchronous_dask():
            self._show(data, names, newest, final)

    def _show(self, data, names, newest, final=False) -> None:
        multiscale = isinstance(data, list)
        if self.layer is None or self.layer not in self.viewer.layers or multiscale != bool(self.layer.multiscale):
            self._add(data, names, newest)
        elif self.placeholder and (newest or final):  # final: a partial epoch written at close
            self._replace_placeholder(data, newest)
        else:
            # Decided before the data changes: the slider follows unless the user moved it away
            # from the last row shown.
            step = self.viewer.dims.current_step
            last_shown = shape_of(self.layer.data)[0] - 1
            self._follow = step[0] >= last_shown if step else True
            self.layer.data = data
        if self._follow:
            self.viewer.dims.set_current_step(0, shape_of(data)[0] - 1)

    def _replace_placeholder(self, data, newest) -> None:
        """The first real rows replace the zeros; the slider then goes to the newest row.  (Setting
        the data slices the placeholder's row 0 first: the reader thread brought it back already,
        see ``on_progress``.)"""
        layer = self.layer
        assert layer is not None  # a placeholder exists before its rows arrive
        layer.data = data
        if newest:
            layer.contrast_limits = contrast_limits(newest[0][1])
        else:
            layer.reset_contrast_limits()
        layer.name = layer.name.split(" (")[0]
        self.placeholder = False
        self._follow = True
        if layer.multiscale:
            self.viewer.reset_view()  # a multiscale layer loads only the tiles in view: frame it

    def _add(self, data, names, newest=None, placeholder=False) -> None:
        name = self._name
        if placeholder:
            name += " (waiting for the first shard epoch)"
        self.placeholder = placeholder
        kwargs = {"axis_labels": names} if names and len(names) == len(shape_of(data)) else {}
        if isinstance(data, list):
            kwargs["multiscale"] = True
        if newest:
            kwargs["contrast_limits"] = contrast_limits(newest[0][1])
        if self.layer is not None and self.layer in self.viewer.layers:
            self.viewer.layers.remove(self.layer)
        # Marked as ours: the recorder never offers its own preview as a source to record.
        self.layer = self.viewer.add_image(data, name=name, metadata={OWN_LAYER_KEY: "preview"}, **kwargs)
        self._follow = True


def _synchronous_dask():
    """Compute dask arrays on the calling thread while napari slices the preview for an update.

    napari computes what it shows on the GUI thread; dask's default thread pool only adds
    hand-offs there, which cost 20-30 ms per update while the recorder's threads keep both cores
    busy (and a distributed Client, where the user has one, must not be sent reads of a local
    store).  Draws the user causes (slider, zoom) keep dask's default scheduler.
    """
    import dask

    return dask.config.set(scheduler="synchronous")
