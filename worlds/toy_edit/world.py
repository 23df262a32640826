"""The toy EDIT world: instruction-based editing of worlds/toy/world.py's scenes, the CPU-sized version of an image-edit
benchmark. A source scene is a render of a toy prompt ("two red squares on the left"); an instruction changes ONE
attribute of it; the edited description is the source prompt with that attribute changed; the target render keeps
everything the instruction did not name. worlds/toy_edit/reward.py scores an edit by pixel analysis, `data/toy_edit/`
holds the dataset and the ~3 MB FLUX.1 Kontext pipeline that `worlds/toy_edit/pretrain.py` trains.

    recolour   "make it green" / "make them green"                        same boxes, same shape, new colour
    reshape    "turn it into a square" / "turn them into squares"           same boxes, same colour, new shape
    move       "move it to the left" / "move them to the top" (any half)    same sizes and colours, in the new half

"it" for one object, "them" for two or three. Every (source prompt, instruction) pair that changes something:
180 × (3 + 2) recolours and reshapes + 36 × 4 + 144 × 3 moves = 1,476 pairs. The held-out split holds out (scene,
instruction) COMBINATIONS, a fifth of each kind's pairs: every held-out edit's transition (e.g. recolour red ->
green) and its source scene occur in training, never together; the edit model is pretrained on the training pairs
alone.
"""

import re
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image, ImageDraw

from worlds.toy.world import (COLOURS, REPO, RESOLUTION, SHAPES, SUPERSAMPLE, ToyPrompt, _colour, _layout, _region,
                              parse_prompt, placement_bounds, toy_prompts)

TOY_EDIT_DIR = REPO / "data" / "toy_edit"
KINDS = ("recolour", "reshape", "move")
SIDES = ("left", "right", "top", "bottom")  # the halves a move names (ToyPrompt.position values)
TEST_FRACTION = 0.2
SPLIT_SEED = 0

# The flags that put a script in the toy edit world, shared by every script's `toy-edit` preset: the shipped FLUX.1
# Kontext model, the edit dataset, the exact edit reward (mean of its six checks), 32 px conditions (Kontext's own
# preferred size would be 1024 px), and evaluation on all 96 held-out edits × 8 seeds (standard error about 0.018:
# RL's gains here are about 0.1, and 4 seeds' 0.025 blurred them).
TOY_EDIT_WORLD = dict(model="flux1-kontext", model_path="toy", dataset=str(TOY_EDIT_DIR), reward=["toy_edit"],
                      resolution=RESOLUTION, condition_size=RESOLUTION, max_sequence_length=16, eval_num_prompts=96,
                      eval_seeds=8, eval_num_steps=8)


@dataclass(frozen=True)
class Edit:
    kind: str  # "recolour", "reshape" or "move"
    value: str  # the new colour, shape or half
    plural: bool  # "them" (two or three objects) rather than "it"

    def text(self) -> str:
        pronoun = "them" if self.plural else "it"
        if self.kind == "recolour":
            return f"make {pronoun} {self.value}"
        if self.kind == "reshape":
            return f"turn {pronoun} into {self.value}s" if self.plural else f"turn it into a {self.value}"
        return f"move {pronoun} to the {self.value}"


_INSTRUCTION = re.compile(
    rf"^(?:make (?P<colour_pronoun>it|them) (?P<colour>{'|'.join(COLOURS)})"
    rf"|turn (?P<shape_pronoun>it|them) into (?P<article>a )?(?P<shape>{'|'.join(SHAPES)})(?P<plural>s?)"
    rf"|move (?P<move_pronoun>it|them) to the (?P<side>{'|'.join(SIDES)}))$")


def parse_instruction(instruction: str) -> Edit:
    """The edit an instruction asks for; ValueError outside the grammar (including "turn it into squares")."""
    match = _INSTRUCTION.match(instruction.strip())
    if match is None:
        raise ValueError(f"{instruction!r} is not a toy edit instruction (make it/them COLOUR, turn it into a SHAPE "
                         f"/ them into SHAPEs, move it/them to the left/right/top/bottom)")
    if match["colour"]:
        return Edit("recolour", match["colour"], match["colour_pronoun"] == "them")
    if match["shape"]:
        plural = match["shape_pronoun"] == "them"
        # "turn it into a square", "turn them into squares": the noun agrees with the pronoun.
        if plural != (match["plural"] == "s") or plural == bool(match["article"]):
            raise ValueError(f"{instruction!r} is not a toy edit instruction: say \"turn it into a SHAPE\" or "
                             f"\"turn them into SHAPEs\"")
        return Edit("reshape", match["shape"], plural)
    return Edit("move", match["side"], match["move_pronoun"] == "them")


