"""FLUX.2 [dev] (`Flux2Pipeline`) and FLUX.2 [klein] (`Flux2KleinPipeline`)."""

import sys
from pathlib import Path

import numpy as np
import torch

from common.models.base import _Adapter, component_class_name
from common.models.tiny_parts import TINY_SEED, _byte_level_bpe, tiny_qwen2_tokenizer
from common.utils import UserError


def _processor_needs_torchvision(model_path: str) -> bool:
    """Whether the checkpoint's tokenizer is a PixtralProcessor (FLUX.2 [dev]'s) and torchvision is missing."""
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available() and component_class_name(model_path, "tokenizer") == "PixtralProcessor"


class Flux2Adapter(_Adapter):
    """FLUX.2 [dev] over `Flux2Pipeline`'s components: a Mistral-3 text encoder whose hidden layers 10, 20 and 30
    are stacked per token (a system prompt in front; every text padded to max_sequence_length, no mask), latents
    2x2-patchified by the VAE side and normalised by the VAE's batch-norm statistics, 4-axis position ids, σ fed to
    the transformer, a σ shift μ fitted empirically to the token count AND the number of steps
    (`compute_empirical_mu`), and guidance as an embedding input (guidance-distilled: no negative prompt)."""

    pipeline_class_name = "Flux2Pipeline"
    display_name = "FLUX.2"
    text_components = ("text_encoder", "tokenizer")
    true_cfg = False
    default_guidance_scale = 4.0  # Flux2Pipeline's default and Flow-Factory's FLUX.2 [dev] setting
    # Flow-Factory's FLUX.2 LoRA targets: both streams' attention and feed-forward in the double-stream blocks and the
    # fused QKV+MLP input of the single-stream blocks. (Their `attn.to_out.0` names no single-block module: those have
    # a plain `attn.to_out`, which a suffix here cannot name without also naming the double blocks' ModuleList.)
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        if load_text_encoders and _processor_needs_torchvision(model_path):
            raise UserError(f"{self.display_name}'s prompt encoding needs torchvision: {model_path!r} tokenizes with a "
                            f"PixtralProcessor, which transformers builds only with it; pip install torchvision, or "
                            f"train from an embedding cache made where it is installed")
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        # The pipeline's own module: its schedule helpers (klein carries copies of FLUX.2's).
        self.pipeline_module = sys.modules[type(self.pipe).__module__]
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 patchify
        self._check_resolution(resolution, multiple)
        self.height = self.width = resolution
        self.grid = resolution // multiple  # image tokens per side
        # (1, grid², 4) position ids (T, H, W, L) of the target's tokens, as prepare_latents makes them.
        self.image_ids = self.pipe._prepare_latent_ids(torch.empty(1, 1, self.grid, self.grid)).to(self.device)

    # ----- text ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """(batch, max_sequence_length, 3·hidden) prompt embeddings as the pipeline's `encode_prompt` builds them
        (chat template, padded to max_sequence_length, three hidden layers side by side per token)."""
        self._require_text_encoders()
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds}

    def _template_ids(self, text: str) -> list[int]:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        chat = format_input([text], system_message=self.pipe.system_message)
        return self.pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=True,
                                                       return_dict=True)["input_ids"][0]

    def count_truncated(self, texts: list[str]) -> int:
        """How many texts the pipeline cuts: the chat template around them counts towards max_sequence_length."""
        if getattr(self.pipe, "tokenizer", None) is None:
            return 0
        return sum(len(self._template_ids(text)) > self.max_sequence_length for text in texts)

    # ----- latents and schedule -----------------------------------------------------------------------
    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial packed latents (batch, grid², C), drawn in the pipeline's (batch, C, grid, grid) layout."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.config.in_channels, self.grid, self.grid)
        return self.pipe._pack_latents(randn_tensor(shape, generator=generators, device=self.device,
                                                    dtype=torch.float32))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as the pipeline builds it: linspace(1, 1/N, N) time-shifted by the empirical μ
        of (image tokens, N)."""
        module = self.pipeline_module
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):  # as the pipeline: the scheduler's own
            sigmas = None
        mu = module.compute_empirical_mu(image_seq_len=self.grid * self.grid, num_steps=num_steps)
        module.retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    # ----- the one forward ----------------------------------------------------------------------------
    def _true_cfg(self, cond: dict[str, torch.Tensor], guidance_scale: float) -> bool:
        return False

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. [dev]: guidance_scale is the guidance embedding. [klein] base: with
        guidance_scale > 1 the negative and positive conditioning run as one batch of 2B and combine as
        v_neg + w·(v_pos − v_neg), as Flux2KleinPipeline does in two calls."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        # The pipeline feeds (1000·σ in the latents' dtype) / 1000: the same rounding here.
        scale = self.scheduler.config.num_train_timesteps
        timestep = (sigma * scale).to(self.dtype) / scale
        embeds, x = cond["prompt_embeds"], latents
        cfg = self._true_cfg(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        guidance = (torch.full((x.shape[0],), guidance_scale, dtype=torch.float32, device=latents.device)
                    if self.config.guidance_embeds else None)
        text_ids = self.pipe._prepare_text_ids(embeds[:1]).to(latents.device)  # (1, L, 4): (0, 0, 0, l)
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep, guidance=guidance,
                        encoder_hidden_states=embeds.to(self.dtype), txt_ids=text_ids, img_ids=self.image_ids,
                        return_dict=False)[0].float()
        return self._cfg_combine(out, guidance_scale) if cfg else out

    # ----- images -------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, (batch, 3, H, W): unpack by position ids, undo the batch
        norm, unpatchify 2x2, decode (the pipeline's steps)."""
        pipe, vae = self.pipe, self.vae
        latents = pipe._unpack_latents_with_ids(latents.to(vae.dtype), self.image_ids.expand(latents.shape[0], -1, -1))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                               latents.dtype)
        images = vae.decode(pipe._unpatchify_latents(latents * std + mean), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class Flux2KleinAdapter(Flux2Adapter):
    """FLUX.2 [klein] over `Flux2KleinPipeline`'s components: FLUX.2's latents, ids, schedule and decoding, a Qwen3
    text encoder (hidden layers 9, 18, 27; Qwen3's chat template with thinking off, no system prompt), no guidance
    embedding. The base (non-distilled) checkpoints run true CFG with a negative prompt when guidance_scale > 1
    (the pipeline's negative prompt is always "", the datasets' negative prompts here, "" by default); the
    step-distilled ones (`is_distilled` in model_index.json) ignore guidance, as the pipeline does."""

    pipeline_class_name = "Flux2KleinPipeline"
    display_name = "FLUX.2 [klein]"
    true_cfg = True
    default_guidance_scale = 4.0  # Flux2KleinPipeline's default and Flow-Factory's klein-base GRPO setting

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only)
        self.distilled = bool(self.pipe.config.get("is_distilled", False))
        if self.distilled:
            self.default_guidance_scale = 1.0

    def _template_ids(self, text: str) -> list[int]:
        tokenizer = self.pipe.tokenizer
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        return tokenizer(chat).input_ids

    def _true_cfg(self, cond: dict[str, torch.Tensor], guidance_scale: float) -> bool:
        return not self.distilled and self._with_negatives(cond, guidance_scale)


