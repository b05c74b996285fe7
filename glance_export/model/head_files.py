"""A head's files read typed and sized, and its tensors checked, for both head loaders (head.py, eagle3.py).

A head directory is often copied or edited by hand. Its config.json may be a FIFO (a plain read blocks until
killed) or a directory; its weights a pickle the safe loader refuses, a file of garbage, a tensor stored as int8
or one row of NaN. Each is one line here naming the file and the tensor, not a hang, a traceback, or a draft that
fails far from its cause ("log-probs that are not <= 0", "max error nan").
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch

from glance_runtime.errors import GlanceError
from glance_runtime.formats.common import read_json
from glance_runtime.store.input_files import open_regular, regular_file

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_head_config(path: Path, fix: str) -> dict[str, Any]:
    """config.json as a JSON object (typed and sized first: a FIFO or a directory is named as what it is)."""
    return read_json(path, "head config", fix)


def read_safetensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, once it is known to be a regular file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    regular_file(path, "head weights", fix)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GlanceError(f"cannot read the head weights {path} ({reason}); {fix}") from None


def read_pickle(path: Path, fix: str) -> dict[str, Any]:
    """A `pytorch_model.bin` through torch's safe loader (weights_only): what it refuses is refused here in our
    own words, which never suggest loading the file unsafely."""
    with open_regular(path, "head weights", fix) as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise GlanceError(f"the head weights {path} are an empty file; {fix}")
        try:
            with warnings.catch_warnings():  # torch warns on stderr about pickle protocols: not the user's line
                warnings.simplefilter("ignore")
                state = torch.load(fh, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL (\S+)", str(exc))
            problem = (f"hold a Python object ({found.group(1)}) besides tensors, which the safe loader never "
                       "unpickles (it could run code)" if found else
                       "are not a pickle of tensors that the safe loader (torch.load with weights_only) reads")
            raise GlanceError(f"the head weights {path} {problem}; convert them to model.safetensors, or {fix}") \
                from None
        except Exception:  # a corrupt pickle fails in whatever way its bytes lead to; no common base short of this
            raise GlanceError(f"the head weights {path} are truncated or not a PyTorch weights file; {fix}") from None
    if not isinstance(state, dict):
        raise GlanceError(f"the head weights {path} hold a {type(state).__name__}, not named tensors; {fix}")
    return state


def check_tensors(state: dict[Any, Any], path: Path, fix: str, index_keys: Iterable[str] = ()) -> None:
    """Every entry a named tensor; every weight (all but the integer `index_keys`, which their own checks read)
    floating-point and finite: an int8 matrix or one NaN row would otherwise load and poison every draft."""
    index_keys = set(index_keys)
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise GlanceError(f"{path}: {key!r} is of type {type(value).__name__}, not a tensor; {fix}")
        if key in index_keys:
            continue
        if value.dtype not in WEIGHT_DTYPES:
            raise GlanceError(f"{path}: {key} is stored as {str(value.dtype).removeprefix('torch.')}, not as "
                              f"floating-point weights (float32, float16, bfloat16 or float64); {fix}")
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise GlanceError(f"{path}: {key} holds {bad} NaN or infinite value{'s' if bad > 1 else ''}; {fix}")
