"""The toy VIDEO world: worlds/toy/world.py's shapes, moving. A prompt names a count, a colour, a shape and a direction
("two blue circles moving down"); a clip is 5 frames of 32×32 in which the objects keep their size, colour and
shape and all move the same 2–3 px per frame that way. worlds/toy_video/reward.py checks each frame and the motion by
pixel analysis; `data/toy_video/model/` is a ~3 MB `WanPipeline` (the real diffusers/transformers classes)
pretrained on the renders by `worlds/toy_video/pretrain.py`.

    prompts    COUNT COLOUR SHAPE[s] moving DIRECTION: 2 × 4 × 3 × 4 = 96, of which a fixed 19 are held out
    renderer   `render_clip(prompt, rng)` -> (5, 32, 32, 3) uint8
    pipeline   `build_toy_video_pipeline()`: random init of the Wan components at toy sizes (pretrain.py trains them)
"""

import re
from dataclasses import dataclass

import numpy as np

from worlds.toy.world import COLOURS, REPO, RESOLUTION, SHAPES, _colour, placement_bounds
from worlds.toy_edit.world import draw_scene, place

TOY_VIDEO_DIR = REPO / "data" / "toy_video"
COUNTS = {"a": 1, "two": 2}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # unit (dx, dy), y down
NUM_FRAMES = 5  # 2k + 1 for the toy VAE's 2× temporal compression: latent frames [f0], [f1, f2], [f3, f4]
SPEED = (2.0, 3.0)  # px per frame at 32×32: 8–12 px over the clip, about one object side
MIN_SIZE, MAX_SIZE = 7, 9  # object sides (the image world's 7–10 less one: two must fit beside their path)
MAX_SEQUENCE_LENGTH = 16  # "three" is not a count here; the longest prompt is 5 words + EOS
TEST_FRACTION = 0.2
SPLIT_SEED = 0
FLOW_SHIFT = 5.0  # the scheduler's shift, as video checkpoints use (Wan2.1 720p: 5): σ stays near 1 early on

# The flags that put a script in the toy video world, shared by every script's `toy-video` preset: the shipped Wan
# model, its prompt split, the exact reward (mean of its six checks), no CFG (the toy model is trained without
# dropping the prompt), and evaluation on all 19 held-out prompts × 8 seeds.
TOY_VIDEO_WORLD = dict(model="wan", model_path="toy", dataset=str(TOY_VIDEO_DIR), reward=["toy_video"],
                       resolution=RESOLUTION, num_frames=NUM_FRAMES, max_sequence_length=MAX_SEQUENCE_LENGTH,
                       guidance_scale=1.0, eval_num_prompts=19, eval_seeds=8, eval_num_steps=8)


@dataclass(frozen=True)
class ClipPrompt:
    count: int
    colour: str
    shape: str
    direction: str  # a key of DIRECTIONS

    def text(self) -> str:
        word = {1: "a", 2: "two"}[self.count]
        return f"{word} {self.colour} {self.shape}{'s' if self.count > 1 else ''} moving {self.direction}"


_PROMPT = re.compile(rf"^(?P<count>{'|'.join(COUNTS)}) (?P<colour>{'|'.join(COLOURS)}) "
                     rf"(?P<shape>{'|'.join(SHAPES)})(?P<plural>s?) moving (?P<direction>{'|'.join(DIRECTIONS)})$")


def parse_clip_prompt(prompt: str) -> ClipPrompt:
    """The parts of a toy video prompt; ValueError for text outside the grammar (including "a red circles ...")."""
    match = _PROMPT.match(prompt.strip())
    if match is None or (match["plural"] == "s") != (match["count"] != "a"):
        raise ValueError(f"{prompt!r} is not a toy video prompt (COUNT COLOUR SHAPE[s] moving DIRECTION)")
    return ClipPrompt(COUNTS[match["count"]], match["colour"], match["shape"], match["direction"])


def video_prompts() -> list[str]:
    """All 96 prompts in grammar order (count, colour, shape, direction)."""
    return [ClipPrompt(n, colour, shape, direction).text()
            for n in COUNTS.values() for colour in COLOURS for shape in SHAPES for direction in DIRECTIONS]


def video_words() -> set[str]:
    return {word for prompt in video_prompts() for word in prompt.split()}


