"""The toy world's exact reward (worlds/toy/world.py): GenEval-style checks of a 32×32 image by pixel analysis,
no learned model, about a millisecond per image.

Pixels are classed by colour (hue windows around the drawn hues; bright unsaturated or off-hue pixels are "other",
dark ones background), objects are the 4-connected components of one colour class of at least 6 pixels at 32×32
(scaled by (resolution/32)², so specks of a decoder's fringe are not objects), and an object's shape comes
from its fill ratio area/box (on anti-aliased coverage, see `shape_of`): 1 for a square, π/4 for a circle,
1/2 for a triangle, which also holds most of its mass in the lower half of its box (the renderer's triangles
point up). A rule on the box corners instead failed on anti-aliased squares, whose corners are partly covered.

Five checks per image, the prompt's parts in turn:
    colour    some object of the requested colour
    count     exactly COUNT objects of that colour
    shape     every one of them has the requested shape (false when there are none)
    position  every one of them has its centroid in the requested half (true when the prompt names no half)
    clean     no object of any other colour class
`partial` is their mean and `strict` their conjunction (GenEval's success).
"""

import numpy as np
import torch

from worlds.toy.world import RESOLUTION, parse_prompt

CLASSES = ("red", "yellow", "green", "blue", "other")
# Hue windows in degrees, [start, end): they tile the circle, so a drifted hue is still named. Cyan and magenta,
# which the renderer never draws, are "other".
HUE_WINDOWS = {"red": (330, 30), "yellow": (30, 80), "green": (80, 170), "other": (170, 195),
               "blue": (195, 265)}  # 265..330 (magenta) falls through to "other"
MIN_VALUE = 0.4  # max(R, G, B) below this is background: about half-covered edge pixels and darker
MIN_SATURATION = 0.45  # bright pixels below this (grey, white) are "other"
MIN_PIXELS = 6  # at 32×32

# Fill ratios (shape_of): square 1, circle π/4 ≈ 0.785, triangle 1/2 ideally; small pixelated or blurred
# triangles reach ~0.75 (their widest row, the base, is partly covered), circles ~0.92.
SQUARE_FILL = 0.93  # squares fill ≥ 0.93
TRIANGLE_FILL = 0.8  # triangles fill < 0.8 and are bottom-heavy; circles are what is left, if symmetric
TRIANGLE_MASS = 0.65  # top/bottom mass ratio of an upward triangle (ideal 1/3)
CIRCLE_MASS = (0.7, 1.45)  # a circle is symmetric (ideal 1)
ASPECT = (0.6, 1.6)  # width/height of every shape's box (ideal 1)
CHECKS = ("colour", "count", "shape", "position", "clean")


def classify_pixels(images: np.ndarray) -> np.ndarray:
    """(B, H, W, 3) floats in [0, 1] -> (B, H, W) int8: −1 background, else an index into CLASSES."""
    value = images.max(-1)
    spread = value - images.min(-1)
    saturation = spread / np.maximum(value, 1e-6)
    r, g, b = images[..., 0], images[..., 1], images[..., 2]
    safe = np.maximum(spread, 1e-6)
    # The HSV hue in degrees, by which channel is the largest (as colorsys computes it).
    hue = np.where(value == r, (g - b) / safe % 6, np.where(value == g, (b - r) / safe + 2, (r - g) / safe + 4)) * 60
    labels = np.full(value.shape, CLASSES.index("other"), dtype=np.int8)
    for name, (start, end) in HUE_WINDOWS.items():
        inside = (hue >= start) | (hue < end) if start > end else (hue >= start) & (hue < end)
        labels[inside & (saturation >= MIN_SATURATION)] = CLASSES.index(name)
    labels[saturation < MIN_SATURATION] = CLASSES.index("other")
    labels[value < MIN_VALUE] = -1
    return labels


