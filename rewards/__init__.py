"""Rewards by name. `--reward SPEC` may be given several times; the weighted scores are combined by the
advantage aggregation (common/advantages.py). Normalisations: docs/algorithms.md §6; docs/rewards.md.

SPEC is one of
    NAME[:WEIGHT][,KEY=VALUE...]            a reward of this package, e.g. `pickscore:1.0`, `ocr,engine=tesseract`
    MODULE:ATTR[:WEIGHT][,KEY=VALUE...]     a user's reward imported by path, e.g. `my_pkg.rewards:Sharpness:0.5`
The part after the first `:` is a weight when it is a number and an attribute name otherwise, so the two forms
cannot be confused (built-in names contain no `:`). Options follow commas; their values may contain `:`
(`remote,url=http://10.0.0.2:8000`). Every reward accepts `name=` (the key of its logged metrics).

The interface a reward follows (the built-in ones and the user's alike):
    class MyReward:
        groupwise = False        # True: called once per group with all K samples of one prompt
        def __init__(self, device=None, dtype=torch.float32, **options): ...   # options: strings from SPEC
        def __call__(self, images, prompts):  # images (B, 3, H, W) floats in [0, 1]; prompts B strings
            return scores                     # B finite numbers (list, numpy or torch)
A reward that judges an edit or an image-to-video sample against its input sets `wants_conditions = True` and is
called as `__call__(images, prompts, conditions)`: conditions[i] is the list of sample i's condition images, each a
(3, h, w) float tensor in [0, 1] at its file's own size. Every other reward is called as before.
`__init__` gets `device`/`dtype` only when it names them. A plain function `(images, prompts) -> scores` works
too (pointwise, no options). Rewards are called under torch.no_grad on detached images; one that raises or
returns NaN/inf or the wrong number of scores stops the run with an error naming it.
"""

import importlib
import inspect
import math
import os
import re
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from common.utils import UserError
from rewards.clip import Aesthetic, ClipScore, PickScore, PickScoreRank
from rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from rewards.ocr import OcrReward
from rewards.remote import RemoteReward
from rewards.toy import ToyReward


@dataclass
class Reward:
    name: str
    weight: float
    score: Callable
    groupwise: bool = False
    wants_conditions: bool = False  # called with the samples' condition images (edit, image-to-video rewards)


# name -> (factory(device, dtype, **options) -> score callable, groupwise). A score object's own `groupwise`
# attribute, when it has one, wins (a remote reward learns it from its server).
REWARDS = {
    "pickscore": (PickScore, False),
    "pickscore_rank": (PickScoreRank, True),
    "clip": (ClipScore, False),
    "aesthetic": (Aesthetic, False),
    "ocr": (OcrReward, False),
    "jpeg_compressibility": (lambda device, dtype: jpeg_compressibility, False),
    "jpeg_incompressibility": (lambda device, dtype: jpeg_incompressibility, False),
    "remote": (RemoteReward, False),
    "toy": (ToyReward, False),
}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")  # a weight; not `nan`/`inf` (attribute names)


def parse_reward_spec(spec: str) -> tuple[str, float, dict]:
    """SPEC -> (source, weight, options); source is a name of REWARDS or `module:attr`."""
    head, *option_items = spec.split(",")
    options = {}
    for item in option_items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise UserError(f"reward option {item!r} in {spec!r} is not KEY=VALUE")
        if key in options:
            raise UserError(f"reward option {key!r} is given twice in {spec!r}")
        options[key] = value
    parts = head.split(":")
    weight = None
    if len(parts) >= 2 and _NUMBER.match(parts[-1]):
        weight = float(parts.pop())
    source = ":".join(parts)
    if ":" in source:
        if source.split(":")[0] in REWARDS:
            raise UserError(f"reward weight in {spec!r} is not a number")
        if not _IMPORT_PATH.match(source):
            raise UserError(f"cannot read --reward {spec!r}: use NAME[:WEIGHT] or MODULE:ATTR[:WEIGHT], "
                            f"then ,KEY=VALUE options")
    elif source not in REWARDS:
        raise UserError(f"unknown reward {source!r}; choose from: {', '.join(sorted(REWARDS))}, "
                        f"or give MODULE:ATTR of your own reward")
    weight = 1.0 if weight is None else weight
    if not math.isfinite(weight):
        raise UserError(f"reward weight in {spec!r} is not finite")
    return source, weight, options


def _import_reward(source: str, spec: str):
    module_name, attr = source.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UserError(f"--reward {spec!r}: cannot import {module_name!r} ({error}); install it or add its "
                        f"folder to PYTHONPATH") from None
    if not hasattr(module, attr):
        raise UserError(f"--reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _construct(factory, device, dtype, options: dict, spec: str):
    """Call `factory` with device/dtype when it names them, and with the options it accepts."""
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and n not in ("self", "device", "dtype")]
    unknown = [key for key in options if key not in accepted and not takes_any]
    if unknown:
        raise UserError(f"--reward {spec!r}: unknown option {unknown[0]!r}; this reward accepts: "
                        f"{', '.join(accepted + ['name'])}")
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if k in params or takes_any}
    return factory(**kwargs, **options)


def load_rewards(specs: list[str], device=None, dtype=torch.float32) -> list[Reward]:
    """Build the rewards of `--reward` SPECs. Rewards on the same backbone with the same settings (e.g.
    pickscore and pickscore_rank, or clip and aesthetic) share one model instance (rewards/clip.py)."""
    if not specs:
        raise UserError("give at least one --reward")
    rewards = []
    for spec in specs:
        source, weight, options = parse_reward_spec(spec)
        name = options.pop("name", None)
        if name is not None and not re.fullmatch(r"[\w.-]+", name):
            raise UserError(f"--reward {spec!r}: name= takes letters, digits, '_', '.' or '-'")
        if ":" in source:
            obj = _import_reward(source, spec)
            if inspect.isclass(obj):
                scorer = _construct(obj, device, dtype, options, spec)
            elif callable(obj):
                if options:
                    raise UserError(f"--reward {spec!r}: {source} is a function and takes no options")
                scorer = obj
            else:
                raise UserError(f"--reward {spec!r}: {source} is neither a class nor a function")
            default_name, groupwise = source.split(":")[1], False
        else:
            factory, groupwise = REWARDS[source]
            scorer = _construct(factory, device, dtype, options, spec)
            default_name = source
        name = name or getattr(scorer, "name", None) or default_name
        groupwise = bool(getattr(scorer, "groupwise", groupwise))
        rewards.append(Reward(name, weight, scorer, groupwise, bool(getattr(scorer, "wants_conditions", False))))
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise UserError(f"two rewards are named {max(names, key=names.count)!r} in {specs}: "
                        f"give one another name with ,name=...")
    return rewards


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
