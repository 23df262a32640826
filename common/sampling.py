"""Sampling a clean x0 from noise, for evaluation and for the algorithms that keep only x0 (DiffusionNFT, AWM, ...).
The GRPO-family scripts write their rollout loop themselves: which steps are stochastic and what is stored IS
their algorithm."""

import torch

from common.dynamics import DYNAMICS, sde_step
from common.solvers import dpm_solver_sample

SAMPLERS = DYNAMICS + ("dpm",)  # a step dynamics applied at every step, or the deterministic multistep solver


def sample_generators(seeds, device) -> list[torch.Generator]:
    """One generator per sample: the noise of sample i depends only on its own seed, not on the batch
    it lands in, so runs with 1 or N processes and resumed runs draw the same rollouts."""
    return [torch.Generator(device).manual_seed(int(seed)) for seed in seeds]


@torch.no_grad()
def sample(velocity, noise: torch.Tensor, sigmas: torch.Tensor, sampler: str = "ode", noise_level: float = 0.0,
           generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Integrate `noise` (at σ_0 = 1) to σ_N = 0 with `velocity(x, sigma) -> v` and return x0.

    sampler: `ode` (Euler), `flow-sde` / `dance-sde` / `cps` (that stochastic step everywhere, its noise drawn from
    `generators`), or `dpm` (deterministic multistep DPM-Solver++ 2M, common/solvers.py). Samples are kept in
    `noise.dtype` between steps, as a rollout stores them."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if sampler == "dpm":
        return dpm_solver_sample(velocity, noise, sigmas).to(noise.dtype)
    x = noise
    for j in range(len(sigmas) - 1):
        x, _, _, _ = sde_step(sampler, velocity(x, sigmas[j]), x, sigmas[j], sigmas[j + 1], noise_level,
                              generator=generators)
    return x