def connected_components(classes: np.ndarray) -> np.ndarray:
    """4-connected components of equal, non-background class: (B, H, W) int64 labels, −1 for background, else
    the flat index (within the batch) of the component's first pixel. Vectorised min-label propagation with
    pointer jumping, which converges in a few sweeps for shapes this small."""
    b, h, w = classes.shape
    index = np.arange(b * h * w).reshape(b, h, w)
    foreground = classes >= 0
    labels = np.where(foreground, index, -1)
    big = b * h * w
    # Same-class neighbour pairs along each axis.
    join_y = foreground[:, 1:] & (classes[:, 1:] == classes[:, :-1])
    join_x = foreground[:, :, 1:] & (classes[:, :, 1:] == classes[:, :, :-1])
    flat = labels.reshape(-1)
    while True:
        current = np.where(foreground, labels, big)
        smaller = current.copy()
        smaller[:, 1:] = np.where(join_y, np.minimum(smaller[:, 1:], current[:, :-1]), smaller[:, 1:])
        smaller[:, :-1] = np.where(join_y, np.minimum(smaller[:, :-1], current[:, 1:]), smaller[:, :-1])
        smaller[:, :, 1:] = np.where(join_x, np.minimum(smaller[:, :, 1:], current[:, :, :-1]), smaller[:, :, 1:])
        smaller[:, :, :-1] = np.where(join_x, np.minimum(smaller[:, :, :-1], current[:, :, 1:]), smaller[:, :, :-1])
        smaller = np.where(foreground, smaller, -1)
        # Pointer jumping: a pixel takes its label's label (labels are pixel indices of the same component).
        jumped = np.where(foreground, flat[np.maximum(smaller, 0)].reshape(b, h, w), -1)
        jumped = np.where(foreground, np.minimum(jumped, smaller), -1)
        if np.array_equal(jumped, labels):
            return labels
        labels = jumped
        flat = labels.reshape(-1)


def _dilate(mask: np.ndarray) -> np.ndarray:
    """The mask grown by one pixel in all 8 directions."""
    h, w = mask.shape
    padded = np.pad(mask, 1)
    grown = np.zeros_like(mask)
    for dy in range(3):
        for dx in range(3):
            grown |= padded[dy:dy + h, dx:dx + w]
    return grown


def shape_of(mask: np.ndarray, value: np.ndarray, background: np.ndarray) -> str | None:
    """The shape of one object, or None when it is none of the three. `mask`: its pixels; `value`: max(R, G, B)
    of the image; `background`: the pixels below MIN_VALUE.

    The fill ratio is measured on coverage, not on the thresholded mask: each pixel of the object and of the dark
    rim around it counts value / (the object's own value), so a half-covered edge pixel counts one half. The box
    is the widest row × the tallest column of coverage. On a thresholded mask a blurred square loses its corners
    (fill 0.85–0.9, read as a circle) and one stray pixel widens a circle's box; coverage sums are what a blur
    preserves, and they give 1 (square), π/4 (circle) and 1/2 (triangle) up to pixelation."""
    rows, cols = np.nonzero(_dilate(mask))
    box = np.s_[rows.min():rows.max() + 1, cols.min():cols.max() + 1]  # the object and its rim
    mask, value, background = mask[box], value[box], background[box]
    reference = np.percentile(value[mask], 90)
    coverage = np.where(mask | (_dilate(mask) & background), np.clip(value / reference, 0, 1), 0.0)
    area, width, height = coverage.sum(), coverage.sum(1).max(), coverage.sum(0).max()
    if not ASPECT[0] <= width / height <= ASPECT[1]:
        return None
    fill = area / (width * height)
    # Top/bottom mass on the mask's own rows; the middle row of an odd-height box counts half to each side.
    ys = np.nonzero(mask)[0]
    middle = (ys.min() + ys.max()) / 2
    top = (ys < middle).sum() + 0.5 * (ys == middle).sum()
    bottom = (ys > middle).sum() + 0.5 * (ys == middle).sum()
    mass = top / max(bottom, 1e-6)
    if fill >= SQUARE_FILL:
        return "square"
    if fill < TRIANGLE_FILL and mass < TRIANGLE_MASS:
        return "triangle"
    return "circle" if CIRCLE_MASS[0] <= mass <= CIRCLE_MASS[1] else None


