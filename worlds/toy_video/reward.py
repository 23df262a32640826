"""The toy video world's exact reward (worlds/toy_video/world.py): each frame read as worlds/toy/reward.py reads an
image, and the motion from the objects' centroids across frames. No learned model, about a millisecond per frame.

Six checks per clip:
    colour    every frame has an object of the requested colour
    count     every frame has exactly COUNT objects of that colour
    shape     in every frame each of them has the requested shape
    clean     no frame has an object of another colour class
    motion    the mean centroid of those objects travels ≥ MIN_TRAVEL px in the requested direction from the first
              frame to the last, never steps back by more than BACKSTEP px between frames, and drifts across the
              direction by at most half its travel
    persist   the objects persist: as many in every frame, each within MAX_STEP px of one in the frame before
`partial` is their mean and `strict` their conjunction; a check's name scores it alone. Distances are at 32×32 and
scale with the frame. The ground truth moves 2–3 px per frame (8–12 px over 5 frames).
"""

import numpy as np
import torch

from worlds.toy.reward import MIN_PIXELS, classify_pixels, connected_components, find_objects
from worlds.toy.world import RESOLUTION
from worlds.toy_video.world import DIRECTIONS, parse_clip_prompt

CHECKS = ("colour", "count", "shape", "clean", "motion", "persist")
MODES = ("partial", "strict", *CHECKS)
MIN_TRAVEL = 4.0  # px over the clip: a third of the slowest ground truth's 8 px is not motion
BACKSTEP = 1.0  # px a frame may step against the direction (centroids of decoded blobs jitter)
MAX_STEP = 5.0  # px an object may move between frames and still be the same object (ground truth: ≤ 3)


def clip_objects(clips) -> list[list[list[dict]]]:
    """(B, F, 3, H, W) floats in [0, 1] -> per clip, per frame, worlds/toy/reward.py's objects."""
    if isinstance(clips, torch.Tensor):
        clips = clips.detach().float().cpu().numpy()
    clips = np.asarray(clips, dtype=np.float32)
    if clips.ndim != 5 or clips.shape[2] != 3:
        raise ValueError(f"expected videos (B, F, 3, H, W), got shape {clips.shape}")
    b, f, _, h, w = clips.shape
    frames = clips.reshape(b * f, 3, h, w).transpose(0, 2, 3, 1).clip(0, 1)
    classes, value = classify_pixels(frames), frames.max(-1)
    labels = connected_components(classes) if len(frames) else classes.astype(np.int64)
    min_pixels = max(1, round(MIN_PIXELS * h * w / RESOLUTION ** 2))
    objects = [find_objects(labels[i], classes[i], value[i], min_pixels) for i in range(b * f)]
    return [objects[i * f:(i + 1) * f] for i in range(b)]


def check_clip(frames: list[list[dict]], prompt: str, resolution: int) -> dict[str, bool]:
    spec = parse_clip_prompt(prompt)
    scale = resolution / RESOLUTION
    mine = [[o for o in objects if o["colour"] == spec.colour] for objects in frames]
    present = all(mine)
    result = dict(
        colour=present,
        count=all(len(m) == spec.count for m in mine),
        shape=present and all(o["shape"] == spec.shape for m in mine for o in m),
        clean=all(len(m) == len(objects) for m, objects in zip(mine, frames)),
        motion=False,
        persist=False,
    )
    if not present:
        return result
    centres = np.array([np.mean([o["centroid"] for o in m], axis=0) for m in mine])  # (F, 2) as (x, y)
    direction = np.array(DIRECTIONS[spec.direction], dtype=np.float64)
    along = centres @ direction
    across = centres @ direction[::-1]  # the other axis (the directions are axis-aligned)
    travel = along[-1] - along[0]
    result["motion"] = bool(travel >= MIN_TRAVEL * scale and np.diff(along).min() >= -BACKSTEP * scale
                            and abs(across[-1] - across[0]) <= travel / 2)
    result["persist"] = all(len(m) == len(mine[0]) for m in mine) and all(
        min(np.hypot(*np.subtract(o["centroid"], p["centroid"])) for p in before) <= MAX_STEP * scale
        for before, after in zip(mine, mine[1:]) for o in after)
    return result


class ToyVideoReward:
    """`--reward toy_video[,mode=strict]`: the toy video world's six checks on whole clips (`video = True`: called
    with (B, F, 3, H, W), not frame by frame); `partial` (default) their mean, `strict` all six, a check's name
    that check alone. Frames of any square resolution (distances and the object threshold scale)."""

    groupwise = False
    video = True

    def __init__(self, mode: str = "partial"):
        if mode not in MODES:
            raise ValueError(f"toy_video reward mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode

    def checks(self, clips, prompts) -> dict[str, np.ndarray]:
        """Each check per clip as float arrays (B,): the six, partial and strict."""
        objects = clip_objects(clips)
        if len(objects) != len(prompts):
            raise ValueError(f"{len(objects)} clips but {len(prompts)} prompts")
        resolution = np.shape(clips)[-1]
        rows = [check_clip(frames, prompt, resolution) for frames, prompt in zip(objects, prompts)]
        result = {name: np.array([row[name] for row in rows], dtype=np.float64) for name in CHECKS}
        stacked = np.stack([result[name] for name in CHECKS]) if rows else np.zeros((len(CHECKS), 0))
        result["partial"] = stacked.mean(0)
        result["strict"] = stacked.min(0) if rows else np.zeros(0)
        return result

    def __call__(self, clips, prompts) -> np.ndarray:
        return self.checks(clips, prompts)[self.mode]
