"""The per-step log-prob gradient scale (common/dynamics.py `log_prob_velocity_scale`, `velocity_coefficient`) against
autograd and a float64 numpy computation of §2's table, and --step-weighting in the coupled scripts: the weight the
script applies equals a float64 k_max/k_j, the ratio stays exactly 1 before the first update, and the flag at its
default leaves a run bitwise unchanged (algorithms.md §4, "Small steps")."""

import math

import numpy as np
import pytest
import torch

from common.dynamics import log_prob_velocity_scale, sde_step, velocity_coefficient
from conftest import read_metrics, run_script, slow_except

# (σ, σ'): the first step (σ = 1), video-like steps near 1 (Wan2.2 A14B's shift 12), an image-like middle step
STEPS = [(1.0, 0.99), (0.9908, 0.9796), (0.9, 0.6), (0.6, 0.3)]
ETA = {"flow-sde": 0.9, "dance-sde": 0.3, "cps": 0.8}


def numpy_mean_std(dynamics, x, v, sigma, sigma_next, eta):
    """μ and S of §2's table in float64."""
    dt = sigma_next - sigma
    if dynamics == "cps":
        std = sigma_next * np.sin(eta * np.pi / 2)
        return (1 - sigma_next) * (x - sigma * v) + np.sqrt(sigma_next**2 - std**2) * (x + (1 - sigma) * v), std
    s = eta * np.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma))) if dynamics == "flow-sde" else eta
    return x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt, s * np.sqrt(-dt)


@pytest.mark.parametrize("dynamics", list(ETA))
@pytest.mark.parametrize("sigma,sigma_next", STEPS)
def test_scale_equals_autograd_and_float64(dynamics, sigma, sigma_next):
    """∂ log p/∂v by autograd of sde_step (float32) = the float64 gradient of §2's log-prob = −k·z/elements."""
    eta, g = ETA[dynamics], torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 5, generator=g)
    x_next = sde_step(dynamics, v, x, sigma, sigma_next, eta, generator=g)[0]
    v_leaf = v.clone().requires_grad_(True)
    log_prob = sde_step(dynamics, v_leaf, x, sigma, sigma_next, eta, prev_sample=x_next)[1]
    (autograd,) = torch.autograd.grad(log_prob.sum(), v_leaf)

    x64, v64, xn64, n = x.double().numpy(), v.double().numpy(), x_next.double().numpy(), x[0].numel()
    mean, std = numpy_mean_std(dynamics, x64, v64, sigma, sigma_next, eta)
    dmean_dv = numpy_mean_std(dynamics, x64, v64 + 1.0, sigma, sigma_next, eta)[0] - mean  # μ is affine in v
    if dynamics == "cps":  # −mean((x' − μ)²)
        expected = 2 * (xn64 - mean) * dmean_dv / n
    else:  # mean(−(x' − μ)²/(2S²) − log S − ½ log 2π)
        expected = (xn64 - mean) / std**2 * dmean_dv / n
    tolerance = 1e-4 * np.abs(expected).max()  # float32's x' − μ cancels where S is small
    np.testing.assert_allclose(autograd.double().numpy(), expected, rtol=1e-4, atol=tolerance)

    coefficient, s = velocity_coefficient(dynamics, sigma, sigma_next, eta)
    np.testing.assert_allclose(coefficient, dmean_dv, rtol=1e-9)
    assert math.isclose(s, std, rel_tol=1e-12)
    k = log_prob_velocity_scale(dynamics, sigma, sigma_next, eta)
    np.testing.assert_allclose(-k * (xn64 - mean) / std / n, expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max())


