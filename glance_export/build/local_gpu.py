"""The GPU this machine has, and whether a target profile may build for it.

Probing uses only files and `nvidia-smi` (no CUDA library, no torch), so it works on a bare Jetson.
The build takes a `BuildGpu` value, so tests can stand in any GPU without one being present.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from glance_runtime.errors import GlanceError

from .targets import PROFILE_NAMES, DeviceProfile, load_profile, version_tuple

JETSON_RELEASES = {"R36": "orin", "R38": "thor"}  # L4T release line: JetPack 6 ships for Orin, JetPack 7 for Thor


@dataclass(frozen=True)
class BuildGpu:
    name: str | None  # None: this machine has no NVIDIA GPU
    compute_capability: str | None = None  # "8.7"
    memory_gib: float | None = None
    jetson: str | None = None  # "orin" / "thor" on a Jetson module

    def describe(self) -> str:
        if self.name is None:
            return "no NVIDIA GPU"
        return f"{self.name} (compute capability {self.compute_capability})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").replace("\x00", "").strip()
    except OSError:
        return ""


def _meminfo_gib(root: Path) -> float | None:
    for line in _read(root / "proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return None


def jetson_profiles() -> dict[str, DeviceProfile]:
    """Jetson family ("orin", "thor") -> its target profile."""
    profiles = (load_profile(name) for name in PROFILE_NAMES)
    return {p.jetson: p for p in profiles if p.jetson}


def _jetson(root: Path) -> BuildGpu | None:
    model = _read(root / "proc/device-tree/model")
    families = jetson_profiles()
    family = next((f for f in families if f in model.lower()), None)
    if family is None:
        release = _read(root / "etc/nv_tegra_release")
        family = next((f for tag, f in JETSON_RELEASES.items() if release.startswith(f"# {tag}")), None)
    if family is None:
        return None
    cc = families[family].compute_capabilities[0]
    return BuildGpu(model or f"Jetson {family.title()}", cc, _meminfo_gib(root), family)


def _nvidia_smi() -> BuildGpu:
    if shutil.which("nvidia-smi") is None:
        return BuildGpu(None)
    try:
        query = ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        name, cc, mib = (field.strip() for field in out.splitlines()[0].split(","))
        return BuildGpu(name, cc, float(mib) / 1024)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return BuildGpu(None)


def probe_device(root: Path = Path("/")) -> BuildGpu:
    """This machine's GPU: a Jetson from its device tree or L4T release file, else the first `nvidia-smi` GPU."""
    return _jetson(root) or _nvidia_smi()


def resolve_target(target: str, device: BuildGpu) -> str:
    """`jetson` means the Jetson this runs on; every other name is a profile."""
    if target != "jetson":
        load_profile(target)
        return target
    families = jetson_profiles()
    family = device.jetson or next((f for f, p in families.items()
                                    if device.compute_capability in p.compute_capabilities), None)
    if family not in families:
        raise GlanceError(f"--target jetson picks Orin or Thor from the device it runs on, and this machine has "
                          f"{device.describe()}; name one: --target jetson-orin or --target jetson-thor")
    return families[family].name


def check_device(profile: DeviceProfile, device: BuildGpu) -> None:
    """Refuse a GPU the target's engines would not run on (or a missing GPU where the builder needs one)."""
    if device.name is None:
        if not profile.ahead_of_time:
            raise GlanceError(f"no NVIDIA GPU found, and {profile.module} builds engines on the GPU that runs them; "
                              f"run this on the {profile.name} device, or write a bundle for it here with --plan-only")
        return
    if device.compute_capability not in profile.compute_capabilities:
        fits = [n for n in PROFILE_NAMES if device.compute_capability in load_profile(n).compute_capabilities]
        hint = f"use --target {fits[0]} for this GPU" if fits else "no target profile covers this GPU"
        raise GlanceError(f"{device.describe()} is not a {profile.name} GPU (compute capability "
                          f"{', '.join(profile.compute_capabilities)}); {hint}, or build on a {profile.name} device "
                          f"(--plan-only writes a bundle for it)")


def meets(cc: str, minimum: str) -> bool:
    """Compute capability `cc` is at least `minimum` ("12.0" >= "8.9")."""
    return version_tuple(cc) >= version_tuple(minimum)
