"""How much real text the export's default reduced draft vocabulary covers, with a real Qwen2 tokenizer.

A GLANCE head without a draft vocabulary of its own gets one from `glance-export onnx` when the target's vocabulary
is large: DEFAULT_SIZE (32,768) tokens chosen from the target's tokenizer by BPE merge order, plus its added tokens
(glance_export/model/vocab_choice.py). No model hub is reachable here, so the tokenizer is rebuilt from llama.cpp's
vocab-only GGUF of Qwen2 (ggml-vocab-qwen2.gguf: tokens, token types and merges; Qwen2, Qwen2.5 and Qwen2.5-VL
share this byte-level BPE of 151,643 tokens) as a HF tokenizer.json, checked against the test strings shipped beside
the GGUF (.inp/.out), and loaded the way the export loads a snapshot's tokenizer (Snapshot, transformers'
AutoTokenizer) from a temporary snapshot directory whose config.json has the real vocab_size of 151,936.

The draft vocabularies come from the export's own code: `head_for_export` on a tiny GLANCE head (hidden size 8, no
draft vocabulary), with --draft-vocab auto (the default: 32,768) and sizes 8,192, 16,384 and 65,536. A second
tokenizer adds the 19 special tokens Qwen2.5-VL's tokenizer has beyond Qwen2's three (ids 151,646-151,664: vision,
box, tool-call and fill-in-the-middle markers, which the GGUF holds as padding); its sets are compared with the
first.

Coverage of a corpus is the share of its tokens (by the real tokenizer) whose id is in the set: what `glance-export
audit` reports for the greedy answers. Drafts stay lossless whatever it is; only acceptance moves with it. Beside it:
the best any set of that size could do on the corpus (its own most frequent tokens, in-sample), the uncovered
tokens that are whitespace runs or partial UTF-8 byte pieces, and the first uncovered tokens in corpus order.

Corpora (all offline, read at run time, each capped at --max-chars characters by a seeded sample of its files):
English prose (CPython's standard-library docstrings; installed packages' METADATA/README/LICENSE texts; the
toolkit's docs), Python source (CPython's standard library), the toolkit's task prompts and answers, English UI
messages and their translations into eight languages (the system's gettext catalogs, /usr/share/locale).

    python benchmarks/draft_vocab_coverage.py OUT [--gguf PATH] [--max-chars 2000000]

Writes OUT/coverage.json and OUT/coverage.md; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT)]

LLAMA_CPP = Path("/work/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
GGUF = LLAMA_CPP / "models" / "ggml-vocab-qwen2.gguf"
GGUF_PY = LLAMA_CPP / "gguf-py"
VOCAB_SIZE = 151936  # Qwen2 / Qwen2.5(-VL) config.json: the LM head's rows, past the tokenizer's ids
SIZES = (8192, 16384, 32768, 65536)
# Qwen2's pre-tokenizer split (tokenizer.ggml.pre = qwen2): contractions, letter runs with one leading non-letter,
# single digits, punctuation runs with trailing newlines, newline runs, whitespace not before a non-space, whitespace
PRE_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
# added tokens of Qwen2.5-VL's tokenizer after Qwen2's <|endoftext|>, <|im_start|>, <|im_end|> (151643-151645)
QWEN25_VL_SPECIALS = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>")
NORMAL, CONTROL = 1, 3  # GGUF token types
PY_LIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
LOCALE = Path("/usr/share/locale")
LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "ru": "Russian", "ar": "Arabic",
             "zh_CN": "Chinese (simplified)", "ja": "Japanese", "ko": "Korean"}
SHOW = 10  # uncovered tokens shown per corpus


def log(line: str) -> None:
    print(f"[coverage {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the tokenizer

def read_gguf(path: Path) -> dict:
    """Tokens, token types, merges and the pre-tokenizer name of a vocab GGUF (llama.cpp's own reader: the gguf-py
    of the llama.cpp tree the GGUF sits in, else of LLAMA_CPP)."""
    sys.path[:0] = [str(path.resolve().parent.parent / "gguf-py"), str(GGUF_PY)]
    try:
        import gguf
    except ImportError:
        raise SystemExit(f"cannot import llama.cpp's gguf package (looked in {sys.path[0]} and {GGUF_PY})") from None

    fields = gguf.GGUFReader(str(path)).fields
    value = lambda key: fields[key].contents() if key in fields else None  # noqa: E731
    out = {"model": value("tokenizer.ggml.model"), "pre": value("tokenizer.ggml.pre"),
           "tokens": value("tokenizer.ggml.tokens"), "types": value("tokenizer.ggml.token_type"),
           "merges": value("tokenizer.ggml.merges"), "eos": value("tokenizer.ggml.eos_token_id")}
    if out["model"] != "gpt2" or out["pre"] != "qwen2" or not out["tokens"] or not out["merges"]:
        raise SystemExit(f"{path} is not a Qwen2 byte-level BPE vocabulary (tokenizer.ggml.model {out['model']!r}, "
                         f"pre {out['pre']!r})")
    return out


def build_tokenizer(vocab: dict, extra_specials: tuple[str, ...] = ()):
    """A HF tokenizer equal to Qwen2's: byte-level BPE over the GGUF's merges, NFC, the qwen2 split, its control
    tokens as added special tokens (then `extra_specials` at the ids after them)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types = vocab["tokens"], vocab["types"]
    regular = {tok: i for i, tok in enumerate(tokens) if types[i] == NORMAL}
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tok = Tokenizer(models.BPE(vocab=regular, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control = [tokens[i] for i in range(len(tokens)) if types[i] == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [*control, *extra_specials]])
    want = [tokens.index(t) for t in control]  # the control tokens keep their GGUF ids
    want += list(range(max(want) + 1, max(want) + 1 + len(extra_specials)))  # then the extras, in order
    got = [tok.token_to_id(t) for t in [*control, *extra_specials]]
    if got != want:
        raise SystemExit(f"the rebuilt tokenizer gives its special tokens ids {got}, not {want}")
    return tok


def gguf_tests(path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs beside the GGUF, read as llama.cpp's test-tokenizer-0 reads them."""
    for suffix in (".inp", ".out"):
        if not path.with_name(path.name + suffix).is_file():
            raise SystemExit(f"no {path}{suffix}: the test strings beside the GGUF check the rebuilt tokenizer")
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8", errors="strict")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with a separator
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise SystemExit(f"{path}.inp holds {len(texts)} tests but {path}.out {len(lines)}")
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


def check(tok, tests) -> dict:
    wrong = []
    for text, want in tests:
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            wrong.append({"text": text, "want": want, "got": got})
    return {"tests": len(tests), "match": len(tests) - len(wrong), "mismatches": wrong[:5]}


def snapshot_dir(where: Path, tok) -> Path:
    """A snapshot the export's Snapshot opens: tokenizer files, a Qwen2 config with the real vocab_size, the stop
    ids of Qwen2.5(-VL)-Instruct, and an empty weights file (nothing here reads weights)."""
    where.mkdir(parents=True)
    tok.save(str(where / "tokenizer.json"))
    (where / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": VOCAB_SIZE,
                                                   "bos_token_id": 151643, "eos_token_id": 151645}))
    (where / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": template}))
    (where / "model.safetensors").write_bytes(b"")
    return where


def chosen_sets(snap) -> dict[int, np.ndarray]:
    """The export's draft vocabulary at each size: `head_for_export` on a tiny head without one."""
    from glance_export.model.head import DraftHead, HeadConfig
    from glance_export.model.vocab_choice import AUTO, DEFAULT_SIZE, default_size, head_for_export

    assert default_size(VOCAB_SIZE) == DEFAULT_SIZE
    head = DraftHead(HeadConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                head_dim=8, intermediate_size=8, vocab_size=VOCAB_SIZE, block_size=4,
                                num_target_layers=2, target_layer_ids=[1], mask_token_id=151643))
    sets = {}
    for size in SIZES:
        restricted, note = head_for_export(snap, head, AUTO if size == DEFAULT_SIZE else size)
        ids = restricted.draft_vocab_ids.numpy().copy()
        assert note and len(ids) == size == restricted.config.draft_vocab_size, (size, note)
        sets[size] = ids
    return sets


