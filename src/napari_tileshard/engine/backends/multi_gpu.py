"""One stream over several GPUs: a GpuBackend per device, batches dealt out in turn.

The Writer's staging ring hands its buffers out in a fixed cycle, and each buffer belongs to one
GPU (its pinned memory is registered for every device, its mirror lives on its own GPU), so
consecutive batches — whole tile epochs, hence whole shard epochs whenever a batch holds one —
alternate between the GPUs without any scheduler of their own.  Each GPU has its own streams,
slots, nvCOMP scratch and kept-for-next-time buffers.  Results come back in submission order (the
collector asks for them in that order), so shards, ``zarr.json`` and the bytes of every shard are
exactly those of one GPU: a batch's encoding does not depend on which GPU made it.

Memory: ``memory_estimate``'s ``device`` is what each GPU holds (the budget applies per GPU, as
in the single-GPU case), ``host`` is the pinned memory of all of them.
"""

from __future__ import annotations

from ..shards import EncodedEpoch
from .base import Backend, MemoryBudget
from .gpu import GpuBackend

__all__ = ["MultiGpuBackend"]


class MultiGpuBackend(Backend):
    name = "gpu"
    accepts_device_arrays = True
    estimate_holds_shards = True

    def __init__(
        self,
        layout,
        codec="zstd",
        level=1,
        *,
        devices,
        slots: int | None = None,
        batch_bytes: int | None = None,
        pyramid=None,
        threads: int | None = None,
    ):
        devices = list(devices)
        if len(devices) < 1:
            raise ValueError("devices must name at least one GPU")
        super().__init__(layout, codec, level, pyramid)
        self.parts = [
            GpuBackend(layout, codec, level, slots=slots, batch_bytes=batch_bytes, pyramid=pyramid, device=d)
            for d in devices
        ]
        self.devices = devices
        self.preferred_batch_bytes = self.parts[0].preferred_batch_bytes
        self.preferred_staging_buffers = GpuBackend.preferred_staging_buffers * len(self.parts)
        self.batches_in_flight = sum(part.batches_in_flight for part in self.parts)
        self._owner: dict[int, GpuBackend] = {}  # staging buffer address -> its GPU's backend
        self._handed_out = 0

    def describe(self) -> str:
        return (
            f"gpu x{len(self.parts)} (" + "; ".join(p.describe().removeprefix("gpu (")[:-1] for p in self.parts) + ")"
        )

    def default_budget(self, physical_memory: int | None = None) -> MemoryBudget:
        budgets = [part.default_budget(physical_memory) for part in self.parts]
        host = [b.host for b in budgets]
        return MemoryBudget(
            host=None if None in host else sum(h for h in host if h is not None),
            device=min((b.device for b in budgets if b.device is not None), default=None),
        )

    def memory_estimate(self, batch_bytes: int, staging_buffers: int) -> dict[str, int]:
        per_gpu = -(-staging_buffers // len(self.parts))
        estimates = [part.memory_estimate(batch_bytes, per_gpu) for part in self.parts]
        return {"host": sum(e["host"] for e in estimates), "device": max(e["device"] for e in estimates)}

    def memory_held(self) -> dict[str, int]:
        held = [part.memory_held() for part in self.parts]
        return {"host": sum(h["host"] for h in held), "device": max(h["device"] for h in held)}

    def allocate_staging(self, nbytes: int):
        part = self.parts[self._handed_out % len(self.parts)]
        self._handed_out += 1
        staging = part.allocate_staging(nbytes)
        self._owner[staging.ctypes.data] = part
        return staging

    def write_device(self, staging, offset: int, data) -> None:
        self._owner[staging.ctypes.data].write_device(staging, offset, data)

    def submit(self, staging, epochs, host_ranges=None, rows=None):
        part = self._owner[staging.ctypes.data]
        return part, part.submit(staging, epochs, host_ranges, rows=rows)

    def result(self, ticket) -> list[list[EncodedEpoch]]:
        part, inner = ticket
        return part.result(inner)

    def staging_free(self, ticket, block=True) -> bool:
        part, inner = ticket
        return part.staging_free(inner, block)

    def close(self) -> None:
        errors = []
        for part in self.parts:
            try:
                part.close()
            except BaseException as exc:  # noqa: BLE001 - close every GPU, then report the first error
                errors.append(exc)
        if errors:
            raise errors[0]
