"""GPU health through NVML (nvidia-ml-py): lost GPUs, uncorrectable ECC errors, critical Xid events.

Runs before the first round and then periodically. Without NVML (no driver, no GPUs, CPU-only
node) :meth:`GpuHealth.open` returns None and the agent skips the checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcelastic.slow.collect import gpu_facts
from hpcelastic.slow.sample import GpuFacts

# Xid codes that mean the GPU (or its memory/link) cannot be trusted until the node is serviced:
# 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high SBE rate,
# 94/95 contained/uncontained ECC, 119/120 GSP errors, 140 unrecovered ECC.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


@dataclass(frozen=True)
class HealthProblem:
    """One reason to mark the node bad."""

    gpu: str
    reason: str


class GpuHealth:
    """Checks the node's GPUs with an NVML binding (``pynvml`` unless another is given)."""

    def __init__(self, nvml: Any, gpu_ids: Sequence[str]) -> None:
        self._nvml = nvml
        self.gpu_ids = tuple(gpu_ids)
        self._events: Any = None
        with contextlib.suppress(nvml.NVMLError):
            self._events = nvml.nvmlEventSetCreate()
            for gid in self.gpu_ids:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlDeviceRegisterEvents(
                        self._handle(gid), nvml.nvmlEventTypeXidCriticalError, self._events
                    )

    @classmethod
    def open(cls, gpu_ids: Sequence[str]) -> GpuHealth | None:
        """A checker for ``gpu_ids`` (NVML indices or UUIDs), or None where NVML or GPUs are absent."""
        if not gpu_ids:
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return None
        return cls(pynvml, gpu_ids)

    def facts(self) -> dict[int, GpuFacts]:
        """Each local rank's GPU facts for slow-node detection (clocks, throttle reasons, power, PCIe)."""
        out = {}
        for local_rank, gid in enumerate(self.gpu_ids):
            with contextlib.suppress(self._nvml.NVMLError):
                out[local_rank] = gpu_facts(self._nvml, self._handle(gid))
        return out

    def check(self) -> list[HealthProblem]:
        """Everything wrong with the GPUs now (empty list: healthy)."""
        nv = self._nvml
        problems: list[HealthProblem] = []
        for gid in self.gpu_ids:
            try:
                handle = self._handle(gid)
                with contextlib.suppress(nv.NVMLError_NotSupported):
                    ecc = nv.nvmlDeviceGetTotalEccErrors(
                        handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                    )
                    if ecc:
                        problems.append(HealthProblem(gid, f"{ecc} uncorrectable ECC error(s)"))
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                    problems.append(HealthProblem(gid, "GPU is lost (fallen off the bus)"))
                else:
                    problems.append(HealthProblem(gid, f"NVML cannot query the GPU: {e}"))
        return problems + self._xid_problems()

    def _xid_problems(self) -> list[HealthProblem]:
        nv = self._nvml
        out: list[HealthProblem] = []
        if self._events is None:
            return out
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                return out
            xid = int(getattr(data, "eventData", 0))
            if xid in FATAL_XIDS:
                out.append(HealthProblem(self._gpu_of(data), f"critical Xid {xid}"))

    def _gpu_of(self, data: Any) -> str:
        nv = self._nvml
        try:
            uuid = nv.nvmlDeviceGetUUID(data.device)
            return uuid if uuid in self.gpu_ids else str(nv.nvmlDeviceGetIndex(data.device))
        except nv.NVMLError:
            return "?"

    def _handle(self, gid: str) -> Any:
        nv = self._nvml
        if gid.startswith(("GPU-", "MIG-")):
            return nv.nvmlDeviceGetHandleByUUID(gid)
        return nv.nvmlDeviceGetHandleByIndex(int(gid))

    def close(self) -> None:
        """Release NVML."""
        with contextlib.suppress(self._nvml.NVMLError):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
