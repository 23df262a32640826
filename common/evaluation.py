"""Held-out evaluation, one code path for the scripts (`common.setup.evaluate`: before the first update and every
--eval-every epochs) and for evaluate.py (any model or run's checkpoint, after the fact): the same prompts, seeds,
batches and ODE give the same numbers. With every evaluation of images goes a blur measure (`hf_share`, logged as
`eval_hf_ratio`) and, given a teacher's reference file, its ratio to the teacher (`blur_ratio`, algorithms.md §9)."""

import json
from pathlib import Path

import numpy as np
import torch

from common.models.base import AudioVideo
from common.parallel import gather_objects, scored_once
from common.sampling import sample, sample_generators
from common.scoring import condition_tensors, score_samples
from common.tracking import log_image, save_image_grid, save_wav


def evaluate_prompts(adapter, accelerator, encode, rewards: list, prompts: list, seeds_per_prompt: int,
                     num_steps: int, batch_size: int, guidance: float, grid: Path | None = None,
                     step: int = 0, best_of: bool = False, prompt_gap: bool = False,
                     hf_reference: dict | None = None, items_out: list | None = None) -> dict:
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
    standard error over the samples' paired differences. Images (not videos) also give `eval_hf_ratio`, the mean of `hf_share`; with `hf_reference` (`load_hf_reference`)
    covering every (prompt, seed) scored, `eval_blur_ratio` and `eval_blur_ratio_correct` (`blur_ratio`). With
    `items_out`, the main process appends one {"prompt", "seed", "hf", "strict"} per sample (a reference file's
    items: `save_hf_reference`)."""
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
                if images.ndim == 4:  # images, not videos: the blur measure of every sample
                    checks["hf_ratio"] = hf_share(images).numpy()
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
    strict = next((key for key in columns if key.endswith("_strict") and not key.startswith("reward_")), None)
    if "hf_ratio" in columns and accelerator.is_main_process and items_out is not None:
        items_out += [{"prompt": prompts[i].prompt, "seed": s, "hf": float(columns["hf_ratio"][k]),
                       "strict": float(columns[strict][k]) if strict else float("nan")}
                      for k, ((i, s), *_) in enumerate(results)]
    if "hf_ratio" in columns and hf_reference is not None:
        out.update(_blur_against(hf_reference, [(prompts[i].prompt, s) for (i, s), *_ in results],
                                 columns["hf_ratio"], columns[strict] if strict else None))
    for key, values in columns.items():
        name = key if key.startswith("prompt_gap_") else f"eval_{key}"
        out[name] = float(values.mean())
        out[f"{name}_se"] = float(values.std() / len(values) ** 0.5) if len(values) > 1 else 0.0
        if best_of and not key.startswith("prompt_gap_") and key != "hf_ratio":  # results are sorted prompt-major
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


# ----- blur (algorithms.md §9) ------------------------------------------------------------------------------
def hf_share(images: torch.Tensor) -> torch.Tensor:
    """h per image (B,), float64: the share of the non-constant spectral energy of its luma above half Nyquist.
    Y = 0.299R + 0.587G + 0.114B minus its mean, P = |DFT₂(Y)|², ρ = √(f_x² + f_y²) in cycles per pixel
    (`fftfreq`, Nyquist 0.5); h = Σ_{ρ > 0.25} P / Σ_{ρ > 0} P. Blurring lowers it; a constant image (no energy to
    share) gives 0."""
    rgb = images.detach().double().cpu()
    luma = 0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2]
    luma = luma - luma.mean(dim=(-2, -1), keepdim=True)
    power = torch.fft.fft2(luma).abs() ** 2
    fy, fx = torch.fft.fftfreq(luma.shape[-2], dtype=torch.float64), torch.fft.fftfreq(luma.shape[-1],
                                                                                     dtype=torch.float64)
    radius = (fy[:, None] ** 2 + fx[None, :] ** 2).sqrt()
    total = (power * (radius > 0)).sum(dim=(-2, -1))
    high = (power * (radius > 0.25)).sum(dim=(-2, -1))
    return torch.where(total > 0, high / total.clamp_min(1e-300), torch.zeros_like(total))


def blur_ratio(hf_model, hf_teacher, prompt_ids, keep_model=None, keep_teacher=None, draws: int = 1000,
               seed: int = 0) -> tuple[float, float]:
    """B = H_model / H_teacher and its bootstrap standard error over prompts (`draws` resamplings of the prompts,
    with replacement, by a fixed generator). The arrays are per sample, the same (prompt, seed) at each position;
    `keep_model` / `keep_teacher` (bool) restrict each mean to those samples (e.g. the ones whose strict check
    passes: B over correct images). NaN when a side keeps no sample."""
    hf_model, hf_teacher = np.asarray(hf_model, np.float64), np.asarray(hf_teacher, np.float64)
    keep_model = np.ones(len(hf_model), bool) if keep_model is None else np.asarray(keep_model, bool)
    keep_teacher = np.ones(len(hf_teacher), bool) if keep_teacher is None else np.asarray(keep_teacher, bool)
    _, prompt = np.unique(np.asarray(prompt_ids), return_inverse=True)
    count = prompt.max() + 1
    per_prompt = [np.bincount(prompt, weights=w, minlength=count)
                  for w in (hf_model * keep_model, keep_model, hf_teacher * keep_teacher, keep_teacher)]

    def ratio(weights):  # weights (..., prompts): how often each prompt is drawn
        sums = [weights @ column for column in per_prompt]
        with np.errstate(invalid="ignore", divide="ignore"):
            return (sums[0] / sums[1]) / (sums[2] / sums[3])

    rng = np.random.default_rng(seed)
    resampled = np.stack([np.bincount(rng.integers(0, count, count), minlength=count) for _ in range(draws)])
    return float(ratio(np.ones(count))), float(np.nanstd(ratio(resampled.astype(np.float64)), ddof=1))


def load_hf_reference(path: str | Path | None) -> dict | None:
    """A teacher's per-sample blur measure (`save_hf_reference`): {(prompt, seed): (h, strict)}; None for None."""
    if path is None:
        return None
    items = json.loads(Path(path).read_text())["items"]
    return {(item["prompt"], int(item["seed"])): (float(item["hf"]), float(item["strict"])) for item in items}


def save_hf_reference(path: str | Path, items: list[dict], about: dict) -> None:
    """Write `evaluate_prompts`'s items_out as a reference file (JSON: `about`, then the items)."""
    from common.utils import write_text_atomic

    lines = ",\n".join(json.dumps(item) for item in items)  # one sample a line
    write_text_atomic(Path(path), json.dumps(about)[:-1] + f', "items": [\n{lines}\n]}}\n')


def _blur_against(reference: dict, keys: list, hf, strict) -> dict:
    """eval_blur_ratio(_se) and eval_blur_ratio_correct(_se) of the samples `keys` against the reference's same
    samples; {} when the reference lacks one of them."""
    if not all(key in reference for key in keys):
        return {}
    teacher = np.array([reference[key] for key in keys])
    ids = [prompt for prompt, _ in keys]
    value, se = blur_ratio(hf, teacher[:, 0], ids)
    out = {"eval_blur_ratio": value, "eval_blur_ratio_se": se}
    if strict is not None:
        value, se = blur_ratio(hf, teacher[:, 0], ids, np.asarray(strict) > 0.5, teacher[:, 1] > 0.5)
        out.update(eval_blur_ratio_correct=value, eval_blur_ratio_correct_se=se)
    return out