# ---------------------------------------------------------------- corpora

def capped(docs: list[str], max_chars: int, seed: int = 0) -> list[str]:
    """`docs` whole if they fit, else a seeded sample of them (in their order) up to `max_chars` characters."""
    if sum(map(len, docs)) <= max_chars:
        return docs
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    keep, total = {}, 0
    for i in order:
        if total >= max_chars:
            break
        keep[i] = docs[i][:max_chars - total]  # the last one cut to fit
        total += len(keep[i])
    return [keep[i] for i in sorted(keep)]


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_files() -> list[Path]:
    # tests, vendored packages, and encodings/ (generated charmap tables: mostly Unicode character names)
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "encodings"}
    return sorted(p for p in PY_LIB.rglob("*.py") if not skip & set(p.relative_to(PY_LIB).parts[:-1]))


def docstrings(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        source = read_text(path)
        try:
            tree = ast.parse(source or "")
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) > 20:
                    out.append(doc)
    return out


def package_texts() -> list[str]:
    """METADATA (the packages' long descriptions), README, LICENSE, .rst/.md/.txt files of installed packages."""
    names = ("METADATA", "README", "LICENSE", "COPYING", "NOTICE", "AUTHORS")
    paths = sorted(p for p in SITE.rglob("*") if p.is_file() and (
        p.name.upper().startswith(names) or p.suffix.lower() in (".rst", ".md"))
        and p.stat().st_size < 2_000_000)
    texts = [(p, read_text(p)) for p in paths]
    # METADATA: its long description only (the body after the header fields)
    texts = [t.partition("\n\n")[2] if p.name == "METADATA" else t for p, t in texts if t]
    return [t for t in texts if t.strip()]


