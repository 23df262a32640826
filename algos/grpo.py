# Flow-GRPO: online RL for flow-matching models. An SDE with the ODE's marginals makes every denoising step a
# Gaussian policy with a log-prob; a PPO-style clipped ratio of those log-probs, on advantages relative to the K
# samples of each prompt, trains it. Flow-GRPO-Fast (--sde-window-size): SDE and training only on a random window
# of consecutive steps, the Euler ODE elsewhere.
# Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470.
# Siblings: grpo_guard.py (regulated ratio), mixgrpo.py (sliding window). Math: docs/algorithms.md §2–4.
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from common.advantages import compute_advantages, trained_samples
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.dynamics import log_prob_velocity_scale, sde_kl, sde_step
from common.sampling import sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    updates_per_epoch: int = 2
    """optimizer steps per epoch; gradients accumulate over the micro-batches and trained steps in between"""
    num_steps: int = 6
    """sampling steps of a rollout"""

    # Algorithm specific arguments
    dynamics: Literal["flow-sde", "dance-sde", "cps"] = "flow-sde"
    """stochastic step of the rollout and of its log-probs (ode has no log-prob)"""
    noise_level: float = 0.9
    """η of the SDE (flow-sde 0.9 FLUX / 0.7 SD3.5, dance-sde ~0.3, cps in [0, 1])"""
    step_weighting: Literal["none", "equalize"] = "none"
    """per-step weight of the policy loss (docs/algorithms.md §4, "Small steps"). equalize: step j's policy
    loss is multiplied by k_max / k_j, k_j the scale of its log-prob's gradient w.r.t. the model output
    (`log_prob_velocity_scale`; ∝ √(−dt) for flow-sde and dance-sde), k_max the largest over every step but the last.
    With a large time shift (video) σ stays near 1 and k_j is small on most steps"""
    sde_window_size: int = 0
    """Flow-GRPO-Fast: > 0 makes only a random window of this many consecutive steps stochastic and trained"""
    sde_window_range: tuple[int, int] | None = None
    """(lo, hi): the window starts uniformly in [lo, hi − size] (unset: (0, num_steps // 2))"""
    clip_range: float | None = None
    """PPO clip ε > 0 on the ratio (unset: 1e-4; 1e-5 with the SDE window); tiny because log-probs are means. 0 is
    refused: the ratio clamped to [1, 1] stops training after each epoch's first optimizer step"""
    kl_beta: float = 0.0
    """weight ≥ 0 of the KL to the reference model (0: off; 0.01 PickScore, 0.04 GenEval/OCR)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (reward std < 1e-12: advantage 0); they carry
    no policy gradient, so by default they are dropped before training, as Flow-GRPO does"""
    offload_trajectories: bool = False
    """keep the stored rollout steps on the CPU between rollout and training"""


