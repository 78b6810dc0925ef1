"""Public test hooks: storage faults through the Sink seam (:mod:`.faults`) and the conformance
suite every Sink passes (:mod:`.sink_tests`), as zarr-python ships ``zarr.testing``."""

from .faults import FaultInjectingSink, SlowDownError, StorageFaults

__all__ = ["FaultInjectingSink", "SlowDownError", "StorageFaults"]