def toolkit_tasks() -> tuple[list[str], list[str]]:
    prompts, answers = [], []
    files = sorted(ROOT.glob("examples/*/tasks.jsonl")) + [
        ROOT / "benchmarks/results/int4_vs_genai/text_tasks.jsonl"]
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                task = json.loads(line)
                prompts.append(task["prompt"])
                answers.extend(dict.fromkeys([task["answer"], *task.get("answers", [])] if "answer" in task else []))
    return prompts, answers


def mo_strings(path: Path) -> tuple[list[str], list[str]]:
    """(msgids, msgstrs) of a gettext .mo catalog, the header entry left out and plural forms split."""
    data = path.read_bytes()
    if len(data) < 28:
        return [], []
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if end is None:
        return [], []
    n, ids_at, strs_at = struct.unpack(end + "3I", data[8:20])
    raw = []
    for table in (ids_at, strs_at):
        entries = []
        for i in range(n):
            length, offset = struct.unpack(end + "2I", data[table + 8 * i: table + 8 * i + 8])
            entries.append(data[offset:offset + length])
        raw.append(entries)
    header = dict(zip(*raw)).get(b"", b"").decode("ascii", "replace")
    charset = "utf-8"
    for line in header.splitlines():
        if "charset=" in line:
            charset = line.split("charset=", 1)[1].strip() or "utf-8"
    msgids, msgstrs = [], []
    for key, value in zip(*raw):
        if not key:
            continue
        try:
            key_text, value_text = key.decode(charset), value.decode(charset)
        except (UnicodeDecodeError, LookupError):
            continue
        msgids.extend(s.split("\x04")[-1] for s in key_text.split("\x00") if s)
        msgstrs.extend(s for s in value_text.split("\x00") if s)
    return msgids, msgstrs


