"""Flow-Factory's GRPO LoRA examples (X-GenGroup/Flow-Factory, examples/grpo/lora/), ported to algos/grpo.py, one
model each. Each entry names the example it ports, or the one it adapts where none is published; the settings,
what was not carried over and the sources of the adaptations are in docs/recipes.md."""

# What every example shares: LoRA r64/α128, groups of 16 at a micro-batch of 1, 2 optimizer steps per epoch, clip
# 1e-4, no KL, weight decay 1e-4, several rewards combined by GDPO.
BASE = dict(advantage_aggregation="gdpo", group_size=16, batch_size=1, updates_per_epoch=2, clip_range=1e-4,
            kl_beta=0.0, weight_decay=1e-4, lora_rank=64, lora_alpha=128)

GRPO = {
    # examples/grpo/lora/flux2/t2i.yaml
    "flux2-flowfactory": dict(BASE, model="flux2", reward=["clip:1.0", "pickscore:0.5"], resolution=512,
                              num_steps=8, eval_num_steps=28, guidance_scale=4.0, noise_level=1.0,
                              sde_window_size=1, sde_window_range=(1, 4), prompts_per_epoch=48,
                              learning_rate=3e-4, eval_every=20, save_every=20),
    # examples/grpo/lora/flux2_klein_base/default.yaml
    "flux2-klein-flowfactory": dict(BASE, model="flux2-klein", reward=["pickscore"], resolution=384, num_steps=8,
                                    eval_num_steps=28, guidance_scale=4.0, noise_level=0.7, sde_window_size=1,
                                    sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=3e-4,
                                    eval_every=20, save_every=20),
    # examples/grpo/lora/z_image/default.yaml
    "z-image-flowfactory": dict(BASE, model="z-image", model_path="Tongyi-MAI/Z-Image", reward=["pickscore"],
                                resolution=512, num_steps=10, eval_num_steps=40, guidance_scale=5.0,
                                noise_level=0.7, sde_window_size=1, sde_window_range=(1, 4), prompts_per_epoch=48,
                                learning_rate=3e-4, eval_every=20, save_every=20),
    # examples/grpo/lora/wan22/t2v.yaml
    "wan2.2-flowfactory": dict(BASE, model="wan2.2", reward=["pickscore"], resolution=480, num_frames=5,
                               num_steps=10, eval_num_steps=28, noise_level=0.9, sde_window_size=1,
                               sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=1e-4, global_std=False,
                               eval_every=20, save_every=20),
    # no Wan2.2-TI2V-5B example: wan22/t2v.yaml at the 5B's own CFG
    "wan2.2-5b-flowfactory": dict(BASE, model="wan2.2-5b", reward=["pickscore"], resolution=480, num_frames=5,
                                  num_steps=10, eval_num_steps=28, noise_level=0.9, sde_window_size=1,
                                  sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=1e-4,
                                  global_std=False, eval_every=20, save_every=20),
    # no Qwen-Image 2.1 example: z_image/default.yaml at 2.1's own inference settings
    "qwen-image-2.1-flowfactory": dict(BASE, model="qwen-image-2.1", reward=["pickscore"], resolution=512,
                                       num_steps=10, eval_num_steps=40, noise_level=0.7, sde_window_size=1,
                                       sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=3e-4,
                                       eval_every=20, save_every=20),
    # examples/grpo/lora/ltx2/t2av.yaml
    "ltx2-flowfactory": dict(BASE, model="ltx2", reward=["pickscore"], resolution=512, num_frames=121,
                             max_sequence_length=1024, num_steps=24, eval_num_steps=24, guidance_scale=1.0,
                             dynamics="cps", noise_level=0.8, sde_window_size=3, sde_window_range=(0, 10),
                             prompts_per_epoch=48, learning_rate=3e-4, global_std=True, gradient_checkpointing=True,
                             eval_every=60, save_every=60),
    # examples/grpo/lora/ltx2/i2av.yaml
    "ltx2-i2v-flowfactory": dict(BASE, model="ltx2-i2v", reward=["pickscore"], resolution=512, num_frames=121,
                                 max_sequence_length=1024, num_steps=30, eval_num_steps=30, guidance_scale=1.0,
                                 dynamics="flow-sde", noise_level=0.7, sde_window_size=1, sde_window_range=(1, 4),
                                 prompts_per_epoch=16, learning_rate=1e-4, global_std=True,
                                 gradient_checkpointing=True, eval_every=60, save_every=60),
    # no Wan2.2 I2V example: wan22/t2v.yaml at the I2V A14B's own CFG
    "wan2.2-i2v-flowfactory": dict(BASE, model="wan2.2-i2v", reward=["pickscore"], resolution=480, num_frames=5,
                                   num_steps=10, eval_num_steps=28, noise_level=0.9, sde_window_size=1,
                                   sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=1e-4,
                                   global_std=False, eval_every=20, save_every=20),
    # no HunyuanVideo-1.5 example: wan22/t2v.yaml at the model's own inference settings
    "hunyuan-video-1.5-flowfactory": dict(BASE, model="hunyuan-video-1.5", reward=["pickscore"], resolution=480,
                                          num_frames=5, num_steps=10, eval_num_steps=50, guidance_scale=6.0,
                                          noise_level=0.9, sde_window_size=1, sde_window_range=(1, 4),
                                          prompts_per_epoch=48, learning_rate=1e-4, global_std=False,
                                          eval_every=20, save_every=20),
    # no HunyuanVideo-1.5 I2V example: as the T2V entry above, for the 480p I2V model
    "hunyuan-video-1.5-i2v-flowfactory": dict(BASE, model="hunyuan-video-1.5-i2v", reward=["pickscore"],
                                              resolution=480, num_frames=5, num_steps=10, eval_num_steps=50,
                                              guidance_scale=6.0, noise_level=0.9, sde_window_size=1,
                                              sde_window_range=(1, 4), prompts_per_epoch=48, learning_rate=1e-4,
                                              global_std=False, eval_every=20, save_every=20),
}
