"""The toy edit world's exact reward (worlds/toy_edit/world.py): did the output carry out the instruction on the
condition image, and keep what the instruction did not name? Pixel analysis only, as worlds/toy/reward.py.

1. The source scene is read off the condition image with worlds/toy/reward.py's analysis: its objects' count, their
   (common) colour and shape, and each one's place. Its half is not read: a scene placed anywhere may happen to lie
   in one half, so the source description names none (a move names the new half; colour and shape edits are held
   to the source's places by `preserved`, which is stricter than a half).
2. The instruction applied to it gives the edited description, e.g. "two green squares"; a move's, "two red
   squares on the left".
3. Six checks of the output: worlds/toy/reward.py's five for the edited description (colour, count, shape, position,
   clean), and
       preserved   the output has as many objects as the source (of any colour), and for colour and shape edits
                   each source object has its own output object of the new description's colour whose box centre
                   lies within 2 px (at 32×32, scaled with the resolution) of the source object's.
   Box centres, not centroids: a square turned into a triangle keeps its box, but the triangle's centroid sits
   side/6 (up to 1.7 px) below the square's, and the thresholded apex moves it further.
`partial` (the reward by default) is the mean of the six, `strict` their conjunction (the edit's success).
"""

from itertools import permutations

import numpy as np
import torch

from worlds.toy.reward import CHECKS as TOY_CHECKS
from worlds.toy.reward import MIN_PIXELS, check_image, classify_pixels, connected_components, find_objects
from worlds.toy.world import RESOLUTION, ToyPrompt
from worlds.toy_edit.world import apply_edit, parse_instruction

CHECKS = (*TOY_CHECKS, "preserved")
TOLERANCE = 2.0  # pixels at 32×32 between a kept object's box centres in the source and the output


def _as_hwc(images) -> np.ndarray:
    """(B, 3, H, W) tensor or array -> (B, H, W, 3) float32 in [0, 1]."""
    if isinstance(images, torch.Tensor):
        images = images.detach().float().cpu().numpy()
    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images (B, 3, H, W), got shape {images.shape}")
    return images.transpose(0, 2, 3, 1).clip(0, 1)


def scene_objects(images) -> list[list[dict]]:
    """worlds/toy/reward.py's objects of each image (colour, shape, centroid, pixels), each with its thresholded mask's
    box centre (x, y) in pixels added as `centre`."""
    images = _as_hwc(images)
    if not len(images):
        return []
    height, width = images.shape[1:3]
    min_pixels = max(1, round(MIN_PIXELS * height * width / RESOLUTION ** 2))
    classes, value = classify_pixels(images), images.max(-1)
    labels = connected_components(classes)
    scenes = []
    for i in range(len(images)):
        objects = find_objects(labels[i], classes[i], value[i], min_pixels)
        # find_objects keeps the components of at least min_pixels in label order: the same walk gives the masks.
        ids, counts = np.unique(labels[i][labels[i] >= 0], return_counts=True)
        for obj, label in zip(objects, ids[counts >= min_pixels]):
            ys, xs = np.nonzero(labels[i] == label)
            obj["centre"] = ((xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2)
        scenes.append(objects)
    return scenes


def source_scene(objects: list[dict]) -> ToyPrompt:
    """The toy description of a condition image's objects (no half named); ValueError when it is not a toy scene
    (no object, more than three, mixed colours or shapes, or a shape that is none of the three)."""
    colours, shapes = {o["colour"] for o in objects}, {o["shape"] for o in objects}
    if not 1 <= len(objects) <= 3 or len(colours) != 1 or len(shapes) != 1 or "other" in colours or None in shapes:
        found = ", ".join(f"{o['colour']} {o['shape']}" for o in objects) or "no object"
        raise ValueError(f"the condition image is not a toy-world scene (1–3 objects of one colour and shape): "
                         f"found {found}")
    return ToyPrompt(len(objects), colours.pop(), shapes.pop(), "")


def _matched(source: list[dict], output: list[dict], tolerance: float) -> bool:
    """A one-to-one pairing of the source objects with the output objects, each pair's box centres within
    `tolerance` (at most three objects: every permutation is tried)."""
    if len(source) != len(output):
        return False
    return any(all(np.hypot(s["centre"][0] - o["centre"][0], s["centre"][1] - o["centre"][1]) <= tolerance
                   for s, o in zip(source, order)) for order in permutations(output))


class ToyEditReward:
    """`--reward toy_edit[,mode=strict]`: the toy edit world's checks of each output against its condition image
    and instruction; `partial` (default) scores the mean of the six checks, `strict` 1 when all hold, else 0."""

    groupwise = False
    wants_conditions = True

    def __init__(self, mode: str = "partial"):
        if mode not in ("partial", "strict"):
            raise ValueError(f"toy_edit reward mode {mode!r} is neither 'partial' nor 'strict'")
        self.mode = mode

    def checks(self, images, prompts, conditions) -> dict[str, np.ndarray]:
        """Each check per image as float arrays (B,): colour, count, shape, position, clean, preserved, partial,
        strict. conditions[i]: sample i's condition images, [(3, h, w) in [0, 1]] (the first is the source)."""
        outputs = scene_objects(images)
        if not len(outputs) == len(prompts) == len(conditions):
            raise ValueError(f"{len(outputs)} images, {len(prompts)} prompts and {len(conditions)} conditions")
        height, width = (images.shape[-2:] if len(outputs) else (RESOLUTION, RESOLUTION))
        sources = self._sources(conditions)
        rows = []
        for objects, instruction, (source, (source_height, source_width)) in zip(outputs, prompts, sources):
            edit = parse_instruction(instruction)
            target = apply_edit(source_scene(source), edit)
            row = check_image(objects, target.text(), height, width)
            # The source's places in the output's pixels (a condition may come at another size than the output).
            sy, sx = height / source_height, width / source_width
            moved = [dict(o, centre=(o["centre"][0] * sx, o["centre"][1] * sy)) for o in source]
            kept = len(objects) == target.count
            if edit.kind != "move":
                mine = [o for o in objects if o["colour"] == target.colour]
                kept = kept and _matched(moved, mine, TOLERANCE * width / RESOLUTION)
            row["preserved"] = kept
            rows.append(row)
        result = {name: np.array([row[name] for row in rows], dtype=np.float64) for name in CHECKS}
        stacked = np.stack([result[name] for name in CHECKS]) if rows else np.zeros((len(CHECKS), 0))
        result["partial"] = stacked.mean(0)
        result["strict"] = stacked.min(0) if rows else np.zeros(0)
        return result

    @staticmethod
    def _sources(conditions) -> list[tuple[list[dict], tuple[int, int]]]:
        """The objects of each sample's first condition image and its (height, width); the images of one size are
        analysed as one batch (the analysis is vectorised over the batch)."""
        firsts = []
        for condition in conditions:
            if not len(condition):
                raise ValueError("toy_edit scores an edit against its source: every sample needs a condition image")
            firsts.append(torch.as_tensor(np.asarray(condition[0], dtype=np.float32)))
        found = [None] * len(firsts)
        for shape in {tuple(c.shape) for c in firsts}:
            members = [i for i, c in enumerate(firsts) if tuple(c.shape) == shape]
            for i, objects in zip(members, scene_objects(torch.stack([firsts[i] for i in members]))):
                found[i] = (objects, shape[-2:])
        return found

    def __call__(self, images, prompts, conditions) -> np.ndarray:
        return self.checks(images, prompts, conditions)[self.mode]
