"""Model adapters: one small class per model family over its diffusers pipeline components.

An adapter encodes prompts, makes the initial noise, gives the σ schedule, runs ONE velocity forward and
decodes latents to images. Rollout and training both call `velocity`, so they cannot drift apart.
Weights live in the model dtype (bf16 on GPUs); everything that leaves `velocity` is float32.
"""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError

DEFAULT_MODEL_PATHS = {
    "flux1": "black-forest-labs/FLUX.1-dev",
    "sd3": "stabilityai/stable-diffusion-3.5-medium",
    "qwen-image": "Qwen/Qwen-Image",
    "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
}
MODELS = tuple(DEFAULT_MODEL_PATHS)


def resolve_model_path(model: str, model_path: str | None) -> str:
    """`tiny` -> the locally built tiny pipeline; `toy` -> the shipped toy-world pipeline (FLUX.1 only); None ->
    the model's published checkpoint."""
    from common.tiny import tiny_model_path
    from common.toy import toy_model_path

    if model_path == "tiny":
        return str(tiny_model_path(model))
    if model_path == "toy":  # the toy world's pretrained FLUX.1 (common/toy.py); a UserError for other models
        return str(toy_model_path(model))
    return model_path or DEFAULT_MODEL_PATHS[model]


class _Adapter:
    """What the adapters share: loading a pipeline's components, parking the frozen text encoders on the CPU,
    autocast to the model dtype, and writing LoRA weights in the pipeline's own format."""

    pipeline_class_name: str
    display_name: str
    text_components: tuple[str, ...]  # skipped when training from the embedding cache
    true_cfg = False
    max_sequence_limit: int | None = None  # the longest prompt the text encoder path accepts, when bounded

    def _load(self, model_path: str, device, dtype: torch.dtype, load_text_encoders: bool, text_only: bool,
              max_sequence_length: int) -> None:
        import diffusers

        limit = self.max_sequence_limit
        if limit is not None and not 0 < max_sequence_length <= limit:
            raise UserError(f"max_sequence_length {max_sequence_length} is not in 1..{limit}, "
                            f"as {self.display_name} requires")
        self.max_sequence_length = max_sequence_length
        self.device = torch.device(device)
        self.dtype = dtype
        # Frozen encoders wait on the CPU between uses when training on an accelerator.
        self.offload_device = torch.device("cpu")
        skip = {} if load_text_encoders else {name: None for name in self.text_components}
        if text_only:  # preprocess.py: only the text encoders
            skip.update(transformer=None, vae=None)
        try:
            found = diffusers.DiffusionPipeline.load_config(model_path).get("_class_name")
            if found != self.pipeline_class_name:
                raise ValueError(f"its model_index.json names {found}, not {self.pipeline_class_name}")
            self.pipe = getattr(diffusers, self.pipeline_class_name).from_pretrained(model_path, dtype=dtype, **skip)
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load a {self.display_name} pipeline from {model_path!r}: "
                            f"{str(err).splitlines()[0]}") from err
        self.pipe.set_progress_bar_config(disable=True)
        self.text_encoders = [getattr(self.pipe, name) for name in self.text_components
                              if name.startswith("text_encoder") and getattr(self.pipe, name, None) is not None]
        for module in self.text_encoders:
            module.requires_grad_(False).to(self.offload_device)
        if text_only:
            return
        self.transformer = self.pipe.transformer.to(self.device).requires_grad_(False)
        self.config = self.transformer.config  # the scripts may wrap `transformer` (DDP): read config from here
        self.vae = self.pipe.vae.to(self.device).requires_grad_(False)
        self.scheduler = self.pipe.scheduler

    def _check_resolution(self, resolution: int, multiple: int, largest: int | None = None) -> None:
        if resolution <= 0 or resolution % multiple or (largest is not None and resolution > largest):
            limit = f" up to {largest}" if largest is not None else ""
            raise UserError(f"resolution {resolution} is not a positive multiple of {multiple}{limit}, "
                            f"as {self.display_name} requires")

    @contextmanager
    def text_encoders_on_device(self):
        """Bring the frozen text encoders to the accelerator for a round of encoding, then back to the CPU."""
        for module in self.text_encoders:
            module.to(self.device)
        try:
            yield
        finally:
            for module in self.text_encoders:
                module.to(self.offload_device)

    def count_truncated(self, texts: list[str]) -> int:
        """How many of `texts` are longer than max_sequence_length tokens of the sequence encoder (T5, UMT5 or the
        Qwen2.5-VL text): the pipelines truncate them silently. 0 when the tokenizers were not loaded (cache)."""
        tokenizer = getattr(self.pipe, self.long_tokenizer, None)
        if tokenizer is None:
            return 0
        return sum(len(tokenizer(text).input_ids) > self.max_sequence_length for text in texts)

    def _require_text_encoders(self) -> None:
        if not self.text_encoders:
            raise RuntimeError("text encoders were not loaded (training from the embedding cache)")

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()

    def _with_negatives(self, cond: dict[str, torch.Tensor], guidance_scale: float) -> bool:
        """True CFG is on when guidance_scale > 1 (as in the pipelines); it needs the negative embeddings."""
        if guidance_scale <= 1:
            return False
        missing = [k for k in cond if not k.startswith("negative_") and f"negative_{k}" not in cond]
        if missing:
            raise ValueError(f"guidance_scale {guidance_scale} > 1 needs negative prompt embeddings "
                             f"(negative_{missing[0]}): encode with common.cache.PromptEncoder")
        return True

    def save_lora(self, directory: str | Path, lora_state_dict: dict[str, torch.Tensor],
                  adapter_name: str = "default") -> None:
        """Write LoRA weights in the diffusers format the matching pipeline's `load_lora_weights` reads, with the
        adapter's peft config as metadata: without it the loader assumes lora_alpha = r, which rescales any
        LoRA trained with α ≠ r (e.g. r 64, α 128)."""
        import diffusers

        peft_config = getattr(self.pipe.transformer, "peft_config", {}).get(adapter_name)  # the unwrapped module
        getattr(diffusers, self.pipeline_class_name).save_lora_weights(
            str(directory), transformer_lora_layers=lora_state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=peft_config.to_dict() if peft_config is not None else None)


