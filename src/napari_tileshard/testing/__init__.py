"""Public test hooks: storage faults through the Sink seam (:mod:`.faults`), interrupts aimed at
every place of a piece of code (:mod:`.interrupts`) and the conformance
suite every Sink passes (:mod:`.sink_tests`, :class:`SinkTests`), as zarr-python ships
``zarr.testing``.  ``SinkTests`` needs pytest; without it, it is left out (as ``zarr.testing``
leaves out its ``StoreTests``) and the fault hooks still import."""

import importlib.util

from .faults import FaultInjectingSink, SlowDownError, StorageFaults
from .interrupts import InterruptAt

__all__ = ["FaultInjectingSink", "InterruptAt", "SlowDownError", "StorageFaults"]

if importlib.util.find_spec("pytest") is not None:
    import pytest

    # Its assertions explain themselves (values compared) as a test module's do.
    pytest.register_assert_rewrite(f"{__name__}.sink_tests")
    from .sink_tests import SinkTests

    __all__ += ["SinkTests"]