def catalogs(lang: str) -> tuple[list[str], list[str], int]:
    ids, strs, files = [], [], 0
    for path in sorted((LOCALE / lang / "LC_MESSAGES").glob("*.mo")):
        a, b = mo_strings(path)
        ids += a
        strs += b
        files += 1
    return list(dict.fromkeys(ids)), list(dict.fromkeys(strs)), files


def corpora(max_chars: int) -> list[dict]:
    """Each corpus: name, what it is, and its documents (deduplicated where strings repeat across catalogs)."""
    out = []

    def add(name: str, what: str, docs: list[str], source_docs: int) -> None:
        docs = capped(docs, max_chars)
        out.append({"name": name, "what": what, "docs": docs, "source_docs": source_docs})
        log(f"corpus {name}: {len(docs):,} documents, {sum(map(len, docs)):,} characters")

    py = stdlib_files()
    docs = docstrings(py)
    add("en-docstrings", f"English prose: docstrings of CPython {sys.version.split()[0]}'s standard library "
        f"({len(py)} modules; tests and the generated encodings/ tables left out)", docs, len(docs))
    docs = package_texts()
    add("en-package-docs", "English prose: METADATA long descriptions, README, LICENSE, .rst and .md files of the "
        "installed Python packages (METADATA without its header fields)", docs, len(docs))
    docs = [t for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] if (t := read_text(p))]
    add("en-toolkit-docs", "English technical prose: the toolkit's own README.md and docs/*.md", docs, len(docs))
    docs = [t for t in map(read_text, py) if t]
    add("python-source", "Python source: CPython's standard-library modules, whole files (code, comments, "
        "docstrings; tests and encodings/ left out)", docs, len(docs))
    prompts, answers = toolkit_tasks()
    add("toolkit-prompts", "the toolkit's task prompts (examples/*/tasks.jsonl, "
        "benchmarks/results/int4_vs_genai/text_tasks.jsonl)", prompts, len(prompts))
    add("toolkit-answers", "the reference answers of examples/*/tasks.jsonl (answer and answers, distinct)",
        answers, len(answers))
    english = []
    translated = []
    for lang, name in LANGUAGES.items():
        ids, strs, files = catalogs(lang)
        english += ids
        translated.append((lang, name, strs, files))
    english = list(dict.fromkeys(english))
    add("en-ui-messages", "English UI messages: the distinct msgids of the gettext catalogs below", english,
        len(english))
    for lang, name, strs, files in translated:
        add(f"{lang}-ui-messages", f"{name}: the distinct translated strings of the {files} gettext catalogs in "
            f"{LOCALE}/{lang}/LC_MESSAGES (system tools: coreutils, apt, git, glib, gtk, ...)", strs, len(strs))
    return out


# ---------------------------------------------------------------- measuring

def token_bytes(tokens: list[str]) -> list[bytes | None]:
    """Each vocabulary string's bytes through the byte-level alphabet (None: a special token's text)."""
    from glance_runtime.prompt.token_bytes import byte_level_alphabet

    table = byte_level_alphabet()
    return [bytes(table[c] for c in t) if t and all(c in table for c in t) else None for t in tokens]


def kind(piece: bytes | None) -> str:
    if piece is None:
        return "special"
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return "partial-utf8"
    return "whitespace" if text.isspace() else "other"


