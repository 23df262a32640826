"""Wan2.2 text-to-video (`WanPipeline`): the A14B model with two experts, and the TI2V-5B model with per-token
timesteps."""

import copy
import os
from pathlib import Path

import torch

from common.checkpoint import LORA_FILE_2
from common.models.tiny_parts import TINY_SEED, tiny_t5_tokenizer
from common.models.wan import WanAdapter, _tiny_wan_vae
from common.models.wan_i2v import WanImageToVideoAdapter
from common.parallel import sequence_parallel_degree
from common.utils import UserError

EXPERTS = ("transformer", "transformer_2")  # high noise, low noise: WanPipeline's component names


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as ONE module, so that `prepare` (DDP, FSDP2, DeepSpeed), the optimizer, the frozen
    policies and the checkpoints see a single transformer. Its forward sends each sample to the expert WanPipeline
    uses at its timestep: `transformer` where t ≥ boundary_ratio · num_train_timesteps, `transformer_2` below
    (a batch with samples on both sides is split and put back in order). The peft calls the scripts and
    common/ make on a transformer (add_adapter, set_adapter, disable/enable_adapters, peft_config, gradient
    checkpointing) act on both experts; `trained` names the experts whose LoRA is trained (--train-experts), the
    other's stays frozen whatever set_adapter does.

    Under torch.distributed every process must run the same experts: FSDP2 gathers an expert's shards in
    collectives, and DDP expects a gradient for every trained weight in every backward. So the processes agree
    (one all-reduce of two flags) on the experts any of them needs, and a process runs an expert it has no sample
    for on a single dummy token, adding 0 × its output, when another process needs it or, with gradients on,
    when the expert has trained weights, on one process as on N. (Its weights then get zero gradients: AdamW's
    momentum and weight decay still move them, as for any weight of a step's model.)"""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_timestep: float,
                 trained: tuple[str, ...] = EXPERTS):
        super().__init__()
        self.transformer, self.transformer_2 = high, low
        self.boundary_timestep = boundary_timestep
        self.trained = trained
        self.config = high.config
        # accelerate's FSDP2 auto-wrap reads the block classes off the root when the config names none (fsdp2.yaml)
        self._no_split_modules = high._no_split_modules

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """Which samples the high-noise expert takes: WanPipeline's `t >= boundary_timestep` (per sample; the
        first token's timestep when they are per token)."""
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        return t >= self.boundary_timestep

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict: bool = False, **kwargs):
        high = self.high_noise(timestep)
        rows = (torch.nonzero(high).flatten(), torch.nonzero(~high).flatten())
        used = torch.tensor([len(rows[0]) > 0, len(rows[1]) > 0], dtype=torch.int32, device=timestep.device)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            torch.distributed.all_reduce(used, op=torch.distributed.ReduceOp.MAX)
        parts, order, idle = [], [], []
        for expert, index, needed in zip(self.experts, rows, used.tolist()):
            if len(index) == len(timestep):  # the whole batch: no copies
                parts.append(expert(hidden_states=hidden_states, timestep=timestep,
                                    encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)[0])
                order.append(index)
            elif len(index):
                rows_only = {k: v[index] if torch.is_tensor(v) else v for k, v in kwargs.items()}
                parts.append(expert(hidden_states=hidden_states[index], timestep=timestep[index],
                                    encoder_hidden_states=encoder_hidden_states[index], return_dict=False,
                                    **rows_only)[0])
                order.append(index)
            elif needed or (torch.is_grad_enabled() and any(p.requires_grad for p in expert.parameters())):
                # Another process runs this expert (take part in its collectives), or DDP expects a gradient for
                # each of its trained weights (taken on one process too, so that 1 and N processes give AdamW the
                # same zero gradients): contribute nothing.
                patch = expert.config.patch_size
                token = hidden_states[:1, :, :patch[0], :patch[1], :patch[2]]
                if sequence_parallel_degree(expert) > 1:  # a whole sample, which splits as the real ones do
                    token = hidden_states[:1]
                first = {k: v[:1] if torch.is_tensor(v) else v for k, v in kwargs.items()}
                idle.append(expert(hidden_states=token, timestep=timestep[:1],
                                   encoder_hidden_states=encoder_hidden_states[:1, :1], return_dict=False,
                                   **first)[0].sum())
        out = parts[0] if len(parts) == 1 else torch.cat(parts)[torch.argsort(torch.cat(order))]
        for dummy in idle:
            out = out + 0 * dummy
        return (out,)

    # --- peft and diffusers calls, on both experts -----------------------------------------------------------------
    @property
    def peft_config(self) -> dict:
        return self.transformer.peft_config  # the experts carry the same adapters with the same configs

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        for expert in self.experts:
            expert.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)
        self.freeze_untrained()

    def set_adapter(self, adapter_name) -> None:
        for expert in self.experts:
            expert.set_adapter(adapter_name)
        self.freeze_untrained()  # peft's set_adapter gives requires_grad back to every layer of the active adapter

    def disable_adapters(self) -> None:
        for expert in self.experts:
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.experts:
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    def freeze_untrained(self) -> None:
        """The LoRA weights of an expert that --train-experts leaves out stay frozen."""
        for name, expert in zip(EXPERTS, self.experts):
            if name not in self.trained:
                for key, p in expert.named_parameters():
                    if "lora_" in key:
                        p.requires_grad_(False)

    def save_pretrained(self, *args, **kwargs):
        raise NotImplementedError("full fine-tuning of the two Wan2.2 experts is not supported (LoRA only)")


