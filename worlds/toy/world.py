"""The toy world: a CPU-sized GenEval. Prompts name a count, a colour, a shape and optionally a half of the image
("two blue squares on the left"); images are 32×32 flat shapes on black. Everything about it is exact: the
renderer draws the ground truth, worlds/toy/reward.py checks an image by pixel analysis, and `data/toy/model/` is a
~3 MB FLUX.1 pipeline (the real diffusers/transformers classes) pretrained on the renders by
`worlds/toy/pretrain.py`, weak enough for RL to improve it on a CPU in minutes.

    prompts    COUNT COLOUR SHAPE[s] [POSITION]: 3 × 4 × 3 × 5 = 180, of which a fixed 36 are held out
    renderer   `render(prompt, rng)` -> (32, 32, 3) uint8, anti-aliased by 4× supersampling
    pipeline   `build_toy_pipeline()`: random init of the FLUX.1 components at toy sizes (pretrain.py trains them)
"""

import colorsys
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[2]
TOY_DIR = REPO / "data" / "toy"

COUNTS = {"a": 1, "two": 2, "three": 3}
COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("", "on the left", "on the right", "at the top", "at the bottom")
RESOLUTION = 32
# The tokens of the longest prompt, "three yellow triangles at the bottom", are 6 words + EOS = 7; the text
# encoders see a fixed 16 (pads change T5's output, as no attention mask is passed, so the length stays fixed).
MAX_SEQUENCE_LENGTH = 16
TEST_FRACTION = 0.2
SPLIT_SEED = 0

# The flags that put a script in the toy world, shared by every script's `toy` preset: the shipped model, its prompt
# split, the exact reward (mean of the five checks), and evaluation on all 36 held-out prompts × 4 seeds (one seed
# per prompt moves the strict success by ±0.05 by noise alone), with the blur ratio to the shipped model at 8 Euler
# steps (data/toy/teacher_hf.json; docs/toy-world.md).
TOY_WORLD = dict(model_path="toy", dataset=str(TOY_DIR), reward=["toy"], resolution=RESOLUTION,
                 max_sequence_length=MAX_SEQUENCE_LENGTH, eval_num_prompts=36, eval_seeds=4, eval_num_steps=8,
                 eval_hf_reference=str(TOY_DIR / "teacher_hf.json"))

# Centre hue (degrees) of each colour as drawn; worlds/toy/reward.py classifies hues into windows around these.
HUES = {"red": 0.0, "yellow": 55.0, "green": 120.0, "blue": 225.0}


@dataclass(frozen=True)
class ToyPrompt:
    count: int
    colour: str
    shape: str
    position: str  # "" (anywhere), "left", "right", "top" or "bottom"

    def text(self) -> str:
        word = {1: "a", 2: "two", 3: "three"}[self.count]
        noun = self.shape + ("s" if self.count > 1 else "")
        where = {"": "", "left": " on the left", "right": " on the right", "top": " at the top",
                 "bottom": " at the bottom"}[self.position]
        return f"{word} {self.colour} {noun}{where}"


_PROMPT = re.compile(
    rf"^(?P<count>{'|'.join(COUNTS)}) (?P<colour>{'|'.join(COLOURS)}) (?P<shape>{'|'.join(SHAPES)})(?P<plural>s?)"
    r"(?: (?:on the (?P<side>left|right)|at the (?P<end>top|bottom)))?$")


def parse_prompt(prompt: str) -> ToyPrompt:
    """The parts of a toy prompt; ValueError for text outside the grammar (including "a red circles")."""
    match = _PROMPT.match(prompt.strip())
    if match is None or (match["plural"] == "s") != (match["count"] != "a"):
        raise ValueError(f"{prompt!r} is not a toy prompt (COUNT COLOUR SHAPE[s] [POSITION])")
    return ToyPrompt(COUNTS[match["count"]], match["colour"], match["shape"], match["side"] or match["end"] or "")


def toy_prompts() -> list[str]:
    """All 180 prompts in grammar order (count, colour, shape, position)."""
    return [ToyPrompt(n, colour, shape, position).text()
            for n in (1, 2, 3) for colour in COLOURS for shape in SHAPES
            for position in ("", "left", "right", "top", "bottom")]


def toy_words() -> set[str]:
    return {word for prompt in toy_prompts() for word in prompt.split()}


