"""Regenerate the toy video world's pretrained Wan pipeline, data/toy_video/model/, from scratch on one CPU thread.

    python worlds/toy_video/pretrain.py                      # the shipped recipe (about 60 CPU-minutes)
    python worlds/toy_video/pretrain.py --out /tmp/toy-video --steps 500
    python worlds/toy_video/pretrain.py --vae-from data/toy_video/model --out /tmp/tv --snapshots /tmp/tv-snapshots
                                                     # the transformer alone, on the shipped VAE

1. Build the pipeline (worlds/toy_video/world.py `build_toy_video_pipeline`) with a fixed seed: a random frozen UMT5.
2. Train the Wan VAE on 5-frame renders of the training prompts: the whole VAE, then the decoder alone with the
   encoder frozen (the latent space the transformer learns is then fixed). Set `latents_mean`/`latents_std` per
   channel from the encoder's latents, so that the transformer sees unit variance (WanPipeline's convention).
3. Save, load through the project's own `WanAdapter` and pretrain the transformer by rectified flow through
   `adapter.velocity` (the forward the RL scripts use): x_σ = (1 − σ)·x0 + σ·ε, target v = ε − x0, σ at the
   scheduler's shift (uniform t, then σ = 5t / (1 + 4t)), AdamW with warm-up, an EMA of the weights, which is what
   is saved.
4. Score the EMA model on the held-out prompts (Euler ODE on the scheduler's σ) and write the pipeline atomically:
   a temporary folder next to the destination, renamed into place.

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
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.models import load_adapter  # noqa: E402
from common.sampling import sample, sample_generators  # noqa: E402
from common.utils import folder_replaced_atomically, quiet_libraries  # noqa: E402
from worlds.toy.world import toy_model_path  # noqa: E402
from worlds.toy_video.reward import ToyVideoReward  # noqa: E402
from worlds.toy_video.world import (FLOW_SHIFT, MAX_SEQUENCE_LENGTH, NUM_FRAMES, RESOLUTION,  # noqa: E402
                                    build_toy_video_pipeline, load_video_split, render_clips)

EVAL_STEPS = 8  # Euler ODE steps of the held-out evaluation (the adapter's `sigmas(8)`)
EVAL_SEEDS = 16  # samples per held-out prompt


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def format_checks(checks: dict[str, np.ndarray]) -> str:
    return " ".join(f"{name} {values.mean():.3f}" for name, values in checks.items())


def clips_for_vae(prompts: list[str], rng: np.random.Generator) -> torch.Tensor:
    """Renders in the VAE's layout (B, 3, F, H, W) in [-1, 1]."""
    return (render_clips(prompts, rng) * 2 - 1).permute(0, 2, 1, 3, 4)


# ----- VAE ---------------------------------------------------------------------------------------------------
FOREGROUND_WEIGHT = 4.0  # extra loss weight on object pixels (a few per cent of a clip)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`AutoencoderKLWan.decode` without its final clamp to [-1, 1]: the clamp passes no gradient to pixels pushed
    below −1, so a decoder that once paints everything black (most pixels are) never learns the objects back (a
    first recipe with the clamp ended with every reconstruction empty). Same causal per-latent-frame loop."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def train_vae(vae, prompts: list[str], test_prompts: list[str], rng: np.random.Generator, full_steps: int,
              decoder_steps: int, batch: int, lr: float) -> None:
    """Reconstruction (MSE + L1 on [-1, 1] clips, object pixels weighted up) plus a light KL, on fresh renders
    every step; the decoder phase sees posterior samples of the frozen encoder, the latents the transformer will
    learn to generate."""
    reward = ToyVideoReward()
    for phase, steps in (("vae", full_steps), ("decoder", decoder_steps)):
        vae.train().requires_grad_(True)
        if phase == "decoder":
            vae.encoder.requires_grad_(False)
            vae.quant_conv.requires_grad_(False)
        params = [p for p in vae.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
        generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
        for step in range(steps):
            clips = clips_for_vae(list(rng.choice(prompts, batch)), rng)
            posterior = vae.encode(clips).latent_dist
            latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
            error = decode_unclamped(vae, latents) - clips
            weight = 1 + FOREGROUND_WEIGHT * (clips.amax(1, keepdim=True) > -0.9).float()
            loss = (weight * error ** 2).mean() + 0.1 * (weight * error.abs()).mean()
            if phase == "vae":
                loss = loss + 1e-5 * posterior.kl().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"{phase} step {step}/{steps} loss {loss.item():.4f}")
            if step % 200 == 199:
                vae.eval()
                log(f"{phase} step {step + 1} reconstructions, held-out x 2: "
                    f"{format_checks(vae_report(vae, test_prompts * 2, rng, reward))}")
                vae.train()
    vae.eval().requires_grad_(False)