def _lora_metadata(module, adapter_name: str):
    config = getattr(module, "peft_config", {}).get(adapter_name)
    return config.to_dict() if config is not None else None


class Wan22Adapter(WanAdapter):
    """Wan2.2-T2V-A14B over `WanPipeline`'s components: Wan2.1's UMT5, VAE, latents and UniPC flow schedule, and
    two experts of the same architecture (`transformer` for high noise, `transformer_2` for low noise) switched at
    the pipeline's boundary_ratio. `transformer` here is a `WanExperts` holding both, so rollouts, training, the
    frozen policies (LoRA adapters on both experts), the KL reference (adapters disabled) and the EMA all route
    every sample as the pipeline would. Each expert has its own CFG scale: a (high, low) pair, or one number for
    both (as WanPipeline with guidance_scale_2 unset)."""

    display_name = "Wan2.2"
    # The references' (high, low) CFG scales: Wan2.2's own A14B text-to-video setting, and Flow-Factory's.
    default_guidance_scale = (4.0, 3.0)
    two_experts = True  # takes train_experts (--train-experts)
    model_components = ("transformer", "transformer_2", "vae")

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 train_experts: str = "both", **video):
        """`video`: num_frames, and condition_size for image-to-video (`Wan22ImageToVideoAdapter`)."""
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                         **video)
        if text_only:
            return
        boundary = self.pipe.config.boundary_ratio * self.scheduler.config.num_train_timesteps
        trained = {"both": EXPERTS, "high": EXPERTS[:1], "low": EXPERTS[1:]}[train_experts]
        self.experts = WanExperts(self.transformer, self.pipe.transformer_2.to(self.device).requires_grad_(False),
                                  boundary, trained)
        self.transformer = self.experts

    def _check_checkpoint(self, model_path: str) -> None:
        if self.pipe.transformer_2 is None or self.pipe.config.get("boundary_ratio") is None:
            raise UserError(f"{model_path!r} has no second expert (transformer_2 and a boundary_ratio): it is not a "
                            f"Wan2.2 A14B checkpoint; use --model wan or wan2.2-5b")

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale=(4.0, 3.0), transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32, each sample through the expert WanPipeline uses at its timestep and at that
        expert's CFG scale (`guidance_scale`: (high, low), or one number for both). As in the pipeline, CFG runs
        for both experts when the high-noise scale is > 1, and for neither otherwise."""
        scales = guidance_scale if isinstance(guidance_scale, (tuple, list)) else (guidance_scale, guidance_scale)
        high, low = (float(s) for s in scales)
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        if not self._with_negatives(cond, high):
            return self._guided(latents, sigma, cond, None, transformer)
        routed_high = self.experts.high_noise(self._timestep(sigma))
        scale = torch.where(routed_high, high, low).float().view(-1, *[1] * (latents.ndim - 1))
        return self._guided(latents, sigma, cond, scale, transformer)

    def save_lora(self, directory: str | Path, lora_state_dict: dict[str, torch.Tensor],
                  adapter_name: str = "default") -> None:
        """Each expert's LoRA in the format WanPipeline's `load_lora_weights` reads: the high-noise expert's in the
        usual file (loads into `transformer`), the low-noise expert's in LORA_FILE_2 (loads with
        `load_into_transformer_2=True`). `lora_state_dict` is keyed `transformer.…` / `transformer_2.…`."""
        import diffusers

        for name, expert, weight_name in zip(EXPERTS, self.experts.experts, (None, LORA_FILE_2)):
            layers = {k.removeprefix(name + "."): v for k, v in lora_state_dict.items() if k.startswith(name + ".")}
            extra = {"weight_name": weight_name} if weight_name else {}
            diffusers.WanPipeline.save_lora_weights(
                str(directory), transformer_lora_layers=layers, safe_serialization=True,
                transformer_lora_adapter_metadata=_lora_metadata(expert, adapter_name), **extra)
        second = Path(directory) / LORA_FILE_2
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(second, 0o666 & ~mask)  # safetensors writes 0600; setup.save opens up the usual file likewise


class Wan22ImageToVideoAdapter(Wan22Adapter, WanImageToVideoAdapter):
    """Wan2.2-I2V-A14B over `WanImageToVideoPipeline`'s components: Wan2.1 I2V's condition (`WanImageToVideoAdapter`:
    the first-frame mask and the VAE latents of [image, black frames...] concatenated after the noisy latents along
    channels, in_channels 36), without its CLIP image tokens (the transformer has no image projection, so the
    pipeline encodes none and the prompt is not padded to 512), and Wan2.2's two experts (`Wan22Adapter`: the
    routing at boundary_ratio, each expert's CFG scale, the two LoRA files). The composition is the MRO: the
    experts' methods first, then the image-to-video loading, condition and model input."""

    display_name = "Wan2.2 I2V"
    # Wan2.2's I2V-A14B setting (wan/configs/wan_i2v_A14B.py: sample_guide_scale (3.5, 3.5), for both experts).
    default_guidance_scale = (3.5, 3.5)
    text_components = ("text_encoder", "tokenizer")  # no CLIP image encoder in the checkpoint
    max_sequence_limit = None  # no image tokens: the 512-token split does not apply


