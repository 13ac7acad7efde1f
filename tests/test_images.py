"""Input images (aot/images.py): every mode read by its own value range, fitted without stretching."""

import numpy as np
import pytest
from PIL import Image

from aot.images import fit, follow_aspect, to_rgb


def gradient(mode: str, top: float, size=(64, 32)) -> Image.Image:
    """A horizontal ramp from 0 to `top` in `mode` (a 16-bit or floating-point grayscale image)."""
    ramp = np.tile(np.linspace(0, top, size[0]), (size[1], 1))
    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    return Image.fromarray(ramp.astype(dtype), mode if mode != "I;16" else None)


@pytest.mark.parametrize(("mode", "top"), [("I;16", 65535), ("I", 65535), ("F", 1.0)])
def test_high_bit_depth_grayscale_keeps_its_range(mode, top, tmp_path):
    image = gradient(mode, top)
    if mode == "I;16":  # as a 16-bit PNG decodes
        image.save(tmp_path / "gray16.png")
        image = Image.open(tmp_path / "gray16.png")
        assert image.mode == "I;16"
    rgb = np.asarray(to_rgb(image), dtype=float)
    assert rgb.shape == (32, 64, 3)
    assert rgb[:, 0].max() == 0 and rgb[:, -1].min() == 255, "the ramp's ends are black and white"
    assert abs(rgb.mean() - 127.5) < 2, "a plain convert('RGB') gives almost all white (16-bit) or black (float)"
    clipped = np.asarray(image.convert("RGB"), dtype=float).mean()
    assert abs(clipped - 127.5) > 60, f"this image would not show the problem ({clipped:.0f})"


def test_values_outside_a_known_range_are_refused_saying_so():
    with pytest.raises(ValueError, match="floating-point pixels outside 0..1"):
        to_rgb(gradient("F", 3.0))
    with pytest.raises(ValueError, match="32-bit integer pixels outside 0..65535"):
        to_rgb(gradient("I", 70000))


def test_transparency_is_laid_on_white_and_a_palette_keeps_its_colours():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)
    half = Image.new("LA", (4, 4), (0, 128))
    assert to_rgb(half).getpixel((0, 0)) == (127, 127, 127)
    palette = Image.new("RGB", (4, 4), (10, 200, 30)).quantize(colors=2)
    assert to_rgb(palette).getpixel((0, 0)) == (10, 200, 30)
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # red in CMYK
    assert to_rgb(cmyk).getpixel((0, 0)) == (255, 0, 0)


def test_fit_crops_to_the_outputs_aspect_ratio_and_never_stretches():
    image = Image.new("RGB", (1000, 700), "white")
    image.paste((255, 0, 0), (0, 0, 100, 700))  # a red band on the left: cropped away for a square
    square, done = fit(image, 512, 512)
    assert square.size == (512, 512) and done == "cropped to 700x700, then resized to 512x512"
    assert np.asarray(square)[:, 0].mean(axis=0).tolist() == [255, 255, 255], "the left band survived: squashed"
    same, done = fit(image, 500, 350)
    assert same.size == (500, 350) and done == "resized to 500x350"


@pytest.mark.parametrize("size", [(1000, 700), (700, 1000), (4000, 1000), (512, 512), (64, 48)])
def test_the_size_an_input_gets_is_on_the_grid_in_range_and_near_its_aspect(size):
    width, height = follow_aspect(size, 1024 * 1024, 16, 512, 1536)
    assert width % 16 == 0 and height % 16 == 0 and 512 <= min(width, height) and max(width, height) <= 1536
    ratio = size[0] / size[1]
    if 512 / 1536 <= ratio <= 1536 / 512:
        assert abs(width / height / ratio - 1) < 0.03, (width, height)
    else:  # a panorama beyond the range: the widest it allows
        assert (width, height) == (1536, 512)
