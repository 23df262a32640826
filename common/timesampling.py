"""Training-time sampling for the decoupled family (DiffusionNFT, AWM): which noise levels σ a clean rollout
sample x0 is re-noised at, and with which noise ε (algorithms.md §5 "Time sampling").

Every sample draws its own T σ's and its own ε's from its own generator (seeded from the run seed, the epoch
and the sample's position), so a run with 1 or N processes and a resumed run train on the same points.
`timestep_range` = (f_lo, f_hi) are fractions along the denoising axis: the discrete kinds take rollout step
indices [⌊f_lo·N⌋, ⌊f_hi·N⌋), the continuous ones σ = shift(u) with u ∈ [1 − f_hi, 1 − f_lo].
"""

import math

import numpy as np
import torch

from common.utils import UserError

TIME_SAMPLINGS = ("discrete_random", "discrete", "discrete_wo_init", "uniform", "logit_normal")


def check_timestep_range(timestep_range) -> tuple[float, float]:
    lo, hi = (float(f) for f in timestep_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise UserError(f"--timestep-range {lo} {hi} must satisfy 0 <= lo < hi <= 1 (fractions along the "
                        f"denoising axis; 0 0.9 keeps the noisiest 90% of the steps)")
    return lo, hi


def eligible_steps(sigmas: torch.Tensor, timestep_range, strategy: str) -> list[int]:
    """Step indices j in [⌊f_lo·N⌋, ⌊f_hi·N⌋) of the N-step rollout schedule σ_0 = 1 > … > σ_{N−1}, chosen by
    INDEX as AWM does ([0, int(0.9·N)) for the noisiest 90%), not by σ value: with a shifted schedule a σ
    threshold admits different steps (SD3.5 at N = 14: σ ≥ 0.1 would admit step 12, σ 0.21, which AWM never
    trains). `discrete_wo_init` also drops j = 0 (σ = 1, where x_σ is pure noise)."""
    lo, hi = check_timestep_range(timestep_range)
    num_steps = len(sigmas) - 1
    steps = list(range(int(lo * num_steps), int(hi * num_steps)))
    return [j for j in steps if j > 0] if strategy == "discrete_wo_init" else steps


def default_num_train(strategy: str, sigmas: torch.Tensor, timestep_range) -> int:
    """⌊0.99·n⌋ distinct steps, n = the eligible rollout steps (DiffusionNFT's `timestep_fraction` 0.99: at
    N = 10 one step is dropped);
    for the continuous strategies n = the number of rollout steps."""
    n = len(eligible_steps(sigmas, timestep_range, strategy)) if strategy.startswith("discrete") else len(sigmas) - 1
    return max(1, math.floor(0.99 * n))


def check_time_sampling(strategy: str, num_train: int, sigmas: torch.Tensor, timestep_range) -> None:
    """Raise UserError for a strategy or count that cannot be drawn."""
    if strategy not in TIME_SAMPLINGS:
        raise UserError(f"unknown --time-sampling {strategy!r}; choose one of: {', '.join(TIME_SAMPLINGS)}")
    check_timestep_range(timestep_range)
    if num_train < 1:
        raise UserError(f"--train-timesteps must be at least 1, got {num_train}")
    if strategy.startswith("discrete"):
        n = len(eligible_steps(sigmas, timestep_range, strategy))
        if num_train > n:
            raise UserError(f"--train-timesteps {num_train} exceeds the {n} rollout steps that {strategy} may pick "
                            f"in --timestep-range {tuple(timestep_range)}; lower it or widen the range")


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """σ = s·u/(1 + (s − 1)·u), clamped to [0.01, 1 − 1e-6]. It acts in σ-space and moves σ toward high
    noise for s > 1 (AWM's convention; Flow-Factory shifts the clean-side fraction, reversing it)."""
    return (shift * u / (1 + (shift - 1) * u)).clamp(0.01, 1 - 1e-6)


def training_seeds(seed: int, epoch: int, count: int) -> list[int]:
    """One seed per sample of the epoch (by position in the epoch's draw) for its training σ's and ε's."""
    return np.random.default_rng([seed, epoch, 0x7153]).integers(0, 2**62, size=count).tolist()


def training_generators(seeds) -> list[torch.Generator]:
    """CPU generators, so the draws do not depend on the accelerator."""
    return [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]


def sample_train_sigmas(strategy: str, num_train: int, generators: list[torch.Generator], sigmas: torch.Tensor,
                        timestep_range=(0.0, 1.0), shift: float = 3.0) -> torch.Tensor:
    """(batch, num_train) float32 σ's, one independent draw per sample, in a random order.

    discrete_random: num_train distinct eligible rollout steps drawn uniformly without replacement
        (DiffusionNFT's default: at N = 10, T = 9 it drops one step, any of the ten, uniformly).
    discrete / discrete_wo_init: the eligible rollout steps are cut into num_train contiguous strata and one step
        is drawn in each, so the σ's are distinct schedule values (AWM; no extra shift: the schedule is shifted).
        A stratified pick of T = n − 1 always keeps the first steps and drops one of the last two.
    uniform: u = lo + (hi − lo)·(i + U_i)/T on [1 − f_hi, 1 − f_lo], then σ = shift(u).
    logit_normal: z_i = Φ⁻¹((i + U_i)/T) (stratified N(0, 1)), u = sigmoid(z) mapped affinely into
        [1 − f_hi, 1 − f_lo] (the identity for the full range), then σ = shift(u).
    """
    lo, hi = check_timestep_range(timestep_range)
    rows = []
    if strategy.startswith("discrete"):
        steps = torch.tensor(eligible_steps(sigmas, timestep_range, strategy))
        bounds = [(i * len(steps)) // num_train for i in range(num_train + 1)]
        lower, width = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
        schedule = sigmas.detach().float().cpu()
    for g in generators:
        strata = (torch.arange(num_train, dtype=torch.float64) + torch.rand(num_train, generator=g,
                                                                            dtype=torch.float64)) / num_train
        order = torch.randperm(num_train, generator=g)
        if strategy == "discrete_random":
            row = schedule[steps[torch.randperm(len(steps), generator=g)[:num_train]]]
        elif strategy.startswith("discrete"):
            # strata is in [i/T, (i+1)/T): its fractional position inside stratum i picks the step.
            pick = lower + ((strata * num_train - torch.arange(num_train)) * width).long().clamp_max(width - 1)
            row = schedule[steps[pick]]
        elif strategy == "uniform":
            row = shift_sigma(1 - hi + (hi - lo) * strata, shift).float()
        elif strategy == "logit_normal":
            z = torch.special.ndtri(strata.clamp(1e-7, 1 - 1e-7))
            row = shift_sigma(1 - hi + (hi - lo) * torch.sigmoid(z), shift).float()
        else:
            raise ValueError(f"unknown time sampling {strategy!r}; choose one of {', '.join(TIME_SAMPLINGS)}")
        rows.append(row[order])
    return torch.stack(rows).to(sigmas.device)


def sample_train_noise(num_train: int, generators: list[torch.Generator], like: torch.Tensor) -> torch.Tensor:
    """(batch, num_train, *like.shape[1:]) float32 ε's, drawn after the σ's from each sample's generator."""
    return torch.stack([torch.randn((num_train, *like.shape[1:]), generator=g) for g in generators]).to(like.device)


# ---- whole groups: draws shared by the K samples of a prompt (DGPO, TDM-R1's surrogate) ----------------------
def group_uniform(seeds, groups: torch.Tensor) -> torch.Tensor:
    """(B,) float64 U ~ U[0, 1), one per group (`groups`: positions in the epoch's draw), shared by its members."""
    members, inverse = torch.unique(groups, return_inverse=True)
    draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float64)
                       for g in training_generators([seeds[int(m)] for m in members])])
    return draws[inverse]


def group_noise(seeds, groups: torch.Tensor, num_train: int, like: torch.Tensor) -> torch.Tensor:
    """(B, num_train, ...) float32 ε's of a micro-batch whose samples belong to `groups` (their positions in the
    epoch's draw): each group draws from its own generator, seeded by seeds[group], and its members share the
    draw; every trained step gets a new ε. A function of (seed, epoch, group) only, not of the micro-batch."""
    members, inverse = torch.unique(groups, return_inverse=True)
    noise = sample_train_noise(num_train, training_generators([seeds[int(g)] for g in members]), like)
    return noise[inverse.to(noise.device)]


def groups_per_micro_batch(local_groups: int, group_size: int, batch_size: int) -> int:
    """The most whole groups that fit a micro-batch of batch_size (at least one) and divide this process's
    groups evenly, so that every micro-batch holds the same number of whole groups."""
    fits = [d for d in range(1, local_groups + 1) if local_groups % d == 0 and d * group_size <= batch_size]
    return max(fits, default=1)
