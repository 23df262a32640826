"""Regenerate the toy world's pretrained FLUX.1 pipeline, data/toy/model/, from scratch on one CPU thread.

    python worlds/toy/pretrain.py                      # the shipped recipe (about an hour of CPU on one thread)
    python worlds/toy/pretrain.py --out /tmp/toy --steps 500
    python worlds/toy/pretrain.py --continue-from data/toy/model --out /tmp/toy-sft --steps 4000 --pool 32
                                                       # supervised fine-tuning of the shipped model (its ceiling)

1. Build the pipeline (worlds/toy/world.py `build_toy_pipeline`) with a fixed seed: random frozen text encoders.
2. Train the VAE on renders of the training prompts: the whole VAE first, then the decoder alone with the
   encoder frozen (the latent space the transformer will learn is then fixed, and the decoder sharpens on it).
   Set `shift_factor`/`scaling_factor` from the encoder's latents so that the transformer sees unit variance.
3. Save, load through the project's own `FluxAdapter` and pretrain the transformer by rectified flow through
   `adapter.velocity` (the forward the RL scripts use): x_σ = (1 − σ)·x0 + σ·ε, target v = ε − x0, logit-normal
   σ, AdamW with warm-up, an EMA of the weights, which is what is saved.
4. Score the EMA model on the held-out prompts (Euler ODE) and write the pipeline atomically: a temporary folder
   next to the destination, renamed into place.

Deterministic for a given seed on one thread (renders, noise and σ all come from seeded generators).
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.models import load_adapter  # noqa: E402
from common.sampling import sample, sample_generators  # noqa: E402
from common.utils import folder_replaced_atomically, quiet_libraries  # noqa: E402
from worlds.toy.reward import ToyReward  # noqa: E402
from worlds.toy.world import (MAX_SEQUENCE_LENGTH, RESOLUTION, build_toy_pipeline, load_toy_split,  # noqa: E402
                              render_batch, toy_model_path)

EVAL_STEPS = 8  # Euler ODE steps of the held-out evaluation (the adapter's `sigmas(8)`)
EVAL_SEEDS = 16  # samples per held-out prompt


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def format_checks(checks: dict[str, np.ndarray]) -> str:
    return " ".join(f"{name} {values.mean():.3f}" for name, values in checks.items())


# ----- VAE ---------------------------------------------------------------------------------------------------
def train_vae(vae, prompts: list[str], rng: np.random.Generator, full_steps: int, decoder_steps: int,
              batch: int, lr: float) -> None:
    """Reconstruction (MSE + L1 on [-1, 1] images) plus a light KL, on fresh renders every step. The decoder
    phase sees posterior samples of the frozen encoder, the latents the transformer will learn to generate."""
    vae.train().requires_grad_(True)
    for phase, steps in (("vae", full_steps), ("decoder", decoder_steps)):
        if phase == "decoder":
            vae.encoder.requires_grad_(False)
        params = [p for p in vae.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
        generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
        for step in range(steps):
            images = render_batch(list(rng.choice(prompts, batch)), rng) * 2 - 1
            posterior = vae.encode(images).latent_dist
            latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
            recon = vae.decode(latents).sample
            loss = F.mse_loss(recon, images) + 0.1 * F.l1_loss(recon, images)
            if phase == "vae":
                loss = loss + 1e-5 * posterior.kl().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"{phase} step {step}/{steps} loss {loss.item():.4f}")
    vae.eval().requires_grad_(False)


@torch.no_grad()
def vae_report(vae, prompts: list[str], rng: np.random.Generator, reward: ToyReward) -> dict[str, np.ndarray]:
    """The reward's checks on reconstructions (posterior means) of fresh renders: the ceiling of the pipeline."""
    images = render_batch(prompts, rng)
    recon = vae.decode(vae.encode(images * 2 - 1).latent_dist.mean).sample
    return reward.checks((recon / 2 + 0.5).clamp(0, 1), prompts)


@torch.no_grad()
def set_latent_scaling(vae, prompts: list[str], rng: np.random.Generator) -> None:
    """shift_factor / scaling_factor from latents of renders, as FLUX's VAE config holds them: the transformer
    works on (z − shift) · scale, of mean 0 and variance 1."""
    images = render_batch(prompts, rng) * 2 - 1
    latents = vae.encode(images).latent_dist.mean
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    log(f"latent shift_factor {shift:.4f} scaling_factor {scale:.4f}")


# ----- transformer -------------------------------------------------------------------------------------------
@torch.no_grad()
def render_pool(adapter, prompts: list[str], per_prompt: int, rng: np.random.Generator):
    """Latents of `per_prompt` renders of each prompt, encoded once (rendering costs as much as a training step,
    so the transformer draws from this pool). Posterior means, not samples: the light KL leaves the posterior
    wide (std ≈ 0.7 against a spread of the means ≈ 0.6) where the decoder ignores the latent, and samples would
    make the transformer spend itself on noise that the decoder (trained on samples) throws away."""
    latents, index = [], []
    for start in range(0, per_prompt, 16):
        for i, prompt in enumerate(prompts):
            n = min(16, per_prompt - start)
            latents.append(adapter.vae.encode(render_batch([prompt] * n, rng) * 2 - 1).latent_dist.mean)
            index += [i] * n
    return torch.cat(latents), torch.tensor(index)