def find_objects(image_labels: np.ndarray, image_classes: np.ndarray, value: np.ndarray,
                 min_pixels: int) -> list[dict]:
    """The objects of one image: colour class, shape, centroid (x, y) in pixels, pixel count."""
    flat = image_labels.reshape(-1)
    ids, counts = np.unique(flat[flat >= 0], return_counts=True)
    objects = []
    for label, size in zip(ids, counts):
        if size < min_pixels:
            continue
        mask = image_labels == label
        ys, xs = np.nonzero(mask)
        objects.append(dict(colour=CLASSES[image_classes[ys[0], xs[0]]], shape=shape_of(mask, value, image_classes < 0),
                            centroid=(xs.mean() + 0.5, ys.mean() + 0.5), pixels=int(size)))
    return objects


def check_image(objects: list[dict], prompt: str, height: int, width: int) -> dict[str, bool]:
    spec = parse_prompt(prompt)
    mine = [o for o in objects if o["colour"] == spec.colour]
    inside = {"": lambda x, y: True, "left": lambda x, y: x < width / 2, "right": lambda x, y: x > width / 2,
              "top": lambda x, y: y < height / 2, "bottom": lambda x, y: y > height / 2}[spec.position]
    return dict(
        colour=bool(mine),
        count=len(mine) == spec.count,
        shape=bool(mine) and all(o["shape"] == spec.shape for o in mine),
        position=spec.position == "" or (bool(mine) and all(inside(*o["centroid"]) for o in mine)),
        clean=len(mine) == len(objects),
    )


MODES = ("partial", "strict", *CHECKS)


class ToyReward:
    """`--reward toy[,mode=strict]`: the toy world's checks; `partial` (default) scores the mean of the five
    checks, `strict` 1 when all hold, else 0, and a check's name (`mode=count`) that check alone, 1 or 0 (a
    single-skill reward, e.g. for the teachers of algos/opd.py). Images of any square resolution (the object
    threshold scales)."""

    groupwise = False

    def __init__(self, mode: str = "partial"):
        if mode not in MODES:
            raise ValueError(f"toy reward mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode

    def checks(self, images, prompts) -> dict[str, np.ndarray]:
        """Each check per image as float arrays (B,): colour, count, shape, position, clean, partial, strict."""
        if isinstance(images, torch.Tensor):
            images = images.detach().float().cpu().numpy()
        images = np.asarray(images, dtype=np.float32)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images (B, 3, H, W), got shape {images.shape}")
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        height, width = images.shape[-2:]
        min_pixels = max(1, round(MIN_PIXELS * height * width / RESOLUTION ** 2))
        images = images.transpose(0, 2, 3, 1).clip(0, 1)
        classes, value = classify_pixels(images), images.max(-1)
        labels = connected_components(classes) if len(images) else classes.astype(np.int64)
        rows = [check_image(find_objects(labels[i], classes[i], value[i], min_pixels), prompt, height, width)
                for i, prompt in enumerate(prompts)]
        result = {name: np.array([row[name] for row in rows], dtype=np.float64) for name in CHECKS}
        stacked = np.stack([result[name] for name in CHECKS]) if rows else np.zeros((len(CHECKS), 0))
        result["partial"] = stacked.mean(0)
        result["strict"] = stacked.min(0) if rows else np.zeros(0)
        return result

    def __call__(self, images, prompts) -> np.ndarray:
        return self.checks(images, prompts)[self.mode]


class ToyColourShare:
    """`--reward toy_colour_share`: the share of the canvas classed as the prompt's colour (`classify_pixels`).
    Anchored to the prompt (another colour scores low) and hackable on purpose: flooding the canvas with that colour
    maximises it while count, shape and position fail — the training reward of the `toy-hack` presets, which watch
    `toy,mode=strict` as the judge (docs/guard.md)."""

    groupwise = False

    def __call__(self, images, prompts) -> np.ndarray:
        if isinstance(images, torch.Tensor):
            images = images.detach().float().cpu().numpy()
        images = np.asarray(images, dtype=np.float32)
        if images.ndim != 4 or images.shape[1] != 3 or len(images) != len(prompts):
            raise ValueError(f"expected images (B, 3, H, W) for {len(prompts)} prompts, got shape {images.shape}")
        classes = classify_pixels(images.transpose(0, 2, 3, 1).clip(0, 1))
        wanted = np.array([CLASSES.index(parse_prompt(p).colour) for p in prompts])
        return (classes == wanted[:, None, None]).mean((1, 2)).astype(np.float64)