def measure(ids: np.ndarray, sets: dict[int, np.ndarray], pieces: list[bytes | None], ranks: np.ndarray) -> dict:
    counts = np.bincount(ids, minlength=VOCAB_SIZE)
    by_count = np.sort(counts)[::-1]
    kinds = np.array([kind(p) for p in pieces] + ["special"] * (VOCAB_SIZE - len(pieces)))
    result = {"tokens": int(len(ids)), "distinct": int((counts > 0).sum()), "sizes": {}}
    for size, chosen in sets.items():
        inside = np.zeros(VOCAB_SIZE, dtype=bool)
        inside[chosen] = True
        covered = int(counts[inside].sum())
        out_ids = ~inside[ids]
        missed = counts * ~inside
        kind_counts = Counter()
        for k in ("whitespace", "partial-utf8", "other", "special"):
            kind_counts[k] = int(missed[kinds == k].sum())
        uncovered = int(len(ids) - covered)
        first = list(dict.fromkeys(ids[out_ids].tolist()))[:SHOW]
        top = np.argsort(-missed, kind="stable")[:SHOW]
        show = lambda t: {"id": int(t), "merge_rank": int(ranks[t]), "text": shown(pieces[t]),  # noqa: E731
                          "count": int(counts[t])}
        result["sizes"][str(size)] = {
            "coverage": covered / max(len(ids), 1),
            "in_sample_best": int(by_count[:size].sum()) / max(len(ids), 1),
            "distinct_covered": int(((counts > 0) & inside).sum()),
            "uncovered": uncovered,
            "uncovered_whitespace_share": kind_counts["whitespace"] / uncovered if uncovered else 0.0,
            "uncovered_partial_utf8_share": kind_counts["partial-utf8"] / uncovered if uncovered else 0.0,
            "uncovered_kinds": dict(kind_counts),
            "first_uncovered": [show(t) for t in first],
            "most_frequent_uncovered": [show(t) for t in top if missed[t] > 0],
        }
    return result


def shown(piece: bytes | None) -> str:
    if piece is None:
        return "<special>"
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + piece.hex(" ")


def encode(tok, docs: list[str], batch: int = 256) -> list[np.ndarray]:
    parts = []
    for i in range(0, len(docs), batch):
        for enc in tok.encode_batch(docs[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int64))
    return parts


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def by_frequency(shares: np.ndarray, added: list[int], size: int) -> np.ndarray:
    """The `size` ids of highest share, the added tokens first (as the export keeps them)."""
    shares = shares.astype(np.float64).copy()
    shares[added] = np.inf
    return np.argsort(-shares, kind="stable")[:size]


def held_out(parts: list[np.ndarray], sets: dict[int, np.ndarray], added: list[int], pooled: np.ndarray) -> dict | None:
    """Merge order against choices by frequency, on the same held-out text (the corpus's odd documents): ranked by
    the corpus's own even documents (in-domain), and by the even documents of every corpus, each weighted alike
    (`pooled`, mixed-domain)."""
    if len(parts) < 2 or not len(test := joined(parts[1::2])):
        return None
    fit = joined(parts[0::2])
    own = np.bincount(fit, minlength=VOCAB_SIZE)
    out = {"fit_tokens": int(len(fit)), "test_tokens": int(len(test)), "sizes": {}}
    for size, chosen in sets.items():
        out["sizes"][str(size)] = {"merge_order": float(np.isin(test, chosen).mean()),
                                   "frequency_in_domain": float(np.isin(test, by_frequency(own, added, size)).mean()),
                                   "frequency_pooled": float(np.isin(test, by_frequency(pooled, added, size)).mean())}
    return out


def pooled_shares(encoded: list[list[np.ndarray]]) -> np.ndarray:
    """Token shares of every corpus's even documents, each corpus weighted alike."""
    total = np.zeros(VOCAB_SIZE)
    for parts in encoded:
        fit = joined(parts[0::2])
        if len(fit):
            total += np.bincount(fit, minlength=VOCAB_SIZE) / len(fit)
    return total


# ---------------------------------------------------------------- report

