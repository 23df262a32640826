"""The TDM-R1 authors' SD3.5-M launchers (Luo-Yihong/TDM-R1), ported to algos/tdmr1.py, and one adaptation of them
to Z-Image-Turbo. The generator of the SD3.5 settings starts from the authors' released TDM SD3.5 LoRA: pass it as
--init-lora (converted to the diffusers format). Settings and sources: docs/recipes.md."""

# config/tdmr1_clean.py `general_ocr_sd3_8gpu_G24_4step` (8 GPUs): SD3.5-M at 512 px, 4 steps, 48 prompts × 24,
# 2 of 4 steps trained, β_pref 10, t_min = t′_min 0.3, w_S 4.5, LoRA r32/α64.
OCR = dict(model="sd3", reward=["ocr"], resolution=512, num_steps=4, group_size=24, prompts_per_epoch=48,
           batch_size=24, train_steps=2, rl_steps=4, tdm_weight=0.3, teacher_cfg=4.5, cfg_reward_scale=3.5,
           surrogate_cfg=4.5, reward_tmin=0.3, surrogate_tmin=0.3, beta_pref=10.0, beta_ref=1e-3, clip_range=1e-3,
           runaway_threshold=0.05, lora_rank=32, lora_alpha=64, learning_rate=7.5e-5, fake_learning_rate=3e-4,
           surrogate_learning_rate=3e-4, global_std=True, gradient_checkpointing=True, epochs=1000, eval_every=20,
           save_every=20)

TDMR1 = {
    "sd3-ocr": OCR,
    # launcher tdmr1_geneval.sh: OCR's with β_pref 1, t_min 0.25, t′_min 0.55, w_S 2.5. GenEval is scored by its
    # detector pipeline, which is not a reward here: give --reward (e.g. a VLM judge).
    "sd3-geneval": {**{k: v for k, v in OCR.items() if k != "reward"}, "surrogate_cfg": 2.5, "reward_tmin": 0.25,
                    "surrogate_tmin": 0.55, "beta_pref": 1.0},
    # Adapted, untested: OCR's numbers on Z-Image-Turbo (this project's z-image default) at 1024 px. Turbo is already
    # step- and guidance-distilled, so it is generator and teacher itself (no --init-lora) and samples CFG-free:
    # λ 0, w_R = w_S = 1, as on FLUX.1. 4 steps as the authors' released Z-Image model; Turbo's own default is 8.
    "z-image-turbo": dict(OCR, model="z-image", resolution=1024, batch_size=8, teacher_cfg=1.0, cfg_reward_scale=0.0,
                          surrogate_cfg=1.0),
}
