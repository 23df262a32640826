"""common/timesampling.py: the decoupled family's training σ's and ε's, checked against numpy computations."""

import math

import numpy as np
import pytest
import torch

from common.timesampling import (check_time_sampling, default_num_train, eligible_steps, sample_train_noise,
                                 sample_train_sigmas, shift_sigma, training_generators, training_seeds)
from common.utils import UserError

# A shifted schedule like FLUX's: σ_j = s·t/(1 + (s − 1)·t), t = 1 − j/N, then σ_N = 0.
N = 10
_t = 1 - np.arange(N) / N
SCHEDULE = torch.tensor(np.append(3 * _t / (1 + 2 * _t), 0.0), dtype=torch.float32)


def generators(count, seed=0):
    return training_generators(range(seed, seed + count))


def test_eligible_steps_are_chosen_by_index_as_awm():
    for lo, hi in [(0.0, 1.0), (0.0, 0.9), (0.2, 0.7)]:
        expected = list(range(int(lo * N), int(hi * N)))  # AWM: [0, int(0.9·N))
        assert eligible_steps(SCHEDULE, (lo, hi), "discrete") == expected
        assert eligible_steps(SCHEDULE, (lo, hi), "discrete_random") == expected
        assert eligible_steps(SCHEDULE, (lo, hi), "discrete_wo_init") == [j for j in expected if j != 0]
    assert eligible_steps(SCHEDULE, (0.0, 0.9), "discrete") == list(range(9))