def pretrain_transformer(adapter, prompts: list[str], test_prompts: list[str], rng: np.random.Generator,
                         steps: int, batch: int, lr: float, warmup: int, ema_decay: float, pool: int,
                         eval_every: int):
    """Rectified flow through `adapter.velocity`; returns the EMA copy of the transformer."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    log(f"rendering and encoding {pool} images per training prompt")
    pool_latents, index = render_pool(adapter, prompts, pool, rng)
    with adapter.text_encoders_on_device():
        cond = adapter.encode_prompts(prompts)
    vae_config = adapter.vae.config
    model = adapter.transformer.train().requires_grad_(True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    c, h, w = pool_latents.shape[1:]
    started = time.process_time()
    for step in range(steps):
        pick = torch.from_numpy(rng.integers(len(pool_latents), size=batch))
        x0 = (pool_latents[pick] - vae_config.shift_factor) * vae_config.scaling_factor
        x0 = adapter.pipe._pack_latents(x0, batch, c, h, w)
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(batch, generator=generator))  # logit-normal(0, 1)
        x_sigma = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        batch_cond = {key: value[index[pick]] for key, value in cond.items()}
        v = adapter.velocity(x_sigma, sigma, batch_cond, transformer=model)
        loss = F.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - ema_decay)
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.4f} cpu {(time.process_time() - started) / 60:.1f} min")
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            checks = evaluate(adapter, ema, test_prompts, seeds=range(4))
            log(f"step {step + 1} held-out (EMA, 4 seeds, {EVAL_STEPS} Euler steps): {format_checks(checks)}")
    model.eval().requires_grad_(False)
    return ema


@torch.no_grad()
def generate(adapter, transformer, prompts: list[str], seeds, num_steps: int = EVAL_STEPS) -> torch.Tensor:
    """Euler-ODE samples (B, 3, H, W) in [0, 1] of `prompts` with one seed each (common.sampling)."""
    with adapter.text_encoders_on_device():
        cond = adapter.encode_prompts(prompts)
    noise = adapter.noise(sample_generators(seeds, adapter.device))
    x0 = sample(lambda x, s: adapter.velocity(x, s, cond, transformer=transformer), noise, adapter.sigmas(num_steps))
    return adapter.decode(x0)


def evaluate(adapter, transformer, prompts: list[str], seeds, num_steps: int = EVAL_STEPS, chunk: int = 144):
    """The reward's checks on every (prompt, seed) pair, prompt-major."""
    pairs = [(p, s) for p in prompts for s in seeds]
    images = torch.cat([generate(adapter, transformer, [p for p, _ in pairs[i:i + chunk]],
                                 [s for _, s in pairs[i:i + chunk]], num_steps) for i in range(0, len(pairs), chunk)])
    return ToyReward().checks(images, [p for p, _ in pairs])


# ----- the recipe --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=toy_model_path())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=400, help="steps training the whole VAE")
    parser.add_argument("--decoder-steps", type=int, default=400, help="then steps training the decoder alone")
    parser.add_argument("--steps", type=int, default=6000, help="transformer pretraining steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--pool", type=int, default=128, help="renders per training prompt for the transformer")
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--continue-from", type=Path, default=None,
                        help="a toy pipeline to fine-tune further on the same renders (its VAE kept; no VAE training)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_libraries()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train, test = load_toy_split()
    reward = ToyReward()
    start = time.process_time()

    if args.continue_from is not None:  # supervised fine-tuning: that pipeline, its transformer trained further
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.continue_from)
    else:
        pipe = build_toy_pipeline(args.seed)
        log(f"VAE: {args.vae_steps} steps, then {args.decoder_steps} decoder steps")
        train_vae(pipe.vae, train, rng, args.vae_steps, args.decoder_steps, args.batch, args.lr)
        log(f"VAE reconstructions, held-out prompts x 16: {format_checks(vae_report(pipe.vae, test * 16, rng, reward))}")
        set_latent_scaling(pipe.vae, train * 8, rng)
        log(f"VAE done, cpu {(time.process_time() - start) / 60:.1f} min")

    with folder_replaced_atomically(args.out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        adapter = load_adapter("flux1", str(tmp), "cpu", torch.float32, resolution=RESOLUTION,
                               max_sequence_length=MAX_SEQUENCE_LENGTH)
        ema = pretrain_transformer(adapter, train, test, rng, args.steps, args.batch, args.lr, args.warmup,
                                   args.ema, args.pool, args.eval_every)
        adapter.pipe.transformer.load_state_dict(ema.state_dict())
        log(f"pretraining done, cpu {(time.process_time() - start) / 60:.1f} min in all")
        checks = evaluate(adapter, adapter.transformer, test, seeds=range(EVAL_SEEDS))
        log(f"held-out, {len(test)} prompts x {EVAL_SEEDS} seeds, Euler ODE {EVAL_STEPS} steps: "
            f"{format_checks(checks)}")
        adapter.pipe.save_pretrained(tmp, safe_serialization=True)
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
