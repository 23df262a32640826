"""Rewards by name. `--reward NAME[:WEIGHT]` may be given several times; the weighted scores are combined
by the advantage aggregation (common/advantages.py).

A reward is a callable `score(images, prompts) -> array (batch,)`, images being (B, 3, H, W) floats in
[0, 1]. A *pointwise* reward scores each sample alone; a *groupwise* reward is called once per group
with all K samples of one prompt (e.g. a rank within the group), whichever processes they were drawn on.
"""

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from common.utils import UserError
from rewards.jpeg import jpeg_compressibility, jpeg_incompressibility


@dataclass
class Reward:
    name: str
    weight: float
    score: Callable
    groupwise: bool = False


# name -> (loader(device, dtype) -> score callable, groupwise)
REWARDS = {
    "jpeg_compressibility": (lambda device, dtype: jpeg_compressibility, False),
    "jpeg_incompressibility": (lambda device, dtype: jpeg_incompressibility, False),
}


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """`name` or `name:weight`."""
    name, _, weight = spec.partition(":")
    if name not in REWARDS:
        raise UserError(f"unknown reward {name!r}; choose from: {', '.join(sorted(REWARDS))}")
    try:
        value = float(weight) if weight else 1.0
    except ValueError:
        raise UserError(f"reward weight in {spec!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"reward weight in {spec!r} is not finite")
    return name, value


def load_rewards(specs: list[str], device=None, dtype=torch.float32) -> list[Reward]:
    parsed = [parse_reward_spec(spec) for spec in specs]
    if not parsed:
        raise UserError("give at least one --reward")
    names = [name for name, _ in parsed]
    if len(set(names)) != len(names):
        raise UserError(f"a reward is listed twice in {specs}")
    rewards = []
    for name, weight in parsed:
        loader, groupwise = REWARDS[name]
        rewards.append(Reward(name, weight, loader(device, dtype), groupwise))
    return rewards


def _checked(reward: Reward, values, count: int) -> torch.Tensor:
    values = torch.as_tensor(np.asarray(values, dtype=np.float64))
    if values.shape != (count,):
        raise RuntimeError(f"reward {reward.name!r} returned shape {tuple(values.shape)}, expected ({count},)")
    if not torch.isfinite(values).all():
        raise UserError(f"reward {reward.name!r} returned NaN or inf for {int((~torch.isfinite(values)).sum())} "
                        f"of {count} samples")
    return values


def score_samples(rewards: list[Reward], images: torch.Tensor, prompts: list[str], group_ids: torch.Tensor,
                  accelerator=None) -> torch.Tensor:
    """Raw scores (batch, num_rewards), float64 on the CPU, for this process's samples.

    Groupwise rewards need every sample of a group: the images are gathered from all processes, each process
    scores the groups it leads (round-robin), and the scores are summed back across processes.
    """
    columns = []
    for reward in rewards:
        if not reward.groupwise:
            columns.append(_checked(reward, reward.score(images, prompts), len(prompts)))
            continue
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather, gather_object

            all_images = gather(images.contiguous()).cpu()
            all_prompts = gather_object(list(prompts))
            all_ids = gather(group_ids.to(accelerator.device)).cpu()
            rank, world = accelerator.process_index, accelerator.num_processes
        else:
            all_images, all_prompts, all_ids, rank, world = images.cpu(), list(prompts), group_ids.cpu(), 0, 1
        scores = torch.zeros(len(all_prompts), dtype=torch.float64)
        for g, gid in enumerate(torch.unique(all_ids).tolist()):
            if g % world != rank:
                continue
            members = (all_ids == gid).nonzero().flatten()
            values = reward.score(all_images[members], [all_prompts[i] for i in members])
            scores[members] = _checked(reward, values, len(members))
        if world > 1:
            from accelerate.utils import reduce

            scores = reduce(scores.to(accelerator.device), reduction="sum").cpu()
        start = accelerator.process_index * len(prompts) if world > 1 else 0
        columns.append(scores[start:start + len(prompts)])
    return torch.stack(columns, dim=1)
