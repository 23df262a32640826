"""Held-out evaluation, one code path for the scripts (`common.setup.evaluate`: before the first update and every
--eval-every epochs) and for evaluate.py (any model or run's checkpoint, after the fact): the same prompts, seeds,
batches and ODE give the same numbers."""

from pathlib import Path

import torch

from common.models.base import AudioVideo
from common.parallel import gather_objects, scored_once
from common.sampling import sample, sample_generators
from common.scoring import condition_tensors, score_samples
from common.tracking import log_image, save_image_grid, save_wav


def evaluate_prompts(adapter, accelerator, encode, rewards: list, prompts: list, seeds_per_prompt: int,
                     num_steps: int, batch_size: int, guidance: float, grid: Path | None = None,
                     step: int = 0, best_of: bool = False, prompt_gap: bool = False) -> dict:
    """Euler-ODE samples of `prompts` × `seeds_per_prompt` fixed seeds with the adapter's transformer as it is now,
    split over the processes (`accelerator`: an Accelerator, or a common.parallel.DataParallel whose data-parallel
    ranks split them) in batches of `batch_size`: each pointwise reward's mean (`eval_reward_<name>`, and
    their weighted sum `eval_reward_mean`), each named column of a reward that returns them
    (`eval_reward_<name>_<column>`), each check of a reward that reports checks (`score.checks(images,
    prompts[, conditions])`: `eval_<reward>_<check>`), each with its standard error (`_se`: the sample standard
    deviation over prompts × seeds / √n). With `grid`, the main process writes a captioned grid of each prompt's
    samples (the first 8 seeds; conditioned prompts: their condition image first) and sends it to the trackers at
    `step`. With `best_of`, also `eval_<key>_best_of_<seeds>`: the mean over prompts of each prompt's best sample
    (for a pass/fail check, the share of prompts that some seed gets right). Audio-video models: the grid shows the
    frames, and each sample in it has its sound beside the grid, `<grid name>_audio/prompt<i>_seed<s>.wav`.
    Judges (`Reward.judge`, --judge) are scored like rewards but logged as `eval_judge_<name>` and left out of
    eval_reward_mean. With `prompt_gap`, every reward and judge also scores each sample against another prompt (the
    next one of `prompts`, a fixed derangement): `prompt_gap_<name>` = mean own − mean shuffled score, with its
    standard error over the samples' paired differences."""
    items = [(i, s) for i in range(len(prompts)) for s in range(seeds_per_prompt)]
    sigmas = adapter.sigmas(num_steps)
    pointwise = [r for r in rewards if not r.groupwise]
    results = []
    with accelerator.split_between_processes(list(range(len(items)))) as mine:
        for start in range(0, len(mine), batch_size):
            batch = [items[k] for k in mine[start:start + batch_size]]
            cond = encode([prompts[i] for i, _ in batch])
            seeds = [i + 1_000_003 * s for i, s in batch]  # prompt i's first seed is i, as in earlier versions
            velocity = lambda x, sigma, cond=cond: adapter.velocity(x, sigma, cond, guidance)  # noqa: E731
            x0 = sample(velocity, adapter.noise(sample_generators(seeds, accelerator.device)), sigmas, "ode")
            decoded = adapter.decode(x0, cond)
            images = decoded.video if isinstance(decoded, AudioVideo) else decoded
            texts = [prompts[i].prompt for i, _ in batch]
            conditions = [prompts[i].images for i, _ in batch]

            def score():  # called at once, in this iteration
                named = {}
                raw = score_samples(pointwise, decoded, texts, torch.tensor([prompts[i].key for i, _ in batch]),
                                    conditions=conditions, columns=named)
                checks = {f"{r.name}_{name}": values for r in pointwise if hasattr(r.score, "checks")
                          for name, values in r.score.checks(images, texts, *(
                              [condition_tensors(conditions)] if r.wants_conditions else [])).items()}
                checks.update({f"reward_{key}": values for key, values in named.items()})
                if prompt_gap and len(prompts) > 1:  # the same samples, each against the next prompt's text
                    other = [(i + 1) % len(prompts) for i, _ in batch]
                    shuffled = score_samples(pointwise, decoded, [prompts[o].prompt for o in other],
                                             torch.tensor([prompts[o].key for o in other]), conditions=conditions)
                    checks.update({f"prompt_gap_{r.name}": raw[:, k] - shuffled[:, k]
                                   for k, r in enumerate(pointwise)})
                return raw, checks

            # the processes of a sequence-parallel group drew the same samples: one of them scores
            raw, checks = scored_once(accelerator, score)
            for row, (i, s) in enumerate(batch):
                shown = grid is not None and s < 8
                sound = decoded[row].cpu() if shown and isinstance(decoded, AudioVideo) else None
                results.append(((i, s), raw[row].tolist(), {k: float(v[row]) for k, v in checks.items()},
                                images[row].cpu() if shown else None, sound))
    results = sorted(gather_objects(accelerator, results), key=lambda item: item[0])
    raw = torch.tensor([r[1] for r in results], dtype=torch.float64)
    weights = torch.tensor([0.0 if r.judge else r.weight for r in pointwise], dtype=torch.float64)
    columns = {"reward_mean": raw @ weights,
               **{f"{'judge' if r.judge else 'reward'}_{r.name}": raw[:, k] for k, r in enumerate(pointwise)},
               **{key: torch.tensor([r[2][key] for r in results], dtype=torch.float64) for key in results[0][2]}}
    out = {}
    for key, values in columns.items():
        name = key if key.startswith("prompt_gap_") else f"eval_{key}"
        out[name] = float(values.mean())
        out[f"{name}_se"] = float(values.std() / len(values) ** 0.5) if len(values) > 1 else 0.0
        if best_of and not key.startswith("prompt_gap_"):  # results are sorted prompt-major
            out[f"eval_{key}_best_of_{seeds_per_prompt}"] = float(values.view(len(prompts), -1).amax(1).mean())
    if grid is not None and accelerator.is_main_process:
        shown = min(seeds_per_prompt, 8)
        samples = torch.stack([r[3] for r in results if r[3] is not None])
        if any(p.images for p in prompts):  # edits and image-to-video: each row starts with its condition image
            samples, shown = _with_conditions(samples, prompts, shown), shown + 1
        picture = save_image_grid(samples, grid, columns=shown, captions=[p.prompt for p in prompts])
        log_image(accelerator, "eval/samples", picture, step)
        for (i, s), *_, sound in results:
            if sound is not None:
                save_wav(sound.audio[0], sound.sample_rate, grid.with_name(f"{grid.stem}_audio") /
                         f"prompt{i:03d}_seed{s}.wav")
    return out


def _with_conditions(samples: torch.Tensor, prompts: list, per_row: int) -> torch.Tensor:
    """The evaluation grid's cells with each prompt's (first) condition image before its samples, resized to them
    (videos: repeated over the frames)."""
    cells = []
    for row, prompt in enumerate(prompts):
        (condition,) = condition_tensors([prompt.images[:1]])[0]
        condition = torch.nn.functional.interpolate(condition[None], size=samples.shape[-2:], mode="bilinear",
                                                    antialias=True)[0].clamp(0, 1)
        if samples.ndim == 5:
            condition = condition.expand(samples.shape[1], *condition.shape)
        cells += [condition, *samples[row * per_row:(row + 1) * per_row]]
    return torch.stack(cells)
