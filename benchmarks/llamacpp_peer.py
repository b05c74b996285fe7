"""llama.cpp as a plain-decoding peer of int4_vs_genai: GGUF conversion, quantization and greedy decode.

Three sides, because llama.cpp lives in its own environment (llama-cpp-python, gguf, numpy):

- CONVERT runs llama.cpp's own `convert_hf_to_gguf.py` (from a llama.cpp source tree, with that tree's
  gguf-py) in the benchmark's interpreter, which has torch. The snapshot's tokenizer is the test suite's tiny
  byte-level BPE, whose hash the converter does not know, so it is declared GPT-2's pre-tokenizer (its split
  is GPT-2's) and read as a GPT-2 vocabulary (there is no sentencepiece model); weights are untouched, and
  prompts reach llama.cpp as ids, never as text.
- `quantize` and `serve` (this file run as a script by the llama.cpp interpreter): llama.cpp's own quantizer
  through `llama_cpp.llama_model_quantize`, and greedy decoding through llama-cpp-python's low-level API
  (one decode per token, argmax of the last row's logits: no sampler chain, no prompt cache).
- `LlamaCpp` drives `serve` in a child over a pipe, as `int4_vs_genai.GenAI` drives GenAI's side.

    PY llamacpp_peer.py quantize IN.gguf OUT.gguf --threads N [--pure] --report OUT.json
    PY llamacpp_peer.py serve MODEL.gguf THREADS CONTEXT    (stdin: [ids, new] per line)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# llama.cpp's forms of the int4 snapshot: name -> pure (every matrix Q4_0, the token embedding included)
FORMS = {"q4_0": False, "q4_0-pure": True}
LABELS = {"q4_0": "llama.cpp Q4_0", "q4_0-pure": "llama.cpp Q4_0 pure"}

CONVERT = r'''
import runpy, sys
from pathlib import Path

tree = Path(sys.argv[1])
sys.path[:0] = [str(tree), str(tree / "gguf-py")]
from conversion.base import TextModel
from conversion.qwen import Qwen2Model

TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
Qwen2Model.set_vocab = TextModel._set_vocab_gpt2
sys.argv = [str(tree / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def convert_command(python: str, tree: Path, snapshot: Path, out: Path) -> list[str]:
    """The command that converts `snapshot` to an f32 GGUF at `out` with the converter of llama.cpp tree `tree`
    (f32: llama.cpp's quantizer then starts from the snapshot's own fp32 weights, as our export does)."""
    return [python, "-c", CONVERT, str(tree), str(snapshot), "--outfile", str(out), "--outtype", "f32"]


def source_tree(path: Path | None) -> Path:
    """The llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py, or one line saying how to get one."""
    if path is None:
        raise SystemExit("--llama-source is needed to convert the snapshot to GGUF: the llama.cpp tree of the "
                         "llama-cpp-python source distribution (pip download --no-binary :all: --no-deps "
                         "llama-cpp-python, unpacked: its vendor/llama.cpp) or a llama.cpp checkout")
    for need in ("convert_hf_to_gguf.py", "gguf-py", "conversion"):
        if not (path / need).exists():
            raise SystemExit(f"--llama-source {path}: no {need} there; pass the llama.cpp tree itself (the "
                             f"sdist's vendor/llama.cpp)")
    return path


def quantize_command(python: str, src: Path, out: Path, pure: bool, threads: int, report: Path) -> list[str]:
    return [python, str(Path(__file__).resolve()), "quantize", str(src), str(out), "--threads", str(threads),
            "--report", str(report), *(["--pure"] if pure else [])]


def quantize(src: Path, out: Path, pure: bool, threads: int, report: Path) -> None:
    """llama.cpp's own Q4_0 quantization (`pure`: every tensor Q4_0, else its default mix, which keeps the
    output projection, here the tied token embedding, at a higher type); the report lists each tensor's type."""
    import llama_cpp
    from gguf import GGUFReader

    params = _set(llama_cpp.llama_model_quantize_default_params(), ftype=llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                  nthread=threads, pure=pure)
    code = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if code != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {out}) returned {code}")
    types: dict[str, int] = {}
    tensors = GGUFReader(out).tensors
    for t in tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    report.write_text(json.dumps({"tensor_types": types, "bytes": out.stat().st_size,
                                  "token_embd": next(t.tensor_type.name for t in tensors
                                                     if t.name == "token_embd.weight")}))


