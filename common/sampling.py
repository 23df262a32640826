"""Rollout: run the whole σ schedule with a chosen dynamics, storing only the steps that will be trained."""

from dataclasses import dataclass

import torch

from common.dynamics import sde_step
from common.solvers import dpm_solver_sample


@dataclass
class Trajectory:
    """What training needs from one rollout batch. Per trained step j (in `steps` order):
    latents[:, i] = x_j, next_latents[:, i] = x_{j+1}, log_probs[:, i] = log p_old(x_{j+1} | x_j),
    means[:, i] = μ_old (only when asked for: GRPO-Guard)."""

    final_latents: torch.Tensor
    steps: list[int]
    latents: torch.Tensor | None = None
    next_latents: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    means: torch.Tensor | None = None


def sample_generators(seeds: list[int], device) -> list[torch.Generator]:
    """One generator per sample: the noise of sample i depends only on its own seed, not on the batch
    it lands in, so runs with 1 or N processes and resumed runs draw the same rollouts."""
    return [torch.Generator(device).manual_seed(int(seed)) for seed in seeds]


@torch.no_grad()
def rollout(adapter, cond, sigmas: torch.Tensor, generators: list[torch.Generator], dynamics: str,
            noise_level: float, sde_steps, train_steps, guidance_scale: float = 3.5,
            keep_means: bool = False, store_device=None, solver_from: int | None = None,
            initial_noise: torch.Tensor | None = None) -> Trajectory:
    """Integrate from noise (σ_0 = 1) to σ_N = 0.

    sde_steps: indices j whose step x_j -> x_{j+1} uses `dynamics`; the others are Euler ODE steps.
    train_steps: indices whose (x_j, x_{j+1}, log-prob) are stored, moved to `store_device` (e.g. the
    CPU, to keep long trajectories out of accelerator memory).
    solver_from: when given (MixGRPO-Flash), the steps from this index on are deterministic multistep
    DPM-Solver++ 2M steps over sigmas[solver_from:] (common/solvers.py) instead, seeded with x̂0 = x − σ·v of
    the step before; every stochastic step must come earlier.
    initial_noise: the latents at σ = 1 (default: drawn from `generators`, which then also draw the SDE
    noise), e.g. one noise shared by a group as DanceGRPO/MixGRPO do.
    """
    sde_steps, train_steps = set(sde_steps), sorted(train_steps)
    if not set(train_steps) <= sde_steps:
        raise ValueError("every trained step must be stochastic: an ODE step has no log-prob")
    base_steps = len(sigmas) - 1 if solver_from is None else solver_from
    if solver_from is not None and not (0 <= solver_from < len(sigmas) - 1 and all(j < solver_from for j in sde_steps)):
        raise ValueError(f"solver_from {solver_from} must be a step index after every stochastic step")
    store = (lambda t: t.to(store_device)) if store_device is not None else (lambda t: t)
    x = adapter.noise(generators) if initial_noise is None else initial_noise
    stored_x, stored_next, stored_logp, stored_mean = [], [], [], []
    history = None
    for j in range(base_steps):
        v = adapter.velocity(x, sigmas[j], cond, guidance_scale)
        if j == base_steps - 1 and solver_from is not None:
            history = (sigmas[j], x.float() - sigmas[j] * v)  # x̂0: the multistep solver's memory
        step_dynamics = dynamics if j in sde_steps else "ode"
        x_next, log_prob, mean, _ = sde_step(step_dynamics, v, x, sigmas[j], sigmas[j + 1], noise_level,
                                             generator=generators)
        if j in train_steps:
            stored_x.append(store(x))
            stored_next.append(store(x_next))
            stored_logp.append(store(log_prob))
            if keep_means:
                stored_mean.append(store(mean))
        x = x_next
    if solver_from is not None:
        x = dpm_solver_sample(lambda latents, sigma: adapter.velocity(latents, sigma, cond, guidance_scale),
                              x, sigmas[solver_from:], history).to(x.dtype)
    if not train_steps:
        return Trajectory(final_latents=x, steps=[])
    return Trajectory(
        final_latents=x,
        steps=train_steps,
        latents=torch.stack(stored_x, dim=1),
        next_latents=torch.stack(stored_next, dim=1),
        log_probs=torch.stack(stored_logp, dim=1),
        means=torch.stack(stored_mean, dim=1) if keep_means else None,
    )
