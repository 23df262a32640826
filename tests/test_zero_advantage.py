"""Which samples count as zero-advantage (algorithms.md §3): those of groups whose K rewards are equal, decided on
the group's reward std, also when the equal reward (0.2, 0.6) is not exact in binary floating point. grpo,
grpo_guard and mixgrpo drop exactly those samples; awm trains every sample, as AWM's reference does."""

import numpy as np
import pytest
import torch

from common.advantages import compute_advantages, trained_samples
from conftest import read_metrics, run_script


K = 16  # the toy presets' group size: the float64 mean of 16 equal 0.2's is not exactly 0.2


def equal_groups(values) -> np.ndarray:
    """Per sample: do all K rewards of its group compare equal? (independent of any std)"""
    rewards = np.asarray(values, np.float64).reshape(-1, K)
    return np.repeat([bool((group == group[0]).all()) for group in rewards], K)


@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
def test_zero_std_groups_are_exactly_the_equal_reward_groups(aggregation):
    constant = [0.2, 0.4, 0.6, 0.8, 1 / 3, 0.1 + 0.2, 0.0, 0.5, 1.0]  # not binary fractions, then exact ones
    mixed = [[0.2] * (K - 1) + [0.4], [0.0] + [1.0] * (K - 1), [0.6] * (K - 1) + [0.6 + 1e-9]]
    values = [v for c in constant for v in [c] * K] + [v for group in mixed for v in group]
    ids = torch.tensor(np.repeat(np.arange(len(values) // K) * 7919 + 3, K))
    advantages, stats = compute_advantages(torch.tensor(values, dtype=torch.float64)[:, None], [1.0], ids,
                                           aggregation)
    expected_zero = equal_groups(values)
    np.testing.assert_array_equal(stats["zero_std"].numpy(), expected_zero)
    keep = trained_samples(stats, keep_zero_advantage=False)
    np.testing.assert_array_equal(keep.numpy(), ~expected_zero)
    assert float(1 - keep.double().mean()) == stats["zero_std_frac"] == len(constant) / (len(values) // K)
    assert bool(trained_samples(stats, keep_zero_advantage=True).all())
    if aggregation == "sum":  # what `A != 0` got wrong: equal rewards such as 0.2 leave a residue of ~1e-13
        residue = advantages[torch.tensor(expected_zero)].abs()
        assert bool((residue[:4 * K] != 0).all()) and float(residue.max()) < 1e-9


CONSTANT_REWARD = '''
def score(images, prompts):
    """The same reward for all K samples of the "constant" prompts (0.2 and 0.6 are not binary fractions, 0.5 is),
    the mean brightness (different for every sample) for the others."""
    table = {"a constant point two": 0.2, "a constant point six": 0.6, "a constant half": 0.5}
    return [table.get(p, float(image.mean())) for image, p in zip(images, prompts)]
'''
PROMPTS = ["a constant point two", "a red apple", "a constant point six", "a blue car", "a constant half",
           "a green tree"]


@pytest.fixture
def half_constant(tmp_path):
    """Six training prompts, all drawn every epoch (M = 6): half of the epoch's groups have equal rewards."""
    data, module = tmp_path / "data", tmp_path / "module"
    data.mkdir(), module.mkdir()
    (data / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (data / "test.txt").write_text("a red apple\n")
    (module / "constant_reward.py").write_text(CONSTANT_REWARD)
    args = ["--preset", "tiny", "--epochs", "1", "--prompts-per-epoch", "6", "--group-size", "4", "--batch-size", "8",
            "--updates-per-epoch", "1", "--num-steps", "4", "--eval-every", "0", "--save-every", "0",
            "--dataset", data, "--reward", "constant_reward:score"]
    return args, {"PYTHONPATH": str(module)}


@pytest.mark.parametrize("script", ["grpo", "grpo_guard", "mixgrpo"])
def test_grpo_family_drops_exactly_the_zero_std_groups(script, half_constant, tmp_path):
    args, env = half_constant
    extra = ["--num-steps", "6", "--window-size", "2"] if script == "mixgrpo" else []
    run_script(f"algos/{script}.py", *args, *extra, "--output-dir", tmp_path / "out", env=env)
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["zero_std_frac"] == 0.5 and metrics["dropped_frac"] == 0.5, metrics


def test_awm_trains_every_sample_and_dropping_rescales_the_policy_gradient(half_constant, tmp_path):
    """Default: nothing dropped. With the KL terms off, the zero-std samples carry no gradient, so the summed
    gradient is the same with or without them and only the averaging differs: dropping the share f = 0.5 makes the
    gradient 1/(1 − f) = 2 times the reference's (every sample in the mean)."""
    args, env = half_constant
    no_kl = ["--kl-beta", "0", "--ema-kl-beta", "0", "--train-timesteps", "2"]
    run_script("algos/awm.py", *args, *no_kl, "--output-dir", tmp_path / "all", env=env)
    run_script("algos/awm.py", *args, *no_kl, "--drop-zero-advantage", "--output-dir", tmp_path / "drop", env=env)
    (every,), (dropped,) = read_metrics(tmp_path / "all"), read_metrics(tmp_path / "drop")
    assert every["zero_std_frac"] == 0.5 and every["dropped_frac"] == 0.0
    assert dropped["zero_std_frac"] == 0.5 and dropped["dropped_frac"] == 0.5
    assert dropped["grad_norm"] == pytest.approx(2 * every["grad_norm"], rel=1e-4)
