"""One denoising step x(σ) -> x(σ') with its Gaussian mean, std and log-prob (algorithms.md §2).

Conventions: x_σ = (1 − σ)·x0 + σ·ε, the network predicts v ≈ ε − x0, sampling runs σ = 1 → 0, so
dt = σ' − σ < 0. All math is float32 whatever the inputs' dtype.

Log-probs are a MEAN over all non-batch elements, not a sum (Flow-GRPO's convention). That is why PPO
clip ranges for these models are tiny (1e-4): a ratio of exp(mean) moves ~1/num_elements as fast.
"""

import math

import torch
from diffusers.utils.torch_utils import randn_tensor

DYNAMICS = ("ode", "flow-sde", "dance-sde", "cps")


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """A float or (batch,) tensor as float32, shaped to broadcast over `like`'s non-batch dims."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def _mean_over_elements(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def sde_step(
    dynamics: str,
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
):
    """Step `sample` at σ to σ' given the model `velocity`.

    Returns (prev_sample, log_prob, mean, std):
      prev_sample  x', drawn from N(mean, std²) unless given (then log_prob re-evaluates it). A drawn x' is
                   rounded through `sample.dtype`, so rollout and training score identical numbers.
      log_prob     (batch,) mean over elements; NaN for `ode`, which has no density.
      mean, std    float32; std is the FULL std S of x' given x (0 for `ode`), broadcastable to `sample`.
    `generator` may be one generator or one per sample (diffusers' `randn_tensor` convention).
    """
    if dynamics not in DYNAMICS:
        raise ValueError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    x = sample.float()
    v = velocity.float()
    sig = _per_sample(sigma, x)
    sig_next = _per_sample(sigma_next, x)
    dt = sig_next - sig

    if dynamics == "ode":
        mean, std = x + v * dt, torch.zeros_like(sig)
    elif dynamics == "flow-sde":
        # σ = 1 would divide by zero in σ/(1 − σ): Flow-GRPO uses the next schedule value there instead.
        sig_safe = torch.where(sig >= 1.0, sig_next, sig)
        s = noise_level * torch.sqrt(sig / (1.0 - sig_safe))
        mean = x + (v + s**2 / (2 * sig) * (x + (1 - sig) * v)) * dt
        std = s * torch.sqrt(-dt)
    elif dynamics == "dance-sde":
        mean = x + (v + noise_level**2 / (2 * sig) * (x + (1 - sig) * v)) * dt
        std = noise_level * torch.sqrt(-dt)
    else:  # cps: coefficients-preserving sampling, noise level is an angle fraction in [0, 1]
        if not 0.0 <= noise_level <= 1.0:
            raise ValueError(f"cps needs noise_level in [0, 1], got {noise_level}")
        x0_hat = x - sig * v
        eps_hat = x + (1 - sig) * v
        std = sig_next * math.sin(noise_level * math.pi / 2)
        mean = (1 - sig_next) * x0_hat + torch.sqrt((sig_next**2 - std**2).clamp_min(0)) * eps_hat

    if prev_sample is None:
        noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev_sample = (mean + std * noise).to(sample.dtype)
    x_next = prev_sample.float()

    if dynamics == "ode":
        log_prob = torch.full((x.shape[0],), float("nan"), device=x.device)
    elif dynamics == "cps":
        # The references' unnormalised form: constants and 1/(2S²) dropped, so its scale differs.
        log_prob = -_mean_over_elements((x_next - mean) ** 2)
    else:
        elementwise = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        log_prob = _mean_over_elements(elementwise.expand_as(x_next))
    return prev_sample, log_prob, mean, std


def sde_kl(dynamics: str, mean: torch.Tensor, mean_ref: torch.Tensor, std, sigma, sigma_next) -> torch.Tensor:
    """Flow-GRPO's KL between the trained and the reference step, per sample (batch,):
    mean_elements((μ − μ_ref)²) / (2s²), where s is the std the references' step function returns: S/√(−dt) for
    flow-sde and dance-sde, but S itself for cps, whose S = σ'·sin(ηπ/2) carries no √(−dt). (The exact Gaussian
    KL would divide by 2S²; the papers' β values are calibrated to this form.) `std` is sde_step's S."""
    if dynamics not in ("flow-sde", "dance-sde", "cps"):
        raise ValueError(f"sde_kl needs a stochastic dynamics (flow-sde, dance-sde, cps), got {dynamics!r}")
    mean, mean_ref = mean.float(), mean_ref.float()
    s = _per_sample(std, mean)  # a float, (batch,) or sde_step's broadcastable (batch, 1, ...)
    if dynamics != "cps":
        s = s / torch.sqrt(_per_sample(sigma, mean) - _per_sample(sigma_next, mean))
    return _mean_over_elements((mean - mean_ref) ** 2) / (2 * s.flatten() ** 2)


def velocity_coefficient(dynamics: str, sigma: float, sigma_next: float, noise_level: float) -> tuple[float, float]:
    """(∂μ/∂v, S) of one step, in float64: the step mean is affine in the model output v (elementwise, the same
    factor for every element), and S is sde_step's full std. ∂μ/∂v = dt·(1 + s²(1 − σ)/(2σ)) for flow-sde (s as
    in sde_step, σ̃ = σ' at σ = 1) and dance-sde (s = η); −(1 − σ')·σ + √(σ'² − S²)·(1 − σ) for cps; dt for ode."""
    if dynamics not in DYNAMICS:
        raise ValueError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    dt = sigma_next - sigma
    if dynamics == "ode":
        return dt, 0.0
    if dynamics == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        return -(1 - sigma_next) * sigma + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * (1 - sigma), std
    if dynamics == "flow-sde":
        s = noise_level * math.sqrt(sigma / (1.0 - (sigma_next if sigma >= 1.0 else sigma)))
    else:
        s = noise_level
    return dt * (1 + s**2 * (1 - sigma) / (2 * sigma)), s * math.sqrt(-dt)


def log_prob_velocity_scale(dynamics: str, sigma: float, sigma_next: float, noise_level: float) -> float:
    """k ≥ 0 such that, at a step's own sample x' = μ + S·z, ∂ log_prob / ∂v = −k·z / (elements) (algorithms.md §4,
    "Small steps"): how strongly the step's log-prob, and so its policy gradient, answers the model output. Gaussian
    steps (flow-sde, dance-sde): k = |∂μ/∂v| / S, which is ∝ √(−dt); cps's unnormalised log-prob: k = 2·S·|∂μ/∂v|.
    0 where the step has no density (ode, or S = 0)."""
    dmean_dv, std = velocity_coefficient(dynamics, sigma, sigma_next, noise_level)
    if std == 0.0:
        return 0.0
    return 2 * std * abs(dmean_dv) if dynamics == "cps" else abs(dmean_dv) / std