def tiny_mistral_tokenizer():
    """A byte-level BPE tokenizer in Mistral's chat format ([SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]) with
    merges that make each word of FLUX.2's system message one token, so that the templated prefix is short as with
    the real tokenizer. The real checkpoint wraps its tokenizer in a PixtralProcessor, which needs torchvision; the
    text-to-image path calls only its `apply_chat_template`, which a tokenizer with the same template answers."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _byte_level_bpe([word for word, _ in pre_tokenizer.pre_tokenize_str(SYSTEM_MESSAGE)])
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer, backend.decoder = pre_tokenizer, decoders.ByteLevel()
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                "[/SYSTEM_PROMPT]", "[IMG]"])
    # Message content is a list of {"type": "text", "text": ...} parts, as Flux2Pipeline formats it.
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% set text = m['content'] if m['content'] is string else "
        "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
        "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
        "{% endfor %}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=2048, chat_template=template)


def _tiny_flux2_vae():
    """AutoencoderKLFlux2 with 8x downsampling; its batch norm over the 2x2-patchified latents gets non-trivial
    running statistics, so that a missed (de)normalisation shows."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                             norm_num_groups=4)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    return vae


def _tiny_flux2_transformer(guidance_embeds: bool):
    """Flux2Transformer2DModel: one double- and one single-stream block, 4-axis RoPE, the text width 3 × the
    tiny text encoder's hidden size (the pipelines stack three of its hidden layers)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * 16, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)


def _flux2_scheduler():
    """FLUX.2's scheduler config: the pipeline passes its empirical μ, which the exponential time shift uses."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def build_tiny_flux2(path: Path) -> None:
    """FLUX.2 [dev]-like: a Mistral3 (Pixtral vision tower unused, 30 text layers so that the pipeline's hidden
    layers 10, 20, 30 exist), the FLUX.2 VAE with its latent batch norm, a guidance-embedding Flux2 transformer."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tiny_mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=2048, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
                         pad_token_id=ids("<pad>")),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=ids("[IMG]")))
    pipe = Flux2Pipeline(scheduler=_flux2_scheduler(), vae=_tiny_flux2_vae(), text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=_tiny_flux2_transformer(guidance_embeds=True))
    pipe.save_pretrained(path, safe_serialization=True)


def build_tiny_flux2_klein(path: Path) -> None:
    """FLUX.2 [klein] base-like: a Qwen3 causal LM (27 layers: the pipeline stacks hidden layers 9, 18, 27) behind
    Qwen3's chat template with thinking off, the FLUX.2 VAE, a Flux2 transformer without guidance embedding (the
    base model runs true CFG), is_distilled False."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>")))
    pipe = Flux2KleinPipeline(scheduler=_flux2_scheduler(), vae=_tiny_flux2_vae(), text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=_tiny_flux2_transformer(guidance_embeds=False),
                              is_distilled=False)
    pipe.save_pretrained(path, safe_serialization=True)
