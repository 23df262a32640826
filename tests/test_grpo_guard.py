"""algos/grpo_guard.py: the regulated ratio against an independent float64 computation on the tiny FLUX.1,
the first ratio, flow-sde only, resume, 2 processes and learning."""

import importlib.util
import math

import numpy as np
import torch
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, script_error, sde_trajectory


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = load_script("grpo_guard")


def gaussian_log_prob64(x, mean, std):
    """Mean over elements of log N(x; mean, std²), float64."""
    return (-((x - mean) ** 2) / (2 * std**2) - np.log(std) - 0.5 * math.log(2 * math.pi)).reshape(len(x), -1).mean(1)


def test_regulated_ratio_matches_float64_on_tiny_flux(tiny_flux_path):
    from common.dynamics import sde_step
    from common.models import load_adapter
    from common.training import add_lora

    torch.manual_seed(0)
    adapter = load_adapter("flux1", "tiny", "cpu", torch.float32, 64, 32)
    add_lora(adapter.transformer, 8, 8, adapter.lora_target_modules)
    sigmas = adapter.sigmas(6)
    cond = adapter.encode_prompts(["a cat", "a dog", "a tree"])
    steps = list(range(5))
    latents, next_latents, log_probs, means = sde_trajectory(adapter, cond, sigmas, [1, 2, 3], "flow-sde", 0.8, 3.5,
                                                             keep_means=True)
    with torch.no_grad():  # move θ away from θ_old
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        for i, j in enumerate(steps):
            x, x_next, mean_old = latents[:, i], next_latents[:, i], means[:, i]
            v = adapter.velocity(x, sigmas[j], cond)
            _, log_prob, mean, std = sde_step("flow-sde", v, x, sigmas[j], sigmas[j + 1], 0.8, prev_sample=x_next)
            ours = guard.regulated_log_ratio(x_next, mean, mean_old, std).double().numpy()

            # float64 from scratch: S from the flow-SDE definition, z = (x' − μ_old)/S, and the log-prob form
            sig, sig_next = float(sigmas[j]), float(sigmas[j + 1])
            sig_safe = float(sigmas[1]) if sig >= 1 else sig
            s = 0.8 * math.sqrt(sig / (1 - sig_safe)) * math.sqrt(sig - sig_next)
            x64, mu64, mu_old64 = (t.double().numpy() for t in (x_next, mean, mean_old))
            z = (x64 - mu_old64) / s
            z_form = (z * (mu64 - mu_old64)).reshape(3, -1).mean(1)
            m = ((mu64 - mu_old64) ** 2).reshape(3, -1).mean(1)
            logp_form = s * (gaussian_log_prob64(x64, mu64, s) - gaussian_log_prob64(x64, mu_old64, s)) + m / (2 * s)
            np.testing.assert_allclose(z_form, logp_form, rtol=1e-9, atol=1e-12)  # the identity itself
            assert np.abs(z_form).max() > 1e-4  # θ really moved
            np.testing.assert_allclose(ours, z_form, rtol=1e-4, atol=1e-8)
            # the rollout noise is standard normal, and the raw ratio sits below the regulated one on average
            assert abs(z.std() - 1) < 0.1
            raw = log_prob.double().numpy() - log_probs[:, i].double().numpy()
            np.testing.assert_allclose(raw, z_form / s - m / (2 * s * s), rtol=1e-3, atol=1e-6)


SMALL = ["--preset", "tiny", "--num-steps", "4", "--prompts-per-epoch", "1", "--group-size", "4",
         "--batch-size", "2", "--updates-per-epoch", "2", "--eval-every", "0"]


def test_resume_equals_uninterrupted_and_first_ratio_is_one(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    run_script("algos/grpo_guard.py", *SMALL, "--epochs", "5", "--save-every", "2", "--output-dir", full)
    run_script("algos/grpo_guard.py", *SMALL, "--epochs", "3", "--save-every", "2", "--output-dir", split)
    run_script("algos/grpo_guard.py", *SMALL, "--epochs", "5", "--save-every", "2", "--output-dir", split, "--resume")
    a, b = read_metrics(full), read_metrics(split)
    for key in ("epoch", "reward_mean", "loss", "ratio_mean", "raw_ratio_mean"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert max(m["ratio_dev_first"] for m in a + b) < 1e-6


@SLOW
def test_two_processes(tmp_path):
    out = tmp_path / "ddp"
    run_script("algos/grpo_guard.py", *SMALL, "--updates-per-epoch", "1", "--epochs", "2", "--output-dir", out,
               launcher=ACCELERATE_2CPU)
    metrics = read_metrics(out)
    assert [m["num_processes"] for m in metrics] == [2, 2]
    assert max(m["ratio_dev_first"] for m in metrics) < 1e-6


def test_refuses_other_dynamics(tmp_path):
    for dynamics in ("dance-sde", "cps"):
        line = script_error("algos/grpo_guard.py", *SMALL, "--dynamics", dynamics, "--output-dir", tmp_path / "x")
        assert line.startswith(f"error: invalid choice '{dynamics}' for argument '--dynamics'") and "flow-sde" in line


@SLOW
def test_learns_on_tiny_flux(tmp_path):
    # tiny preset, 60 epochs: mean reward of the last 10 minus the first 10 epochs. On the 2-core AMD EPYC of CI
    # (2026-12-01) seeds 1/2/3 gave +0.02/+0.91/+1.04 kB (where this was first written: +0.93/+1.03/+1.00; the
    # trajectory follows the CPU's float rounding). Seed 2, margin +0.3 kB (rewards are −kB of JPEG).
    out = tmp_path / "learn"
    run_script("algos/grpo_guard.py", "--preset", "tiny", "--epochs", "60", "--seed", "2", "--eval-every", "0",
               "--save-every", "0", "--output-dir", out)
    metrics = read_metrics(out)
    rewards = [m["reward_mean"] for m in metrics]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last - first > 0.3, (first, last)
    assert max(m["ratio_dev_first"] for m in metrics) < 1e-6
    # the paper's observation: the raw ratio drifts below 1 (by m/(2S²) in the log), the regulated one does not;
    # and the tiny preset's clip range is reached
    raw, regulated = np.mean([m["raw_ratio_mean"] for m in metrics]), np.mean([m["ratio_mean"] for m in metrics])
    assert raw < 0.995 and abs(regulated - 1) < 2e-3, (raw, regulated)
    assert any(m["clipfrac"] > 0 for m in metrics)
