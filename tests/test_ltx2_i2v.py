"""LTX-2 image-to-audio-video (`--model ltx2-i2v`) on the tiny LTX-2: the condition image's first latent frame lives
in `cond`, not in the policy's state, so no SDE step touches it. Parity with diffusers' LTX2ImageToVideoPipeline
(its image_crf=0; both streams' latents, the clean first frame included, and both outputs, CFG off and per stream),
the state and log-prob over the generated elements only with the ratio at 1, the LoRA file in the stock pipeline,
the embedding cache (condition latents included, cached = online bitwise), and refusals."""

import json

import pytest
import torch
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, condition_inputs, fingerprint_inputs, open_cache
from common.data import Prompt, load_images, load_prompts
from common.distributed import lora_state_dict
from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ode_sample, script_error, sde_trajectory

RESOLUTION, FRAMES = 32, 9  # 5 latent frames of 8×8 tokens (the first: the condition's), 9 audio latent frames
GUIDANCE = (3.0, 7.0)  # the pipeline's (video, audio) CFG defaults


def scene(colour, size, box) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(colour, box)
    return image


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("ltx2-i2v")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Two prompts with their first frames (neither square nor the output size: both are resized) and different
    negative prompts."""
    folder = tmp_path_factory.mktemp("ltx2_i2v")
    (folder / "images").mkdir()
    scene((200, 30, 30), (48, 40), (4, 8, 20, 24)).save(folder / "images" / "red.png")
    scene((30, 30, 200), (40, 56), (10, 2, 30, 14)).save(folder / "images" / "blue.png")
    (folder / "train.jsonl").write_text(
        '{"prompt": "the cat walks away", "negative_prompt": "blurry, static", "image": "images/red.png"}\n'
        '{"prompt": "a ball rolls", "image": "images/blue.png"}\n')
    return load_prompts(folder, "train")


def adapter_of(path, **kwargs):
    return load_adapter("ltx2-i2v", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=16,
                        num_frames=FRAMES, **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return adapter_of(path)


def stock(path, records, guidance, steps, seeds, output_type, lora=None, use_cross_timestep=False):
    """LTX2ImageToVideoPipeline on the same checkpoint, CFG only (its spatio-temporal and modality guidance and its
    rescale off), the condition image encoded as given (image_crf=0), the cross-attention modulated as LTX-2.0's
    reference does (use_cross_timestep=False; the pipeline's default True is LTX-2.3's)."""
    from diffusers import LTX2ImageToVideoPipeline

    pipe = LTX2ImageToVideoPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    images = [load_images(r.images)[0] for r in records]
    output = pipe(image=images, prompt=[r.prompt for r in records], negative_prompt=[r.negative_prompt for r in records],
                  height=RESOLUTION, width=RESOLUTION, num_frames=FRAMES, frame_rate=24.0, num_inference_steps=steps,
                  guidance_scale=guidance[0], audio_guidance_scale=guidance[1], stg_scale=0.0, audio_stg_scale=0.0,
                  modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                  spatio_temporal_guidance_blocks=None, image_crf=0, max_sequence_length=16, output_type=output_type,
                  use_cross_timestep=use_cross_timestep, generator=sample_generators(seeds, "cpu"))
    if output_type != "latent":
        return output
    # denormalised, unpacked -> normalised, packed: the condition's tokens, then our state's
    video = pipe._pack_latents(pipe._normalize_latents(output.frames, pipe.vae.latents_mean, pipe.vae.latents_std,
                                                       pipe.vae.config.scaling_factor))
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(output.audio), pipe.audio_vae.latents_mean,
                                          pipe.audio_vae.latents_std)
    return video, audio


def whole(adapter, state, cond):
    """Our state with the condition's first-frame tokens in front, as the pipeline's latents."""
    video, audio = adapter.split(state)
    return torch.cat([cond["image_latents"], video], dim=1), audio


def test_ode_rollout_and_decode_reproduce_the_stock_pipeline(adapter, path, records):
    cond = PromptEncoder(adapter)(records)
    assert adapter.condition_tokens == 64 and cond["image_latents"].shape == (2, 64, 4)
    x = adapter.noise(sample_generators([3, 4], "cpu"))
    assert x.shape == (2, 4 * 64 * 4 + 9 * 2 * 2) and adapter.video_numel == 4 * 64 * 4  # frames 1..4, then audio
    finals = {}
    for guidance in ((1.0, 1.0), GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 4, [3, 4], guidance)
        for ours, theirs in zip(whole(adapter, finals[guidance], cond), stock(path, records, guidance, 4, [3, 4],
                                                                              "latent")):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (finals[(1.0, 1.0)] - finals[GUIDANCE]).abs().max() > 0.01
    # LTX-2.3's modulation (the pipeline's default) is another model here: the condition tokens' timestep 0 is not
    # the audio's σ
    for ours, theirs in zip(whole(adapter, finals[GUIDANCE], cond),
                            stock(path, records, GUIDANCE, 4, [3, 4], "latent", use_cross_timestep=True)):
        assert (ours - theirs).abs().max() > 1e-3
    ours, theirs = adapter.decode(finals[GUIDANCE], cond), stock(path, records, GUIDANCE, 4, [3, 4], "pt")
    assert ours.video.shape == theirs.frames.shape == (2, FRAMES, 3, RESOLUTION, RESOLUTION)
    torch.testing.assert_close(ours.video, theirs.frames, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.audio, theirs.audio.float(), rtol=0, atol=1e-5)
    # The condition image matters: the same prompts and noise with the images swapped give other samples.
    swapped = PromptEncoder(adapter)([Prompt(r.prompt, r.negative_prompt, o.images, o.image_digests)
                                      for r, o in zip(records, records[::-1])])
    assert (ode_sample(adapter, swapped, 4, [3, 4], GUIDANCE) - finals[GUIDANCE]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs the condition's first-frame latents"):
        adapter.decode(finals[GUIDANCE])


def test_sde_steps_are_scored_on_the_generated_elements_and_the_ratio_is_one(adapter, records):
    """The state holds no condition token, so a flow-sde step (and its log-prob, the mean over the state's
    elements) covers the generated video frames and the audio only; re-scoring a stored step gives ratio 1."""
    cond = PromptEncoder(adapter)(records * 2)
    sigmas = adapter.sigmas(4)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE,
                                                      steps=range(3))
    assert latents.shape[-1] == adapter.video_numel + 9 * 2 * 2 and torch.isfinite(log_probs).all()
    for j in range(3):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        assert v.shape == latents[:, j].shape
        log_prob = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                            prev_sample=next_latents[:, j])[1]
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_lora_file_loads_into_the_stock_pipeline(path, records, tmp_path):
    tuned = adapter_of(path)
    torch.manual_seed(0)
    add_lora(tuned.transformer, 4, 8, tuned.lora_target_modules)
    with torch.no_grad():
        for name, p in tuned.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tuned.save_lora(tmp_path, lora_state_dict(tuned.transformer, tuned.transformer.state_dict()))
    cond = PromptEncoder(tuned)(records)
    ours = whole(tuned, ode_sample(tuned, cond, 3, [1, 2], GUIDANCE), cond)
    theirs = stock(path, records, GUIDANCE, 3, [1, 2], "latent", lora=tmp_path)
    base = stock(path, records, GUIDANCE, 3, [1, 2], "latent")
    for mine, loaded, untuned in zip(ours, theirs, base):  # video, then audio
        torch.testing.assert_close(mine, loaded, rtol=0, atol=5e-5)
        assert (loaded - untuned).abs().max() > 1e-3


def test_cache_holds_the_condition_latents_bitwise(adapter, path, records, tmp_path):
    from accelerate import Accelerator

    entries = cache_entries(records, [], with_negatives=True)
    inputs = fingerprint_inputs("ltx2-i2v", str(path), 16, torch.float32, list(entries),
                                condition_inputs("ltx2-i2v", RESOLUTION, None, FRAMES))
    encoder_only = adapter_of(path, text_only=True)  # preprocess.py's load: Gemma, the connectors and the VAE
    assert all(getattr(encoder_only.pipe, name) is None for name in ("transformer", "audio_vae", "vocoder"))
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    trainer = adapter_of(path, load_text_encoders=False)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None
    cached = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(records)
    online = PromptEncoder(adapter)(records)
    assert "negative_image_latents" in online and torch.equal(online["negative_image_latents"],
                                                              online["image_latents"])
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))


def test_bad_input_is_refused_with_one_line(path, tmp_path):
    message = script_error("algos/grpo.py", "--preset", "tiny", "--model", "ltx2-i2v", "--model-path", "tiny",
                           "--sequence-parallel", "2", "--output-dir", tmp_path / "run")
    assert message.startswith("error: --sequence-parallel: ltx2-i2v gives the video tokens one timestep each")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="--condition-size 64 differs from --resolution 32: for LTX-2 I2V the "
                                        "condition image is the video's first frame, at the output size"):
        adapter_of(path, condition_size=64)
    with pytest.raises(UserError, match="resolution 30 is not a positive multiple of 4, as LTX-2 I2V requires"):
        load_adapter("ltx2-i2v", str(path), "cpu", torch.float32, 30, max_sequence_length=16, text_only=True)
    index = json.loads((path / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises(UserError, match="names WanImageToVideoPipeline, not LTX2ImageToVideoPipeline or "
                                        "LTX2Pipeline"):
        adapter_of(tmp_path, text_only=True)


def test_bf16_weights_keep_float32_outputs(path):
    adapter = load_adapter("ltx2-i2v", str(path), "cpu", torch.bfloat16, RESOLUTION, max_sequence_length=16,
                           num_frames=FRAMES)
    cond = adapter.encode_prompts(["a cat"], [[scene((200, 30, 30), (48, 40), (4, 8, 20, 24))]])
    assert cond["image_latents"].dtype == torch.float32  # as the pipeline keeps its latents
    x = adapter.noise(sample_generators([0], "cpu"))
    v = adapter.velocity(x, 0.5, cond, 1.0)
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    decoded = adapter.decode(x, cond)
    assert decoded.video.dtype == torch.float32 and decoded.video.shape == (1, FRAMES, 3, RESOLUTION, RESOLUTION)