def toy_split(seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """(train, test): a fixed 20% (36 prompts) held out at random, redrawn until every word of the grammar still
    appears in training, so a held-out prompt is a new combination of known words, never an unknown word."""
    prompts = toy_prompts()
    rng = np.random.default_rng(seed)
    n_test = round(TEST_FRACTION * len(prompts))
    while True:
        held_out = set(rng.permutation(len(prompts))[:n_test].tolist())
        train = [p for i, p in enumerate(prompts) if i not in held_out]
        if {w for p in train for w in p.split()} == toy_words():
            return train, [p for i, p in enumerate(prompts) if i in held_out]


def load_toy_split() -> tuple[list[str], list[str]]:
    """The shipped split, data/toy/{train,test}.txt (written from `toy_split()`)."""
    read = lambda name: [line for line in (TOY_DIR / name).read_text().splitlines() if line.strip()]  # noqa: E731
    return read("train.txt"), read("test.txt")


# ----- renderer ---------------------------------------------------------------------------------------------
SUPERSAMPLE = 4  # draw at 4× and box-filter down: exact area coverage in 1/16 steps, i.e. anti-aliased edges
MIN_SIZE, MAX_SIZE = 7, 10  # object side in pixels at 32×32 (three must fit in one half with gaps)
GAP = 2  # pixels between objects' boxes, so anti-aliased edges never join two objects into one component
MARGIN = 1  # pixels kept free along the image border


def _region(position: str, resolution: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) in pixels that every object of `position` must lie inside."""
    half = resolution // 2
    return {"": (0, 0, resolution, resolution), "left": (0, 0, half, resolution),
            "right": (half, 0, resolution, resolution), "top": (0, 0, resolution, half),
            "bottom": (0, half, resolution, resolution)}[position]


def placement_bounds(region, resolution: int) -> tuple[float, float, float, float, float]:
    """`region` less the border margin where it touches the image's edge, and the gap between boxes, in pixels."""
    scale = resolution / RESOLUTION
    x0, y0, x1, y1 = region
    x0, y0 = x0 + MARGIN * scale * (x0 == 0), y0 + MARGIN * scale * (y0 == 0)
    x1, y1 = x1 - MARGIN * scale * (x1 == resolution), y1 - MARGIN * scale * (y1 == resolution)
    return x0, y0, x1, y1, GAP * scale


def _layout(count: int, region, resolution: int, rng: np.random.Generator) -> list[tuple[float, float, float]]:
    """`count` non-overlapping squares (x, y, side) in pixels (multiples of 1/SUPERSAMPLE), inside `region`.
    Rejection sampling; sizes are redrawn after a run of failed placements (three big ones may not fit a half)."""
    scale = resolution / RESOLUTION
    x0, y0, x1, y1, gap = placement_bounds(region, resolution)
    quantize = lambda v: np.floor(v * SUPERSAMPLE) / SUPERSAMPLE  # noqa: E731
    while True:
        sizes = [quantize(rng.uniform(MIN_SIZE, MAX_SIZE) * scale) for _ in range(count)]
        for _ in range(50):
            boxes = []
            for size in sizes:
                x = quantize(rng.uniform(x0, x1 - size))
                y = quantize(rng.uniform(y0, y1 - size))
                if all(x + size + gap <= bx or bx + bs + gap <= x or y + size + gap <= by or by + bs + gap <= y
                       for bx, by, bs in boxes):
                    boxes.append((x, y, size))
                else:
                    break
            if len(boxes) == count:
                return boxes


def _colour(name: str, rng: np.random.Generator) -> tuple[int, int, int]:
    """A saturated, bright variant of `name` (a little jitter in hue, saturation and value, for variety)."""
    hue = (HUES[name] + rng.uniform(-6, 6)) % 360 / 360
    r, g, b = colorsys.hsv_to_rgb(hue, rng.uniform(0.8, 0.95), rng.uniform(0.85, 1.0))
    return round(255 * r), round(255 * g), round(255 * b)


def render(prompt: str, rng: np.random.Generator, resolution: int = RESOLUTION) -> np.ndarray:
    """The ground truth of a toy prompt: (resolution, resolution, 3) uint8, flat anti-aliased shapes on black,
    non-overlapping, inside the requested half when the prompt names one. Triangles point up."""
    spec = parse_prompt(prompt)
    size = resolution * SUPERSAMPLE
    canvas = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(canvas)
    for x, y, side in _layout(spec.count, _region(spec.position, resolution), resolution, rng):
        fill = _colour(spec.colour, rng)
        # PIL's boxes include their last pixel: subtract one supersampled pixel so the side is exact.
        x, y, s = x * SUPERSAMPLE, y * SUPERSAMPLE, side * SUPERSAMPLE
        if spec.shape == "circle":
            draw.ellipse([x, y, x + s - 1, y + s - 1], fill=fill)
        elif spec.shape == "square":
            draw.rectangle([x, y, x + s - 1, y + s - 1], fill=fill)
        else:
            draw.polygon([(x + (s - 1) / 2, y), (x + s - 1, y + s - 1), (x, y + s - 1)], fill=fill)
    return np.asarray(canvas.resize((resolution, resolution), Image.Resampling.BOX))


def render_batch(prompts: list[str], rng: np.random.Generator, resolution: int = RESOLUTION):
    """Renders of `prompts` as a float32 torch tensor (B, 3, H, W) in [0, 1], the layout rewards take."""
    import torch

    images = np.stack([render(p, rng, resolution) for p in prompts])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255


def toy_model_path(model: str = "flux1") -> Path:
    """The shipped pretrained toy pipeline of `model` (`--model-path toy`: the registry's `toy` column): FLUX.1 (the
    toy world, data/toy/model/), FLUX.1 Kontext (the toy edit world) and Wan (the toy video world)."""
    from common.models import resolve_model_path

    return Path(resolve_model_path(model, "toy"))


# ----- the pipeline ----------------------------------------------------------------------------------------
# `worlds/toy/pretrain.py` builds these with a fixed seed, trains the VAE and the transformer, and saves the
# pipeline. The text encoders stay as initialised: random but frozen, they still map each prompt to a distinct
# embedding, and the transformer's input projections learn to read it.
def _toy_bpe_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges learned on the toy words (most frequent pair first, ties by the pair), until each word is
    one token. Merges learned this way re-encode every training word into the same single token; chaining each
    word's letters independently would not, since BPE applies the globally lowest-ranked merge first."""
    from collections import Counter

    pieces = {word: list(word[:-1]) + [word[-1] + "</w>"] for word in words}
    merges = []
    while any(len(p) > 1 for p in pieces.values()):
        pairs = Counter(pair for p in pieces.values() for pair in zip(p, p[1:]))
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word, p in pieces.items():
            merged, i = [], 0
            while i < len(p):
                if i + 1 < len(p) and (p[i], p[i + 1]) == best:
                    merged.append(p[i] + p[i + 1])
                    i += 2
                else:
                    merged.append(p[i])
                    i += 1
            pieces[word] = merged
    return merges


def toy_clip_tokenizer():
    """A CLIP BPE tokenizer in which each toy word is one token (other text falls back to characters)."""
    from transformers import CLIPTokenizer

    from common.models.tiny_parts import _characters

    merges = _toy_bpe_merges(sorted(toy_words()))
    pieces = ["<|startoftext|>", "<|endoftext|>"] + _characters() + [c + "</w>" for c in _characters()]
    pieces += [a + b for a, b in merges if a + b not in pieces]
    return CLIPTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                         model_max_length=MAX_SEQUENCE_LENGTH)