def _set(params, **values):
    """`params` (a llama.cpp parameter struct) with `values` set; a field this llama-cpp-python does not have is
    an error, not a Python attribute that llama.cpp never sees."""
    names = {field[0] for field in type(params)._fields_}
    for name, value in values.items():
        if name not in names:
            raise SystemExit(f"{type(params).__name__} has no field {name}: this benchmark needs llama-cpp-python "
                             f"0.3.36 or a release with the same parameters")
        setattr(params, name, value)
    return params


class Decoder:
    """A GGUF loaded once (read into memory, not mapped, so no page faults land in a timed step) with one
    context of `context` positions; each answer starts from a cleared KV cache."""

    def __init__(self, model: Path, threads: int, context: int):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = _set(llama_cpp.llama_model_default_params(), load_mode=llama_cpp.LLAMA_LOAD_MODE_NONE)
        self.model = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
        if not self.model:
            raise SystemExit(f"{model}: llama.cpp could not load it")
        cparams = _set(llama_cpp.llama_context_default_params(), n_ctx=context, n_batch=context, n_seq_max=1,
                       n_threads=threads, n_threads_batch=threads)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def _step(self, tokens) -> int:
        """Decode `tokens` (a ctypes array) after the cached ones; the greedy token after the last."""
        import numpy as np

        code = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, len(tokens)))
        if code != 0:
            raise SystemExit(f"llama_decode returned {code}")
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.vocab,))
        return int(logits.argmax())

    def generate(self, ids: list[int], new: int) -> dict:
        """`new` greedy tokens after `ids`; the prefill (and the token it yields) timed apart, as GenAI's side."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        one = (self.lib.llama_token * 1)()
        t0 = time.perf_counter()
        tokens = [self._step((self.lib.llama_token * len(ids))(*ids))]
        t1 = time.perf_counter()
        while len(tokens) < new:
            one[0] = tokens[-1]
            tokens.append(self._step(one))
        t2 = time.perf_counter()
        return {"tokens": tokens, "prefill_ms": (t1 - t0) * 1e3,
                "ms_per_token_decode": (t2 - t1) * 1e3 / max(len(tokens) - 1, 1)}


def peak_rss() -> int:
    """This process's peak resident bytes since its exec (VmHWM; ru_maxrss would count the resident set of
    the process that started it, which it had before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status: the peak resident set needs Linux")


def serve(model: Path, threads: int, context: int) -> None:
    """Answer each stdin line [ids, new] with one JSON line; at end of input, the process's peak resident set."""
    decoder = Decoder(model, threads, context)
    for line in sys.stdin:
        print(json.dumps(decoder.generate(*json.loads(line))), flush=True)
    print(json.dumps({"peak_rss": peak_rss()}), flush=True)


class LlamaCpp:
    """llama.cpp's greedy decode of one GGUF in a child running `python` (the llama-cpp-python environment),
    always a child: its OpenMP pool stays out of the process that runs ONNX Runtime's threads. The child's
    log (llama.cpp's load messages) goes to `log`."""

    def __init__(self, model: Path, threads: int, python: str, context: int, log: Path):
        self.log = open(log, "w")
        self.child = subprocess.Popen([python, str(Path(__file__).resolve()), "serve", str(model), str(threads),
                                       str(context)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self.log, text=True)

    def generate(self, ids: list[int], new: int) -> dict:
        self.child.stdin.write(json.dumps([ids, new]) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            raise SystemExit(f"llama.cpp's side exited ({self.child.wait()}): see {self.log.name}")
        return json.loads(line)

    def close(self) -> int:
        """End the child; its peak resident bytes (model loaded, every answer decoded)."""
        self.child.stdin.close()
        peak = json.loads(self.child.stdout.readline())["peak_rss"]
        self.child.wait()
        self.log.close()
        return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--threads", type=int, required=True)
    q.add_argument("--pure", action="store_true")
    q.add_argument("--report", type=Path, required=True)
    s = sub.add_parser("serve")
    s.add_argument("model", type=Path)
    s.add_argument("threads", type=int)
    s.add_argument("context", type=int)
    args = ap.parse_args()
    if args.command == "quantize":
        quantize(args.src, args.out, args.pure, args.threads, args.report)
    else:
        serve(args.model, args.threads, args.context)


if __name__ == "__main__":
    main()
