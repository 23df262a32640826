"""Group-relative advantages (algorithms.md §3). Called on the WHOLE epoch (all processes gathered), so
every group's statistics see all K of its samples whichever process drew them."""

import torch

AGGREGATIONS = ("sum", "gdpo")
ZERO_STD = 1e-12  # a group reward std below this counts as zero


def _group_mean_std(values: torch.Tensor, inverse: torch.Tensor, num_groups: int):
    """Per-sample group mean and population std (ddof 0) of `values` (N,), groups given by `inverse`."""
    count = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, inverse, torch.ones_like(values))
    mean = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, inverse, values) / count
    var = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, inverse, (values - mean[inverse]) ** 2) / count
    return mean[inverse], var.sqrt()[inverse], var.sqrt()


def compute_advantages(rewards: torch.Tensor, weights, group_ids: torch.Tensor, aggregation: str = "sum",
                       global_std: bool = False, clip: float = 5.0):
    """rewards: (N, R) raw scores of R rewards; weights: R floats; group_ids: (N,) ints (prompt hashes).

    Returns (advantages (N,) float64 clamped to ±clip, stats): `zero_std_frac` (share of groups whose combined
    reward std is below ZERO_STD), `zero_std` ((N,) bool, that per sample), `num_groups`. Math in float64.
    - sum:  r = Σ w_k r_k;  A = (r − mean_group r) / (std + 1e-4), std = the group's or (global_std) the epoch's.
    - gdpo: â_k = (r_k − mean_group r_k) / max(std_group r_k, 1e-6); c = Σ w_k â_k;
            A = (c − mean c) / max(std c, 1e-6) over the epoch.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    rewards = rewards.to(torch.float64).reshape(len(group_ids), -1)
    weights = torch.as_tensor(weights, dtype=torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    combined = rewards @ weights
    if aggregation == "sum":
        mean, std, group_std = _group_mean_std(combined, inverse, num_groups)
        if global_std:
            std = combined.std(correction=0).expand_as(combined)
        advantages = (combined - mean) / (std + 1e-4)
    else:
        normalised = []
        for k in range(rewards.shape[1]):
            mean_k, std_k, _ = _group_mean_std(rewards[:, k], inverse, num_groups)
            normalised.append((rewards[:, k] - mean_k) / std_k.clamp_min(1e-6))
        c = torch.stack(normalised, dim=1) @ weights
        advantages = (c - c.mean()) / c.std(correction=0).clamp_min(1e-6)
        _, _, group_std = _group_mean_std(combined, inverse, num_groups)
    # A group whose K combined rewards are equal holds no preference. Decided on its reward std, not on A == 0:
    # equal rewards such as 0.2 or 0.6 (not binary fractions) leave |A| ~ 1e-13 after the float64 mean.
    zero_std = group_std < ZERO_STD
    stats = {"zero_std_frac": float(zero_std.double().mean()), "num_groups": num_groups,
             "zero_std": zero_std[inverse]}
    return advantages.clamp(-clip, clip), stats


def trained_samples(stats: dict, keep_zero_advantage: bool) -> torch.Tensor:
    """(N,) bool: the samples an update trains on. Samples of zero-std groups carry no policy gradient and are
    dropped (Flow-GRPO's filter) unless `keep_zero_advantage`; the share dropped then equals `zero_std_frac`
    (groups of K each)."""
    zero_std = stats["zero_std"]
    return torch.ones_like(zero_std) if keep_zero_advantage else ~zero_std


def group_members(group_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{group id: positions of its samples, in order} for the epoch's (or a process's) samples."""
    group_ids = torch.as_tensor(group_ids)
    return {int(g): torch.nonzero(group_ids == g).flatten() for g in torch.unique(group_ids)}


def best_worst_pairs(advantages: torch.Tensor, group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """One (best, worst) pair of positions per group, by advantage (the first of equals wins). A group whose
    samples all have the same advantage gives no pair: it holds no preference."""
    pairs = []
    for members in group_members(group_ids).values():
        values = advantages[members]
        if bool((values == values[0]).all()):
            continue
        pairs.append((int(members[torch.argmax(values)]), int(members[torch.argmin(values)])))
    return pairs
