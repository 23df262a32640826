"""Scoring samples with loaded rewards (rewards/ builds them from `--reward` specs): one call per reward with
its failures turned into one-line errors, groupwise rewards over all processes, and the condition images of
edits and image-to-video for the rewards that want them. Part of `common` so that the training machinery never
imports `rewards/`: the scripts load the rewards and hand them to `setup`."""

import os
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from common.utils import UserError


@dataclass
class Reward:
    name: str
    weight: float
    score: Callable
    groupwise: bool = False
    wants_conditions: bool = False  # called with the samples' condition images (edit, image-to-video rewards)


def condition_tensors(paths_per_sample) -> list[list[torch.Tensor]]:
    """Each sample's condition image files as (3, h, w) float tensors in [0, 1] (what a reward that wants
    conditions receives)."""
    from common.data import load_images

    return [[torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 for image in load_images(paths)]
            for paths in paths_per_sample]


def call_reward(reward: Reward, images: torch.Tensor, prompts: list[str], conditions=None) -> torch.Tensor:
    """Scores of one call as float64 (B,), off the graph; any failure becomes a one-line UserError naming
    the reward (with where it was raised, since the traceback is not printed). Video (B, F, 3, H, W): every
    frame index is scored as one batch of images and the scores are averaged over frames. `conditions`: each
    sample's condition images (`condition_tensors`), passed to a reward that wants them."""
    if images.ndim == 5:
        return torch.stack([call_reward(reward, images[:, f], prompts, conditions)
                            for f in range(images.shape[1])]).mean(0)
    count = len(prompts)
    extra = ()
    if reward.wants_conditions:
        if conditions is None or not any(conditions):
            raise UserError(f"reward {reward.name!r} judges samples against their condition images, but these "
                            f"samples have none (train a conditioned model on a dataset with \"image\" fields)")
        extra = (conditions,)
    try:
        with torch.no_grad():
            values = reward.score(images.detach(), list(prompts), *extra)
    except UserError:
        raise
    except Exception as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserError(f"reward {reward.name!r} raised {type(error).__name__} at "
                        f"{os.path.basename(frame.filename)}:{frame.lineno}: {message}") from error
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64)
    try:
        values = torch.as_tensor(np.asarray(values, dtype=np.float64))
    except (TypeError, ValueError):
        raise UserError(f"reward {reward.name!r} returned {type(values).__name__}, not {count} numbers") from None
    if values.shape != (count,):
        raise UserError(f"reward {reward.name!r} returned shape {tuple(values.shape)}, expected ({count},)")
    if not torch.isfinite(values).all():
        raise UserError(f"reward {reward.name!r} returned NaN or inf for {int((~torch.isfinite(values)).sum())} "
                        f"of {count} samples")
    return values


def _gather_everything(images, prompts, group_ids, accelerator, conditions):
    """All processes' samples (in rank order) and where this process's start; counts may differ by rank."""
    from accelerate.utils import gather, gather_object, pad_across_processes

    counts = gather_object([len(prompts)])
    # Collectives need device tensors (NCCL) of one size on every rank: pad, gather, then drop the padding.
    padded_images = pad_across_processes(images.detach().to(accelerator.device).contiguous(), dim=0)
    padded_ids = pad_across_processes(group_ids.to(accelerator.device), dim=0)
    all_images, all_ids, size = gather(padded_images).cpu(), gather(padded_ids).cpu(), max(counts)
    keep = torch.cat([torch.arange(r * size, r * size + c) for r, c in enumerate(counts)])
    all_prompts = gather_object(list(prompts))
    all_conditions = gather_object(list(conditions)) if conditions is not None else None
    return all_images[keep], all_prompts, all_ids[keep], all_conditions, sum(counts[:accelerator.process_index])


def score_samples(rewards: list[Reward], images: torch.Tensor, prompts: list[str], group_ids: torch.Tensor,
                  accelerator=None, conditions=None) -> torch.Tensor:
    """Raw scores (batch, num_rewards), float64 on the CPU, for this process's samples. `conditions`: each
    sample's condition image paths (a tuple, empty for text-only prompts), read only for rewards that want them.

    Groupwise rewards need every sample of a group: the samples of all processes are gathered (once), each
    process scores the groups it leads (round-robin over the sorted group ids), and the scores are summed
    back across processes. All processes must call this together when any reward is groupwise.
    """
    group_ids = torch.as_tensor(group_ids)
    if len(group_ids) != len(prompts) or len(images) != len(prompts):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts and {len(group_ids)} group ids differ")
    world = accelerator.num_processes if accelerator is not None else 1
    columns, everything = [], None
    loaded = condition_tensors(conditions) if conditions is not None and any(r.wants_conditions for r in rewards) \
        else None
    for reward in rewards:
        if not reward.groupwise:
            columns.append(call_reward(reward, images, prompts, loaded))
            continue
        if everything is None:
            everything = (_gather_everything(images, prompts, group_ids, accelerator, conditions) if world > 1
                          else (images.detach().cpu(), list(prompts), group_ids.cpu(), conditions, 0))
        all_images, all_prompts, all_ids, all_conditions, start = everything
        scores = torch.zeros(len(all_prompts), dtype=torch.float64)
        for g, gid in enumerate(torch.unique(all_ids).tolist()):
            if world > 1 and g % world != accelerator.process_index:
                continue
            members = (all_ids == gid).nonzero().flatten()
            group_conditions = (condition_tensors([all_conditions[i] for i in members])
                                if reward.wants_conditions and all_conditions is not None else None)
            scores[members] = call_reward(reward, all_images[members], [all_prompts[i] for i in members],
                                          group_conditions)
        if world > 1:
            from accelerate.utils import reduce

            scores = reduce(scores.to(accelerator.device), reduction="sum").cpu()
        columns.append(scores[start:start + len(prompts)])
    return torch.stack(columns, dim=1)
