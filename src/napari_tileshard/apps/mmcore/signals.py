"""Listening to pymmcore-plus's MDA signals on the thread that emits them (the MDA thread)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MDA_HANDLER_SIGNALS", "connect_on_mda_thread"]

#: the MDA signals a frame handler listens to (pymmcore-plus's names)
MDA_HANDLER_SIGNALS = ("sequenceStarted", "frameReady", "sequenceFinished")


def connect_on_mda_thread(mda_events, listener, names: tuple[str, ...] = MDA_HANDLER_SIGNALS) -> Callable[[], None]:
    """Connect ``listener``'s methods to the MDA signals of the same names, called on the thread
    that emits them (the MDA thread) whether the signals are psygnal's or Qt's.  Returns the
    function that disconnects them again (harmless when they are already disconnected)."""
    options: dict = {}
    if hasattr(mda_events, "metaObject"):  # Qt signals: a plain callable would be queued to the GUI thread
        from qtpy.QtCore import Qt

        options = {"type": Qt.ConnectionType.DirectConnection}
    slots = [getattr(listener, name) for name in names]
    for name, slot in zip(names, slots):
        getattr(mda_events, name).connect(slot, **options)

    def detach() -> None:
        for name, slot in zip(names, slots):
            try:
                getattr(mda_events, name).disconnect(slot)
            except (TypeError, RuntimeError, ValueError):  # already disconnected
                pass

    return detach