def toy_t5_tokenizer(words=None):
    """A unigram T5 tokenizer (ids 0/1/2 = pad/eos/unk) in which each toy word (or each of `words`) is one piece:
    whole words score higher than their spelling in characters, which remain as a fallback for other text."""
    from transformers import T5Tokenizer

    from common.models.tiny_parts import _characters

    vocab = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    vocab.update({"▁" + word: -1.0 for word in sorted(toy_words() if words is None else words)})
    for c in _characters():
        vocab.setdefault("▁" + c, -2.5)
        vocab.setdefault(c, -3.0)
    return T5Tokenizer(vocab=list(vocab.items()), extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)


def build_toy_pipeline(seed: int = 0):
    """A randomly initialised FLUX.1 pipeline at toy sizes (seeded): ~0.46M-parameter transformer, ~0.16M VAE.

    The shapes follow FLUX.1's constraints: in_channels = 4 × latent channels (2×2 packing), the rotary axes
    sum to the head dimension, the pooled projection reads the CLIP width and the joint attention the T5 width.
    The VAE has two blocks, so it downsamples 2× (32×32 images -> 16×16 latents -> 64 packed tokens) and the
    pipeline needs sides divisible by 2 × 2 = 4. No guidance embedding: the toy model is not distilled."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = toy_clip_tokenizer(), toy_t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=MAX_SEQUENCE_LENGTH, projection_dim=32,
        # The pooled output is read at the first EOS: the config must name the tokenizer's EOS id.
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
        relative_attention_num_buckets=8,
    ))
    # scaling_factor / shift_factor are placeholders: pretrain.py sets them from the trained encoder's latents.
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[16, 32], layers_per_block=1, mid_block_add_attention=False,
        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    # FLUX.1's resolution-dependent shift, rescaled to toy sizes: 64 tokens (32×32) get the base shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=64, max_image_seq_len=1024,
    )
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
