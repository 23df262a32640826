"""Z-Image and Z-Image-Turbo (`ZImagePipeline`)."""

from pathlib import Path

import torch

from common.models.base import _Adapter
from common.models.tiny_parts import TINY_SEED, _tiny_sd3_vae, tiny_qwen2_tokenizer
from common.utils import UserError


class ZImageAdapter(_Adapter):
    """Z-Image over `ZImagePipeline`'s components: a Qwen3 text encoder behind a chat template, a single-stream
    DiT that takes lists of per-sample latents and caption embeddings, FLUX.1's VAE, unpacked latents (batch, C,
    H/8, W/8).

    Two conventions differ from the scripts' and are turned around here, so that σ (1 = noise, 0 = data) goes in
    and v ≈ ε − x0 comes out as for every model: the transformer takes the reversed time (1000 − 1000·σ)/1000 ≈
    1 − σ (which it scales by 1000 itself), and it predicts x0 − ε, the negative of v.

    Guidance follows the other true-CFG models: `guidance_scale` w > 1 turns CFG on and gives
    v_neg + w·(v_pos − v_neg). The pipeline writes the same as pos + s·(pos − neg) with its `guidance_scale`
    s = w − 1 (CFG on for s > 0), and computes it in that form, as here: the pipeline's s = 4 is w = 5;
    Z-Image-Turbo's s = 0 is w = 1. The pipeline's two CFG options are the attributes `cfg_truncation` (CFG only
    where 1 − σ ≤ it) and `cfg_normalization` (the guided prediction's norm capped at that multiple of the
    positive one; 0 = off)."""

    pipeline_class_name = "ZImagePipeline"
    default_guidance_scale = 1.0  # Z-Image-Turbo is guidance-distilled: the pipeline's guidance_scale 0 (no CFG)
    display_name = "Z-Image"
    text_components = ("text_encoder", "tokenizer")
    long_tokenizer = "tokenizer"
    true_cfg = True  # the non-distilled Z-Image runs with CFG (the pipeline's 3–5, i.e. w = 4–6)
    cfg_truncation = 1.0  # the pipeline's defaults
    cfg_normalization = 0.0
    # Flow-Factory's Z-Image LoRA targets: attention and SwiGLU feed-forward of every block (refiners included).
    lora_target_modules = [
        "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        # The RoPE tables bound both sequences: image rows and columns on axes 1 and 2, the caption (padded to a
        # multiple of 32, from position 1) and after it the image on axis 0.
        text_axis, row_axis = self.config.axes_lens[0], self.config.axes_lens[1]
        self._check_resolution(resolution, 2 * self.vae_scale_factor, row_axis * 2 * self.vae_scale_factor)
        if -(-max_sequence_length // 32) * 32 + 1 >= text_axis:
            raise UserError(f"max_sequence_length {max_sequence_length} is too long for this {self.display_name} "
                            f"transformer (its caption positions end at {text_axis})")
        self.height = self.width = resolution

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The text encoder's second-to-last hidden state over the chat-formatted prompt, its unpadded tokens
        (`ZImagePipeline.encode_prompt`), zero-padded to max_sequence_length with a 0/1 mask so that prompts of any
        length stack (and cache); `velocity` hands the transformer only the masked rows, as the pipeline does."""
        self._require_text_encoders()
        # The pipeline rewrites the list it is given in place (each text becomes its chat template): pass a copy.
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        padded = embeds[0].new_zeros(len(embeds), self.max_sequence_length, embeds[0].shape[-1])
        mask = torch.zeros(len(embeds), self.max_sequence_length, dtype=torch.long, device=padded.device)
        for row, tokens in enumerate(embeds):
            padded[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def count_truncated(self, texts: list[str]) -> int:
        """How many `texts` the pipeline truncates: their length counted over the chat template it wraps them in."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        if tokenizer is None:
            return 0
        formatted = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=True) for text in texts]
        return sum(len(tokenizer(text).input_ids) > self.max_sequence_length for text in formatted)

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, H/8, W/8) from the pipeline's `prepare_latents`, one generator per sample."""
        return self.pipe.prepare_latents(len(generators), self.config.in_channels, self.height, self.width,
                                         torch.float32, self.device, generators)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as `ZImagePipeline` builds it: linspace(1, 1/N), the scheduler's shift (static
        3 for Z-Image-Turbo; μ from the image tokens when the config asks for dynamic shifting)."""
        from diffusers.pipelines.z_image.pipeline_z_image import (calculate_shift, get_default_z_image_sigmas,
                                                                  retrieve_timesteps)

        cfg = self.scheduler.config
        tokens = (self.height // self.vae_scale_factor // 2) * (self.width // self.vae_scale_factor // 2)
        mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=get_default_z_image_sigmas(num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    def model_time(self, sigma: torch.Tensor) -> torch.Tensor:
        """The time the transformer takes at σ: (1000 − t)/1000 of the scheduler's timestep t = 1000·σ, in float32
        as the pipeline computes it (≈ 1 − σ: 0 at pure noise, 1 at data)."""
        steps = self.scheduler.config.num_train_timesteps
        return (steps - sigma.float() * steps) / steps

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 1.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) ≈ ε − x0 in float32: minus the transformer's output at the reversed time. With
        guidance_scale w > 1 the positive rows and then the negative rows of the samples that CFG applies to run as
        one list (the pipeline's order) and combine as pos + (w − 1)·(pos − neg), with the pipeline's truncation
        (decided per sample from its own σ) and norm cap."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        time = self.model_time(sigma)
        guided = []
        if self._with_negatives(cond, guidance_scale):
            truncated = (time.double() > self.cfg_truncation).tolist() if self.cfg_truncation <= 1 else [False] * batch
            guided = [i for i in range(batch) if not truncated[i]]
        captions = self._captions(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        if guided:
            negatives = self._captions(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
            captions += [negatives[i] for i in guided]
        x = latents.to(self.dtype).unsqueeze(2)  # (batch, C, 1 frame, h, w), one list entry per sample
        inputs = list(x.unbind(0)) + [x[i] for i in guided]
        times = torch.cat([time, time[guided]])
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            outputs = model(inputs, times, captions, return_dict=False)[0]
        preds = [out.float() for out in outputs[:batch]]
        for k, i in enumerate(guided):
            pos, neg = preds[i], outputs[batch + k].float()
            pred = pos + (guidance_scale - 1) * (pos - neg)
            if self.cfg_normalization > 0:
                cap = torch.linalg.vector_norm(pos) * float(self.cfg_normalization)
                norm = torch.linalg.vector_norm(pred)
                pred = pred * torch.where(norm > cap, cap / norm, torch.ones_like(norm))
            preds[i] = pred
        return -torch.stack(preds).squeeze(2)

    def _captions(self, embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """Each prompt's unpadded caption embedding (tokens, dim), as the pipeline hands them to the transformer."""
        return [row[keep.bool()] for row, keep in zip(embeds.to(self.dtype), mask)]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        images = self.vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


# A Qwen3-style chat template: ZImagePipeline formats every prompt as one user turn with a generation prompt and
# thinking left on, which renders as below in the real Qwen3 template (no <think> block is added then).
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tiny_z_image(path: Path) -> None:
    """Z-Image-Turbo-like: a 2-layer Qwen3 text encoder (the pipeline reads its second-to-last hidden state) behind
    a Qwen3-style chat template, the single-stream Z-Image DiT (noise and caption refiners, then joint layers; 3-axis
    RoPE with the real axis lengths), FLUX's 4-block VAE with its scaling and shift, and the real checkpoint's
    scheduler (static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    ))
    vae = _tiny_sd3_vae(4, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE constants, as Z-Image's
    # head_dim 16 = sum(axes_dims); axes_lens as the real model (caption positions on axis 0, image rows, columns).
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 4, 4], axes_lens=[1536, 512, 512],
    )
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(path, safe_serialization=True)
