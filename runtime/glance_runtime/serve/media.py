"""Images named in chat messages: data URLs and `file://` paths under the media directory, nothing remote.

Every limit is checked before pixels are decoded, so a small file that claims a huge canvas (a
decompression bomb) is refused from its header alone.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from .openai_errors import RequestError


def _open(data: bytes, where: str, max_pixels: int) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise RequestError(f"{where} is {width}x{height} pixels, over this server's {max_pixels}; "
                                   "downscale it first", param="messages", code="image_too_large")
            img.load()
            return img.convert("RGB")
    except RequestError:
        raise
    except Image.DecompressionBombError:
        raise RequestError(f"{where} claims an absurd size; downscale it first", param="messages",
                           code="image_too_large") from None
    except (OSError, ValueError, SyntaxError):
        raise RequestError(f"{where} is not an image Pillow can decode; send a PNG, JPEG or WebP",
                           param="messages", code="invalid_image") from None


def _data_url(url: str, max_pixels: int) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise RequestError("an image data URL must be data:image/...;base64,<data>", param="messages",
                           code="invalid_image_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("the image data URL's payload is not valid base64", param="messages",
                           code="invalid_base64") from None
    return _open(data, "the data URL's image", max_pixels)


def _file_url(url: str, media_dir: Path | None, max_pixels: int) -> Image.Image:
    if media_dir is None:
        raise RequestError("file:// images are disabled; start the server with --media-dir DIR to serve files from "
                           "DIR, or send the image as a data URL", param="messages", code="media_dir_not_set")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError("a file:// URL must name a local path (file:///...)", param="messages",
                           code="invalid_image_url")
    root = media_dir.resolve()
    raw = Path(unquote(parsed.path))
    path = (raw if raw.is_absolute() else root / raw).resolve()
    if not path.is_relative_to(root):
        raise RequestError(f"{unquote(parsed.path)} is outside the media directory; only files under --media-dir "
                           "are served", param="messages", code="path_outside_media_dir")
    if not path.is_file():
        raise RequestError(f"{path.relative_to(root)} does not exist in the media directory", param="messages",
                           code="image_not_found")
    return _open(path.read_bytes(), f"image {path.relative_to(root)}", max_pixels)


def load_image_url(url: str, media_dir: Path | None, max_pixels: int) -> Image.Image:
    """The decoded image an `image_url` part names; remote URLs are refused, never fetched."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, max_pixels)
    if scheme == "file":
        return _file_url(url, media_dir, max_pixels)
    if scheme in ("http", "https", "ftp"):
        raise RequestError("this server never fetches remote images; send the image as a data URL "
                           "(data:image/png;base64,...) or a file:// path under --media-dir", param="messages",
                           code="remote_image_refused")
    raise RequestError("an image_url must be a data: URL or a file:// path", param="messages",
                       code="invalid_image_url")
