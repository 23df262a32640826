"""LTX-2 text-to-audio-video (`LTX2Pipeline`): one transformer denoises a video latent and an audio latent together,
at one σ; the adapter presents the pair as ONE latent tensor, so that the SDE steps, log-probs and every script treat
it as any other model's latents."""

from pathlib import Path

import numpy as np
import torch

from common.models.base import AudioVideo, FirstFrameConditioned, _Adapter
from common.models.tiny_parts import TINY_SEED, _characters
from common.utils import UserError


class LTX2Adapter(_Adapter):
    """LTX-2 over `LTX2Pipeline`'s components: Gemma 3 (every hidden layer, stacked) and the text connectors, the
    LTX-2 video VAE, the audio VAE (mel spectrogram latents) and the vocoder, and the audio-video transformer.

    The state is the joint latent (batch, N): the pipeline's packed video tokens (batch, frames·h·w, C_v) flattened,
    followed by its packed, normalised audio tokens (batch, audio frames, C_a·mel bins) flattened. `velocity` splits
    it, runs the transformer once on both streams and joins the two velocities the same way, so one SDE step (and
    one log-prob, averaged over all N elements of both modalities) covers video and audio: a single policy.

    Both streams share the σ schedule (the pipeline steps a copy of one scheduler for the audio) and the timestep
    σ·1000. Guidance is true CFG per modality, a (video, audio) pair of scales (one number: both): the pipeline's
    x0-space delta form with only its CFG term, v_neg + w·(v_pos − v_neg) (the same, algebraically); its
    spatio-temporal, modality-isolation guidance and guidance rescale are not used (each costs another transformer
    forward or ties samples of a batch, and the stock pipeline reproduces our samples with them off).

    `decode` returns an `AudioVideo`: frames (batch, F, 3, H, W) in [0, 1] and the vocoder's waveforms (batch,
    channels, samples) at `sample_rate`. The frame rate is the pipeline's default 24 fps; it sets the audio length
    (F / 24 s) and the video's RoPE positions."""

    pipeline_class_name = "LTX2Pipeline"
    display_name = "LTX-2"
    # LTX2Pipeline's (video, audio) CFG defaults, the ltx-pipelines reference settings for LTX-2.
    default_guidance_scale = (3.0, 7.0)
    text_components = ("text_encoder", "tokenizer", "connectors")
    model_components = ("transformer", "vae", "audio_vae", "vocoder")
    long_tokenizer = "tokenizer"
    true_cfg = True
    video = True
    audio = True  # decodes an AudioVideo
    frame_rate = 24.0
    first_frame_given = False  # image-to-video (LTX2ImageToVideoAdapter): the condition is the first latent frame
    # Every attention of both streams (self, text cross-attention, audio↔video cross-attention): the names LTX-2's
    # own trainer targets.
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]
    # The transformer's FSDP2 units. LTX2VideoTransformer3DModel names no _no_split_modules, which accelerate's
    # auto-wrap reads when the config names no classes (configs/fsdp2.yaml): the adapter sets it.
    no_split_modules = ["LTX2VideoTransformerBlock"]
    # LTX-2.0's reference modulates each stream's audio-video cross-attention (scale, shift and gate) by its own
    # timesteps (Lightricks/LTX-2 as released, packages/ltx-core/src/ltx_core/model/transformer/transformer_args.py,
    # MultiModalTransformerArgsPreprocessor.prepare): diffusers' use_cross_timestep=False. True, the pipelines'
    # default, is the LTX-2.3 behaviour; the two differ only where a stream's timesteps vary by token (I2V).
    use_cross_timestep = False

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 1024, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int = 33):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if self.pipe.connectors is not None:  # frozen like the text encoder, parked on the CPU between uses
            self.pipe.connectors.requires_grad_(False).to(self.offload_device)
            self.text_encoders.append(self.pipe.connectors)
        if text_only:
            return
        pipe = self.pipe
        self.transformer._no_split_modules = self.no_split_modules
        for module in (pipe.audio_vae, pipe.vocoder):
            module.to(self.device).requires_grad_(False)
        self.spatial_factor = pipe.vae_spatial_compression_ratio
        self.temporal_factor = pipe.vae_temporal_compression_ratio
        self._check_resolution(resolution, self.spatial_factor * self.config.patch_size)
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            examples = f"{4 * self.temporal_factor + 1} or {15 * self.temporal_factor + 1}"
            raise UserError(f"num_frames {num_frames} is not {self.temporal_factor}k + 1 (e.g. {examples}), as the "
                            f"LTX-2 VAE requires")
        self.height = self.width = resolution
        self.num_frames = num_frames
        # The video's latent grid and the audio's latent length, as LTX2Pipeline.__call__ derives them.
        self.latent_frames = (num_frames - 1) // self.temporal_factor + 1
        self.latent_h = self.latent_w = resolution // self.spatial_factor
        audio_vae = pipe.audio_vae
        # latent frames per second, then the clip's, in the pipeline's order of operations
        compression = float(audio_vae.temporal_compression_ratio)
        per_second = audio_vae.config.sample_rate / audio_vae.config.mel_hop_length / compression
        self.audio_frames = round(num_frames / self.frame_rate * per_second)
        self.latent_mel_bins = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        self.video_shape = (self.config.in_channels, self.latent_frames, self.latent_h, self.latent_w)
        self.audio_shape = (audio_vae.config.latent_channels, self.audio_frames, self.latent_mel_bins)
        patch, patch_t = self.config.patch_size, self.config.patch_size_t
        self.video_tokens = (self.latent_frames // patch_t, self.latent_h // patch, self.latent_w // patch)
        # Image-to-video: the first latent frame's tokens (the first h·w, patch_size_t being 1) are the condition's,
        # kept clean and never stepped: the state holds the other frames' tokens and the audio's.
        self.condition_tokens = self.video_tokens[1] * self.video_tokens[2] if self.first_frame_given else 0
        tokens = int(np.prod(self.video_tokens))
        self.video_numel = int(np.prod(self.video_shape)) // tokens * (tokens - self.condition_tokens)
        self.sample_rate = int(pipe.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Gemma 3's hidden states (all layers, left-padded to max_sequence_length) through the text connectors,
        as `LTX2Pipeline.__call__` does: the video and the audio stream's text tokens and their 0/1 mask. Only these
        reach the transformer, so the cache holds them (not the stacked hidden states, 49 × wider)."""
        self._require_text_encoders()
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                max_sequence_length=self.max_sequence_length, device=self.device)
        video_embeds, audio_embeds, mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        return {"prompt_embeds": video_embeds, "audio_prompt_embeds": audio_embeds, "prompt_attention_mask": mask}

    # --- the joint latent --------------------------------------------------------------------------------------------
    def join(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Packed generated video tokens (B, S_v, C_v) and audio tokens (B, S_a, C_a) -> the joint latent (B, N)."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint latent (B, N) -> packed generated video tokens (B, S_v, C_v), packed audio tokens (B, S_a, C_a)."""
        batch, video_tokens = latents.shape[0], int(np.prod(self.video_tokens)) - self.condition_tokens
        video = latents[:, :self.video_numel].reshape(batch, video_tokens, -1)
        return video, latents[:, self.video_numel:].reshape(batch, self.audio_frames, -1)

    def _whole_video(self, video: torch.Tensor, cond: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The generated video tokens with the condition's clean first-frame tokens before them (image-to-video);
        as they are for text-to-video."""
        if not self.condition_tokens:
            return video
        if cond is None or "image_latents" not in cond:
            raise ValueError(f"{self.display_name} needs the condition's first-frame latents (cond['image_latents'])")
        return torch.cat([cond["image_latents"].to(video.device, video.dtype), video], dim=1)

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial joint latent, float32: each sample's generator draws its video noise (batch, C, F', H', W'), then
        its audio noise (batch, C_a, audio frames, mel bins), in the order `LTX2Pipeline` draws them, packed as it
        packs them (image-to-video: the first frame's noise, which the condition replaces, is drawn and dropped)."""
        from diffusers.utils.torch_utils import randn_tensor

        batch, pipe = len(generators), self.pipe
        video = randn_tensor((batch, *self.video_shape), generator=generators, device=self.device, dtype=torch.float32)
        audio = randn_tensor((batch, *self.audio_shape), generator=generators, device=self.device, dtype=torch.float32)
        video = pipe._pack_latents(video, self.config.patch_size, self.config.patch_size_t)
        return self.join(video[:, self.condition_tokens:], pipe._pack_audio_latents(audio))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 as `LTX2Pipeline` sets them: linspace(1, 1/N) shifted by μ fitted to the video token
        count (the scheduler's terminal stretch included); the audio steps on the same σ."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        cfg = self.scheduler.config
        mu = calculate_shift(int(np.prod(self.video_tokens)), cfg.get("base_image_seq_len", 1024),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.95),
                             cfg.get("max_shift", 2.05))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale=(3.0, 7.0), transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) of the joint latent in float32. With a (video, audio) scale > 1 (CFG on for both streams
        when either is, as in the pipeline) negative and positive prompts run as one batch of 2B, and each stream
        combines as v_neg + w·(v_pos − v_neg) with its own w. Image-to-video: the condition's first-frame tokens
        go before the generated ones at timestep 0 (the pipeline's conditioning mask), and their velocity, which
        nothing steps, is dropped."""
        scales = guidance_scale if isinstance(guidance_scale, (tuple, list)) else (guidance_scale, guidance_scale)
        video_scale, audio_scale = (float(s) for s in scales)
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        video, audio = self.split(latents)
        video = self._whole_video(video, cond)
        embeds, audio_embeds, mask = cond["prompt_embeds"], cond["audio_prompt_embeds"], cond["prompt_attention_mask"]
        timestep = sigma * self.scheduler.config.num_train_timesteps  # the scheduler's timesteps, σ·1000
        video_timestep = timestep
        if self.condition_tokens:  # per video token, 0 on the clean condition tokens (the audio's is the clip's)
            video_timestep = timestep[:, None].repeat(1, video.shape[1])
            video_timestep[:, :self.condition_tokens] = 0
        cfg = self._with_negatives(cond, max(video_scale, audio_scale))
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            audio_embeds = torch.cat([cond["negative_audio_prompt_embeds"], audio_embeds])
            mask = torch.cat([cond["negative_prompt_attention_mask"], mask])
            video, audio = torch.cat([video, video]), torch.cat([audio, audio])
            timestep, video_timestep = torch.cat([timestep, timestep]), torch.cat([video_timestep, video_timestep])
        model = self.transformer if transformer is None else transformer
        frames, height, width = self.video_tokens
        with self._autocast():
            out_video, out_audio = model(
                hidden_states=video.to(self.dtype), audio_hidden_states=audio.to(self.dtype),
                encoder_hidden_states=embeds.to(self.dtype), audio_encoder_hidden_states=audio_embeds.to(self.dtype),
                timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=mask,
                audio_encoder_attention_mask=mask, num_frames=frames, height=height, width=width, fps=self.frame_rate,
                audio_num_frames=self.audio_frames, use_cross_timestep=self.use_cross_timestep,
                return_dict=False)
        out_video, out_audio = out_video[:, self.condition_tokens:].float(), out_audio.float()
        if cfg:
            out_video, out_audio = self._cfg_combine(out_video, video_scale), self._cfg_combine(out_audio, audio_scale)
        return self.join(out_video, out_audio)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond: dict[str, torch.Tensor] | None = None) -> AudioVideo:
        """Joint latents -> frames (batch, F, 3, H, W) in [0, 1] and waveforms (batch, channels, samples), float32,
        as `LTX2Pipeline` decodes them (video VAE at decode timestep 0 with no decode noise; audio VAE to a mel
        spectrogram, then the vocoder). Image-to-video decodes the condition's first frame with the generated ones
        (the VAE is causal in time: every frame depends on it), so it needs `cond`."""
        pipe, vae = self.pipe, self.vae
        video, audio = self.split(latents.float())
        video = self._whole_video(video, cond)
        patch, patch_t = self.config.patch_size, self.config.patch_size_t
        video = pipe._unpack_latents(video, *self.video_tokens, patch, patch_t)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = (torch.zeros(len(video), device=video.device, dtype=vae.dtype)
                    if vae.config.timestep_conditioning else None)
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]  # (batch, 3, F, H, W) in [-1, 1]
        frames = (frames.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)
        audio_vae = pipe.audio_vae
        audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, self.audio_frames, num_mel_bins=self.latent_mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return AudioVideo(frames, pipe.vocoder(mel.to(pipe.vocoder.dtype)).float(), self.sample_rate)


class LTX2ImageToVideoAdapter(FirstFrameConditioned, LTX2Adapter):
    """LTX-2 image-to-audio-video over `LTX2ImageToVideoPipeline` (the same components as `LTX2Pipeline`): the
    condition image, VAE-encoded, is the video's first latent frame. The pipeline keeps those tokens clean (its
    conditioning mask: per-token timestep 0) and steps only the other frames; here they are not in the state at all.
    The joint latent holds the generated tokens (video frames ≥ 1, then the audio), `encode_prompts` adds the
    condition's packed first-frame latents (`image_latents`, batch × h·w tokens × C, float32 as the pipeline keeps
    them) to the text conditioning, and `velocity` and `decode` put them back in front: an SDE step never touches
    them, and the log-prob covers the generated elements only.

    The condition image is encoded as given, the pipeline with `image_crf=0`: by default the pipeline first
    re-compresses it as one H.264 frame (CRF 33 for LTX-2's Gemma 3, through PyAV), the compression LTX-2 was
    trained on; to reproduce that, give images so compressed. Video and audio timesteps, σ schedule (μ from all
    video tokens, the condition's included) and guidance are `LTX2Adapter`'s."""

    pipeline_class_name = "LTX2ImageToVideoPipeline"
    also_loads = ("LTX2Pipeline",)  # Lightricks/LTX-2 names LTX2Pipeline; the pipelines share its components
    display_name = "LTX-2 I2V"
    condition_components = ("vae",)  # condition latents are cached: preprocess.py VAE-encodes them
    first_frame_given = True
    # LTX-2's plan splits the video tokens but not a per-token timestep, which the clean first frame needs
    sequence_parallel_refusal = ("gives the video tokens one timestep each (0 on the condition's), which LTX-2's "
                                 "sequence-parallel plan in diffusers does not split; run without the flag")

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 1024, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None, num_frames: int = 33):
        self._check_condition_size(condition_size, resolution)
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                         num_frames)
        self.condition_size = condition_size
        if text_only:  # preprocess.py encodes the conditions: the VAE and the output size are all they need
            self._check_resolution(resolution, self.pipe.vae_spatial_compression_ratio)
            self.height = self.width = resolution
        elif self.config.patch_size_t != 1:
            raise UserError(f"{model_path!r}: its transformer packs {self.config.patch_size_t} latent frames per "
                            f"token; {self.display_name} needs the first frame in tokens of its own (patch_size_t 1)")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        """The text conditioning of `LTX2Adapter` and each prompt's condition image as the pipeline's first latent
        frame: resized to the output size, the VAE's mode (`argmax`), normalised by the latent statistics (without
        the scaling factor, as `prepare_latents` does), packed; one row per prompt."""
        self._check_one_image_each(prompts, images)
        from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import retrieve_latents

        cond, pipe, rows = super().encode_prompts(prompts), self.pipe, []
        vae, patch = pipe.vae, pipe.transformer_spatial_patch_size
        for (image,) in images:
            pixels = pipe.video_processor.preprocess(image, height=self.height, width=self.width)
            pixels = pixels.to(self.device, self.dtype)  # the pipeline casts the image to the prompt dtype
            latents = retrieve_latents(vae.encode(pixels[:, :, None].to(vae.dtype)), None, "argmax").float()
            latents = pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)
            rows.append(pipe._pack_latents(latents, patch, 1))
        return {**cond, "image_latents": torch.cat(rows)}


def tiny_gemma_tokenizer(max_length: int = 1024):
    """A Gemma (SentencePiece-style BPE) tokenizer over single characters, with a merge of "▁" and each character
    (a word-initial character is one token), Gemma's special tokens and its left padding."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<image_soft_token>", "<start_of_image>",
                "<end_of_image>"]
    pieces = specials + ["▁"] + _characters() + ["▁" + c for c in _characters()]
    return GemmaTokenizer(vocab={piece: i for i, piece in enumerate(pieces)},
                          merges=[("▁", c) for c in _characters()], model_max_length=max_length)


def build_tiny_ltx2(path: Path) -> None:
    """LTX-2-like: a 2-layer Gemma 3 (Gemma3ForConditionalGeneration, its SigLIP tower one layer, unused for text),
    the LTX-2.0 text connectors (one shared projection of the stacked hidden states, one connector layer per
    stream), the audio-video transformer with both streams and their cross-attention, the LTX-2 video VAE (a 2×2
    pixel patchify and one spatio-temporal block: 4× spatial, 2× temporal; the real one is 32×, 8×) with non-trivial
    latent statistics, the audio VAE (stereo mel spectrogram latents) and the vocoder, and the LTX-Video family's
    scheduler config (μ shift fitted between 1024 and 4096 tokens, terminal σ stretched to 0.1)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = tiny_gemma_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         sliding_window=16, pad_token_id=ids("<pad>"), eos_token_id=ids("<eos>"),
                         bos_token_id=ids("<bos>")),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=ids("<image_soft_token>"), boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>")))
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3,  # 2 layers + the embeddings, stacked
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split")
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=2 * 2, audio_out_channels=2 * 2, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
        rope_double_precision=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",), upsample_residual=(False,), upsample_factor=(1,),
        timestep_conditioning=False, patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    with torch.no_grad():  # latent statistics that are not 0 and 1, so that a missed (de)normalisation shows
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
        vae.latents_std.copy_(torch.tensor([1.5, 2.0, 2.5, 1.0]))
        audio_vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, len(audio_vae.latents_mean)))
        audio_vae.latents_std.copy_(torch.linspace(0.8, 1.6, len(audio_vae.latents_std)))
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(path, safe_serialization=True)