@torch.no_grad()
def vae_report(vae, prompts: list[str], rng: np.random.Generator, reward) -> dict[str, np.ndarray]:
    """The reward's checks on reconstructions (posterior means) of fresh renders: the ceiling of the pipeline."""
    recon = torch.cat([vae.decode(vae.encode(clips_for_vae(prompts[i:i + 32], rng)).latent_dist.mean).sample
                       for i in range(0, len(prompts), 32)])
    return reward.checks((recon.permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1), prompts)


@torch.no_grad()
def set_latent_scaling(vae, prompts: list[str], rng: np.random.Generator) -> None:
    """latents_mean / latents_std per channel from latents of renders, as Wan's VAE config holds them: the
    transformer works on (z − mean) / std."""
    latents = torch.cat([vae.encode(clips_for_vae(prompts[i:i + 32], rng)).latent_dist.mean
                         for i in range(0, len(prompts), 32)])
    mean, std = latents.mean((0, 2, 3, 4)), latents.std((0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(v, 4) for v in mean.tolist()],
                           latents_std=[round(v, 4) for v in std.tolist()])
    log(f"latents_mean {vae.config.latents_mean} latents_std {vae.config.latents_std}")


# ----- transformer -------------------------------------------------------------------------------------------
@torch.no_grad()
def render_pool(adapter, prompts: list[str], per_prompt: int, rng: np.random.Generator):
    """Normalised latents of `per_prompt` renders of each prompt, encoded once (posterior means, as the toy
    world's recipe explains: samples would spend the transformer on noise the decoder ignores)."""
    config = adapter.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    latents, index = [], []
    for start in range(0, per_prompt, 16):
        for i, prompt in enumerate(prompts):
            n = min(16, per_prompt - start)
            raw = adapter.vae.encode(clips_for_vae([prompt] * n, rng)).latent_dist.mean
            latents.append((raw - mean) / std)
            index += [i] * n
    return torch.cat(latents), torch.tensor(index)


