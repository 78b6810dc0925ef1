"""Qt/napari layer: everything that imports Qt lives here (the core never does)."""

__all__: list[str] = []