def instructions() -> list[str]:
    """All 22 instruction texts: 4 colours, 3 shapes and 4 halves, each with "it" and "them"."""
    values = {"recolour": COLOURS, "reshape": SHAPES, "move": SIDES}
    return [Edit(kind, value, plural).text() for kind in KINDS for value in values[kind] for plural in (False, True)]


def source_value(spec: ToyPrompt, kind: str) -> str:
    """The source's value of the attribute an edit of `kind` changes ("" for a scene placed anywhere)."""
    return {"recolour": spec.colour, "reshape": spec.shape, "move": spec.position}[kind]


def apply_edit(spec: ToyPrompt, edit: Edit) -> ToyPrompt:
    """The edited description; ValueError when the pronoun disagrees with the count or the edit changes nothing."""
    if edit.plural != (spec.count > 1):
        raise ValueError(f"{edit.text()!r} does not fit {spec.text()!r}: say \"{'them' if spec.count > 1 else 'it'}\"")
    if source_value(spec, edit.kind) == edit.value:
        raise ValueError(f"{edit.text()!r} changes nothing in {spec.text()!r}")
    field = {"recolour": "colour", "reshape": "shape", "move": "position"}[edit.kind]
    return replace(spec, **{field: edit.value})


def edit_description(source_prompt: str, instruction: str) -> str:
    """The source prompt with the instruction's attribute changed: ("two red squares", "move them to the left")
    -> "two red squares on the left"."""
    return apply_edit(parse_prompt(source_prompt), parse_instruction(instruction)).text()


def edit_pairs() -> list[tuple[str, str]]:
    """All 1,476 (source prompt, instruction) pairs that change something, in grammar order (source, then
    instruction in `instructions()` order)."""
    pairs = []
    for prompt in toy_prompts():
        spec = parse_prompt(prompt)
        for instruction in instructions():
            edit = parse_instruction(instruction)
            if edit.plural == (spec.count > 1) and source_value(spec, edit.kind) != edit.value:
                pairs.append((prompt, instruction))
    return pairs


def transition(source_prompt: str, instruction: str) -> tuple[str, str, str]:
    """(kind, source value, new value) of a pair: the unit the split holds out."""
    edit = parse_instruction(instruction)
    return edit.kind, source_value(parse_prompt(source_prompt), edit.kind), edit.value


def integer_ids(keys: list) -> np.ndarray:
    """Each key's index among the distinct keys, in order of first appearance."""
    index = {}
    return np.array([index.setdefault(key, len(index)) for key in keys])


def edit_split(seed: int = SPLIT_SEED) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, test) pairs: round(20%) of each kind's pairs held out (recolour 108 of 540, reshape 72 of 360, move
    115 of 576: 295 of 1,476), drawn with `seed` and redrawn until every held-out pair's transition (kind, source
    value -> new value) and source scene still occur in training. A held-out edit is then a new (scene,
    instruction) combination: an edit the model was trained to make, on a scene it was trained to edit otherwise,
    never the two together (as the toy world holds out prompts, not attribute values)."""
    pairs = edit_pairs()
    rng = np.random.default_rng(seed)
    held_out = set()
    for kind in KINDS:
        mine = [p for p in pairs if parse_instruction(p[1]).kind == kind]
        n = round(TEST_FRACTION * len(mine))
        # A draw keeps a transition (or scene) in training iff it holds out fewer of its pairs than there are:
        # counted with integer ids, since thousands of draws are rejected before one is kept.
        ids = [integer_ids([transition(*p) for p in mine]), integer_ids([source for source, _ in mine])]
        totals = [np.bincount(i) for i in ids]
        while True:
            draw = rng.permutation(len(mine))[:n]
            if all((np.bincount(i[draw], minlength=len(t)) < t).all() for i, t in zip(ids, totals)):
                held_out |= {mine[i] for i in draw}
                break
    return [p for p in pairs if p not in held_out], [p for p in pairs if p in held_out]


# ----- renderer ---------------------------------------------------------------------------------------------
def draw_scene(shape: str, boxes, fills, resolution: int = RESOLUTION) -> np.ndarray:
    """Objects of one shape at the given boxes (x, y, side) in pixels with the given RGB fills, drawn exactly as
    worlds/toy/world.py's `render` draws them: (resolution, resolution, 3) uint8."""
    size = resolution * SUPERSAMPLE
    canvas = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(canvas)
    for (x, y, side), fill in zip(boxes, fills):
        # PIL's boxes include their last pixel: subtract one supersampled pixel so the side is exact.
        x, y, s = x * SUPERSAMPLE, y * SUPERSAMPLE, side * SUPERSAMPLE
        if shape == "circle":
            draw.ellipse([x, y, x + s - 1, y + s - 1], fill=fill)
        elif shape == "square":
            draw.rectangle([x, y, x + s - 1, y + s - 1], fill=fill)
        else:
            draw.polygon([(x + (s - 1) / 2, y), (x + s - 1, y + s - 1), (x, y + s - 1)], fill=fill)
    return np.asarray(canvas.resize((resolution, resolution), Image.Resampling.BOX))


