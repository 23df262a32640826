"""sde_step against an independent float64 numpy implementation of algorithms.md §2."""

import math

import numpy as np
import pytest
import torch

from common.dynamics import sde_kl, sde_step

SHAPE = (3, 4, 5)  # batch 3, 20 elements per sample


def reference_step(dynamics, v, x, sigma, sigma_next, eta, sigma_1=None):
    """float64 numpy: (mean, std) of x' for one sample, straight from the spec's table."""
    dt = sigma_next - sigma
    if dynamics == "flow-sde":
        tilde = sigma_1 if sigma == 1.0 else sigma
        s = eta * math.sqrt(sigma / (1 - tilde))
        return x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt, s * math.sqrt(-dt)
    if dynamics == "dance-sde":
        return x + (v + eta**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt, eta * math.sqrt(-dt)
    if dynamics == "cps":
        x0, eps = x - sigma * v, x + (1 - sigma) * v
        std = sigma_next * math.sin(eta * math.pi / 2)
        return (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps, std
    raise ValueError(dynamics)


def reference_log_prob(dynamics, x_next, mean, std):
    if dynamics == "cps":
        return -np.mean((x_next - mean) ** 2)
    return np.mean(-((x_next - mean) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi))


def toy(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


@pytest.mark.parametrize("dynamics", ["flow-sde", "dance-sde", "cps"])
def test_zero_noise_is_the_euler_step(dynamics):
    v, x = toy()
    prev, _, mean, std = sde_step(dynamics, v, x, 0.7, 0.55, 0.0, generator=torch.Generator().manual_seed(1))
    euler = x.double() + v.double() * (0.55 - 0.7)
    assert float(torch.as_tensor(std).abs().max()) == 0.0
    torch.testing.assert_close(mean.double(), euler, rtol=0, atol=1e-6)
    torch.testing.assert_close(prev.double(), euler, rtol=0, atol=1e-6)
    ode_prev, ode_logp, _, _ = sde_step("ode", v, x, 0.7, 0.55, 0.9)
    torch.testing.assert_close(ode_prev.double(), euler, rtol=0, atol=1e-6)
    assert torch.isnan(ode_logp).all()  # the ODE has no density


@pytest.mark.parametrize("dynamics,eta", [("flow-sde", 0.9), ("dance-sde", 0.3), ("cps", 0.7)])
@pytest.mark.parametrize("sigma,sigma_next", [(0.8, 0.6), (0.35, 0.0), (1.0, 0.9)])
def test_mean_std_and_log_prob_match_float64(dynamics, eta, sigma, sigma_next):
    v, x = toy(seed=3)
    prev, log_prob, mean, std = sde_step(dynamics, v, x, sigma, sigma_next, eta,
                                         generator=torch.Generator().manual_seed(7))
    for b in range(SHAPE[0]):
        ref_mean, ref_std = reference_step(dynamics, v[b].double().numpy(), x[b].double().numpy(), sigma,
                                           sigma_next, eta, sigma_1=sigma_next)
        np.testing.assert_allclose(mean[b].double().numpy(), ref_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(torch.as_tensor(std).flatten()[b]), ref_std, rtol=1e-6)
        if ref_std == 0 and dynamics != "cps":
            continue
        ref_logp = reference_log_prob(dynamics, prev[b].double().numpy(), ref_mean, ref_std)
        np.testing.assert_allclose(float(log_prob[b]), ref_logp, rtol=1e-5, atol=1e-5)


def test_flow_sde_first_step_uses_the_second_schedule_value():
    v, x = toy()
    _, _, _, std = sde_step("flow-sde", v, x, 1.0, 0.9, 0.5)
    expected = 0.5 * math.sqrt(1.0 / (1 - 0.9)) * math.sqrt(0.1)
    np.testing.assert_allclose(std.flatten().numpy(), expected, rtol=1e-6)
    assert torch.isfinite(std).all()


@pytest.mark.parametrize("dynamics", ["flow-sde", "dance-sde", "cps"])
def test_re_evaluating_a_stored_sample_reproduces_its_log_prob(dynamics):
    v, x = toy(seed=5)
    prev, log_prob, _, _ = sde_step(dynamics, v, x, 0.6, 0.4, 0.5, generator=torch.Generator().manual_seed(2))
    _, again, _, _ = sde_step(dynamics, v, x, 0.6, 0.4, 0.5, prev_sample=prev)
    assert torch.equal(log_prob, again)


def test_per_sample_sigmas_equal_separate_calls():
    v, x = toy(seed=9)
    sigmas, nexts = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.3, 0.0])
    prev, logp, mean, _ = sde_step("flow-sde", v, x, sigmas, nexts, 0.7, generator=torch.Generator().manual_seed(4))
    for b in range(3):
        _, logp_b, mean_b, _ = sde_step("flow-sde", v[b:b + 1], x[b:b + 1], float(sigmas[b]), float(nexts[b]), 0.7,
                                        prev_sample=prev[b:b + 1])
        torch.testing.assert_close(mean[b:b + 1], mean_b)
        torch.testing.assert_close(logp[b:b + 1], logp_b)


def test_float32_math_under_bf16_inputs():
    v, x = toy(seed=11, dtype=torch.bfloat16)
    prev, log_prob, mean, std = sde_step("flow-sde", v, x, 0.7, 0.5, 0.9, generator=torch.Generator().manual_seed(0))
    assert mean.dtype == torch.float32 and log_prob.dtype == torch.float32
    assert prev.dtype == torch.bfloat16  # stored in the input dtype...
    # ...and the log-prob was computed on the rounded sample: re-evaluation gives the same number.
    _, again, _, _ = sde_step("flow-sde", v, x, 0.7, 0.5, 0.9, prev_sample=prev)
    assert torch.equal(log_prob, again)
    ref_mean, _ = reference_step("flow-sde", v[0].double().numpy(), x[0].double().numpy(), 0.7, 0.5, 0.9)
    np.testing.assert_allclose(mean[0].double().numpy(), ref_mean, rtol=1e-6, atol=1e-6)


def test_one_generator_per_sample_makes_noise_independent_of_the_batch():
    v, x = toy(seed=1)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    full, _, _, _ = sde_step("dance-sde", v, x, 0.5, 0.4, 0.3, generator=gens([10, 11, 12]))
    alone, _, _, _ = sde_step("dance-sde", v[1:2], x[1:2], 0.5, 0.4, 0.3, generator=gens([11]))
    assert torch.equal(full[1:2], alone)


def test_bad_arguments():
    v, x = toy()
    with pytest.raises(ValueError, match="unknown dynamics 'sde'.*flow-sde"):
        sde_step("sde", v, x, 0.5, 0.4, 0.3)
    with pytest.raises(ValueError, match=r"cps needs noise_level in \[0, 1\]"):
        sde_step("cps", v, x, 0.5, 0.4, 1.5)


def reference_kl(dynamics, mean, mean_ref, std, sigma, sigma_next):
    """float64 numpy, the references' KL: mean((μ − μ_ref)²)/(2s²) with s the std their step returns —
    S/√(−dt) for flow-sde and dance-sde (S = s·√(−dt) there), S itself for cps (σ'·sin(ηπ/2), no √(−dt))."""
    s = std if dynamics == "cps" else std / math.sqrt(sigma - sigma_next)
    return np.mean((mean - mean_ref) ** 2) / (2 * s**2)


@pytest.mark.parametrize("dynamics,eta", [("flow-sde", 0.9), ("dance-sde", 0.3), ("cps", 0.7)])
@pytest.mark.parametrize("sigma,sigma_next", [(0.8, 0.6), (1.0, 0.9), (0.3, 0.25)])
def test_sde_kl_matches_float64(dynamics, eta, sigma, sigma_next):
    v, x = toy(seed=21)
    v_ref = v + 0.05 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    prev, _, mean, std = sde_step(dynamics, v, x, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(1))
    _, _, mean_ref, _ = sde_step(dynamics, v_ref, x, sigma, sigma_next, eta, prev_sample=prev)
    kl = sde_kl(dynamics, mean, mean_ref, std, sigma, sigma_next)
    assert kl.shape == (SHAPE[0],) and kl.dtype == torch.float32
    for b in range(SHAPE[0]):
        ref_mean, ref_std = reference_step(dynamics, v[b].double().numpy(), x[b].double().numpy(), sigma,
                                           sigma_next, eta, sigma_1=sigma_next)
        ref_mean_ref, _ = reference_step(dynamics, v_ref[b].double().numpy(), x[b].double().numpy(), sigma,
                                         sigma_next, eta, sigma_1=sigma_next)
        expected = reference_kl(dynamics, ref_mean, ref_mean_ref, ref_std, sigma, sigma_next)
        np.testing.assert_allclose(float(kl[b]), expected, rtol=1e-4)
    # per-sample σ tensors give the same numbers as scalars
    batch = torch.full((SHAPE[0],), sigma), torch.full((SHAPE[0],), sigma_next)
    torch.testing.assert_close(sde_kl(dynamics, mean, mean_ref, std, *batch), kl)


def test_sde_kl_for_cps_is_not_divided_by_the_step_length():
    """The old scripts used s = S/√(σ − σ') for cps too, i.e. a KL (σ − σ') times too small."""
    v, x = toy(seed=22)
    prev, _, mean, std = sde_step("cps", v, x, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(1))
    _, _, mean_ref, _ = sde_step("cps", v + 0.1, x, 0.5, 0.4, 0.7, prev_sample=prev)
    kl = sde_kl("cps", mean, mean_ref, std, 0.5, 0.4)
    wrong = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * (std.flatten() / math.sqrt(0.1)) ** 2)
    torch.testing.assert_close(kl * 0.1, wrong)
    with pytest.raises(ValueError, match="stochastic dynamics"):
        sde_kl("ode", mean, mean_ref, std, 0.5, 0.4)