class Wan22TI2VAdapter(WanAdapter):
    """Wan2.2-TI2V-5B text-to-video over `WanPipeline`: one transformer, the Wan2.2 VAE (48 latent channels, 16×
    spatial compression) and the pipeline's expand_timesteps: the transformer takes one timestep per latent token
    (batch, frames · H/32 · W/32), all equal to the sample's for text-to-video, as WanPipeline builds them."""

    display_name = "Wan2.2-5B"
    default_guidance_scale = 5.0  # Wan2.2's TI2V-5B setting

    def _check_checkpoint(self, model_path: str) -> None:
        if self.pipe.transformer_2 is not None or not self.pipe.config.get("expand_timesteps", False):
            raise UserError(f"{model_path!r} is not a Wan2.2 TI2V checkpoint (one transformer with "
                            f"expand_timesteps); use --model wan or wan2.2")

    def _transformer_timestep(self, sigma: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """UniPC's integer timestep repeated over the latent tokens, as WanPipeline's expand_timesteps builds it
        (its mask `[:, ::2, ::2]`: one entry per 2×2 patch); per sample, so each row may carry its own σ."""
        tokens = latents[0, 0, :, ::2, ::2].numel()
        return self._timestep(sigma).float()[:, None].expand(-1, tokens)


def _tiny_umt5(tokenizer):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                       num_layers=2, relative_attention_num_buckets=8))


def build_tiny_wan22(path: Path) -> None:
    """Wan2.2-T2V-A14B-like: `build_tiny_wan`'s UMT5 and Wan2.1 VAE, two transformers of one config (the high-noise
    `transformer` and the low-noise `transformer_2`, initialised differently) and the real pipeline's
    boundary_ratio 0.875; the UniPC flow schedule at shift 3 puts steps on both sides of the boundary."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = _tiny_wan_vae()
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64,
    ) for _ in range(2)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0],
                       transformer_2=experts[1], vae=vae, scheduler=scheduler, boundary_ratio=0.875)
    pipe.save_pretrained(path, safe_serialization=True)


def build_tiny_wan22_5b(path: Path) -> None:
    """Wan2.2-TI2V-5B-like: UMT5, the Wan2.2 VAE (residual up/down blocks, a 2×2 pixel patchify: 16× spatial, 4×
    temporal; its latent channels scaled from 48 to 8), one transformer taking per-token timesteps, and the
    pipeline's expand_timesteps; UniPC flow schedule at the real checkpoint's shift 5."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.0], latents_std=[1.5, 2.0, 2.5, 1.0, 1.2, 0.8, 1.1, 1.3],
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=8, out_channels=8,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler, expand_timesteps=True)
    pipe.save_pretrained(path, safe_serialization=True)


def build_tiny_wan22_i2v(path: Path) -> None:
    """Wan2.2-I2V-A14B-like: `build_tiny_wan`'s UMT5 and VAE, no CLIP image encoder, two transformers of one config
    without an image projection that take the noise, the first-frame mask (4) and the condition latents
    (in_channels = 2·z_dim + 4, as the real 36 = 2·16 + 4), the A14B I2V boundary 0.9 and sample shift 5 (Wan2.2's
    wan/configs/wan_i2v_A14B.py) as boundary_ratio and UniPC flow shift: 4 steps put two timesteps on each side of
    the boundary (999, 937 | 833, 625)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = _tiny_wan_vae()
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * 4 + 4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=64,
    ) for _ in range(2)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0],
                                   transformer_2=experts[1], vae=vae, scheduler=scheduler, boundary_ratio=0.9)
    pipe.save_pretrained(path, safe_serialization=True)