def test_sd3_schedule_at_14_steps_never_admits_step_12():
    """SD3.5 at N = 14 (the scheduler's own schedule, shift 3): step 12 has σ ≈ 0.21 ≥ 0.1, so choosing by σ
    admitted it; AWM trains indices [0, int(0.9·14)) = [0, 12) only."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(14)
    sigmas = scheduler.sigmas.float()
    assert 0.2 < float(sigmas[12]) < 0.22
    assert eligible_steps(sigmas, (0.0, 0.9), "discrete") == list(range(12))


def test_discrete_random_is_a_uniform_subset_without_replacement():
    """DiffusionNFT's default: ⌊0.99·N⌋ distinct steps uniformly at random; at N = 10 each step is the dropped one
    about 1/10 of the time (a stratified pick would always keep steps 0–7)."""
    T, count = N - 1, 4000
    rows = sample_train_sigmas("discrete_random", T, generators(count), SCHEDULE).tolist()
    index_of = {float(SCHEDULE[j]): j for j in range(N)}
    dropped = np.zeros(N)
    for row in rows:
        steps = {index_of[s] for s in row}
        assert len(steps) == T
        dropped[list(set(range(N)) - steps)[0]] += 1
    np.testing.assert_allclose(dropped / count, 0.1, atol=0.02)
    stratified = sample_train_sigmas("discrete", T, generators(200), SCHEDULE)
    assert all(float(SCHEDULE[j]) in row for row in stratified.tolist() for j in range(8))


@pytest.mark.parametrize("strategy", ["discrete", "discrete_wo_init"])
def test_discrete_picks_one_distinct_step_per_stratum(strategy):
    steps = eligible_steps(SCHEDULE, (0.0, 0.9), strategy)
    T = 4
    sigmas = sample_train_sigmas(strategy, T, generators(200), SCHEDULE, (0.0, 0.9))
    assert sigmas.shape == (200, T) and sigmas.dtype == torch.float32
    index_of = {float(SCHEDULE[j]): j for j in steps}
    bounds = [len(steps) * i // T for i in range(T + 1)]  # strata of positions in `steps`
    seen = set()
    for row in sigmas.tolist():
        positions = sorted(steps.index(index_of[s]) for s in row)  # KeyError if σ is not an eligible step
        assert [np.searchsorted(bounds, p, side="right") - 1 for p in positions] == list(range(T))
        seen |= set(positions)
    assert seen == set(range(len(steps)))  # every eligible step gets drawn
    assert len({tuple(r) for r in sigmas.tolist()}) > 100  # per-sample draws, in a random order
    if strategy == "discrete_wo_init":
        assert (sigmas < 1).all()


def test_nft_default_takes_all_but_one_percent_of_the_steps():
    assert default_num_train("discrete", SCHEDULE, (0.0, 1.0)) == math.floor(0.99 * N)
    assert default_num_train("discrete_wo_init", SCHEDULE, (0.0, 1.0)) == math.floor(0.99 * (N - 1))
    sigmas = sample_train_sigmas("discrete", N - 1, generators(50), SCHEDULE)
    assert all(len(set(row)) == N - 1 for row in sigmas.tolist())


def test_shift_matches_numpy_and_moves_sigma_toward_noise():
    u = torch.linspace(0, 1, 101, dtype=torch.float64)
    expected = np.clip(3 * u.numpy() / (1 + 2 * u.numpy()), 0.01, 1 - 1e-6)
    np.testing.assert_allclose(shift_sigma(u, 3.0).numpy(), expected, rtol=0, atol=1e-15)
    # Mean σ for u uniform on [a, 1]: (3/2)·[(1 − a) − ½·ln(3/(1 + 2a))]/(1 − a). For a = 0 it is ≈ 0.68,
    # the value algorithms.md quotes (it names [0.2, 1], where the formula gives ≈ 0.79).
    for a in (0.1, 0.2):  # (a = 0 would hit the clamp at 0.01)
        grid = torch.tensor(a + (1 - a) * (np.arange(100000) + 0.5) / 100000)
        analytic = 1.5 * ((1 - a) - 0.5 * math.log(3 / (1 + 2 * a))) / (1 - a)
        assert float(shift_sigma(grid, 3.0).mean()) == pytest.approx(analytic, abs=1e-6)
    assert analytic == pytest.approx(0.7855, abs=1e-4)
    assert 1.5 * (1 - 0.5 * math.log(3)) == pytest.approx(0.68, abs=0.005)


def _unshift(sigma, s=3.0):
    return sigma / (s - (s - 1) * sigma)


def test_uniform_is_stratified_on_the_range_then_shifted():
    T, (lo, hi) = 5, (0.0, 0.8)
    sigmas = sample_train_sigmas("uniform", T, generators(300), SCHEDULE, (lo, hi)).double().numpy()
    u = _unshift(sigmas)
    assert (u >= 1 - hi - 1e-6).all() and (u <= 1 - lo + 1e-6).all()
    strata = np.floor((u - (1 - hi)) / (hi - lo) * T).clip(0, T - 1)
    assert all(sorted(row) == list(range(T)) for row in strata.tolist())
    assert sigmas.mean() == pytest.approx(0.7855, abs=0.01)  # 1500 stratified draws of the mean above
    assert len({tuple(r) for r in sigmas.tolist()}) == 300


def test_logit_normal_is_a_stratified_normal_through_a_sigmoid():
    T = 4
    sigmas = sample_train_sigmas("logit_normal", T, generators(300), SCHEDULE).double().numpy()
    u = _unshift(sigmas)
    z = np.log(u / (1 - u))
    phi = np.array([[0.5 * (1 + math.erf(v / math.sqrt(2))) for v in row] for row in z])
    strata = np.floor(phi * T).clip(0, T - 1)
    assert all(sorted(row) == list(range(T)) for row in strata.tolist())
    # With a range the sigmoid is mapped affinely into [1 − f_hi, 1 − f_lo] before the shift.
    ranged = _unshift(sample_train_sigmas("logit_normal", T, generators(300), SCHEDULE, (0.3, 0.6)).double().numpy())
    assert ranged.min() >= 0.4 - 1e-6 and ranged.max() <= 0.7 + 1e-6


@pytest.mark.parametrize("strategy", ["discrete_random", "discrete", "uniform", "logit_normal"])
def test_each_sample_draws_from_its_own_generator(strategy):
    seeds = training_seeds(7, 3, 6)
    assert seeds == training_seeds(7, 3, 6) and seeds != training_seeds(7, 4, 6)
    like = torch.zeros(6, 16, 4)
    gens = training_generators(seeds)
    batch_sigmas = sample_train_sigmas(strategy, 3, gens, SCHEDULE)
    batch_noise = sample_train_noise(3, gens, like)
    gens = training_generators(seeds[4:])  # the same samples in another micro-batch / process
    assert torch.equal(sample_train_sigmas(strategy, 3, gens, SCHEDULE), batch_sigmas[4:])
    assert torch.equal(sample_train_noise(3, gens, like[4:]), batch_noise[4:])
    assert batch_noise.shape == (6, 3, 16, 4)
    assert not torch.equal(batch_noise[0, 0], batch_noise[0, 1]) and not torch.equal(batch_noise[0], batch_noise[1])


def test_noise_is_standard_normal():
    noise = sample_train_noise(8, generators(64), torch.zeros(64, 32, 16)).double().numpy()
    assert abs(noise.mean()) < 0.01 and abs(noise.std() - 1) < 0.01


@pytest.mark.parametrize("args,message", [
    (("beta", 2, (0.0, 1.0)), "unknown --time-sampling 'beta'; choose one of: discrete_random, discrete, discrete_wo_init, uniform"),
    (("discrete", 11, (0.0, 1.0)), "--train-timesteps 11 exceeds the 10 rollout steps that discrete may pick"),
    (("discrete_wo_init", 10, (0.0, 1.0)), "exceeds the 9 rollout steps that discrete_wo_init may pick"),
    (("uniform", 0, (0.0, 1.0)), "--train-timesteps must be at least 1"),
    (("uniform", 2, (0.5, 0.5)), "--timestep-range 0.5 0.5 must satisfy 0 <= lo < hi <= 1"),
    (("uniform", 2, (0.0, 1.5)), "must satisfy 0 <= lo < hi <= 1"),
])
def test_bad_settings_raise_one_line_user_errors(args, message):
    strategy, count, timestep_range = args
    with pytest.raises(UserError, match=None) as info:
        check_time_sampling(strategy, count, SCHEDULE, timestep_range)
    assert message in str(info.value) and "\n" not in str(info.value)
    check_time_sampling("uniform", 50, SCHEDULE, (0.0, 1.0))  # continuous strategies take any count