PRESETS = {
    # The toy world (docs/toy-world.md): SDE and training only on the first two of 8 steps (Flow-GRPO-Fast's window,
    # pinned at the start, where count, shape and place are decided; the ODE elsewhere), 8 prompts × 16 samples,
    # lr 3e-4 (1e-3 and 2e-3 rose then collapsed), KL 0.04 to the pretrained model.
    "toy": dict(TOY_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                num_steps=8, noise_level=0.7, sde_window_size=2, sde_window_range=(0, 2), learning_rate=3e-4,
                lora_rank=16, lora_alpha=16, clip_range=1e-3, kl_beta=0.04, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting on the strict edit reward (all six checks; with
    # their mean, held-out edits rose about half as fast), LoRA lr 1e-3, clip 1e-2, KL 0.01, evaluated with an EMA
    # of the weights (0.98 an optimizer step): without the EMA that lr peaks at +0.06 by epoch 60 and falls back;
    # with it held-out edits gain +0.07 to +0.09 by epoch 180 over 3 seeds (best points +0.09 to +0.11) and hold.
    # 180 epochs: about 20 CPU-minutes.
    "toy-edit": dict(TOY_EDIT_WORLD, reward=["toy_edit,mode=strict"], epochs=180, prompts_per_epoch=8, group_size=16,
                     batch_size=32, updates_per_epoch=2, num_steps=8, noise_level=0.7, sde_window_size=2,
                     sde_window_range=(0, 2), learning_rate=1e-3, lora_rank=16, lora_alpha=16, clip_range=1e-2,
                     kl_beta=0.01, ema=True, ema_decay=0.98, eval_every=20, save_every=20),
    # The toy video world (docs/toy-video-world.md): the toy-edit setting (LoRA lr 1e-3, clip 1e-2, KL 0.01, EMA
    # 0.98) at 8 prompts × 8 samples (16 a prompt gained half as much in 50 epochs), η 1.0 and a cosine decay of
    # the rate. By epoch 80, η 0.7 gained +0.13 / +0.14 / +0.02 held-out strict success over seeds 1-3, η 1.0
    # +0.20 / +0.18 / +0.19; at a constant rate η 1.0 then collapsed in seed 3 (0.257 by epoch 149, below the base),
    # with the cosine decay it did not. 150 epochs: ~16 CPU-minutes.
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=150, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=2, num_steps=8, noise_level=1.0, sde_window_size=2, sde_window_range=(0, 2),
                      learning_rate=1e-3, lr_schedule="cosine", lora_rank=16, lora_alpha=16, clip_range=1e-2,
                      kl_beta=0.01, ema=True, ema_decay=0.98, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): its log-prob averages only 256 elements, so the
    # papers' lr and clip do not move it; a 100× clip range and LoRA lr 3e-2 raise the JPEG reward within ~150
    # epochs for every seed tried.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=8, noise_level=0.8,
                 learning_rate=3e-2, lora_rank=8, lora_alpha=8, clip_range=1e-2, global_std=False,
                 eval_every=50, eval_num_prompts=8, save_every=50),
    # Flow-GRPO's FLUX.1-dev PickScore setting: LoRA r64/α128, 6 rollout steps, η 0.9, group 24, 48 prompts,
    # 28 eval steps, KL 0.01.
    "flux1-flowgrpo": dict(reward=["pickscore"], resolution=512, num_steps=6, eval_num_steps=28, noise_level=0.9,
                           group_size=24, prompts_per_epoch=48, batch_size=8, learning_rate=3e-4, clip_range=1e-4,
                           kl_beta=0.01, lora_rank=64, lora_alpha=128, epochs=1000, eval_every=20, save_every=20),
    # Flow-Factory's FLUX.2 [dev] GRPO example (examples/grpo/lora/flux2/t2i.yaml): LoRA r64/α128 at 512², 8 rollout
    # steps with guidance 4, flow-SDE η 1.0 on one step drawn from steps 1–3, group 16, 48 prompts, 2 updates,
    # clip 1e-4, no KL, lr 3e-4, weight decay 1e-4, CLIP text alignment + 0.5 PickScore by GDPO aggregation, 28
    # eval steps. (Their EMA every 4 epochs and 1024² evaluation are not carried over.)
    "flux2-flowfactory": dict(model="flux2", reward=["clip:1.0", "pickscore:0.5"], advantage_aggregation="gdpo",
                              resolution=512, num_steps=8, eval_num_steps=28, guidance_scale=4.0, noise_level=1.0,
                              sde_window_size=1, sde_window_range=(1, 4), group_size=16, prompts_per_epoch=48,
                              batch_size=1, updates_per_epoch=2, learning_rate=3e-4, weight_decay=1e-4,
                              clip_range=1e-4, kl_beta=0.0, lora_rank=64, lora_alpha=128, eval_every=20,
                              save_every=20),
    # Flow-Factory's FLUX.2 [klein] base GRPO example (examples/grpo/lora/flux2_klein_base/default.yaml): the 9B base,
    # LoRA r64/α128 at 384², 8 rollout steps with true CFG 4, flow-SDE η 0.7 on one step drawn from steps 1–3, group
    # 16, 48 prompts, 2 updates, clip 1e-4, no KL, lr 3e-4, PickScore by GDPO aggregation, 28 eval steps.
    "flux2-klein-flowfactory": dict(model="flux2-klein", reward=["pickscore"], advantage_aggregation="gdpo",
                                    resolution=384, num_steps=8, eval_num_steps=28, guidance_scale=4.0,
                                    noise_level=0.7, sde_window_size=1, sde_window_range=(1, 4), group_size=16,
                                    prompts_per_epoch=48, batch_size=1, updates_per_epoch=2, learning_rate=3e-4,
                                    weight_decay=1e-4, clip_range=1e-4, kl_beta=0.0, lora_rank=64, lora_alpha=128,
                                    eval_every=20, save_every=20),
    # Flow-Factory's Z-Image GRPO example (examples/grpo/lora/z_image/default.yaml): the non-distilled base, LoRA
    # r64/α128 at 512², 10 rollout steps with CFG 4 in the pipeline's terms (pos + 4·(pos − neg): w = 5 here),
    # flow-SDE η 0.7 on one step drawn from steps 1–3, group 16, 48 prompts, 2 updates, clip 1e-4, no KL, lr 3e-4,
    # weight decay 1e-4, PickScore by GDPO aggregation, 40 eval steps. (Their EMA every 4 epochs and 1024²
    # evaluation are not carried over.)
    "z-image-flowfactory": dict(model="z-image", model_path="Tongyi-MAI/Z-Image", reward=["pickscore"],
                                advantage_aggregation="gdpo", resolution=512, num_steps=10, eval_num_steps=40,
                                guidance_scale=5.0, noise_level=0.7, sde_window_size=1, sde_window_range=(1, 4),
                                group_size=16, prompts_per_epoch=48, batch_size=1, updates_per_epoch=2,
                                learning_rate=3e-4, weight_decay=1e-4, clip_range=1e-4, kl_beta=0.0, lora_rank=64,
                                lora_alpha=128, eval_every=20, save_every=20),
    # Flow-Factory's Wan2.2 T2V A14B GRPO example (examples/grpo/lora/wan22/t2v.yaml): LoRA r64/α128 on both
    # experts at 480², 5 frames, 10 rollout steps with CFG 4 (high-noise expert) / 3 (low-noise expert: the model's
    # default here), flow-SDE η 0.9 on one step drawn from steps 1–3, group 16, 48 prompts, 2 updates, clip 1e-4,
    # no KL, lr 1e-4, weight decay 1e-4, per-group std, PickScore by GDPO aggregation, 28 eval steps. (Their EMA
    # every 4 epochs and 720² × 21-frame evaluation are not carried over.)
    "wan2.2-flowfactory": dict(model="wan2.2", reward=["pickscore"], advantage_aggregation="gdpo", resolution=480,
                               num_frames=5, num_steps=10, eval_num_steps=28, noise_level=0.9, sde_window_size=1,
                               sde_window_range=(1, 4), group_size=16, prompts_per_epoch=48, batch_size=1,
                               updates_per_epoch=2, learning_rate=1e-4, weight_decay=1e-4, clip_range=1e-4,
                               kl_beta=0.0, global_std=False, lora_rank=64, lora_alpha=128, eval_every=20,
                               save_every=20),
    # Flow-Factory publishes no Wan2.2-TI2V-5B example: its Wan2.2 T2V GRPO example above, carried over unchanged
    # but for the CFG, the 5B's own scale 5 (Wan2.2's TI2V-5B setting; the model's default here).
    "wan2.2-5b-flowfactory": dict(model="wan2.2-5b", reward=["pickscore"], advantage_aggregation="gdpo",
                                  resolution=480, num_frames=5, num_steps=10, eval_num_steps=28, noise_level=0.9,
                                  sde_window_size=1, sde_window_range=(1, 4), group_size=16, prompts_per_epoch=48,
                                  batch_size=1, updates_per_epoch=2, learning_rate=1e-4, weight_decay=1e-4,
                                  clip_range=1e-4, kl_beta=0.0, global_std=False, lora_rank=64, lora_alpha=128,
                                  eval_every=20, save_every=20),
    # No RL setting for Qwen-Image 2.1 is published: Flow-Factory's Z-Image GRPO example above (the closest
    # single-stream model's) at 2.1's own inference settings from its model card and official README
    # (QwenLM/Qwen-Image-2.1): no CFG (guidance 1, the model's default here) and
    # 40 sampling steps for evaluation. Text-to-image on the default prompts; a dataset with "image" fields makes it
    # the same setting for editing.
    "qwen-image-2.1-flowfactory": dict(model="qwen-image-2.1", reward=["pickscore"], advantage_aggregation="gdpo",
                                       resolution=512, num_steps=10, eval_num_steps=40, noise_level=0.7,
                                       sde_window_size=1, sde_window_range=(1, 4), group_size=16,
                                       prompts_per_epoch=48, batch_size=1, updates_per_epoch=2, learning_rate=3e-4,
                                       weight_decay=1e-4, clip_range=1e-4, kl_beta=0.0, lora_rank=64,
                                       lora_alpha=128, eval_every=20, save_every=20),
    # Flow-Factory's LTX-2 text-to-audio-video GRPO example (examples/grpo/lora/ltx2/t2av.yaml): LoRA r64/α128, 121
    # frames at 24 fps, 24 rollout steps without CFG (guidance 1, its spatio-temporal and modality guidance off, as
    # here), CPS η 0.8 on 3 steps within steps 0–9, group 16, 48 prompts, 2 updates, clip 1e-4, no KL, lr 3e-4,
    # weight decay 1e-4, global std, GDPO aggregation. Not carried over: its 512×768 (square 512 here), its CLAP
    # audio-text and ImageBind audio-video rewards (PickScore on the frames instead: give an audio reward with
    # --reward), its EMA every 4 epochs and its 50-step evaluation at guidance 4.
    "ltx2-flowfactory": dict(model="ltx2", reward=["pickscore"], advantage_aggregation="gdpo", resolution=512,
                             num_frames=121, max_sequence_length=1024, num_steps=24, eval_num_steps=24,
                             guidance_scale=1.0, dynamics="cps", noise_level=0.8, sde_window_size=3,
                             sde_window_range=(0, 10), group_size=16, prompts_per_epoch=48, batch_size=1,
                             updates_per_epoch=2, learning_rate=3e-4, weight_decay=1e-4, clip_range=1e-4, kl_beta=0.0,
                             global_std=True, lora_rank=64, lora_alpha=128, gradient_checkpointing=True,
                             eval_every=60, save_every=60),
    # Flow-Factory's LTX-2 image-to-audio-video GRPO example (examples/grpo/lora/ltx2/i2av.yaml, "not fully tested"
    # by its authors): as t2av above but 30 rollout steps, Flow-SDE η 0.7 on 1 step within steps 1–3, 16 prompts and
    # lr 1e-4. Not carried over: the same as above, and its image dataset (give --dataset prompts with "image").
    "ltx2-i2v-flowfactory": dict(model="ltx2-i2v", reward=["pickscore"], advantage_aggregation="gdpo", resolution=512,
                                 num_frames=121, max_sequence_length=1024, num_steps=30, eval_num_steps=30,
                                 guidance_scale=1.0, dynamics="flow-sde", noise_level=0.7, sde_window_size=1,
                                 sde_window_range=(1, 4), group_size=16, prompts_per_epoch=16, batch_size=1,
                                 updates_per_epoch=2, learning_rate=1e-4, weight_decay=1e-4, clip_range=1e-4,
                                 kl_beta=0.0, global_std=True, lora_rank=64, lora_alpha=128,
                                 gradient_checkpointing=True, eval_every=60, save_every=60),
    # Flow-Factory publishes no Wan2.2 I2V example: its Wan2.2 T2V GRPO example above, carried over unchanged but
    # for the CFG, the I2V A14B's own 3.5 for both experts (Wan2.2's wan/configs/wan_i2v_A14B.py: sample_guide_scale
    # (3.5, 3.5), with sample_shift 5 and boundary 0.9, which the checkpoint's configs carry; the model's default
    # here). Give --dataset prompts with their first frames ("image").
    "wan2.2-i2v-flowfactory": dict(model="wan2.2-i2v", reward=["pickscore"], advantage_aggregation="gdpo",
                                   resolution=480, num_frames=5, num_steps=10, eval_num_steps=28, noise_level=0.9,
                                   sde_window_size=1, sde_window_range=(1, 4), group_size=16, prompts_per_epoch=48,
                                   batch_size=1, updates_per_epoch=2, learning_rate=1e-4, weight_decay=1e-4,
                                   clip_range=1e-4, kl_beta=0.0, global_std=False, lora_rank=64, lora_alpha=128,
                                   eval_every=20, save_every=20),
    # No RL setting is published for HunyuanVideo-1.5: Flow-Factory's Wan2.2 T2V GRPO example above, carried over
    # unchanged but for the model's own inference settings from the official repo (Tencent-Hunyuan/HunyuanVideo-1.5
    # README, "Optimal Inference Configurations": CFG 6 and 50 steps for the 480p T2V and I2V models; its flow shift 5
    # is the checkpoint scheduler's to set). Square 480² (its 480p buckets are 848×480 and the like; runs are square).
    "hunyuan-video-1.5-flowfactory": dict(model="hunyuan-video-1.5", reward=["pickscore"], advantage_aggregation="gdpo",
                                          resolution=480, num_frames=5, num_steps=10, eval_num_steps=50,
                                          guidance_scale=6.0, noise_level=0.9, sde_window_size=1,
                                          sde_window_range=(1, 4), group_size=16, prompts_per_epoch=48, batch_size=1,
                                          updates_per_epoch=2, learning_rate=1e-4, weight_decay=1e-4,
                                          clip_range=1e-4, kl_beta=0.0, global_std=False, lora_rank=64,
                                          lora_alpha=128, eval_every=20, save_every=20),
    # The same for the 480p I2V model; give --dataset prompts with their first frames ("image").
    "hunyuan-video-1.5-i2v-flowfactory": dict(model="hunyuan-video-1.5-i2v", reward=["pickscore"],
                                              advantage_aggregation="gdpo", resolution=480, num_frames=5,
                                              num_steps=10, eval_num_steps=50, guidance_scale=6.0, noise_level=0.9,
                                              sde_window_size=1, sde_window_range=(1, 4), group_size=16,
                                              prompts_per_epoch=48, batch_size=1, updates_per_epoch=2,
                                              learning_rate=1e-4, weight_decay=1e-4, clip_range=1e-4, kl_beta=0.0,
                                              global_std=False, lora_rank=64, lora_alpha=128, eval_every=20,
                                              save_every=20),
}


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "Flow-GRPO (arXiv:2505.05470): PPO-style clipped ratio of SDE step log-probs.")
    window = args.sde_window_size > 0
    lo, hi = args.sde_window_range or (0, args.num_steps // 2)
    if window and not (0 <= lo <= hi - args.sde_window_size and hi <= args.num_steps):
        raise UserError(f"--sde-window-range ({lo}, {hi}) cannot hold a window of {args.sde_window_size} steps "
                        f"within {args.num_steps} steps")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if args.clip_range is not None and not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive, got {args.clip_range}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    clip_range = args.clip_range if args.clip_range is not None else (1e-5 if window else 1e-4)
    run = setup(args, load_run_rewards(args), reference_copy=args.kl_beta > 0)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    # --step-weighting equalize: w_j = k_max / k_j, k_j the step's gradient scale (algorithms.md §4); none: 1
    scales = [log_prob_velocity_scale(args.dynamics, float(sigmas[j]), float(sigmas[j + 1]), args.noise_level)
              for j in range(args.num_steps)]
    step_weights = [max(scales[:-1]) / k if args.step_weighting == "equalize" and k > 0 else 1.0 for k in scales]
    store = "cpu" if args.offload_trajectories else device
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="grpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        if window:  # Flow-GRPO-Fast: one window of SDE steps for the whole epoch
            start = int(np.random.default_rng([args.seed, epoch, 0x3D]).integers(lo, hi - args.sde_window_size + 1))
            sde_steps = train_steps = list(range(start, start + args.sde_window_size))
        else:  # every step stochastic; the last (σ' = 0) is not trained
            sde_steps, train_steps = list(range(args.num_steps)), list(range(args.num_steps - 1))

        # ---- 2. rollout: x_{j+1} = sde_step(x_j); keep (x_j, x_{j+1}, log p_old(x_{j+1} | x_j)) of trained steps --
        cond = run.encode(records)
        run.transformer.eval()
        stored = {"x": [], "x_next": [], "log_prob_old": []}
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        with torch.no_grad():
            for index in rollout_batches:
                c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
                x, steps = adapter.noise(generators), {"x": [], "x_next": [], "log_prob_old": []}
                for j in range(args.num_steps):
                    v = adapter.velocity(x, sigmas[j], c, guidance)
                    x_next, log_prob, _, _ = sde_step(args.dynamics if j in sde_steps else "ode", v, x, sigmas[j],
                                                      sigmas[j + 1], args.noise_level, generator=generators)
                    if j in train_steps:
                        for key, value in zip(steps, (x, x_next, log_prob)):
                            steps[key].append(value.to(store))
                    x = x_next
                for key in stored:
                    stored[key].append(torch.stack(steps[key], dim=1))  # (batch, trained steps, ...)
                scoring.submit(adapter.decode(x, c).cpu())
        stored = {key: torch.cat(values) for key, values in stored.items()}
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and group-relative advantages over the whole epoch (all processes) ----------------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # A group whose K rewards are equal (A = 0) has no policy gradient: drop it, keeping equal micro-step counts.
        keep = trained_samples(adv_stats, args.keep_zero_advantage)
        plan = plan_micro_batches(keep, run.data.num_processes, run.data.process_index,
                                  args.batch_size, args.updates_per_epoch)
        advantages = advantages[run.local].float().to(device)
        reward_time = time.time() - reward_start

        # ---- 4. update: the clipped surrogate on every stored step ----------------------------------------------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "ratio_mean", "grad_norm")}
        ratio_dev_first = torch.zeros((), device=device)
        for update, micro_batches in enumerate(plan):
            for mb in micro_batches:
                c, adv, weight, real = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                        mb.weight.to(device), mb.real.to(device))
                for i, j in enumerate(train_steps):
                    x, x_next, log_prob_old = (stored[key][mb.index, i].to(device) for key in stored)
                    with micro_step(run.accelerator, run.transformer, mb.last and i == len(train_steps) - 1):
                        v = adapter.velocity(x, sigmas[j], c, guidance)
                        _, log_prob, mean, std = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1],
                                                          args.noise_level, prev_sample=x_next)
                        # Flow-GRPO eq. 6: ratio of the new to the rollout policy's step density, clipped as in PPO.
                        ratio = torch.exp(log_prob - log_prob_old)
                        clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
                        policy_loss = step_weights[j] * clipped  # 1 unless --step-weighting equalize
                        kl = torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # KL to the reference step, in Flow-GRPO's form (sde_kl)
                            v_ref = run.reference.velocity(x, sigmas[j], c, guidance)
                            _, _, mean_ref, _ = sde_step(args.dynamics, v_ref, x, sigmas[j], sigmas[j + 1],
                                                         args.noise_level, prev_sample=x_next)
                            kl = sde_kl(args.dynamics, mean, mean_ref, std, sigmas[j], sigmas[j + 1])
                        loss = policy_loss + args.kl_beta * kl
                        # weight: 1 / (kept samples of this optimizer step), so the step averages samples and steps
                        run.accelerator.backward((weight * loss).sum() / len(train_steps))
                    if not real.any():  # a padding-only micro-batch (see plan_micro_batches)
                        continue
                    with torch.no_grad():  # statistics over this micro-batch's kept samples
                        if update == 0:  # invariant: θ = θ_old before the first optimizer step, so ratio ≡ 1
                            ratio_dev_first = torch.maximum(ratio_dev_first, (ratio[real] - 1).abs().max())
                        for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                           ("approx_kl", 0.5 * (log_prob - log_prob_old) ** 2), ("ratio_mean", ratio),
                                           ("clipfrac", ((ratio - 1).abs() > clip_range).float())):
                            stats[key].append(value[real].mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            del stats["kl"]

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(ratio_dev_first=float(run.accelerator.reduce(ratio_dev_first, "max")),
                       zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "clipfrac",
                                 "approx_kl", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
