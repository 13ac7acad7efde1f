"""Input images: what an upload may be, how it becomes RGB, and how it meets the output's size.

An upload is bounded before it is decoded (`upload_problem`: bytes, pixels and format read from the
header), converted to 8-bit RGB by its own value range (`to_rgb`: 16-bit and floating-point
pixels are scaled, not clipped; transparency is laid on white), and fitted to the output without
stretching (`fit`: cropped to the output's aspect ratio around its centre, then resized). An edit
model's output follows its input's aspect ratio by default (`follow_aspect`).
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
from PIL import Image

# Untrusted sizes, bounded before any work: an input image is resized to the output (at most
# 2048 px a side), so a 50 MB, 64-megapixel upload is more than any camera sends.
MAX_IMAGE_BYTES = 50_000_000
MAX_IMAGE_PIXELS = 64_000_000
# The formats read (PIL's names), as refusals name them.
FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}
ALLOWED = (
    f"an image file ({', '.join(FORMATS.values())}) of at most {MAX_IMAGE_BYTES // 10**6} MB "
    f"and {MAX_IMAGE_PIXELS // 10**6} megapixels"
)


def upload_problem(path: str) -> str | None:
    """What makes the file at `path` unusable as an input image, or None.

    Read before it is decoded: its size on disk (at most `MAX_IMAGE_BYTES`), and from its header
    its format (one of `FORMATS`) and pixel count (at most `MAX_IMAGE_PIXELS`: a decompression bomb
    is refused, not decoded). A file PIL cannot open at all is "not an image".
    """
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        return f"has {os.path.getsize(path) / 1e6:.0f} MB"
    try:
        with warnings.catch_warnings(), Image.open(path) as image:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the bound below says it
            kind, pixels = image.format, image.width * image.height
    except Exception:
        return "is not an image"
    if kind not in FORMATS:
        return f"is a {kind} file"
    return f"has {pixels / 1e6:.0f} megapixels" if pixels > MAX_IMAGE_PIXELS else None


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as 8-bit RGB, each mode read by its own value range.

    16-bit integers (PIL's `I;16*`, and `I` within 0..65535) are divided by 257; floating-point
    pixels (`F`) within 0..1 are multiplied by 255; a palette keeps its colours; an alpha channel
    (RGBA, LA, PA, a palette's transparency) is laid on white; CMYK, YCbCr and the other modes go
    through PIL's own conversion. A plain `convert("RGB")` clips instead: a 16-bit grayscale
    photo comes out almost all white, a floating-point one all black.

    Raises:
        ValueError: values no range rule covers (32-bit integers above 65535, floats outside
            0..1, NaN), or a mode PIL cannot convert; the message says which.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I") or mode == "F":
        values = np.asarray(image, dtype=np.float64)
        if mode == "F":
            if not (np.isfinite(values).all() and 0 <= values.min() and values.max() <= 1):
                raise ValueError("has floating-point pixels outside 0..1")
            scaled = values * 255
        else:
            if values.min() < 0 or values.max() > 65535:
                raise ValueError("has 32-bit integer pixels outside 0..65535")
            scaled = values / 257
        gray = Image.fromarray(np.rint(scaled).astype(np.uint8))
        return gray.convert("RGB")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError:
        raise ValueError(f"has pixels in mode {mode}, which cannot be read as RGB") from None


def fit(image: Image.Image, width: int, height: int) -> tuple[Image.Image, str]:
    """`image` (RGB) at `width` x `height` without stretching: cropped around its centre to that
    aspect ratio (where it differs by more than a pixel), then resized (Lanczos). Returns the image
    and what was done, for a request's notes ("cropped to 1000x658, then resized to 1216x800")."""
    w, h = image.size
    if abs(w * height - h * width) >= max(width, height):  # more than a pixel off that aspect
        if w * height > h * width:  # wider: cut the sides
            crop_w, crop_h = round(h * width / height), h
        else:  # taller: cut the top and bottom
            crop_w, crop_h = w, round(w * height / width)
        left, top = (w - crop_w) // 2, (h - crop_h) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
        done = f"cropped to {crop_w}x{crop_h}, then resized to {width}x{height}"
    else:
        done = f"resized to {width}x{height}"
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    return image, done


def follow_aspect(size: tuple[int, int], area: int, step: int, low: int, high: int) -> tuple[int, int]:
    """(width, height) of about `area` pixels at the aspect ratio of `size` (width, height): each
    side a multiple of `step` in `low..high`, the nearest to that ratio (as diffusers' Kontext
    pipeline picks a preferred resolution for its input). A ratio the range cannot hold (a
    panorama beyond high / low) gets the range's widest."""
    ratio = size[0] / size[1]

    def side(value: float) -> int:
        return min(max(round(value / step) * step, low), high)

    width, height = side(math.sqrt(area * ratio)), side(math.sqrt(area / ratio))
    if width == high and height > low:  # clamped: the other side follows the ratio instead
        height = side(high / ratio)
    elif height == high and width > low:
        width = side(high * ratio)
    return width, height