def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def render(report: dict) -> str:
    sizes = [str(s) for s in SIZES]
    default = str(report["default_size"])
    lines = ["# Default draft vocabulary: coverage of real text with the real Qwen2 tokenizer", "",
             f"Written by `benchmarks/draft_vocab_coverage.py` ({report['date']}). Tokenizer: "
             f"`{report['gguf']}` rebuilt as a HF tokenizer.json (byte-level BPE, {report['tokenizer']['regular']:,} "
             f"tokens, {report['tokenizer']['merges']:,} merges, NFC, the qwen2 split); llama.cpp's test strings: "
             f"{report['gguf_tests']['written']['match']}/{report['gguf_tests']['written']['tests']} tokenize to the "
             f"listed ids as written, {report['gguf_tests']['snapshot']['match']}/"
             f"{report['gguf_tests']['snapshot']['tests']} through the export's Snapshot (transformers "
             "AutoTokenizer).", "",
             f"Sets: the export's own choice (`head_for_export`, config vocab_size {VOCAB_SIZE:,}): --draft-vocab "
             f"auto gives {int(default):,} tokens; the other sizes are --draft-vocab N. "
             f"{report['sets']['note']}", "",
             "Coverage = share of the corpus's tokens whose id is in the set (what `glance-export audit` reports for "
             f"the greedy answers). Every corpus here uses fewer distinct tokens (at most "
             f"{max(c['distinct'] for c in report['corpora']):,}) than the default set holds, so a set of "
             f"{int(default):,} chosen from the corpus itself would cover all of it: at the default size the gaps "
             "are the choice's, not the size's (the held-out table below).", "",
             "| corpus | tokens | distinct | " + " | ".join(f"{int(s):,}" + (" (default)" if s == default else "")
                                                     for s in sizes) + " |",
             "|---|---:|---:|" + "---:|" * len(sizes)]
    for c in report["corpora"]:
        cells = [pct(c["sizes"][s]["coverage"]) for s in sizes]
        lines.append(f"| {c['name']} | {c['tokens']:,} | {c['distinct']:,} | " + " | ".join(cells) + " |")
    lines += ["", f"Uncovered tokens at the default size ({int(default):,}): how many, and which share are "
              "whitespace runs or partial UTF-8 byte pieces (a byte-level BPE has no byte fallback token: a "
              "character without a token of its own is spelled in pieces of its UTF-8 bytes).", "",
              "| corpus | uncovered | whitespace | partial UTF-8 | first uncovered tokens (corpus order) |",
              "|---|---:|---:|---:|---|"]
    for c in report["corpora"]:
        d = c["sizes"][default]
        first = ", ".join(f"`{json.dumps(t['text'], ensure_ascii=False)[1:-1]}`" for t in d["first_uncovered"][:6])
        lines.append(f"| {c['name']} | {d['uncovered']:,} ({pct(1 - d['coverage'])}) | "
                     f"{pct(d['uncovered_whitespace_share'])} | {pct(d['uncovered_partial_utf8_share'])} | "
                     f"{first.replace('|', chr(92) + '|')} |")
    lines += ["", "Most frequent uncovered tokens at the default size (count):", ""]
    for c in report["corpora"]:
        top = c["sizes"][default]["most_frequent_uncovered"][:6]
        if top:
            shown_ = ", ".join(f"`{json.dumps(t['text'], ensure_ascii=False)[1:-1]}` {t['count']:,}" for t in top)
            lines.append(f"- {c['name']}: {shown_}")
    lines += ["", "Held out: the export's merge-order set against sets of the same size chosen by token frequency "
              "(the added tokens kept), all measured on each corpus's odd documents. In-domain: ranked by the "
              "corpus's own even documents (an optimistic bound: a draft vocabulary chosen from text like the "
              "answers). Pooled: ranked by the even documents of all the corpora above, each weighted alike (one "
              f"mixed set for every corpus, each corpus's own text 1/{len(report['corpora'])} of its weight). Merge "
              "order / in-domain / pooled:", "",
              "| corpus | held-out tokens | " + " | ".join(f"{int(s):,}" for s in sizes) + " |",
              "|---|---:|" + "---:|" * len(sizes)]
    for c in report["corpora"]:
        h = c["held_out"]
        if h:
            cells = [" / ".join(pct(h["sizes"][s][k]) for k in ("merge_order", "frequency_in_domain",
                                                                 "frequency_pooled")) for s in sizes]
            lines.append(f"| {c['name']} | {h['test_tokens']:,} | " + " | ".join(cells) + " |")
    lines += ["", "Corpora:", ""]
    for c in report["corpora"]:
        lines.append(f"- **{c['name']}**: {c['what']}; {c['documents']:,} documents of {c['source_documents']:,}, "
                     f"{c['characters']:,} characters, {c['tokens']:,} tokens.")
    lines += ["", f"Qwen2.5-VL's 19 further special tokens: {report['qwen25_vl']['note']}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory for coverage.json and coverage.md")
    ap.add_argument("--gguf", type=Path, default=GGUF, help=f"llama.cpp vocab-only GGUF of Qwen2 (default {GGUF})")
    ap.add_argument("--max-chars", type=int, default=3_000_000, help="characters per corpus at most (default 3M)")
    args = ap.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"no GGUF at {args.gguf}: pass --gguf PATH (llama.cpp's models/ggml-vocab-qwen2.gguf)")
    started = time.time()
    log(f"reading {args.gguf}")
    vocab = read_gguf(args.gguf)
    tok = build_tokenizer(vocab)
    tests = gguf_tests(args.gguf)
    written = check(tok, tests)
    log(f"tokenizer built: {written['match']}/{written['tests']} llama.cpp test strings give the listed ids")

    from glance_export.model.adapters import Snapshot
    from glance_export.model.vocab_choice import DEFAULT_SIZE, merge_ranks

    with tempfile.TemporaryDirectory(prefix="draft_vocab_coverage_") as tmp:
        snap = Snapshot(snapshot_dir(Path(tmp) / "qwen2", tok))
        backend = snap.tokenizer.backend_tokenizer
        loaded = check(backend, tests)
        log(f"snapshot tokenizer ({type(snap.tokenizer).__name__}): {loaded['match']}/{loaded['tests']} match")
        sets = chosen_sets(snap)
        log("draft vocabularies chosen by head_for_export: " + ", ".join(map(str, sets)))
        vl_tok = build_tokenizer(vocab, QWEN25_VL_SPECIALS)
        vl_snap = Snapshot(snapshot_dir(Path(tmp) / "qwen2.5-vl", vl_tok))
        vl_sets = chosen_sets(vl_snap)
        ranks_doc, added = merge_ranks(json.loads(backend.to_str()))

    ranks = np.full(VOCAB_SIZE, VOCAB_SIZE, dtype=np.int64)  # past the tokenizer: ranked after everything
    for t, r in ranks_doc.items():
        ranks[t] = r
    pieces = token_bytes(vocab["tokens"][:min(len(vocab["tokens"]), VOCAB_SIZE)])
    for i, ty in enumerate(vocab["types"]):
        if ty != NORMAL:
            pieces[i] = None
    merged = [t for t, r in ranks_doc.items() if r >= 0]
    in_order = sum(1 for t in merged if t == ranks_doc[t] + (len(ranks_doc) - len(merged)))
    lowest = {s: bool(np.array_equal(v, np.r_[np.arange(s - len(added)), added])) for s, v in sets.items()}
    set_note = (f"Qwen2's ids follow its merge order ({in_order:,} of its {len(merged):,} merged tokens have id = "
                f"merge rank + {len(ranks_doc) - len(merged)}, the byte alphabet's size), so the set of N tokens is "
                f"{'exactly' if all(lowest.values()) else 'not exactly'} ids 0 to N-{len(added) + 1} plus the "
                f"{len(added)} added tokens {added}.")
    log(set_note)

    docs = corpora(args.max_chars)
    encoded = []
    for c in docs:
        t0 = time.time()
        encoded.append(encode(backend, c["docs"]))
        log(f"tokenized {c['name']}: {sum(map(len, encoded[-1])):,} tokens ({time.time() - t0:.1f} s)")
    pooled = pooled_shares(encoded)
    results = []
    for c, parts in zip(docs, encoded):
        t0 = time.time()
        ids = joined(parts)
        literal = sum(d.count(s) for d in c["docs"] for s in QWEN25_VL_SPECIALS)
        m = measure(ids, sets, pieces, ranks)
        vl = {str(s): float(np.isin(ids, vl_sets[s]).mean()) if len(ids) else 0.0 for s in SIZES}
        results.append({"name": c["name"], "what": c["what"], "documents": len(c["docs"]),
                        "source_documents": c["source_docs"], "characters": sum(map(len, c["docs"])), **m,
                        "coverage_qwen25_vl_specials": vl, "held_out": held_out(parts, sets, added, pooled),
                        "_literal": literal})
        cov = m["sizes"][str(DEFAULT_SIZE)]["coverage"]
        log(f"{c['name']}: coverage at {DEFAULT_SIZE:,}: {pct(cov)} "
            f"({time.time() - t0:.1f} s)")
    literal = sum(r.pop("_literal") for r in results)

    diffs = {s: int(len(np.setdiff1d(sets[s], vl_sets[s]))) for s in SIZES}
    traded = [shown(pieces[t]) for t in np.setdiff1d(sets[DEFAULT_SIZE], vl_sets[DEFAULT_SIZE])]
    change = {(r["name"], s): abs(r["coverage_qwen25_vl_specials"][str(s)] - r["sizes"][str(s)]["coverage"])
              for r in results for s in SIZES}
    where = max(change, key=change.get)
    worst = change[where]
    worst_default = max(v for (_, s), v in change.items() if s == DEFAULT_SIZE)
    vl_note = (f"a tokenizer with them (ids 151,646-151,664, as Qwen2.5-VL's) makes the export keep them too, so "
               f"each set trades its {diffs[DEFAULT_SIZE]} latest merges for them (ids differing per size: "
               f"{', '.join(f'{s:,}: {d}' for s, d in diffs.items())}; at {DEFAULT_SIZE:,} the merges dropped are "
               f"{', '.join(json.dumps(t, ensure_ascii=False) for t in traded)}). Coverage moves by at most "
               f"{100 * worst:.2f} points ({where[0]} at {where[1]:,}) and by at most {100 * worst_default:.3f} "
               f"points at {DEFAULT_SIZE:,} (the corpora hold {literal} of their 19 strings, so they "
               f"tokenize the same either way).")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gguf": str(args.gguf),
              "tokenizer": {"regular": sum(1 for t in vocab["types"] if t == NORMAL),
                            "added": [vocab["tokens"][i] for i, t in enumerate(vocab["types"]) if t == CONTROL],
                            "merges": len(vocab["merges"]), "pre": vocab["pre"], "split": PRE_SPLIT,
                            "config_vocab_size": VOCAB_SIZE},
              "gguf_tests": {"written": written, "snapshot": loaded}, "default_size": DEFAULT_SIZE,
              "sets": {"sizes": list(SIZES), "note": set_note,
                       "lowest_ids_plus_added": {str(s): v for s, v in lowest.items()},
                       "added_tokens": added},
              "qwen25_vl": {"note": vl_note, "ids_differing": {str(s): d for s, d in diffs.items()},
                            "max_coverage_change": worst, "max_coverage_change_default": worst_default,
                            "merges_dropped_at_default": traded},
              "max_chars": args.max_chars, "seconds": round(time.time() - started, 1), "corpora": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coverage.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (args.out / "coverage.md").write_text(render(report), encoding="utf-8")
    log(f"wrote {args.out / 'coverage.json'} and {args.out / 'coverage.md'} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
