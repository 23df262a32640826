"""Deterministic multistep DPM-Solver++ (2M, midpoint) for flow-matching models, on a caller-given σ list.

DPM-Solver++ (Lu et al., arXiv:2211.01095) integrates the probability-flow ODE on the data prediction
x̂0 = x − σ·v with α = 1 − σ (flow matching); the 2M variant reuses the previous step's x̂0, so it is
second order at one model call per step. We run diffusers' `DPMSolverMultistepScheduler` in its
flow-matching mode. Its `set_timesteps` builds its own σ list and takes no `sigmas=`, so the caller's
list is written over `scheduler.sigmas`/`timesteps` after `set_timesteps` (checked against a hand-written
DPM-Solver++ 2M to 2e-5, tests/test_solvers.py). The final
step (σ' = 0) is first order: it returns x̂0, as in diffusers (`final_sigmas_type="zero"`).

Used by MixGRPO-Flash for the compressed tail of its rollouts (arXiv:2507.21802) and available to any
script that wants deterministic rollouts from σ = 1.
"""

import torch
from diffusers import DPMSolverMultistepScheduler


def dpm_solver_scheduler(sigmas: torch.Tensor, begin_index: int = 0) -> DPMSolverMultistepScheduler:
    """A DPM-Solver++ 2M scheduler that steps through `sigmas` (descending, ending at 0), starting at
    `begin_index`."""
    scheduler = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", prediction_type="flow_prediction",
        use_flow_sigmas=True, final_sigmas_type="zero", lower_order_final=True)
    steps = len(sigmas) - 1
    scheduler.set_timesteps(steps)
    scheduler.sigmas = sigmas.detach().float().cpu()
    scheduler.timesteps = scheduler.sigmas[:-1] * scheduler.config.num_train_timesteps
    scheduler.num_inference_steps = steps
    scheduler.set_begin_index(begin_index)
    return scheduler


def dpm_solver_sample(velocity_fn, sample: torch.Tensor, sigmas: torch.Tensor,
                      history: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """Integrate `sample` from σ = sigmas[0] to sigmas[-1] = 0 with DPM-Solver++ 2M: len(sigmas) − 1 calls
    of `velocity_fn(x, sigma) -> v` (v ≈ ε − x0, float32).

    history: (σ_prev, x̂0_prev), the data prediction of the step that led to sigmas[0] (e.g. the last SDE step
    before a compressed tail). It seeds the multistep memory so that the first step is already second order;
    without it the first step is first order (DDIM-like). Returns float32 latents at σ = 0.
    """
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).flatten()
    if len(sigmas) < 2 or float(sigmas[-1]) != 0.0 or not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing, hold at least 2 values and end at 0")
    x = sample.float()
    if history is not None:
        sigma_prev, x0_prev = history
        if float(sigma_prev) <= float(sigmas[0]):
            raise ValueError(f"history σ {float(sigma_prev)} must be above the first σ {float(sigmas[0])}")
        sigmas = torch.cat([torch.tensor([float(sigma_prev)]), sigmas.cpu()])
        scheduler = dpm_solver_scheduler(sigmas, begin_index=1)
        scheduler.model_outputs[-1] = x0_prev.float()  # the 2M update reads the previous x̂0 from here
        scheduler.lower_order_nums = 1
        start = 1
    else:
        scheduler = dpm_solver_scheduler(sigmas)
        start = 0
    for k in range(start, len(sigmas) - 1):
        v = velocity_fn(x, sigmas[k].to(x.device))
        x = scheduler.step(v.float(), scheduler.timesteps[k], x, return_dict=False)[0]
    return x
