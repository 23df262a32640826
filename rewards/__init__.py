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
(3, h, w) float tensor in [0, 1] at its file's own size. A reward that scores sound sets `wants_audio = True` and
is called once per batch as `__call__(images, prompts[, conditions], audio=waveforms, sample_rate=hz)`: `images`
the whole video (B, F, 3, H, W), `audio` the waveforms (B, channels, samples), float32, at `sample_rate` Hz (as the
audio-video model's vocoder makes them; e.g. `audio_loudness`); with a model that makes no audio it stops the run
with one line before anything is loaded. Every other reward is called as before (an audio-video model's frames
only). A reward that judges whole video clips sets `video = True` and receives (B, F, 3, H, W) (others score each
frame and the scores are averaged); given an image model it stops the run with one line. `__call__` may return a
dict: its "score" entry (B numbers) is the score, every other entry a named column of B numbers (e.g. per-dimension
scores) logged as `reward_<name>_<column>_mean/_std` and `eval_reward_<name>_<column>`.
`__init__` gets `device`/`dtype` only when it names them. A plain function `(images, prompts) -> scores` works
too (pointwise, no options). Rewards are called under torch.no_grad on detached images; one that raises or
returns NaN/inf or the wrong number of scores stops the run with an error naming it.
In training, a pointwise reward is called once per rollout micro-batch, from a worker thread while the next
micro-batch is denoised (--reward-workers; common/scoring.py), one call at a time unless the score object sets
`thread_safe = True` (as the remote client and the VLM judge do). A reward that draws random numbers should use
its own generator: draws from torch's global one would interleave with the rollout's.
"""

import importlib
import inspect
import math
import re

import torch

from common.scoring import Reward, call_reward, condition_tensors, score_samples  # noqa: F401 (re-exported)
from common.utils import UserError
from rewards.audio import AudioLoudness, AudioPitch
from rewards.clip import Aesthetic, ClipScore, PickScore, PickScoreRank
from rewards.imagereward import ImageReward
from rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from rewards.ocr import OcrReward
from rewards.qwen_vl import EditReward, HPSv3, VideoAlign
from rewards.remote import RemoteReward
from rewards.vlm_judge import VlmJudge
from worlds.toy.reward import ToyColourShare, ToyReward
from worlds.toy_edit.reward import ToyEditReward
from worlds.toy_video.reward import ToyVideoReward


# name -> (factory(device, dtype, **options) -> score callable, groupwise). A score object's own `groupwise`
# attribute, when it has one, wins (a remote reward learns it from its server).
REWARDS = {
    "pickscore": (PickScore, False),
    "pickscore_rank": (PickScoreRank, True),
    "clip": (ClipScore, False),
    "aesthetic": (Aesthetic, False),
    "ocr": (OcrReward, False),
    "imagereward": (ImageReward, False),
    "hpsv3": (HPSv3, False),
    "editreward": (EditReward, False),
    "videoalign": (VideoAlign, False),
    "jpeg_compressibility": (lambda device, dtype: jpeg_compressibility, False),
    "jpeg_incompressibility": (lambda device, dtype: jpeg_incompressibility, False),
    "remote": (RemoteReward, False),
    "toy": (ToyReward, False),
    "toy_colour_share": (ToyColourShare, False),
    "toy_edit": (ToyEditReward, False),
    "toy_video": (ToyVideoReward, False),
    "vlm_judge": (VlmJudge, False),
    "audio_loudness": (AudioLoudness, False),
    "audio_pitch": (AudioPitch, False),
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
    except SyntaxError as error:  # the user's own file: where, not a traceback through importlib
        raise UserError(f"--reward {spec!r}: {error.filename}:{error.lineno}: {type(error).__name__} in "
                        f"{module_name!r}: {error.msg}") from None
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
    try:
        return factory(**kwargs, **options)
    except ValueError as error:  # a bad option value (e.g. toy's mode=): one line, as for the other spec errors
        raise UserError(f"--reward {spec!r}: {error}") from None


def load_rewards(specs: list[str], device=None, dtype=torch.float32, judges: list[str] = ()) -> list[Reward]:
    """Build the rewards of `--reward` SPECs, then the judges of `--judge` SPECs (`Reward.judge`: scored at
    evaluation only). Rewards on the same backbone with the same settings (e.g. pickscore and pickscore_rank, or
    clip and aesthetic) share one model instance (rewards/clip.py)."""
    if not specs:
        raise UserError("give at least one --reward")
    rewards = []
    for spec, judge in [(spec, False) for spec in specs] + [(spec, True) for spec in judges]:
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
        if judge and groupwise:
            raise UserError(f"--judge {spec!r} is groupwise (it ranks a group's samples): a judge scores each "
                            f"evaluation sample on its own")
        rewards.append(Reward(name, weight, scorer, groupwise, bool(getattr(scorer, "wants_conditions", False)),
                              bool(getattr(scorer, "video", False)), bool(getattr(scorer, "wants_audio", False)),
                              judge))
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise UserError(f"two rewards or judges are named {max(names, key=names.count)!r} in "
                        f"{[*specs, *judges]}: give one another name with ,name=...")
    return rewards


def load_run_rewards(args) -> list[Reward]:
    """The rewards of a training script's flags: every --reward (the JPEG compressibility reward when none is given),
    then every --judge (scored at evaluation only), on --reward-device (`accelerator`: this process's device)."""
    from accelerate import PartialState

    # The same process state that setup's Accelerator then joins (a PartialState made first decides the launch).
    state = PartialState(cpu=not torch.cuda.is_available())
    device = state.device if args.reward_device == "accelerator" else torch.device("cpu")
    return load_rewards(args.reward or ["jpeg_compressibility"], device, judges=getattr(args, "judge", None) or [])
