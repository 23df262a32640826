"""Regenerate the toy edit world's pretrained FLUX.1 Kontext pipeline, data/toy_edit/model/, on one CPU thread.

    python worlds/toy_edit/pretrain.py                          # the shipped recipe
    python worlds/toy_edit/pretrain.py --out /tmp/edit --steps 500

1. Start from the toy world's pipeline (data/toy/model/): its VAE, text encoders, tokenizers, scheduler and
   transformer, assembled unchanged into a `FluxKontextPipeline` (same components, no config change).
2. Render a pool of (source, target) pairs of the training edits (worlds/toy_edit/world.py) and VAE-encode both once:
   the condition latents exactly as the pipeline encodes a condition image (the VAE's mode, shifted and scaled:
   checked against `adapter.encode_prompts` on a render before training), the targets' posterior means likewise.
3. Train the transformer by rectified flow through the project's `FluxKontextAdapter.velocity` (the forward
   RL uses): x_σ = (1 − σ)·x0 + σ·ε with the condition's tokens appended, target v = ε − x0, logit-normal σ,
   AdamW with warm-up, an EMA of the weights, which is what is saved. Edit kinds are drawn 1 : 2 : 6 (recolour :
   reshape : move): a recolour is learned several times faster than a reshape, and a move slowest (drawn
   1 : 1 : 2, held-out recolour success was 0.84 at 1,000 steps while moves were at 0.06).
4. Score the EMA model on the held-out dataset lines (data/toy_edit/test.jsonl's pairs and source renders; Euler
   ODE) per edit kind, and write the pipeline atomically: a temporary folder next to the destination, renamed
   into place.

Deterministic for a given seed on one thread (renders, noise and σ all come from seeded generators; the learning
rate is constant after warm-up, so a shorter run is a prefix of a longer one). 1,500 steps leave the base model
mediocre, held-out strict success about 0.4 (docs/toy-edit-world.md), which leaves RL room in every kind.
"""

import argparse
import copy
import filecmp
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.models import load_adapter  # noqa: E402
from common.models.flux import FluxAdapter  # noqa: E402
from common.sampling import sample, sample_generators  # noqa: E402
from common.utils import folder_replaced_atomically, quiet_libraries  # noqa: E402
from worlds.toy.world import MAX_SEQUENCE_LENGTH, RESOLUTION, toy_model_path  # noqa: E402
from worlds.toy_edit.reward import ToyEditReward  # noqa: E402
from worlds.toy_edit.world import (KINDS, dataset_records, edit_split, instructions, parse_instruction,  # noqa: E402
                                   render_edit)

EVAL_STEPS = 8  # Euler ODE steps of the held-out evaluation (the adapter's `sigmas(8)`)
EVAL_SEEDS = 16  # samples per held-out line at the end (4 during training)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) renders -> (B, 3, H, W) floats in [0, 1]."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def format_checks(checks: dict[str, np.ndarray], kinds: np.ndarray) -> str:
    overall = " ".join(f"{name} {values.mean():.3f}" for name, values in checks.items())
    per_kind = " ".join(f"{kind} {checks['strict'][kinds == kind].mean():.3f}" for kind in KINDS)
    return f"{overall} | strict by kind: {per_kind}"


# ----- data --------------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_images(adapter, images: torch.Tensor) -> torch.Tensor:
    """Packed latents of images in [0, 1]: the VAE's mode, shifted and scaled, as `FluxKontextPipeline`
    (`_encode_vae_image`) encodes a condition image and as the transformer sees a clean target."""
    pipe = adapter.pipe
    latents = pipe._encode_vae_image(images * 2 - 1, generator=None)
    b, c, h, w = latents.shape
    return pipe._pack_latents(latents, b, c, h, w)