def test_scale_is_proportional_to_the_root_of_the_step_length():
    """dance-sde: k = (1 + η²(1 − σ)/(2σ))·√(−dt)/η, so at one σ, a 4× shorter step has half the scale."""
    k = [log_prob_velocity_scale("dance-sde", 0.9, 0.9 - dt, 0.3) for dt in (0.04, 0.01)]
    assert math.isclose(k[0] / k[1], 2.0, rel_tol=1e-12)
    assert math.isclose(k[0], (1 + 0.09 * 0.1 / 1.8) * math.sqrt(0.04) / 0.3, rel_tol=1e-12)
    assert log_prob_velocity_scale("ode", 0.9, 0.8, 0.0) == 0.0 and log_prob_velocity_scale("cps", 0.3, 0.0, 0.5) == 0.0


@pytest.fixture(scope="module")
def tiny_sigmas(tiny_flux_path):
    from common.models import load_adapter

    return load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 64, max_sequence_length=32).sigmas(4)


def numpy_weight(sigmas, j, eta):
    """k_max/k_j in float64 from §2's formulas: k = |∂μ/∂v|/S (flow-sde), k_max over every step but the last."""
    s = sigmas.double().numpy()

    def k(i):
        x, v = np.zeros(1), np.zeros(1)
        mean, std = numpy_mean_std("flow-sde", x, v, s[i], s[i + 1], eta)
        dmean_dv = abs(float(numpy_mean_std("flow-sde", x, v + 1.0, s[i], s[i + 1], eta)[0][0] - mean[0]))
        return dmean_dv / std

    return max(k(i) for i in range(len(s) - 2)) / k(j)


# The flags that make step 0 the only trained step of epoch 0 (grpo_guard trains every step: no isolation).
ISOLATE = {"grpo": ["--sde-window-size", "1", "--sde-window-range", "0", "1"], "grpo_guard": [],
           "mixgrpo": ["--window-size", "1", "--window-schedule", "progressive"],
           "dppo": ["--sde-window-size", "1", "--sde-window-range", "0", "1"]}
ONE_EPOCH = ["--preset", "tiny", "--epochs", "1", "--eval-every", "1", "--eval-num-prompts", "1", "--num-steps", "4",
             "--group-size", "4", "--noise-level", "0.8", "--updates-per-epoch", "1"]
TIMING = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}


@pytest.mark.parametrize("script", slow_except(list(ISOLATE), "grpo"))
def test_step_weighting_in_the_script(script, tmp_path, tiny_sigmas):
    """One epoch, one optimizer step, runs from the same seed (the same rollouts):
    - (grpo) `--step-weighting none` is bitwise the run without the flag (every logged number but the timings, the
      evaluations before and after training included): the default path multiplies by exactly 1.0;
    - with equalize the ratio is still exactly 1 before the update;
    - with step 0 the only trained step, the equalize run's gradient norm is w_0 = k_max/k_0 (float64, §2's formulas)
      times the unweighted one's (the loss is scaled by a constant). GRPO-Guard trains every step and weights by
      |∂μ/∂v| (its regulated ratio's scale): there the weighted gradient only has to differ."""
    modes = {"plain": [], "none": ["--step-weighting", "none"], "equalize": ["--step-weighting", "equalize"]}
    if script != "grpo":  # the full tier: the other scripts run the same flag through the same two lines
        del modes["none"]
    runs = {}
    for mode, flags in modes.items():
        run_script(f"algos/{script}.py", *ONE_EPOCH, *ISOLATE[script], *flags, "--output-dir", tmp_path / mode)
        runs[mode] = [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(tmp_path / mode, base=True)]
    assert runs["plain"] == runs.get("none", runs["plain"]) and len(runs["plain"]) == 2
    none, equalize = runs["plain"][1], runs["equalize"][1]
    assert equalize["ratio_dev_first"] == none["ratio_dev_first"] == 0.0
    if script == "grpo_guard":
        assert equalize["grad_norm"] != pytest.approx(none["grad_norm"], rel=1e-3)
    else:
        weight = numpy_weight(tiny_sigmas, 0, 0.8)
        assert weight > 2  # the first step's scale is far under the largest one's
        assert equalize["grad_norm"] == pytest.approx(weight * none["grad_norm"], rel=1e-4)
