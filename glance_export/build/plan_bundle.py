"""`glance-export build --plan-only`: a folder to carry to a device this machine is not, and build there.

It holds the whole ONNX export (hard links where the filesystem allows, so no weight is copied on the
same disk), the target profile, a README and a one-line build.sh running `glance-export build --artifacts .`.
No TensorRT is needed to write it.
"""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from glance_runtime.store.atomic import atomic_directory
from glance_runtime.formats import artifacts as artifacts_format

from .targets import DeviceProfile, profile_text
from .memory_plan import MemoryPlan
from .precision import Precision

SCRIPT = "build.sh"
BUNDLE_FORMAT = "glance-build-bundle"
README = "README.md"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_command(profile: DeviceProfile, flags: list[str]) -> str:
    return shlex.join(["glance-export", "build", "--artifacts", ".", "--target", profile.name, "--out", "engines",
                       *flags])


def _install(plan: MemoryPlan) -> str:
    """The toolkit install the device's build needs: cutting a graph into parts reads its shapes with onnx and
    ONNX Runtime's symbolic shape inference (sympy), nothing else needs more than the edge install."""
    if plan.cuts:
        return (f"The toolkit with the `parts` extra (`pip install 'glance-toolkit[parts]'`: onnx, sympy and "
                f"onnxruntime, no torch), since {', '.join(plan.cuts)} is built in parts.")
    return "The toolkit's edge install (`pip install glance-toolkit`; no torch or onnx needed)."


def _readme(profile: DeviceProfile, manifest: artifacts_format.Manifest, command: str, plan: MemoryPlan,
            precision: Precision, files: list[str]) -> str:
    opset = manifest.opset
    parser = (f"opset {opset} graphs parse on every accepted version" if opset <= profile.max_opset
              else f"opset {opset} (ONNX Attention) graphs need {profile.module} >= {profile.attention_op_from}")
    return f"""# GLANCE build bundle: {profile.name}

{profile.description}.

This folder is a complete ONNX export ({manifest.family}, {manifest.dtype}, opset {opset}, max context \
{manifest.max_context}, max tree {manifest.max_tree}) and what the device needs to build \
TensorRT engines from it. It also runs as is on ONNX Runtime (`glance-run --artifacts .`).

## On the device

- GPU: compute capability {', '.join(profile.compute_capabilities)}.
- `{profile.module}` >= {profile.min_version} and < {profile.below_version}: {profile.install}.
- {_install(plan)}

Then run `./{SCRIPT}`, which is:

    {command}

It writes `engines/<graph>.engine` for every graph and `engines/engines.json` (TensorRT version, device,
precision, profiles, hashes). Extra flags pass through, e.g. `./{SCRIPT} --timing-cache timing.cache`.

## Planned on the export machine

- Precision {precision.name}: {precision.how}.
- Parser: {profile.attention}; {parser}.
- {plan.explain()}.
- On the device the memory budget is the device's own memory unless `--memory-gib` is given
  ({profile.memory_note}).

Files: {', '.join(files)}.
"""


def write_bundle(out: Path, artifacts: Path, profile: DeviceProfile, flags: list[str], plan: MemoryPlan,
                 precision: Precision) -> Path:
    manifest = artifacts_format.read(artifacts)
    command = build_command(profile, flags)
    written = [f"{profile.name}.json", SCRIPT, README]  # never linked: writing them would write through a link
    with atomic_directory(out, BUNDLE_FORMAT, "glance-export build --plan-only") as tmp:
        files = sorted(p.name for p in artifacts.iterdir()
                       if p.is_file() and not p.name.startswith(".") and p.name not in written)
        for name in files:
            _link_or_copy(artifacts / name, tmp / name)
        (tmp / written[0]).write_text(profile_text(profile.name))
        script = tmp / SCRIPT
        script.write_text(f'#!/bin/sh\ncd "$(dirname "$0")" && exec {command} "$@"\n')
        script.chmod(0o755)
        (tmp / README).write_text(_readme(profile, manifest, command, plan, precision, files + written[:2]))
    return out