@torch.no_grad()
def render_pool(adapter, pairs: list[tuple[str, str]], per_pair: int, rng: np.random.Generator):
    """(condition latents, target latents, instruction index) of `per_pair` renders of each training pair, encoded
    once (rendering a pair costs more than a training step does)."""
    texts = instructions()
    conditions, targets, index = [], [], []
    chunk = 256
    jobs = [(source, instruction, int(rng.integers(2**62))) for _ in range(per_pair) for source, instruction in pairs]
    for start in range(0, len(jobs), chunk):
        renders = [render_edit(*job) for job in jobs[start:start + chunk]]
        conditions.append(encode_images(adapter, to_tensor([s for s, _ in renders])))
        targets.append(encode_images(adapter, to_tensor([t for _, t in renders])))
        index += [texts.index(instruction) for _, instruction, _ in jobs[start:start + chunk]]
    return torch.cat(conditions), torch.cat(targets), torch.tensor(index), [parse_instruction(j[1]).kind for j in jobs]


def check_encoding(adapter) -> None:
    """The pool's condition latents are what the adapter computes from a dataset line's PIL image."""
    from PIL import Image

    source, _ = render_edit("two red squares on the left", "make them green", 0)
    ours = encode_images(adapter, to_tensor([source]))
    theirs = adapter.encode_prompts(["make them green"], [[Image.fromarray(source)]])["image_latents"]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# ----- transformer -------------------------------------------------------------------------------------------
def pretrain_transformer(adapter, pairs, test_records, rng: np.random.Generator, args):
    """Rectified flow through `adapter.velocity` with the condition tokens appended; returns the EMA copy."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    log(f"rendering and encoding {args.pool} renders of each of {len(pairs)} training pairs")
    conditions, targets, index, kinds = render_pool(adapter, pairs, args.pool, rng)
    kinds = np.array(kinds)
    by_kind = [np.nonzero(kinds == kind)[0] for kind in KINDS]
    weights = np.array(args.kind_weights) / np.sum(args.kind_weights)
    with adapter.text_encoders_on_device():
        text = FluxAdapter.encode_prompts(adapter, instructions())  # the text part of the Kontext conditioning
    # The condition tokens' position ids (axis 0 = 1), as the adapter makes them for any 32×32 condition.
    blank = to_pil(np.zeros((RESOLUTION, RESOLUTION, 3)))
    image_ids = adapter.encode_prompts(["make it red"], [[blank]])["image_ids"]
    model = adapter.transformer.train().requires_grad_(True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    log(f"pool ready: {len(targets)} pairs; kinds drawn with weights {dict(zip(KINDS, weights.round(3)))}")
    started = time.process_time()
    for step in range(args.steps):
        # A kind per sample by `weights`, then a pool entry of that kind.
        kind = rng.choice(len(KINDS), size=args.batch, p=weights)
        pick = torch.from_numpy(np.array([by_kind[k][rng.integers(len(by_kind[k]))] for k in kind]))
        x0 = targets[pick]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(args.batch, generator=generator))  # logit-normal(0, 1)
        x_sigma = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        cond = {key: value[index[pick]] for key, value in text.items()}
        cond.update(image_latents=conditions[pick], image_ids=image_ids.expand(args.batch, -1, -1))
        v = adapter.velocity(x_sigma, sigma, cond, transformer=model)
        loss = F.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - args.ema)
        if step % 100 == 0 or step == args.steps - 1:
            log(f"step {step}/{args.steps} loss {loss.item():.4f} cpu {(time.process_time() - started) / 60:.1f} min")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            checks, test_kinds = evaluate(adapter, ema, test_records, seeds=range(4))
            log(f"step {step + 1} held-out (EMA, 4 seeds, {EVAL_STEPS} Euler steps): "
                f"{format_checks(checks, test_kinds)}")
    model.eval().requires_grad_(False)
    return ema


def to_pil(image: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.asarray(image, dtype=np.uint8))


@torch.no_grad()
def evaluate(adapter, transformer, records, seeds, num_steps: int = EVAL_STEPS, chunk: int = 128):
    """The reward's checks on every (line, seed), line-major, and each sample's edit kind. The conditioning comes
    from `adapter.encode_prompts` on the lines' source renders (what data/toy_edit/images/ holds)."""
    items = [(r, s) for r in records for s in seeds]
    sources = {r: render_edit(r.source, r.instruction, r.seed)[0] for r in records}
    images = []
    for start in range(0, len(items), chunk):
        batch = items[start:start + chunk]
        with adapter.text_encoders_on_device():
            cond = adapter.encode_prompts([r.instruction for r, _ in batch],
                                          [[to_pil(sources[r])] for r, _ in batch])
        noise = adapter.noise(sample_generators([s for _, s in batch], adapter.device))
        x0 = sample(lambda x, s, cond=cond: adapter.velocity(x, s, cond, transformer=transformer), noise,
                    adapter.sigmas(num_steps))
        images.append(adapter.decode(x0))
    conditions = [[to_tensor([sources[r]])[0]] for r, _ in items]
    checks = ToyEditReward().checks(torch.cat(images), [r.instruction for r, _ in items], conditions)
    return checks, np.array([r.kind for r, _ in items])