def place(sizes, region, resolution: int, rng: np.random.Generator, attempts: int = 200):
    """Boxes (x, y, side) for objects of the given sides inside `region`, without overlap, as worlds/toy/world.py's
    `_layout` places them but keeping the sides; None when `attempts` placements all fail."""
    x0, y0, x1, y1, gap = placement_bounds(region, resolution)
    quantize = lambda v: np.floor(v * SUPERSAMPLE) / SUPERSAMPLE  # noqa: E731
    for _ in range(attempts):
        boxes = []
        for size in sizes:
            x = quantize(rng.uniform(x0, x1 - size))
            y = quantize(rng.uniform(y0, y1 - size))
            if not all(x + size + gap <= bx or bx + bs + gap <= x or y + size + gap <= by or by + bs + gap <= y
                       for bx, by, bs in boxes):
                break
            boxes.append((x, y, size))
        if len(boxes) == len(sizes):
            return boxes
    return None


def render_edit(source_prompt: str, instruction: str, seed: int,
                resolution: int = RESOLUTION) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) renders of an edit, (resolution, resolution, 3) uint8 each, deterministic for `seed`.

    The source is `render(source_prompt, np.random.default_rng(seed))` of worlds/toy/world.py (same draws in the same
    order). Recolour: the same boxes in a fresh shade of the new colour; reshape: the same boxes and fills, the new
    shape; move: the same sides and fills, placed afresh in the new half (a source placed anywhere is redrawn until
    its sides fit a half: three 10 px objects fit the whole image but no half)."""
    spec = parse_prompt(source_prompt)
    edit = parse_instruction(instruction)
    target = apply_edit(spec, edit)
    rng = np.random.default_rng(seed)
    while True:
        boxes = _layout(spec.count, _region(spec.position, resolution), resolution, rng)
        fills = [_colour(spec.colour, rng) for _ in boxes]
        if edit.kind != "move":
            break
        moved = place([side for _, _, side in boxes], _region(edit.value, resolution), resolution, rng)
        if moved is not None:
            break
    source = draw_scene(spec.shape, boxes, fills, resolution)
    if edit.kind == "recolour":
        result = draw_scene(spec.shape, boxes, [_colour(target.colour, rng) for _ in boxes], resolution)
    elif edit.kind == "reshape":
        result = draw_scene(target.shape, boxes, fills, resolution)
    else:
        result = draw_scene(spec.shape, moved, fills, resolution)
    return source, result


# ----- the dataset ------------------------------------------------------------------------------------------
# data/toy_edit/{train,test}.jsonl: per kind, this many pairs drawn without replacement from the split's pairs,
# each with one fixed source render (`seed` below). Equal numbers per kind, so each kind's success is read off the
# same number of lines.
DATASET_LINES = {"train": 128, "test": 32}  # per kind: 384 train lines, 96 test lines
DATASET_SEED = 0
RENDER_SEED_BASE = {"train": 0, "test": 1_000_000}  # a line's source render seed: base + line index


@dataclass(frozen=True)
class EditRecord:
    source: str  # the source prompt (not in the dataset line: the model sees the image)
    instruction: str  # the dataset line's "prompt"
    seed: int  # render_edit's seed of the source image
    name: str  # the image's path in the dataset folder

    @property
    def kind(self) -> str:
        return parse_instruction(self.instruction).kind


def dataset_records(split: str) -> list[EditRecord]:
    """The lines of data/toy_edit/{split}.jsonl, in file order (kinds interleaved in a shuffled order)."""
    train, test = edit_split()
    pairs = {"train": train, "test": test}[split]
    rng = np.random.default_rng([DATASET_SEED, ("train", "test").index(split)])
    chosen = []
    for kind in KINDS:
        mine = [p for p in pairs if parse_instruction(p[1]).kind == kind]
        chosen += [mine[i] for i in sorted(rng.permutation(len(mine))[:DATASET_LINES[split]])]
    chosen = [chosen[i] for i in rng.permutation(len(chosen))]
    base = RENDER_SEED_BASE[split]
    return [EditRecord(source, instruction, base + i, f"images/{split}_{i:03d}.png")
            for i, (source, instruction) in enumerate(chosen)]
