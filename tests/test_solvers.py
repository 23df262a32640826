"""DPM-Solver++ 2M (common/solvers.py) against independent float64 computations, and its accuracy against
Euler on a Gaussian toy (exact solution known) and on the tiny FLUX.1."""

import numpy as np
import pytest
import torch

from common.solvers import dpm_solver_sample

# Toy data: each element i is x0_i ~ N(m_i, s_i²). With x_σ = (1 − σ)x0 + σε the exact velocity E[ε − x0 | x_σ]
# is affine in x and the probability-flow ODE has a closed form:
#   V(σ) = (1 − σ)²s² + σ²,  v(x, σ) = (σ − (1 − σ)s²)/V · (x − (1 − σ)m) − m,
#   x(σ) = (1 − σ)m + √V(σ) · ξ with ξ constant along a trajectory.
RNG = np.random.default_rng(0)
M = RNG.uniform(-1.0, 1.0, size=(2, 64))
S = RNG.uniform(0.05, 1.0, size=(2, 64))


def toy_velocity_np(x, sigma):
    var = (1 - sigma) ** 2 * S**2 + sigma**2
    return (sigma - (1 - sigma) * S**2) / var * (x - (1 - sigma) * M) - M


def toy_velocity(x, sigma):
    return torch.from_numpy(toy_velocity_np(x.double().numpy(), float(sigma))).float()


def toy_exact(x_a, sigma_a):
    """x(0) from x(σ_a) along the exact ODE."""
    xi = (x_a - (1 - sigma_a) * M) / np.sqrt((1 - sigma_a) ** 2 * S**2 + sigma_a**2)
    return M + S * xi


def flux_like_sigmas(n, start=1.0, shift=3.0):
    """n + 1 points from shift(start) down to 0, shifted like SD3/FLUX schedules (denser near σ = 1)."""
    u = np.linspace(start, 0.0, n + 1)
    return shift * u / (1 + (shift - 1) * u)


def dpm_2m_reference(velocity_np, x, sigmas, history=None):
    """Hand-written DPM-Solver++ 2M (Lu et al. 2022, multistep, midpoint form) in float64 for flow matching:
    α = 1 − σ, λ = log(α/σ), data prediction D = x − σ·v. Step s → t with h = λ_t − λ_s:
        x_t = (σ_t/σ_s)·x + α_t·(1 − e^{−h})·(D_s + (D_s − D_prev)/(2r)),  r = (λ_s − λ_prev)/h,
    first order (D_prev term dropped) when there is no previous D and on the final step to σ = 0."""
    x = np.array(x, dtype=np.float64)
    prev = history  # (σ_prev, D_prev)
    for k in range(len(sigmas) - 1):
        s, t = sigmas[k], sigmas[k + 1]
        d = x - s * velocity_np(x, s)
        if t == 0.0:
            x = d  # σ_t/σ_s = 0 and α_t(1 − e^{−∞}) = 1
        else:
            lam = lambda sig: np.log((1 - sig) / sig) if sig < 1 else -np.inf  # noqa: E731
            h = lam(t) - lam(s)
            correction = 0.0
            if prev is not None:
                r = (lam(s) - lam(prev[0])) / h
                correction = (d - prev[1]) / (2 * r)
            x = (t / s) * x + (1 - t) * (1 - np.exp(-h)) * (d + correction)
        prev = (s, d)
    return x


def test_matches_hand_written_dpm_solver_2m_from_noise():
    x1 = RNG.standard_normal((2, 64))
    sigmas = flux_like_sigmas(10)
    ours = dpm_solver_sample(toy_velocity, torch.from_numpy(x1).float(), torch.from_numpy(sigmas).float())
    expected = dpm_2m_reference(toy_velocity_np, x1, np.float32(sigmas).astype(np.float64))
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=2e-5)