def video_split(seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """(train, test): a fixed 20% (19 prompts) held out at random, redrawn until every word still appears in
    training, so a held-out prompt is a new combination of known words."""
    prompts = video_prompts()
    rng = np.random.default_rng(seed)
    n_test = round(TEST_FRACTION * len(prompts))
    while True:
        held_out = set(rng.permutation(len(prompts))[:n_test].tolist())
        train = [p for i, p in enumerate(prompts) if i not in held_out]
        if {w for p in train for w in p.split()} == video_words():
            return train, [p for i, p in enumerate(prompts) if i in held_out]


def load_video_split() -> tuple[list[str], list[str]]:
    """The shipped split, data/toy_video/{train,test}.txt (written from `video_split()`)."""
    read = lambda name: [line for line in (TOY_VIDEO_DIR / name).read_text().splitlines() if line.strip()]  # noqa: E731
    return read("train.txt"), read("test.txt")


# ----- renderer ---------------------------------------------------------------------------------------------
def render_clip(prompt: str, rng: np.random.Generator, resolution: int = RESOLUTION,
                num_frames: int = NUM_FRAMES) -> np.ndarray:
    """The ground truth of a toy video prompt: (num_frames, resolution, resolution, 3) uint8. The objects are
    placed (non-overlapping, as worlds/toy/world.py places them) where their whole path stays inside the frame, then
    drawn at p0 + t · speed · direction in frame t, with one fill each for the whole clip."""
    spec = parse_clip_prompt(prompt)
    scale = resolution / RESOLUTION
    speed = np.floor(rng.uniform(*SPEED) * scale * 4) / 4  # a multiple of the renderer's 1/4-px supersampling
    travel = speed * (num_frames - 1)
    dx, dy = DIRECTIONS[spec.direction]
    # The start region: the frame less the path's length on the side the objects move toward.
    x0, y0, x1, y1 = 0, 0, resolution, resolution
    x0, x1 = x0 + travel * (dx < 0), x1 - travel * (dx > 0)
    y0, y1 = y0 + travel * (dy < 0), y1 - travel * (dy > 0)
    # placement_bounds keeps the border margin only where a region touches the frame's edge; the far end of the
    # path must keep it too, so the start region is shrunk by the margin there as well.
    margin = placement_bounds((0, 0, resolution, resolution), resolution)[0]
    x0, x1 = x0 + margin * (dx < 0), x1 - margin * (dx > 0)
    y0, y1 = y0 + margin * (dy < 0), y1 - margin * (dy > 0)
    while True:
        sizes = [np.floor(rng.uniform(MIN_SIZE, MAX_SIZE) * scale * 4) / 4 for _ in range(spec.count)]
        boxes = place(sizes, (x0, y0, x1, y1), resolution, rng)
        if boxes is not None:
            break
    fills = [_colour(spec.colour, rng) for _ in boxes]
    return np.stack([draw_scene(spec.shape, [(x + t * speed * dx, y + t * speed * dy, s) for x, y, s in boxes],
                                fills, resolution) for t in range(num_frames)])


def render_clips(prompts: list[str], rng: np.random.Generator, resolution: int = RESOLUTION,
                 num_frames: int = NUM_FRAMES):
    """Renders of `prompts` as a float32 torch tensor (B, F, 3, H, W) in [0, 1], the layout video rewards take."""
    import torch

    clips = np.stack([render_clip(p, rng, resolution, num_frames) for p in prompts])
    return torch.from_numpy(clips).permute(0, 1, 4, 2, 3).float() / 255


# ----- the pipeline ----------------------------------------------------------------------------------------
def build_toy_video_pipeline(seed: int = 0):
    """A randomly initialised `WanPipeline` at toy sizes (seeded). The Wan VAE with one downsampling stage that
    halves both space and time (32×32 × 5 frames -> 16×16 × 3 latent frames of 8 channels), a 4-layer Wan DiT of
    width 64 (4 heads × 16; rotary axes t/h/w = 8/4/4) on 2×2 patches (192 tokens), a 2-layer UMT5 at width 32
    (random and frozen, as in the toy world) with a tokenizer that holds each toy word as one token, and UniPC's
    flow schedule at FLOW_SHIFT."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from worlds.toy.world import toy_t5_tokenizer

    tokenizer = toy_t5_tokenizer(video_words())
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                               num_layers=2, relative_attention_num_buckets=8))
    # latents_mean / latents_std are placeholders: pretrain.py sets them from the trained encoder's latents.
    vae = AutoencoderKLWan(base_dim=16, z_dim=8, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[True], latents_mean=[0.0] * 8, latents_std=[1.0] * 8,
                           scale_factor_spatial=2, scale_factor_temporal=2)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
                                        in_channels=8, out_channels=8, text_dim=32, freq_dim=64, ffn_dim=256,
                                        num_layers=4, rope_max_seq_len=64)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)