class FluxAdapter(_Adapter):
    """FLUX.1 (dev/schnell) over `FluxPipeline`'s components. Guidance-distilled: the guidance scale is an
    embedding input, not true CFG."""

    pipeline_class_name = "FluxPipeline"
    display_name = "FLUX.1"
    text_components = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    long_tokenizer = "tokenizer_2"
    true_cfg = False  # guidance is an embedding input: no negative prompts to encode
    default_guidance_scale = 3.5  # FLUX.1-dev's guidance embedding (Flow-GRPO)
    # Attention and feed-forward projections of both block types (Flow-GRPO's FLUX LoRA targets).
    lora_target_modules = [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp", "proj_out",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        self._check_resolution(resolution, multiple)
        self.height = self.width = resolution
        self.latent_h = 2 * (resolution // multiple)
        self.latent_w = 2 * (resolution // multiple)
        self.num_channels = self.config.in_channels // 4
        self.image_ids = self.pipe._prepare_latent_image_ids(
            1, self.latent_h // 2, self.latent_w // 2, self.device, dtype)

    # ----- text ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning for a batch of prompts: batch-first tensors on the adapter's device.
        (Call inside `text_encoders_on_device()` on an accelerator, or it runs the encoders on the CPU.)"""
        self._require_text_encoders()
        prompt_embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    # ----- latents and schedule -----------------------------------------------------------------------
    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial packed latents, one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.num_channels, self.latent_h, self.latent_w)
        latents = randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)
        return self.pipe._pack_latents(latents, len(generators), self.num_channels, self.latent_h, self.latent_w)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as `FluxPipeline` builds it (linspace + resolution-dependent shift)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        cfg = self.scheduler.config
        mu = calculate_shift((self.latent_h // 2) * (self.latent_w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    # ----- the one forward ----------------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 3.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. `sigma` is a float or a (batch,) tensor. `transformer`: another policy's
        module (a frozen copy) instead of the adapter's own; the same call for every policy, so they cannot drift."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        guidance = torch.full((batch,), guidance_scale, device=latents.device) if self.config.guidance_embeds else None
        prompt_embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(
                hidden_states=latents.to(self.dtype),
                timestep=sigma.to(self.dtype),  # FLUX takes σ (the pipeline passes timestep / 1000)
                guidance=guidance,
                pooled_projections=cond["pooled_prompt_embeds"].to(self.dtype),
                encoder_hidden_states=prompt_embeds.to(self.dtype),
                txt_ids=text_ids,
                img_ids=self.image_ids,
                return_dict=False,
            )[0]
        return out.float()

    # ----- images -------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class SD3Adapter(_Adapter):
    """Stable Diffusion 3 / 3.5 over `StableDiffusion3Pipeline`'s components: two CLIP encoders + T5, an MMDiT
    that takes diffusers' timestep 1000·σ, true classifier-free guidance with negative prompts."""

    pipeline_class_name = "StableDiffusion3Pipeline"
    default_guidance_scale = 4.5  # true CFG scale of the references (SD3.5-M, Flow-GRPO)
    display_name = "SD3"
    max_sequence_limit = 512  # the T5 input
    text_components = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
    long_tokenizer = "tokenizer_3"
    true_cfg = True
    # Flow-GRPO's SD3.5 LoRA targets: the joint attention's image and text projections (not `attn2`).
    lora_target_modules = [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 256, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        patch = self.config.patch_size
        largest = self.config.pos_embed_max_size * patch * self.vae_scale_factor if self.config.pos_embed_max_size else None
        self._check_resolution(resolution, self.vae_scale_factor * patch, largest)
        self.height = self.width = resolution

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """CLIP-L/CLIP-G hidden states (zero-padded to the T5 width) followed by the T5 states, and both CLIP
        pooled projections side by side, as `StableDiffusion3Pipeline.encode_prompt` builds them."""
        self._require_text_encoders()
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, H/8, W/8), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.config.in_channels, self.height // self.vae_scale_factor,
                 self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's own schedule, called with no sigmas as `StableDiffusion3Pipeline` does: a linspace
        of the (already shifted) training range, shifted by 3 again, so the last σ before 0 is ≈ 0.009 at N = 10."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (calculate_shift,
                                                                                        retrieve_timesteps)

        cfg, kwargs = self.scheduler.config, {}
        if cfg.get("use_dynamic_shifting", False):  # not SD3.5's config; kept as the pipeline has it
            patch = self.config.patch_size
            seq_len = (self.height // self.vae_scale_factor // patch) * (self.width // self.vae_scale_factor // patch)
            kwargs["mu"] = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                           cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", **kwargs)
        return self.scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32; with guidance_scale > 1 the negative and positive conditioning run as one
        batch of 2B and combine as v_neg + w·(v_pos − v_neg), as the pipeline does."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        timestep = sigma * self.scheduler.config.num_train_timesteps  # the scheduler's own float32 product
        embeds, pooled, x = cond["prompt_embeds"], cond["pooled_prompt_embeds"], latents
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep,
                                   encoder_hidden_states=embeds.to(self.dtype),
                                   pooled_projections=pooled.to(self.dtype), return_dict=False)[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class QwenImageAdapter(_Adapter):
    """Qwen-Image over `QwenImagePipeline`'s components: a Qwen2.5-VL text encoder behind a chat template,
    packed 2x2 latents like FLUX.1, σ fed to the transformer, true CFG with the pipeline's norm rescale.

    Prompt embeddings have one row per text token; `encode_prompts` zero-pads them to `max_sequence_length`
    with a mask so that texts of any length stack (and cache); `velocity` trims the padding no row of the
    batch uses and masks the rest, so padded tokens never reach the image tokens."""

    pipeline_class_name = "QwenImagePipeline"
    default_guidance_scale = 4.0  # true CFG scale of the references (Qwen-Image, Flow-GRPO)
    display_name = "Qwen-Image"
    max_sequence_limit = 1024
    text_components = ("text_encoder", "tokenizer")
    long_tokenizer = "tokenizer"
    true_cfg = True
    # Flow-GRPO's Qwen-Image LoRA targets: attention of both streams and both streams' MLPs.
    lora_target_modules = [
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        if self.config.guidance_embeds:
            raise UserError(f"{model_path!r} is a guidance-distilled Qwen-Image transformer, which this adapter "
                            f"does not support (it runs true CFG)")
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        self._check_resolution(resolution, multiple)
        self.height = self.width = resolution
        self.latent_h = self.latent_w = 2 * (resolution // multiple)
        self.num_channels = self.config.in_channels // 4

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The last hidden state of the text encoder over the chat template minus its 34-token system prefix
        (`QwenImagePipeline.encode_prompt`), zero-padded to max_sequence_length, and its 0/1 mask."""
        self._require_text_encoders()
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = self.max_sequence_length - embeds.shape[1]
        return {"prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
                "prompt_embeds_mask": torch.nn.functional.pad(mask.long(), (0, pad))}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial packed latents (batch, (h/2)·(w/2), 4C), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        batch = len(generators)
        shape = (batch, 1, self.num_channels, self.latent_h, self.latent_w)  # the pipeline's 1-frame layout
        latents = randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)
        return self.pipe._pack_latents(latents, batch, self.num_channels, self.latent_h, self.latent_w)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as `QwenImagePipeline` builds it (linspace, resolution-dependent shift μ,
        the scheduler's shift_terminal)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        cfg = self.scheduler.config
        mu = calculate_shift((self.latent_h // 2) * (self.latent_w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. With guidance_scale > 1: negative and positive in one batch of 2B,
        v = v_neg + w·(v_pos − v_neg), rescaled per token to the norm of v_pos (QwenImagePipeline's true CFG)."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        embeds, mask, x = cond["prompt_embeds"], cond["prompt_embeds_mask"], latents
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_embeds_mask"], mask])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        keep = int(mask.sum(dim=1).max())  # text columns some row of this batch uses
        embeds, mask = embeds[:, :keep], mask[:, :keep]
        mask = None if bool(mask.all()) else mask  # the pipeline passes a mask only when a text is padded
        # The pipeline feeds (1000·σ in the latents' dtype) / 1000: the same rounding here.
        timestep = (sigma * self.scheduler.config.num_train_timesteps).to(self.dtype) / self.scheduler.config.num_train_timesteps
        img_shapes = [[(1, self.latent_h // 2, self.latent_w // 2)]] * x.shape[0]
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep, guidance=None,
                                   encoder_hidden_states_mask=mask, encoder_hidden_states=embeds.to(self.dtype),
                                   img_shapes=img_shapes, return_dict=False)[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            combined = uncond + guidance_scale * (text - uncond)
            out = combined * (torch.norm(text, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, shape (batch, 3, H, W) (the VAE's single frame)."""
        latents = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor).to(self.vae.dtype)
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        images = self.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class WanAdapter(_Adapter):
    """Wan2.1 text-to-video over `WanPipeline`'s components: UMT5 encoder, the Wan 3D causal VAE, latents
    (batch, C, 1 + (F − 1)/4, H/8, W/8), true CFG. Decoded videos are (batch, F, 3, H, W).

    The schedule is the checkpoint's UniPC flow schedule (σ from `set_timesteps`, as the pipeline and
    Flow-GRPO's Wan trainer use), integrated by our Euler/SDE steps instead of UniPC's multistep updates.
    The transformer sees the scheduler's integer timestep, ⌊1000·σ⌋, capped at 999 as UniPC's is."""

    pipeline_class_name = "WanPipeline"
    default_guidance_scale = 4.5  # true CFG scale of the references (Wan2.1, Flow-GRPO)
    display_name = "Wan"
    text_components = ("text_encoder", "tokenizer")
    long_tokenizer = "tokenizer"
    true_cfg = True
    # Flow-GRPO's Wan2.1 LoRA targets (the add_* projections exist only in image-to-video checkpoints).
    lora_target_modules = [
        "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int = 33):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        if self.pipe.transformer_2 is not None or self.pipe.config.get("expand_timesteps", False):
            raise UserError(f"{model_path!r} is a Wan2.2 two-expert or per-token-timestep checkpoint; only "
                            f"single-transformer Wan2.1-style text-to-video checkpoints are supported")
        self.vae_scale_factor = self.pipe.vae_scale_factor_spatial
        self.temporal_factor = self.pipe.vae_scale_factor_temporal
        self._check_resolution(resolution, self.vae_scale_factor * self.config.patch_size[1])
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise UserError(f"num_frames {num_frames} is not {self.temporal_factor}k + 1 (e.g. 33 or 81), "
                            f"as the Wan VAE requires")
        self.height = self.width = resolution
        self.num_frames = num_frames

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """UMT5 states of the cleaned prompt, zeroed past its end and padded to max_sequence_length
        (`WanPipeline.encode_prompt`)."""
        self._require_text_encoders()
        prompt_embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                   max_sequence_length=self.max_sequence_length, device=self.device)
        return {"prompt_embeds": prompt_embeds}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, latent frames, H/8, W/8), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.config.in_channels, (self.num_frames - 1) // self.temporal_factor + 1,
                 self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's σ for `num_steps`, as `WanPipeline` sets them, ending at 0. UniPC lowers σ_0 = 1 by
        1e-6 only to keep its log-SNR finite; Euler/SDE steps need no such guard (and flow-sde's σ = 1 rule
        needs σ_0 = 1 exactly), so it is put back."""
        self.scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self.scheduler.sigmas.float().clone()
        if abs(float(sigmas[0]) - 1.0) < 1e-5:
            sigmas[0] = 1.0
        return sigmas.to(self.device)

    def _timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """UniPC's timestep int64(1000·σ): truncated, at most num_train_timesteps − 1."""
        steps = self.scheduler.config.num_train_timesteps
        return (sigma.double() * steps).floor().clamp(max=steps - 1).long()

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32; with guidance_scale > 1 negative and positive conditioning run as one
        batch of 2B and combine as v_neg + w·(v_pos − v_neg), as the pipeline does."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        timestep, embeds, x = self._timestep(sigma), cond["prompt_embeds"], latents
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep,
                                   encoder_hidden_states=embeds.to(self.dtype), return_dict=False)[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> videos in [0, 1], float32, shape (batch, frames, 3, H, W)."""
        latents = latents.to(self.vae.dtype)
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]  # (batch, 3, F, H, W)
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


ADAPTERS = {"flux1": FluxAdapter, "sd3": SD3Adapter, "qwen-image": QwenImageAdapter, "wan": WanAdapter}


def load_adapter(model: str, model_path: str | None, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int | None = None):
    """The adapter of `model`; `load_text_encoders=False` when training from the embedding cache,
    `text_only=True` to load nothing but the text encoders (preprocess.py). `num_frames` (video models only)
    defaults to the adapter's own default."""
    if model not in ADAPTERS:
        raise UserError(f"unknown model {model!r}; choose one of: {', '.join(ADAPTERS)}")
    extra = {}
    if num_frames is not None:
        if model != "wan":
            raise UserError(f"num_frames applies to video models (wan), not to {model}")
        extra["num_frames"] = num_frames
    path = resolve_model_path(model, model_path)
    return ADAPTERS[model](path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                           **extra)
