"""`glance-export triton` writes a model repository that the real `tritonserver` (from the nvidia-pytriton
wheel) serves on a loopback port: `generate` and `generate_stream` answer with `glance-run`'s text, concurrent
requests too (decoded together).

The Python-backend stubs run in a virtual environment with numpy 1.26 (Triton 2.51's stub crashes on
string tensors under numpy 2) and the runtime's dependencies; the test builds it once with pip into
pytest's cache directory (about a minute from pip's cache) and reuses it while its package list holds."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import metadata
from pathlib import Path

import httpx
import pytest

from glance_export.cli import main as export_main
from glance_export.triton.launch import install_hint
from support import RECEIPT, glance_run, wait_until_ok

ENV_PACKAGES = ["numpy==1.26.4", "onnxruntime", "pillow", "tokenizers", "jinja2>=3.1.6"]
TRITON_WHEEL = "nvidia-pytriton"  # installed without its Python client's dependencies: only the binary is used
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120

pytestmark = [pytest.mark.edge,  # needs no torch: runs on the edge install too
              pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                                 reason="the nvidia-pytriton wheel ships tritonserver for Linux x86-64 only")]


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True,
                   timeout=600)


@pytest.fixture(scope="session")
def stub_env(request, tmp_path_factory) -> Path:
    """The stubs' virtual environment, built once per package list and Python version (complete or absent),
    in pytest's cache where it has one, so later runs reuse it."""
    key = hashlib.sha256(json.dumps([PYVER, ENV_PACKAGES, TRITON_WHEEL]).encode()).hexdigest()[:12]
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("triton-env")) if cache is not None else tmp_path_factory.mktemp("triton-env")
    env = root / f"py{PYVER}-{key}"
    if (env / "complete").is_file():
        return env
    shutil.rmtree(env, ignore_errors=True)  # an interrupted build left no marker: start it over
    print(f"building the Triton stub environment in {env} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)  # in place: it names its path
    _pip(env / "bin" / "python", *ENV_PACKAGES)
    _pip(env / "bin" / "python", "--no-deps", TRITON_WHEEL)
    (env / "complete").write_text("")
    return env


def _free_ports() -> int:
    """An HTTP port whose next two (gRPC, metrics) are free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65533 and all(_free(p) for p in (port + 1, port + 2)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def triton(stub_env, tmp_path_factory):
    """tritonserver on loopback ports serving the repository `glance-export triton` wrote, launched by exactly
    the commands it printed."""
    root = tmp_path_factory.mktemp("triton")
    repo = root / "repo"
    port = _free_ports()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_main(["triton", "--out", str(repo), "--python-env", str(stub_env), "--port", str(port)]) == 0
    commands = printed.getvalue().strip().splitlines()
    assert len(commands) == 4 and "--http-address 127.0.0.1" in commands[-1]
    subprocess.run(["bash", "-ec", "\n".join(commands[:-1])], check=True, timeout=120)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (root / "tritonserver.log").open("w")
    proc = subprocess.Popen(["bash", "-c", commands[-1]], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_ok(f"{url}/v2/health/ready", proc, START_TIMEOUT_S):
            pytest.fail("tritonserver did not become ready:\n" + (root / "tritonserver.log").read_text()[-4000:])
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that failed to start has exited already
            os.killpg(proc.pid, signal.SIGTERM)  # the shell and the server it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow  # a real tritonserver
def test_generate_and_generate_stream_answer_with_glance_runs_text(triton):
    ref = glance_run("What is the total?", RECEIPT)["text"]
    body = {"prompt": "What is the total?", "image": base64.b64encode(RECEIPT.read_bytes()).decode(), "max_tokens": 256}
    r = httpx.post(f"{triton}/v2/models/glance/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == ref
    with httpx.stream("POST", f"{triton}/v2/models/glance/generate_stream", json={**body, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as s:
        pieces = [e["text"] for e in _events(s)]
    assert "".join(pieces) == ref and len(pieces) > 1
    text_only = httpx.post(f"{triton}/v2/models/glance/generate", json={"prompt": "Describe this."},
                           timeout=REQUEST_TIMEOUT_S)
    assert text_only.json()["text"] == glance_run("Describe this.")["text"]


@pytest.mark.slow  # a real tritonserver
def test_sampled_requests_get_glance_runs_sampled_answer_and_bad_settings_a_400(triton):
    """temperature, top_p and seed as request inputs, greedy and sampled requests at once: each answer is glance-run's
    with the same settings; a temperature out of range is refused naming it."""
    asks = [("Describe this.", {}), ("Name a colour.", {"temperature": 1.2, "top_p": 0.95, "seed": 11}),
            ("Describe this.", {"temperature": 0.8, "seed": 12}), ("What is the total?", {"top_k": 5})]

    def generate(ask):
        return httpx.post(f"{triton}/v2/models/glance/generate", json={"prompt": ask[0], "max_tokens": 64, **ask[1]},
                          timeout=REQUEST_TIMEOUT_S).json()["text"]

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(generate, asks))
    for (prompt, kw), text in zip(asks, got):
        flags = [f for k, v in kw.items() for f in (f"--{k.replace('_', '-')}", str(v))]
        assert text == glance_run(prompt, None, 64, *flags)["text"], kw
    bad = httpx.post(f"{triton}/v2/models/glance/generate", json={"prompt": "hi", "temperature": -1.0},
                     timeout=REQUEST_TIMEOUT_S)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]


@pytest.mark.slow  # a real tritonserver
def test_concurrent_requests_are_decoded_together_each_with_its_answer_alone(triton):
    """The shipped model's graphs are batched, so the instance decodes these requests in one running batch."""
    image = base64.b64encode(RECEIPT.read_bytes()).decode()
    asks = [("What is the total?", image), ("Describe this.", None), ("What is the date?", image), ("Hello", None)]
    refs = [glance_run(q, RECEIPT if i else None, max_new_tokens=48)["text"] for q, i in asks]

    def generate(ask):
        prompt, img = ask
        body = {"prompt": prompt, "max_tokens": 48, **({"image": img} if img else {})}
        return httpx.post(f"{triton}/v2/models/glance/generate", json=body, timeout=REQUEST_TIMEOUT_S).json()["text"]

    with ThreadPoolExecutor(len(asks)) as pool:
        assert list(pool.map(generate, asks)) == refs


@pytest.mark.slow  # a real tritonserver
@pytest.mark.parametrize("image", ["@@not base64@@", "", base64.b64encode(b"not an image file").decode(),
                                   base64.b64encode(RECEIPT.read_bytes()[:200]).decode()],
                         ids=["not-base64", "empty", "not-an-image", "truncated"])
def test_an_image_that_is_not_one_is_a_400_and_the_model_keeps_serving(triton, image):
    """An image field that is present must be an image: answering without it would answer another question."""
    bad = httpx.post(f"{triton}/v2/models/glance/generate", json={"prompt": "What is the total?", "image": image},
                     timeout=REQUEST_TIMEOUT_S)
    assert bad.status_code == 400 and "image" in bad.json()["error"], bad.text
    short = glance_run("What is the total?", RECEIPT, max_new_tokens=3)["text"]
    body = {"prompt": "What is the total?", "image": base64.b64encode(RECEIPT.read_bytes()).decode(), "max_tokens": 3}
    assert httpx.post(f"{triton}/v2/models/glance/generate", json=body,
                      timeout=REQUEST_TIMEOUT_S).json()["text"] == short


def test_repository_layout_and_instance_groups(tmp_path, capsys):
    repo = tmp_path / "repo"
    assert export_main(["triton", "--out", str(repo), "--instances-per-gpu", "3", "--gpu", "--provider", "cuda",
                        "--max-batch", "6"]) == 0
    config = (repo / "glance" / "config.pbtxt").read_text()
    assert "count: 3 kind: KIND_GPU" in config and "decoupled: true" in config
    assert '"max_batch"' in config and 'string_value: "6"' in config
    assert '"providers"' in config and (repo / "glance" / "1" / "model.py").is_file()
    assert export_main(["triton", "--out", str(tmp_path / "bad"), "--instances-per-gpu", "0"]) == 2
    assert export_main(["triton", "--out", str(tmp_path / "bad"), "--python-env", str(tmp_path)]) == 2
    assert export_main(["triton", "--out", str(tmp_path / "bad"), "--max-batch", "0"]) == 2
    err = capsys.readouterr().err
    assert "--instances-per-gpu" in err and "--python-env" in err and "--max-batch" in err
    assert not (tmp_path / "bad").exists()


def test_without_the_wheel_it_says_to_install_the_triton_extra(tmp_path, capsys):
    """The hint installs what pyproject's `triton` extra declares (the wheel and numpy < 2, as the stub needs)
    into the stubs' environment, never into this interpreter's (the export's, with numpy 2)."""
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    assert export_main(["triton", "--out", str(tmp_path / "repo"), "--python-env", str(env)]) == 0
    out, err = capsys.readouterr()
    command = shlex.split(re.search(r"`([^`]+)`", err)[1])
    assert out == "" and command[:4] == [str(env / "bin" / "python"), "-m", "pip", "install"]
    assert command[4] == "-e", "editable: the stubs import the clone's runtime and find its shipped model"
    source, extras = re.fullmatch(r"(.+)\[(.+)\]", command[5]).groups()
    assert Path(source) == ROOT and set(extras.split(",")) == {"onnxruntime", "triton"}
    declared = {}
    for requirement in metadata("glance-toolkit").get_all("Requires-Dist"):
        name, _, marker = requirement.partition(";")
        extra = re.search(r"extra == \"(.+?)\"", marker)
        if extra:
            declared.setdefault(extra[1], []).append(name.replace(" ", ""))
    assert "numpy<2" in declared["triton"] and "onnxruntime" in declared
    assert any(r.startswith("nvidia-pytriton") for r in declared["triton"])
    without_env = install_hint(None)
    assert "--python-env" in without_env and sys.executable not in without_env and "[onnxruntime,triton]" in without_env
