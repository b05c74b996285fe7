"""The commands that launch a written model repository with the `tritonserver` the nvidia-pytriton wheel carries.

The wheel keeps the server binary, its backends and one Python-backend stub per Python version inside the
installed package, and the server wants the stub beside the Python backend's library. So the launch copies
the backends once into a directory of the user's, puts the stub for the stubs' Python there, and starts the
binary with the wheel's libraries on LD_LIBRARY_PATH, every endpoint bound to loopback (a server meant for
other machines is put behind a proxy that does authentication, which Triton does not).
"""
from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

WHEEL = "nvidia-pytriton"
STUB_EXTRAS = ("onnxruntime", "triton")  # pyproject's extras the stubs' environment installs
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Wheel:
    """Where the wheel is installed: its site-packages and the Python version the stubs run with."""
    site: Path
    python: str  # "3.11"

    @property
    def server(self) -> Path:
        return self.site / "pytriton" / "tritonserver"


def find_wheel(python_env: Path | None) -> Wheel | None:
    """The wheel in `python_env` (the stubs' environment), else in this interpreter's; None where absent."""
    if python_env is not None:
        for server in sorted(Path(python_env).resolve().glob("lib/python3.*/site-packages/pytriton/tritonserver")):
            return Wheel(server.parents[1], server.parents[2].name.removeprefix("python"))
        return None
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    if not (site / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        return None
    return Wheel(site, f"{sys.version_info.major}.{sys.version_info.minor}")


def stub_requirement() -> list[str]:
    """pip's arguments for the stubs' environment: the `triton` extra (nvidia-pytriton, numpy < 2, which Triton's
    stub needs for string tensors) with `onnxruntime`; from this clone where there is one, editable, so the
    runtime the stubs import and the embedded default's models are the clone's."""
    root = Path(__file__).resolve().parents[2]
    extras = f"[{','.join(STUB_EXTRAS)}]"
    return ["-e", f"{root}{extras}"] if (root / "pyproject.toml").is_file() else [f"glance-toolkit{extras}"]


def install_hint(python_env: Path | None) -> str:
    """How to get a tritonserver: the stubs' own environment with the `triton` extra (never this interpreter's
    when no --python-env is given: the export's environment has numpy 2, which the stub cannot run with)."""
    requirement = shlex.join(stub_requirement())
    if python_env is None:
        return (f"{WHEEL} is not installed here, so there is no tritonserver to launch the repository with; make "
                f"the stubs' environment (Linux x86-64) with `python3 -m venv ENV && ENV/bin/pip install {requirement}`"
                " and run this command again with --python-env ENV")
    python = shlex.quote(str(Path(python_env) / "bin" / "python"))
    return (f"{WHEEL} is not installed in {python_env}, so there is no tritonserver to launch the repository with; "
            f"install the stubs' requirements there (Linux x86-64) with `{python} -m pip install {requirement}` and "
            "run this command again")


def launch_commands(repo: Path, wheel: Wheel, port: int) -> list[str]:
    """Shell commands, in order: copy the backends and the stub, then run the server on loopback (HTTP on
    `port`, gRPC on port + 1, metrics on port + 2)."""
    repo = Path(repo).resolve()
    backends = repo.with_name(f"{repo.name}-backends")
    stub = wheel.server / "python_backend_stubs" / wheel.python / "triton_python_backend_stub"
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    return [
        f"mkdir -p {q(backends)}",
        f"cp -r {q(wheel.server / 'backends')}/. {q(backends)}/",
        f"cp {q(stub)} {q(backends / 'python')}/",
        f"LD_LIBRARY_PATH={q(wheel.site / 'nvidia_pytriton.libs')} {q(wheel.server / 'bin' / 'tritonserver')} "
        f"--model-repository {q(repo)} --backend-directory {q(backends)} "
        f"--http-address {HOST} --http-port {port} --grpc-address {HOST} --grpc-port {port + 1} "
        f"--metrics-address {HOST} --metrics-port {port + 2}",
    ]
