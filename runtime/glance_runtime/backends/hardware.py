"""Names of the processor a backend computes on, as cost profiles are keyed by them."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def host_cpu() -> str:
    """The host processor's model name and core count."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable: what the kernel can hand a new allocation without swapping (free plus reclaimable
    cache); None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cuda_gpu(device_id: int, compute_capability: str) -> str:
    return f"CUDA GPU {device_id} (compute capability {compute_capability})"
