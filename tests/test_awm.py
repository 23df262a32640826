"""algos/awm.py: the weightings and the clipped objective against float64 numpy, on- and off-policy behaviour,
and end-to-end runs on the tiny FLUX.1 (learning, resume, 2 processes, bad input)."""

import importlib.util

import numpy as np
import pytest
import torch

from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, script_error

TINY = ["--preset", "tiny"]
FAST = TINY + ["--epochs", "2", "--eval-every", "1", "--eval-num-prompts", "2"]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu",
             "peak_memory_gb"}  # measured


def _script():
    spec = importlib.util.spec_from_file_location("awm_script", REPO / "algos" / "awm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the training loop sits under `if __name__ == "__main__"`
    return module


awm = _script()


def _toy(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, 6, 4, generator=g)
    v = target + torch.randn(batch, 6, 4, generator=g) * torch.tensor([0.01, 0.3, 1.0, 2.0])[:batch, None, None]
    sigma = torch.tensor([0.05, 0.4, 0.75, 1.0])[:batch]
    adv = torch.tensor([1.0, -0.4, 0.25, -1.0])[:batch]
    return v, target, sigma, adv


def _numpy_weight(loss, s, weighting, p):
    """w(ℓ, σ) from algorithms.md §5, float64."""
    return {"uniform": loss, "t": s * loss, "t2": s * s * loss,
            "huber": s * (np.sqrt(loss + 1e-10) - 1e-5),
            "ghuber": s / p * ((loss + 1e-10) ** p - (1e-10) ** p)}[weighting]


def _numpy_weight_grad(loss, s, weighting, p):
    """dw/dℓ, float64."""
    return {"uniform": np.ones_like(loss), "t": s, "t2": s * s, "huber": s * 0.5 / np.sqrt(loss + 1e-10),
            "ghuber": s * (loss + 1e-10) ** (p - 1)}[weighting]


@pytest.mark.parametrize("weighting,power", [("uniform", 0.25), ("t", 0.25), ("t2", 0.25), ("huber", 0.25),
                                             ("ghuber", 0.25), ("ghuber", 0.5)])
def test_weightings_equal_a_float64_computation(weighting, power):
    v, target, sigma, _ = _toy()
    log_prob = awm.matching_log_prob(v, target, sigma, weighting, power)
    loss = ((v.double().numpy() - target.double().numpy()) ** 2).reshape(4, -1).mean(1)
    expected = -_numpy_weight(loss, sigma.double().numpy(), weighting, power)
    assert log_prob.dtype == torch.float64 and log_prob.shape == (4,)
    np.testing.assert_allclose(log_prob.numpy(), expected, rtol=1e-12, atol=1e-15)



def test_default_weighting_is_the_authors_ghuber():
    """Every configuration AWM's authors ship uses ghuber with p = 0.25; the paper presets inherit it (only the tiny
    preset picks uniform, documented there)."""
    assert (awm.Args().weighting, awm.Args().ghuber_power) == ("ghuber", 0.25)
    assert all("weighting" not in preset for name, preset in awm.PRESETS.items() if name.startswith("flux1"))

@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_on_policy_ratio_is_one_and_the_gradient_is_that_of_mean_a_logp(weighting):
    v, target, sigma, adv = _toy()
    v = v.clone().requires_grad_(True)
    log_prob = awm.matching_log_prob(v, target, sigma, weighting)
    loss, ratio = awm.clipped_policy_loss(log_prob, log_prob.detach(), adv.double(), clip_range=1.0)
    assert torch.equal(ratio, torch.ones_like(ratio))
    loss.mean().backward()
    # Independent gradient of −mean_b(A_b·logp_b) = mean_b(A_b·w(ℓ_b)): A_b·w'(ℓ_b)·2(v − t)/n / B.
    diff = v.detach().double().numpy() - target.double().numpy()
    n, s = diff[0].size, sigma.double().numpy()
    loss_np = (diff ** 2).reshape(4, -1).mean(1)
    scale = adv.double().numpy() * _numpy_weight_grad(loss_np, s, weighting, 0.25) * 2 / n / 4
    np.testing.assert_allclose(v.grad.double().numpy(), scale[:, None, None] * diff, rtol=1e-6, atol=1e-12)


def test_clip_stops_the_gradient_of_samples_whose_ratio_left_the_range():
    log_prob_old = torch.zeros(4, dtype=torch.float64)
    log_prob = torch.tensor([0.5, 0.5, -0.5, -0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, ratio = awm.clipped_policy_loss(log_prob, log_prob_old, adv, clip_range=0.2)
    loss = loss.mean()
    loss.backward()
    r = np.exp([0.5, 0.5, -0.5, -0.5])
    a = np.array([1.0, -1.0, 1.0, -1.0])
    objective = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    assert float(loss.detach()) == pytest.approx(objective.mean(), rel=1e-12)
    # ratio 1.65 with A > 0 and ratio 0.61 with A < 0 are clipped (no gradient); the other two are not.
    expected = np.where([True, False, False, True], 0.0, -a * r / 4)
    np.testing.assert_allclose(log_prob.grad.numpy(), expected, rtol=1e-12, atol=0)


def test_help_warns_about_turning_off_both_regularisers():
    result = run_script("algos/awm.py", "--help")
    text = " ".join(result.stdout.split())
    assert "turning off BOTH the EMA-KL term" in text and "PPO clip" in text and "collapse" in text


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory, tiny_flux_path):
    out = tmp_path_factory.mktemp("awm2")
    run_script("algos/awm.py", *FAST, "--kl-beta", "1e-3", "--weighting", "ghuber", "--output-dir", out)
    return out


def test_on_policy_run_writes_metrics_and_keeps_the_ratio_at_one(two_epoch_run):
    metrics = read_metrics(two_epoch_run)
    assert [m["epoch"] for m in metrics] == [0, 1]
    required = {"epoch", "reward_mean", "reward_std", "loss", "policy_loss", "matching_loss", "kl", "ema_kl",
                "approx_kl", "clipfrac", "ratio_mean", "ratio_dev_max", "ema_decay", "epoch_time_s",
                "num_processes", "eval_reward_mean", "samples_seen", "rollout_time_s", "reward_time_s", "train_time_s"}
    assert all(required <= m.keys() for m in metrics)
    assert all(np.isfinite(m[k]) for m in metrics for k in required)
    assert all(m["ratio_dev_max"] == 0 and m["ratio_mean"] == 1 and m["clipfrac"] == 0 for m in metrics)
    assert metrics[0]["ema_kl"] == 0 and metrics[1]["ema_kl"] > 0 and metrics[1]["kl"] > 0
    assert [m["ema_decay"] for m in metrics] == [0.001, 0.002]
    assert (two_epoch_run / "eval" / "epoch_000001.png").exists()
    assert (two_epoch_run / "checkpoints" / "epoch_000001" / "pytorch_lora_weights.safetensors").exists()


def test_off_policy_samples_with_an_ema_that_lags_and_the_clip_engages(tmp_path):
    """EMA decay held at 0.3 from the first epoch: after an update the EMA (the sampler) differs from θ, the
    ratio leaves a small clip range and the clip engages; before the first update the ratio is exactly 1."""
    run_script("algos/awm.py", *TINY, "--epochs", "3", "--eval-every", "0", "--off-policy", "--clip-range", "1e-4",
               "--ema-decay-rate", "0.3", "--output-dir", tmp_path)
    metrics = read_metrics(tmp_path)
    assert [m["ema_decay"] for m in metrics] == [0.3, 0.3, 0.3]
    assert metrics[0]["ratio_dev_max"] == 0 and metrics[0]["clipfrac"] == 0 and metrics[0]["ema_kl"] == 0
    assert all(m["ema_kl"] > 0 and m["ratio_dev_max"] > 1e-4 and m["clipfrac"] > 0 for m in metrics[1:])
    assert all(m["approx_kl"] > 0 for m in metrics[1:])


@SLOW
def test_reward_rises_on_tiny_flux(tmp_path):
    """Fixed seed, the tiny preset (50 epochs): the mean JPEG reward of the last 10 epochs beats the first 10's
    by > 0.3 kB (seen with the preset's uniform weighting: +0.73/+0.60/+0.88 for seeds 1-3)."""
    run_script("algos/awm.py", *TINY, "--seed", "1", "--eval-every", "0", "--output-dir", tmp_path)
    rewards = [m["reward_mean"] for m in read_metrics(tmp_path)]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    print(f"first-10 mean {first:.3f} kB, last-10 mean {last:.3f} kB")
    assert last - first > 0.3


@SLOW
def test_resume_equals_the_uninterrupted_run(tmp_path):
    args = TINY + ["--epochs", "5", "--save-every", "2", "--eval-every", "2", "--eval-num-prompts", "2",
                   "--off-policy", "--time-sampling", "logit_normal"]
    run_script("algos/awm.py", *args, "--output-dir", tmp_path / "full")
    run_script("algos/awm.py", *args, "--epochs", "3", "--output-dir", tmp_path / "split")
    run_script("algos/awm.py", *args, "--resume", "--output-dir", tmp_path / "split")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    full, split = strip(read_metrics(tmp_path / "full")), strip(read_metrics(tmp_path / "split"))
    assert [m["epoch"] for m in split] == [0, 1, 2, 3, 4] and "eval_reward_mean" in split[4]
    assert split == full


@SLOW
def test_two_processes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = FAST + ["--batch-size", "4", "--eval-num-prompts", "4"]
    run_script("algos/awm.py", *args, "--output-dir", one)
    run_script("algos/awm.py", *args, "--output-dir", two, launcher=ACCELERATE_2CPU)
    m1, m2 = read_metrics(one), read_metrics(two)
    assert [m["num_processes"] for m in m2] == [2, 2]
    assert m2[0]["reward_mean"] == pytest.approx(m1[0]["reward_mean"], abs=1e-9)
    # Per-sample σ and ε and DDP's gradient mean: the first optimizer step's gradient is the single process's.
    assert m2[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-5)
    assert m2[0]["loss"] == pytest.approx(m1[0]["loss"], rel=1e-5, abs=1e-7)  # on-policy: 0 up to rounding
    # ... hence the update and epoch 1.
    assert m2[1]["reward_mean"] == pytest.approx(m1[1]["reward_mean"], abs=1e-3)
    assert m2[1]["matching_loss"] == pytest.approx(m1[1]["matching_loss"], rel=1e-3)


def test_full_finetune_with_an_ema_copy(tmp_path):
    run_script("algos/awm.py", *FAST, "--full-finetune", "--learning-rate", "3e-3", "--off-policy",
               "--weighting", "t", "--output-dir", tmp_path)
    metrics = read_metrics(tmp_path)
    assert metrics[0]["ema_kl"] == 0 and metrics[1]["ema_kl"] > 0
    assert (tmp_path / "checkpoints" / "epoch_000001" / "transformer").is_dir()


def _error_of(*args):
    return script_error("algos/awm.py", *args)


@pytest.mark.parametrize("flags,message", [
    (["--weighting", "cubic"], "'--weighting'. Expected one of ('ghuber', 'uniform', 't', 't2', 'huber')"),
    (["--train-timesteps", "9"], "--train-timesteps 9 exceeds the 5 rollout steps that discrete may pick"),
    (["--clip-range", "0"], "--clip-range must be positive (inf: no clip)"),
])
def test_bad_input_gives_one_line_error(tmp_path, flags, message):
    assert message in _error_of(*TINY, "--epochs", "1", "--output-dir", tmp_path / "out", *flags)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