def shifted_sigmas(batch: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """σ = s·t / (1 + (s − 1)·t) of t uniform in (0, 1): the density of the σ's an N-step sampler on the scheduler's
    shifted schedule visits, for any N (at shift 5, 8 steps never evaluate below σ = 0.42; a logit-normal σ
    would spend half of the training below 0.5)."""
    t = torch.rand(batch, generator=generator)
    return shift * t / (1 + (shift - 1) * t)


def pretrain_transformer(adapter, prompts: list[str], test_prompts: list[str], rng: np.random.Generator,
                         steps: int, batch: int, lr: float, warmup: int, ema_decay: float, pool: int,
                         eval_every: int, shift: float, snapshots: Path | None = None):
    """Rectified flow through `adapter.velocity`; returns the EMA copy of the transformer."""
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    log(f"rendering and encoding {pool} clips per training prompt")
    pool_latents, index = render_pool(adapter, prompts, pool, rng)
    with adapter.text_encoders_on_device():
        cond = adapter.encode_prompts(prompts)
    model = adapter.transformer.train().requires_grad_(True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    started = time.process_time()
    for step in range(steps):
        pick = torch.from_numpy(rng.integers(len(pool_latents), size=batch))
        x0 = pool_latents[pick]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = shifted_sigmas(batch, shift, generator)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_sigma = (1 - s) * x0 + s * noise
        batch_cond = {key: value[index[pick]] for key, value in cond.items()}
        v = adapter.velocity(x_sigma, sigma, batch_cond, guidance_scale=1.0, transformer=model)
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
            checks = evaluate(adapter, ema, test_prompts, seeds=range(4), num_steps=2 * EVAL_STEPS)
            log(f"step {step + 1} held-out (EMA, 4 seeds, {2 * EVAL_STEPS} Euler steps): {format_checks(checks)}")
            if snapshots is not None:  # to pick a weaker base by its held-out score, if the final one is too strong
                snapshots.mkdir(parents=True, exist_ok=True)
                save_file(ema.state_dict(), snapshots / f"transformer-{step + 1}.safetensors")
    model.eval().requires_grad_(False)
    return ema


@torch.no_grad()
def generate(adapter, transformer, prompts: list[str], seeds, num_steps: int = EVAL_STEPS) -> torch.Tensor:
    """Euler-ODE clips (B, F, 3, H, W) in [0, 1] of `prompts` with one seed each (common.sampling)."""
    with adapter.text_encoders_on_device():
        cond = adapter.encode_prompts(prompts)
    noise = adapter.noise(sample_generators(seeds, adapter.device))
    x0 = sample(lambda x, s: adapter.velocity(x, s, cond, guidance_scale=1.0, transformer=transformer), noise,
                adapter.sigmas(num_steps))
    return adapter.decode(x0)


def evaluate(adapter, transformer, prompts: list[str], seeds, num_steps: int = EVAL_STEPS, chunk: int = 64):
    """The reward's checks on every (prompt, seed) pair, prompt-major."""
    pairs = [(p, s) for p in prompts for s in seeds]
    clips = torch.cat([generate(adapter, transformer, [p for p, _ in pairs[i:i + chunk]],
                                [s for _, s in pairs[i:i + chunk]], num_steps) for i in range(0, len(pairs), chunk)])
    return ToyVideoReward().checks(clips, [p for p, _ in pairs])


# ----- the recipe --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=toy_model_path("wan"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-from", type=Path, default=None,
                        help="take the VAE of this pipeline folder (an earlier run's) instead of training one")
    parser.add_argument("--vae-steps", type=int, default=2000, help="steps training the whole VAE")
    parser.add_argument("--decoder-steps", type=int, default=500, help="then steps training the decoder alone")
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=6000, help="transformer pretraining steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3, help="the transformer's")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--shift", type=float, default=FLOW_SHIFT, help="time shift of the training σ")
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--pool", type=int, default=64, help="renders per training prompt for the transformer")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--snapshots", type=Path, default=None, help="save the EMA transformer at every evaluation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet_libraries()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train, test = load_video_split()
    reward = ToyVideoReward()
    start = time.process_time()

    pipe = build_toy_video_pipeline(args.seed)
    if args.vae_from is not None:
        from diffusers import AutoencoderKLWan

        pipe.vae = AutoencoderKLWan.from_pretrained(args.vae_from, subfolder="vae")
        log(f"VAE of {args.vae_from}")
    else:
        log(f"VAE: {args.vae_steps} steps, then {args.decoder_steps} decoder steps")
        train_vae(pipe.vae, train, test, rng, args.vae_steps, args.decoder_steps, args.vae_batch, args.vae_lr)
        log(f"VAE reconstructions, held-out x 8: {format_checks(vae_report(pipe.vae, test * 8, rng, reward))}")
        set_latent_scaling(pipe.vae, train * 4, rng)
        log(f"VAE done, cpu {(time.process_time() - start) / 60:.1f} min")
    # The transformer's own stream of renders and noise: the same whether the VAE was trained here or taken
    rng = np.random.default_rng([args.seed, 1])

    with folder_replaced_atomically(args.out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        adapter = load_adapter("wan", str(tmp), "cpu", torch.float32, resolution=RESOLUTION,
                               max_sequence_length=MAX_SEQUENCE_LENGTH, num_frames=NUM_FRAMES)
        ema = pretrain_transformer(adapter, train, test, rng, args.steps, args.batch, args.lr, args.warmup,
                                   args.ema, args.pool, args.eval_every, args.shift, args.snapshots)
        adapter.pipe.transformer.load_state_dict(ema.state_dict())
        log(f"pretraining done, cpu {(time.process_time() - start) / 60:.1f} min in all")
        checks = evaluate(adapter, adapter.transformer, test, seeds=range(EVAL_SEEDS))
        log(f"held-out, {len(test)} prompts x {EVAL_SEEDS} seeds, Euler ODE {EVAL_STEPS} steps: "
            f"{format_checks(checks)}")
        adapter.pipe.save_pretrained(tmp, safe_serialization=True)
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
