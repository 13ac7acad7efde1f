"""Draw assets/example.png: the input image of app.py's edit examples (a house on a hill, 640x448).

Drawn here rather than taken from a photo, so that the template ships no image of anyone's.

    python assets/make_example.py
"""

from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

WIDTH, HEIGHT = 640, 448


def draw() -> Image.Image:
    image = Image.new("RGB", (WIDTH, HEIGHT))
    pen = ImageDraw.Draw(image)
    for y in range(HEIGHT):  # sky: deep blue at the top to pale near the horizon
        t = y / HEIGHT
        pen.line([(0, y), (WIDTH, y)], fill=(int(70 + 150 * t), int(130 + 100 * t), int(200 + 40 * t)))
    pen.ellipse((470, 50, 550, 130), fill=(255, 236, 170))  # the sun
    pen.polygon([(0, 300), (180, 250), (380, 280), (640, 230), (640, 448), (0, 448)], fill=(86, 150, 72))
    pen.polygon([(0, 360), (260, 320), (640, 350), (640, 448), (0, 448)], fill=(66, 124, 58))
    pen.rectangle((230, 210, 400, 320), fill=(222, 200, 170))  # the house
    pen.polygon([(215, 212), (315, 140), (415, 212)], fill=(150, 60, 50))
    for left in (250, 340):
        pen.rectangle((left, 235, left + 35, 270), fill=(70, 90, 120))
    pen.rectangle((300, 260, 330, 320), fill=(110, 70, 45))
    pen.rectangle((110, 250, 122, 320), fill=(100, 70, 40))  # a tree
    pen.ellipse((75, 170, 160, 265), fill=(52, 110, 50))
    return image.filter(ImageFilter.SMOOTH)


if __name__ == "__main__":
    draw().save(Path(__file__).with_name("example.png"), optimize=True)
