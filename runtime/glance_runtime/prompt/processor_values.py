"""The values of a model's `preprocessor_config.json` (and `video_preprocessor_config.json`) that size,
scale and resample pixels, checked when the model is opened: a patch size of 0, a std of 0, an unknown
resampling filter or a pixel bound of billions would otherwise surface as a crash or an exhausted machine
at the first image, in whichever backend met it first."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import GlanceError, IntegrityError
from ..formats.common import Invalid, check_int, read_json
from .images import MAX_IMAGE_PIXELS as MAX_PIXELS

RESAMPLE_FILTERS = range(6)  # PIL's filters as transformers numbers them (3: bicubic)
FIX = "restore it from the model's source"
INTEGERS = {"patch_size": (1, 1024), "temporal_patch_size": (1, 64), "merge_size": (1, 64),
            "min_pixels": (1, MAX_PIXELS), "max_pixels": (1, MAX_PIXELS), "max_video_tokens": (1, 1 << 24),
            "resample": (RESAMPLE_FILTERS.start, RESAMPLE_FILTERS.stop - 1)}
OPTIONAL = ("min_pixels", "max_pixels")  # null: taken from `size`, as transformers reads them
FLAGS = ("do_resize", "do_rescale", "do_normalize", "cap_pixels_per_frame")


def _numbers(raw: dict[str, Any], key: str, nonzero: bool) -> None:
    if key not in raw:
        return
    value = raw[key]
    values = value if isinstance(value, list) else [value]
    if len(values) not in (1, 3) or any(type(v) not in (int, float) or not math.isfinite(v) or (nonzero and v == 0)
                                        for v in values):
        raise Invalid(f"{key} is {value!r:.40}; it must be one or three finite numbers"
                      + (", none of them 0" if nonzero else ""))


def check_values(raw: Any) -> dict[str, Any]:
    """`raw` if every value that shapes pixels is in range; Invalid naming the first that is not."""
    if not isinstance(raw, dict):
        raise Invalid("it holds no JSON object")
    for key, (low, high) in INTEGERS.items():  # present means set: null is no value (bar the pixel bounds)
        if key in raw and not (raw[key] is None and key in OPTIONAL):
            check_int(raw[key], key, low, high)
    size = raw.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise Invalid(f"size is {size!r:.40}; it must be an object")
        for key in ("shortest_edge", "longest_edge"):
            if size.get(key) is not None:
                check_int(size[key], f"size.{key}", 1, MAX_PIXELS)
    for key in FLAGS:
        if key in raw and type(raw[key]) is not bool:
            raise Invalid(f"{key} is {raw[key]!r:.40}; it must be true or false")
    _numbers(raw, "image_mean", nonzero=False)
    _numbers(raw, "image_std", nonzero=True)
    _numbers(raw, "rescale_factor", nonzero=True)
    low = raw.get("min_pixels") or (size or {}).get("shortest_edge")
    high = raw.get("max_pixels") or (size or {}).get("longest_edge")
    if low is not None and high is not None and low > high:
        raise Invalid(f"the smallest image ({low} pixels) is above the largest ({high})")
    return raw


def read_processor_config(path: Path) -> dict[str, Any]:
    """The checked JSON object in `path`; IntegrityError naming the file, the value and the fix otherwise."""
    try:
        return check_values(read_json(path, "image processor config", FIX))
    except Invalid as exc:
        raise IntegrityError(f"{path}: {exc}; {FIX}") from None
    except GlanceError as exc:
        raise IntegrityError(str(exc)) from None