def test_history_seeds_the_first_step_as_second_order():
    # A segment from σ_a that continues a trajectory: its first step must use D from the step before σ_a.
    full = np.float32(flux_like_sigmas(12)).astype(np.float64)
    x_prev = RNG.standard_normal((2, 64)) * 0.8
    s_prev, s_a = full[3], full[4]
    d_prev = x_prev - s_prev * toy_velocity_np(x_prev, s_prev)
    x_a = x_prev + (s_a - s_prev) * toy_velocity_np(x_prev, s_prev)
    tail = full[4:]
    ours = dpm_solver_sample(toy_velocity, torch.from_numpy(x_a).float(), torch.from_numpy(tail).float(),
                             history=(float(s_prev), torch.from_numpy(d_prev).float()))
    expected = dpm_2m_reference(toy_velocity_np, x_a, tail, history=(s_prev, d_prev))
    np.testing.assert_allclose(ours.numpy(), expected, rtol=0, atol=2e-5)
    # ... and it is not the unseeded (first-order first step) result
    unseeded = dpm_2m_reference(toy_velocity_np, x_a, tail)
    assert np.abs(expected - unseeded).max() > 1e-3


def euler(velocity, x, sigmas):
    for k in range(len(sigmas) - 1):
        x = x + (sigmas[k + 1] - sigmas[k]) * velocity(x, sigmas[k])
    return x


def test_converges_to_exact_solution_and_beats_euler_on_gaussian_toy():
    x_a = RNG.standard_normal((2, 64)) * 0.9
    sigma_a = float(np.float32(flux_like_sigmas(1, start=0.6)[0]))
    exact = toy_exact(x_a, sigma_a)
    errors = {}
    for n in (8, 16, 64, 256):
        sigmas = torch.from_numpy(flux_like_sigmas(n, start=0.6)).float()
        dpm = dpm_solver_sample(toy_velocity, torch.from_numpy(x_a).float(), sigmas).numpy()
        eul = euler(toy_velocity_np, x_a, sigmas.double().numpy())
        errors[n] = (np.abs(dpm - exact).max(), np.abs(eul - exact).max())
    assert errors[256][0] < 2e-3
    assert errors[256][0] < errors[64][0] < errors[16][0]
    for n in (8, 16, 64):
        dpm_err, euler_err = errors[n]
        assert dpm_err < euler_err / 2, (n, errors)


def test_tiny_flux_segment_converges_to_fine_euler(tiny_flux_path):
    from common.models import load_adapter

    torch.manual_seed(0)
    adapter = load_adapter("flux1", "tiny", "cpu", torch.float32, 64, 32)
    cond = adapter.encode_prompts(["a red cat", "a blue sky"])
    velocity = lambda x, sigma: adapter.velocity(x, sigma, cond)  # noqa: E731
    with torch.no_grad():
        base = adapter.sigmas(12)
        x = euler(velocity, adapter.noise([torch.Generator().manual_seed(s) for s in (1, 2)]), base[:5])
        sigma_a = float(base[4])
        fine = euler(velocity, x, torch.linspace(sigma_a, 0.0, 1001))  # 1000 Euler steps: error ~3e-4
        errors = {}
        for n in (8, 16, 128):
            sigmas = torch.linspace(sigma_a, 0.0, n + 1)
            errors[n] = ((dpm_solver_sample(velocity, x, sigmas) - fine).abs().max().item(),
                         (euler(velocity, x, sigmas) - fine).abs().max().item())
    assert errors[128][0] < 2e-3, errors
    for n in (8, 16):
        assert errors[n][0] < errors[n][1] / 1.5, errors


def test_rejects_bad_sigma_lists():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError):
        dpm_solver_sample(toy_velocity, x, torch.tensor([0.5, 0.1]))  # does not end at 0
    with pytest.raises(ValueError):
        dpm_solver_sample(toy_velocity, x, torch.tensor([0.5, 0.6, 0.0]))  # not decreasing
    with pytest.raises(ValueError):
        dpm_solver_sample(toy_velocity, x, torch.tensor([0.5, 0.0]), history=(0.4, x))  # history below σ_0
