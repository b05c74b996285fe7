"""Images as every prompt builder takes them: a path checked and decoded now, any encoding turned into the
8-bit RGB viewers show, and the processors' smart resize (with its aspect-ratio bound)."""
from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..errors import GlanceError, InputError
from ..store.input_files import not_regular

MAX_IMAGE_PIXELS = 8192 * 8192  # the largest image the runtime decodes at all


def check_image_path(path: str | Path) -> Path:
    """The file an image path names, or a refusal that says what the path really is."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"image {path} is a symbolic link loop; point it at an image file") from None
        if exc.errno == errno.ENOENT and path.is_symlink():
            raise InputError(f"image {path} is a dangling symbolic link (to {os.readlink(path)}); point it at an "
                              "existing image file") from None
        if exc.errno == errno.ENOENT:
            raise InputError(f"image {path} does not exist; pass an existing image file") from None
        if exc.errno == errno.ENOTDIR:
            raise InputError(f"image {path}: a part of the path is a file, not a directory; pass an existing "
                              "image file") from None
        raise InputError(f"image {path} cannot be reached ({exc.strerror}); pass a readable image file") from None
    if (what := not_regular(mode)) is not None:
        raise InputError(f"image {path} is {what}, not an image file; pass an image file")
    if not os.access(path, os.R_OK):
        raise InputError(f"image {path} cannot be read (permission denied); make it readable or pass another file")
    return path


WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # greys wider than 8 bits


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as image viewers show it, so one picture gives one prompt whatever its encoding and whichever
    surface it came through (the API, glance-run, glance-serve, Triton, training data): rotated by its EXIF
    orientation; wide greys scaled to 8 bits (`_eight_bit`); transparency (an alpha channel, premultiplied or
    not, a palette with alpha, or one colour marked transparent in L, RGB, 16-bit or palette images)
    composited over white; every other mode (1, L, P, CMYK, YCbCr, LAB, HSV) converted by Pillow. Always a
    new image: the caller may close the one it passed."""
    image = ImageOps.exif_transpose(image)
    if image.mode in WIDE_MODES:
        values = np.asarray(image).astype(np.float64)
        clear = image.info.get("transparency")
        grey = _eight_bit(values, image.mode)
        if isinstance(clear, (int, float)) and not isinstance(clear, bool) and (values == clear).any():
            image = Image.fromarray(np.dstack([grey, np.where(values == clear, 0, 255).astype(np.uint8)]), "LA")
        else:
            image = Image.fromarray(grey, "L")
    if image.mode == "La":  # premultiplied grey and alpha: Pillow converts it to LA only
        image = image.convert("LA")
    if image.mode in ("LA", "PA", "RGBA", "RGBa") or "transparency" in image.info or \
            (image.mode == "P" and image.palette is not None and image.palette.mode.endswith("A")):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _eight_bit(values: np.ndarray, mode: str) -> np.ndarray:
    """uint8 greys of a wide image's values: 16-bit and 32-bit integers scaled from their full range (not
    clipped at 255, which turns a 16-bit PNG almost white), a 32-bit image whose values all fit 16 bits read
    as 16-bit data (how 16-bit scans are stored as 32-bit TIFF); floats read as 0..1 intensities when they
    lie in that range, else as 0..255; negatives, NaN and what is past the top clipped."""
    finite = values[np.isfinite(values)]
    if mode == "F":
        top = 1.0 if finite.size and finite.min() >= 0 and finite.max() <= 1 else 255.0
    else:
        top = 65535.0 if mode != "I" or not finite.size or finite.max() <= 65535 else float(2**31 - 1)
    grey = np.clip(np.nan_to_num(values, nan=0.0, posinf=top, neginf=0.0) / top, 0, 1) * 255
    return np.round(grey).astype(np.uint8)


def load_image(path: str | Path) -> Image.Image:
    """Open and decode an image fully now, so a bad file fails here with its name, not inside a graph."""
    path = check_image_path(path)
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InputError(f"image {path} is {width}x{height}, larger than {MAX_IMAGE_PIXELS} pixels; "
                                  "downscale it first")
            return to_rgb(img)
    except GlanceError:
        raise
    except Image.DecompressionBombError:
        raise InputError(f"image {path} is absurdly large; downscale it first") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"image {path} cannot be decoded ({exc}); pass a PNG, JPEG or other Pillow format") from None


def check_pixels(height: int, width: int, what: str = "image") -> None:
    """Refuse a picture without pixels (an empty array, a 0-wide image): every resize divides by its sides."""
    if min(height, width) < 1:
        raise InputError(f"{what} is {width}x{height} pixels, so it has nothing to see; pass a non-empty {what}")


def check_aspect(height: int, width: int, what: str = "image", fix: str = "crop it first") -> None:
    """Refuse a picture without pixels, or over 200:1, which the vision processors cannot resize to whole
    patches."""
    check_pixels(height, width, what)
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"{what} aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1; {fix}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Nearest size with both sides multiples of `factor` and area within [min_pixels, max_pixels]."""
    check_aspect(height, width)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w
