"""Images named in chat messages: data URLs and `file://` paths under the media directory, nothing remote.

Every limit is checked before pixels are decoded: each image's size comes from its header, so a small
file that claims a huge canvas (a decompression bomb) is refused from its header alone, and the images of
one request share one pixel budget, so many images each under the per-image cap cannot add up to
gigabytes. A file is opened as an image (its header read) before the rest of it is read, and one larger
than a request body could be is refused from its size alone.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from PIL import Image

from ..prompt.images import to_rgb
from ..store.input_files import not_regular
from .openai_errors import RequestError


class PixelBudget:
    """The pixels one request's images may still take (`--max-request-pixels`), each at most `per_image`."""

    def __init__(self, per_image: int, per_request: int):
        self.per_image, self.per_request, self.left = per_image, per_request, per_request

    def take(self, where: str, width: int, height: int) -> None:
        pixels = width * height
        if pixels > self.per_image:
            raise RequestError(f"{where} is {width}x{height} pixels, over this server's {self.per_image} per image "
                               "(--max-image-pixels); downscale it first", param="messages", code="image_too_large")
        if pixels > self.left:
            raise RequestError(f"the request's images add up to over this server's {self.per_request} pixels per "
                               "request (--max-request-pixels); send fewer or smaller images", param="messages",
                               code="request_pixels_too_large")
        self.left -= pixels


def _open(source: BinaryIO | Path, where: str, budget: PixelBudget) -> "Opened":
    """The image's header read and its pixels taken from the budget; the pixels are decoded later."""
    try:
        img = Image.open(source)
    except Image.DecompressionBombError:
        raise RequestError(f"{where} claims an absurd size; downscale it first", param="messages",
                           code="image_too_large") from None
    except (OSError, ValueError, SyntaxError):
        raise RequestError(f"{where} is not an image Pillow can decode; send a PNG, JPEG or WebP",
                           param="messages", code="invalid_image") from None
    try:
        budget.take(where, *img.size)
    except RequestError:
        img.close()
        raise
    return Opened(img, where)


class Opened:
    """An image whose header has been read and counted, not yet decoded."""

    def __init__(self, image: Image.Image, where: str):
        self.image, self.where = image, where

    def decode(self) -> Image.Image:
        try:
            self.image.load()
            return to_rgb(self.image)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            raise RequestError(f"{self.where} is not an image Pillow can decode; send a PNG, JPEG or WebP",
                               param="messages", code="invalid_image") from None

    def close(self) -> None:
        self.image.close()


def _data_url(url: str, budget: PixelBudget) -> Opened:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise RequestError("an image data URL must be data:image/...;base64,<data>", param="messages",
                           code="invalid_image_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("the image data URL's payload is not valid base64", param="messages",
                           code="invalid_base64") from None
    return _open(io.BytesIO(data), "the data URL's image", budget)


def _file_path(url: str, media_dir: Path) -> Path:
    """The file a `file://` URL names under `media_dir`; a name no file system takes is a 400, not a crash."""
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError("a file:// URL must name a local path (file:///...)", param="messages",
                           code="invalid_image_url")
    name = unquote(parsed.path)
    root = media_dir.resolve()
    try:
        raw = Path(name)
        path = (raw if raw.is_absolute() else root / raw).resolve()
        inside = path.is_relative_to(root)
        mode = path.stat().st_mode if inside and path.exists() else None
    except (OSError, ValueError):  # a NUL byte, a name over the file system's length limit
        raise RequestError(f"the file:// path {name[:80]!a} is not a usable file name", param="messages",
                           code="invalid_image_url") from None
    if not inside:
        raise RequestError(f"{name[:200]!a} is outside the media directory; only files under --media-dir are "
                           "served", param="messages", code="path_outside_media_dir")
    where = str(path.relative_to(root))[:200]
    if mode is None:
        raise RequestError(f"{where!a} does not exist in the media directory", param="messages",
                           code="image_not_found")
    if (what := not_regular(mode)) is not None:  # never opened: a FIFO would block the server's request
        raise RequestError(f"{where!a} in the media directory is {what}, not an image file; name an image file",
                           param="messages", code="not_an_image_file")
    return path


def _file_url(url: str, media_dir: Path | None, budget: PixelBudget, max_bytes: int) -> Opened:
    if media_dir is None:
        raise RequestError("file:// images are disabled; start the server with --media-dir DIR to serve files from "
                           "DIR, or send the image as a data URL", param="messages", code="media_dir_not_set")
    path = _file_path(url, media_dir)
    where = f"image {str(path.relative_to(media_dir.resolve()))[:200]!a}"
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise RequestError(f"{where} cannot be read ({exc.strerror})", param="messages",
                           code="image_not_found") from None
    if size > max_bytes:
        raise RequestError(f"{where} is {size} bytes, over the {max_bytes} a request body may hold "
                           "(--max-body-mb); downscale it first", param="messages", code="image_too_large")
    return _open(path, where, budget)


def open_image_url(url: str, media_dir: Path | None, budget: PixelBudget, max_bytes: int) -> Opened:
    """The image an `image_url` part names, its header read and counted; remote URLs are refused, never fetched."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, budget)
    if scheme == "file":
        return _file_url(url, media_dir, budget, max_bytes)
    if scheme in ("http", "https", "ftp"):
        raise RequestError("this server never fetches remote images; send the image as a data URL "
                           "(data:image/png;base64,...) or a file:// path under --media-dir", param="messages",
                           code="remote_image_refused")
    raise RequestError("an image_url must be a data: URL or a file:// path", param="messages",
                       code="invalid_image_url")
