"""Chat input as an application passes it, normalised once for both prompt builders.

Applications speak OpenAI-style `messages` (system/user/assistant; content a string or a list of
`{"type": "text"|"image"|"video", ...}` parts) and hold images as paths, `PIL.Image`s, numpy arrays or
encoded bytes; a video is a list of such frames (or one uint8 [T, H, W, 3] array) with the rate they
were taken at (`"fps"`, default `video.DEFAULT_FPS`). The chat templates want parts without payloads
(`{"type": "image"}`, `{"type": "video"}`) and the processors want RGB images and videos in prompt
order, so this module splits the one into the other and refuses what no template here can render
(unknown roles or parts) with the fix.
"""
from __future__ import annotations

import io
import reprlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ..errors import InputError
from .images import check_pixels, load_image, to_rgb
from .video import DEFAULT_FPS, Video

ROLES = ("system", "user", "assistant")
ImageLike = str | Path | Image.Image | np.ndarray | bytes
# frames in order, or a uint8 [T, H, W, 3] array, or {"video": either, "fps": the rate they were taken at}
VideoLike = Sequence[ImageLike] | np.ndarray | dict[str, Any]
IMAGE_EXAMPLE, VIDEO_EXAMPLE = "'photo.png'", "['frame1.png', 'frame2.png']"  # one of each, as refusals show


def listed(name: str, value: Any, example: str) -> list[Any]:
    """`images=`/`videos=`/`messages=` as a list: a list or tuple (None: none). One image or video passed
    bare (a path string, an array, a dict) would otherwise be iterated as characters, rows or keys."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{name} must be a list, got {type(value).__name__}; pass a list even for one: "
                         f"{name}=[{example}]")
    return list(value)


def user_turn(text: str, images: Sequence[ImageLike] | None = (),
              videos: Sequence[VideoLike] | None = ()) -> dict[str, Any]:
    """One user message: its images, then its videos, then the text (the order the processors' examples use)."""
    images, videos = listed("images", images, IMAGE_EXAMPLE), listed("videos", videos, VIDEO_EXAMPLE)
    return {"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                        *({"type": "video", **v} if isinstance(v, dict) else {"type": "video", "video": v}
                                          for v in videos),
                                        {"type": "text", "text": text}]}


def conversation(prompt: str | None = None, images: Sequence[ImageLike] | None = None,
                 messages: Sequence[dict[str, Any]] | None = None, system: str | None = None,
                 videos: Sequence[VideoLike] | None = None) -> list[dict[str, Any]]:
    """The messages of a call given either as a prompt (with images and videos) or as `messages`, system first."""
    if (prompt is None) == (messages is None):
        raise InputError("pass either a prompt (with optional images) or messages=[...], not both or neither")
    if messages is None:
        if not isinstance(prompt, str):
            raise InputError(f"the prompt must be a string, got {type(prompt).__name__}")
        msgs = [user_turn(prompt, images, videos)]
    else:
        if listed("images", images, IMAGE_EXAMPLE) or listed("videos", videos, VIDEO_EXAMPLE):
            raise InputError("with messages=[...], put the images and videos inside them as {'type': 'image', "
                             "'image': ...} and {'type': 'video', 'video': [frames]} parts")
        msgs = listed("messages", messages, "{'role': 'user', 'content': 'What is shown?'}")
    if system is not None:
        if not isinstance(system, str):
            raise InputError(f"system must be a string, got {type(system).__name__}")
        if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system":
            raise InputError("the messages already start with a system message; drop system=...")
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def _image(value: Any) -> Image.Image:
    """An RGB image with pixels, from a path, PIL image, HxW(x3|4) uint8 array or encoded bytes, each through
    `to_rgb` (an HxWx4 array is RGBA: its transparency shows as white, as in a file)."""
    image = _decoded(value)
    check_pixels(image.height, image.width)
    return image


def _decoded(value: Any) -> Image.Image:
    if isinstance(value, (str, Path)):
        return load_image(value)
    if isinstance(value, Image.Image):
        try:
            value.load()  # a closed image, or a lazily opened one whose file has gone, fails here
        except (OSError, ValueError, SyntaxError) as exc:
            raise InputError(f"a PIL image cannot be read ({exc}); pass an open image (load() or copy() it before "
                             "closing its file)") from None
        return to_rgb(value)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] not in (3, 4)):
            raise InputError(f"an image array must be uint8 HxW, HxWx3 or HxWx4; got {value.dtype} {value.shape}")
        return to_rgb(Image.fromarray(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(value))) as img:
                img.load()
                return to_rgb(img)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise InputError(f"image bytes cannot be decoded ({exc}); pass PNG, JPEG or other Pillow-format bytes") from None
    raise InputError(f"an image must be a path, PIL.Image, numpy array or bytes; got {type(value).__name__}")


def _video(part: dict[str, Any]) -> Video:
    """A video part's frames (each as an image is given, or rows of one [T, H, W, 3] array) and its fps."""
    value, fps = part["video"], part.get("fps", DEFAULT_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not np.isfinite(fps) or fps <= 0:
        raise InputError(f"a video's fps must be a positive number (the rate its frames were taken at); got "
                         f"{reprlib.repr(fps)}")
    if isinstance(value, np.ndarray):
        if value.ndim != 4:
            raise InputError(f"a video array must be uint8 [T, H, W, 3]; got {value.dtype} {value.shape}")
        value = list(value)
    if isinstance(value, (str, Path, bytes, Image.Image)) or not isinstance(value, (list, tuple)):
        raise InputError("a video must be a list of frames (paths, PIL.Images, arrays or bytes) or a uint8 "
                         f"[T, H, W, 3] array; got {type(value).__name__}")
    if not value:
        raise InputError("a video needs at least one frame")
    return Video([_image(frame) for frame in value], float(fps))


def split(messages: Sequence[dict[str, Any]], text_only: bool = False
          ) -> tuple[list[dict[str, Any]], list[Image.Image], list[Video]]:
    """Template messages (image and video parts without payloads), and the decoded images and videos, each in
    prompt order. `text_only` (a model without vision): each content becomes one string, its text parts joined
    as the vision templates join them, since a text template prints a list as Python's repr of it (or drops
    it); an image or video part is refused."""
    rendered: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    videos: list[Video] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise InputError(f"message {i} must be a dict with role one of {', '.join(ROLES)}; got {reprlib.repr(msg)}")
        content = msg.get("content")
        if isinstance(content, str):
            rendered.append({"role": msg["role"], "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            raise InputError(f"message {i}'s content must be a string or a list of parts; got {type(content).__name__}")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image", "video") and text_only:
                raise InputError(f"message {i} has {'an image' if kind == 'image' else 'a video'} part, but this model "
                                 f"is text-only and sees no {kind}s; drop the {kind}s or load a vision-language model")
            elif kind == "image" and "image" in part:
                images.append(_image(part["image"]))
                parts.append({"type": "image"})
            elif kind == "video" and "video" in part:
                videos.append(_video(part))
                parts.append({"type": "video"})
            else:
                raise InputError(f"message {i} has a part {reprlib.repr(part)}; parts are {{'type': 'text', 'text': "
                                 "str}, {'type': 'image', 'image': path | PIL.Image | array | bytes} or "
                                 "{'type': 'video', 'video': [frames], 'fps': number}")
        rendered.append({"role": msg["role"],
                         "content": "".join(p["text"] for p in parts) if text_only else parts})
    if not any(m["role"] == "user" for m in rendered):
        raise InputError("the messages have no user message; add one with the question")
    return rendered, images, videos