# ----- the recipe --------------------------------------------------------------------------------------------
def share_frozen_components(folder: Path, base: Path, out: Path) -> None:
    """Edit training changes only the transformer: replace each other weighted component of `folder` (to become `out`)
    by a relative link to the toy model's, after checking its weights are the same bytes, so the repository holds
    them once."""
    for name in ("text_encoder", "text_encoder_2", "vae"):
        mine, theirs = folder / name, base / name
        weights = sorted(theirs.glob("*.safetensors"))
        if weights and all(filecmp.cmp(mine / w.name, w, shallow=False) for w in weights):
            shutil.rmtree(mine)
            mine.symlink_to(os.path.relpath(theirs.resolve(), out.resolve()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=toy_model_path("flux1-kontext"))
    parser.add_argument("--base", type=Path, default=toy_model_path(), help="the toy world's FLUX.1 pipeline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500, help="transformer pretraining steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--pool", type=int, default=16, help="renders per training pair")
    parser.add_argument("--kind-weights", type=float, nargs=3, default=(1.0, 2.0, 6.0),
                        help="how often recolour, reshape and move edits are drawn, relatively")
    parser.add_argument("--eval-every", type=int, default=250)
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_libraries()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    from diffusers import FluxKontextPipeline, FluxPipeline

    train, _ = edit_split()
    test_records = dataset_records("test")
    start = time.process_time()
    with folder_replaced_atomically(args.out) as tmp:
        # The toy pipeline's components, unchanged, as a Kontext pipeline: the condition's tokens are appended.
        FluxKontextPipeline(**FluxPipeline.from_pretrained(args.base).components).save_pretrained(
            tmp, safe_serialization=True)
        adapter = load_adapter("flux1-kontext", str(tmp), "cpu", torch.float32, resolution=RESOLUTION,
                               max_sequence_length=MAX_SEQUENCE_LENGTH, condition_size=RESOLUTION)
        check_encoding(adapter)
        checks, kinds = evaluate(adapter, adapter.transformer, test_records, seeds=range(4))
        log(f"the toy model before edit training, held-out (4 seeds): {format_checks(checks, kinds)}")
        ema = pretrain_transformer(adapter, train, test_records, rng, args)
        adapter.pipe.transformer.load_state_dict(ema.state_dict())
        log(f"pretraining done, cpu {(time.process_time() - start) / 60:.1f} min in all")
        checks, kinds = evaluate(adapter, adapter.transformer, test_records, seeds=range(EVAL_SEEDS))
        log(f"held-out, {len(test_records)} lines x {EVAL_SEEDS} seeds, Euler ODE {EVAL_STEPS} steps: "
            f"{format_checks(checks, kinds)}")
        adapter.pipe.save_pretrained(tmp, safe_serialization=True)
        share_frozen_components(tmp, args.base, args.out)
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
