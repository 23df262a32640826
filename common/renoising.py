"""Re-noising a state of a flow's trajectory to a higher noise level, as TDM-R1 queries its fake score, surrogate
and teacher above each step of the generator (algorithms.md §9 "Query times and re-noising"): the query times,
uniform in the schedule's unshifted time, and the flow's forward transition q(x_q | y) with the velocity it implies.
"""

import math

import torch


def schedule_shift(adapter, num_steps: int) -> float:
    """s of the rollout schedule as φ(u) = s·u/(1 + (s − 1)·u): the scheduler's static shift, or, for
    resolution-dependent shifting, e^μ (FLUX's exponential shift at this resolution, whose rational form this is;
    μ itself for a linear one), μ read off the call the pipeline's schedule makes."""
    scheduler = adapter.scheduler
    config = scheduler.config
    if not config.get("use_dynamic_shifting", False):
        return float(config.get("shift", 1.0))
    seen, original = [], scheduler.time_shift
    scheduler.time_shift = lambda mu, sigma, t: (seen.append(mu), original(mu, sigma, t))[1]
    try:
        adapter.sigmas(num_steps)
    finally:
        del scheduler.time_shift
    return math.exp(seen[0]) if config.get("time_shift_type", "exponential") == "exponential" else float(seen[0])


def shift_time(u, shift: float):
    """φ(u) = s·u/(1 + (s − 1)·u): unshifted time to σ."""
    return shift * u / (1 + (shift - 1) * u)


def unshift_time(sigma, shift: float):
    """φ⁻¹(σ) = σ/(s − (s − 1)·σ)."""
    return sigma / (shift - (shift - 1) * sigma)


def query_sigma(sigma_lo, uniform, shift: float, margin: float):
    """σ_q = φ(u₀ + U·(1 − u₀)), u₀ = φ⁻¹(σ_lo) + margin: uniform in unshifted time between just above the
    boundary state's σ and pure noise (below 1, where the surrogate target divides by 1 − σ_q)."""
    start = (unshift_time(sigma_lo, shift) + margin).clamp(max=1.0)
    return shift_time(start + uniform * (1 - start), shift).clamp(max=1 - 1e-6)


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) broadcast against a (B, ...) tensor."""
    return values.to(like.dtype).view(-1, *[1] * (like.ndim - 1))


def renoise(y, sigma_n, sigma_q, noise):
    """The flow's forward transition q(x_q | y) from σ_n up to σ_q > σ_n: x_q = α·y + β·ξ with
    α = (1 − σ_q)/(1 − σ_n), β = √(σ_q² − α²·σ_n²), so a y = (1 − σ_n)·x0 + σ_n·ε lands at
    (1 − σ_q)·x0 + noise of std σ_q. σ's (B,). Returns (x_q, α (B,), β (B,))."""
    sigma_n, sigma_q = torch.as_tensor(sigma_n, dtype=sigma_q.dtype).expand_as(sigma_q), sigma_q
    alpha = (1 - sigma_q) / (1 - sigma_n)
    beta = (sigma_q ** 2 - alpha ** 2 * sigma_n ** 2).clamp_min(0).sqrt()
    return per_sample(alpha, y) * y + per_sample(beta, y) * noise, alpha, beta


def surrogate_target(x_q, noise, beta, sigma_q):
    """u_S = (σ_q·ξ/β − x_q)/(1 − σ_q): the velocity implied by q(x_q | y)'s conditional score −ξ/β (for σ_n = 0,
    ξ − y: the flow-matching target)."""
    return (per_sample(sigma_q / beta, x_q) * noise - x_q) / per_sample(1 - sigma_q, x_q)
