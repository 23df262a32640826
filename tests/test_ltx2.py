"""LTX-2 on its tiny pipeline: the joint audio-video latent as one policy (parity with diffusers' LTX2Pipeline in both
streams' latents and both outputs, each stream at its own CFG scale; one log-prob over all elements of both), the
LoRA files in the pipeline's format, the embedding cache, the audio rewards against numpy, audio through scoring and
the .wav files (a run's, beside its evaluation grid: tests/test_matrix.py), and refusals."""

import math
import wave

import numpy as np
import pytest
import torch

from common.cache import PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache
from common.data import Prompt
from common.distributed import lora_state_dict
from common.dynamics import sde_step
from common.models import ADAPTERS, load_adapter
from common.models.base import AudioVideo
from common.sampling import sample_generators
from common.scoring import Reward, call_reward
from common.training import add_lora
from common.utils import UserError
from conftest import SLOW, ode_sample, read_metrics, run_script, script_error

FRAMES = 9  # 2k + 1 for the tiny VAE: 5 latent frames; 9 / 24 s of audio: 9 audio latent frames
GUIDANCE = (3.0, 7.0)  # LTX2Pipeline's (video, audio) CFG defaults
PROMPTS = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("ltx2")


def make_adapter(path, **kwargs):
    return load_adapter("ltx2", str(path), "cpu", torch.float32, 32, max_sequence_length=16, num_frames=FRAMES,
                        **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return make_adapter(path)


def stock(path, lora=None):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def pipeline_outputs(pipe, guidance, steps, seeds, output_type):
    """The stock pipeline with CFG only (its spatio-temporal and modality guidance and its rescale off)."""
    return pipe(prompt=[p.prompt for p in PROMPTS], negative_prompt=[p.negative_prompt for p in PROMPTS], height=32,
                width=32, num_frames=FRAMES, frame_rate=24.0, num_inference_steps=steps, guidance_scale=guidance[0],
                audio_guidance_scale=guidance[1], stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                spatio_temporal_guidance_blocks=None, max_sequence_length=16, output_type=output_type,
                use_cross_timestep=False, generator=sample_generators(seeds, "cpu"))  # LTX-2.0's reference


def joint_latents(pipe, output):
    """The pipeline's output_type="latent" (denormalised, unpacked) as our joint latent: normalised and packed."""
    video = pipe._pack_latents(pipe._normalize_latents(output.frames, pipe.vae.latents_mean, pipe.vae.latents_std,
                                                       pipe.vae.config.scaling_factor))
    audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(output.audio), pipe.audio_vae.latents_mean,
                                          pipe.audio_vae.latents_std)
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def test_ode_rollout_and_decode_reproduce_the_stock_pipeline(adapter, path):
    """Same generators, same steps: the stock pipeline's video and audio latents and its frames and waveforms, with CFG
    off and at each stream's own scale; both scales matter (the audio's only in the audio part)."""
    pipe, cond = stock(path), PromptEncoder(adapter)(PROMPTS)
    finals = {}
    for guidance in ((1.0, 1.0), GUIDANCE, (3.0, 3.0)):
        final = ode_sample(adapter, cond, 4, [3, 4], guidance)
        theirs = pipeline_outputs(pipe, guidance, 4, [3, 4], "latent")
        torch.testing.assert_close(final, joint_latents(pipe, theirs), rtol=0, atol=2e-5)
        finals[guidance] = final
    ours, theirs = adapter.decode(finals[GUIDANCE]), pipeline_outputs(pipe, GUIDANCE, 4, [3, 4], "pt")
    assert ours.video.shape == theirs.frames.shape == (2, FRAMES, 3, 32, 32)
    assert ours.audio.shape == theirs.audio.shape and ours.audio.shape[1] == 2  # stereo
    torch.testing.assert_close(ours.video, theirs.frames, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.audio, theirs.audio.float(), rtol=0, atol=1e-5)
    assert ours.sample_rate == pipe.vocoder.config.output_sampling_rate
    video_part = slice(0, adapter.video_numel)
    audio_part = slice(adapter.video_numel, None)
    assert (finals[(1.0, 1.0)] - finals[GUIDANCE]).abs().max() > 0.01
    # CFG on both streams at once: the audio scale changes the audio first (the video follows through the streams'
    # cross-attention at later steps)
    one_step = lambda g: adapter.velocity(adapter.noise(sample_generators([3, 4], "cpu")), 1.0, cond, g)  # noqa: E731
    with torch.no_grad():
        delta = one_step(GUIDANCE) - one_step((3.0, 3.0))
    assert delta[:, video_part].abs().max() == 0 and delta[:, audio_part].abs().max() > 1e-3


def test_one_log_prob_over_both_modalities(adapter):
    """One SDE step of the joint latent: its log-prob is the mean of the Gaussian log-density over every element of
    the video AND the audio (numpy, float64, each stream apart then weighted by its size)."""
    gen = torch.Generator().manual_seed(0)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    v = torch.randn(x.shape, generator=gen)
    x_next, log_prob, mean, std = sde_step("flow-sde", v, x, 0.8, 0.6, 0.7, generator=torch.Generator().manual_seed(1))
    xn, mu, s = x_next.double().numpy(), mean.double().numpy(), float(std.flatten()[0])
    n_video = adapter.video_numel
    parts = [(xn[:, :n_video], mu[:, :n_video]), (xn[:, n_video:], mu[:, n_video:])]
    densities = [(-((a - m) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).mean(1) for a, m in parts]
    sizes = [n_video, x.shape[1] - n_video]
    assert sizes[1] == math.prod(adapter.audio_shape) > 0
    expected = (densities[0] * sizes[0] + densities[1] * sizes[1]) / sum(sizes)
    np.testing.assert_allclose(log_prob.double().numpy(), expected, rtol=1e-5)
    # re-scoring the stored step (training) gives the rollout's log-prob exactly: the ratio starts at 1
    again = sde_step("flow-sde", v, x, 0.8, 0.6, 0.7, prev_sample=x_next)[1]
    assert torch.equal(again, log_prob)


def test_lora_file_loads_into_the_stock_pipeline(adapter, path, tmp_path):
    """save_lora writes what LTX2Pipeline.load_lora_weights reads: the stock pipeline with it gives our rollout's
    latents, which differ from the base model's."""
    tuned = make_adapter(path)
    torch.manual_seed(0)
    add_lora(tuned.transformer, 4, 4, tuned.lora_target_modules)
    with torch.no_grad():
        for name, p in tuned.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tuned.save_lora(tmp_path, lora_state_dict(tuned.transformer, tuned.transformer.state_dict()))
    cond = PromptEncoder(tuned)(PROMPTS)
    ours = ode_sample(tuned, cond, 4, [3, 4], GUIDANCE)
    pipe = stock(path, tmp_path)
    torch.testing.assert_close(ours, joint_latents(pipe, pipeline_outputs(pipe, GUIDANCE, 4, [3, 4], "latent")),
                               rtol=0, atol=5e-5)
    base = ode_sample(adapter, cond, 4, [3, 4], GUIDANCE)
    for part in (slice(0, adapter.video_numel), slice(adapter.video_numel, None)):
        assert (ours[:, part] - base[:, part]).abs().max() > 1e-3  # both streams changed


def test_cached_embeddings_equal_online_and_preprocess_loads_no_model(adapter, path, tmp_path):
    from accelerate import Accelerator

    texts = cache_texts(PROMPTS, [], with_negatives=True)
    inputs = fingerprint_inputs("ltx2", str(path), 32, torch.float32, texts)
    encoder_only = make_adapter(path, text_only=True)
    assert all(getattr(encoder_only.pipe, name) is None for name in ("transformer", "vae", "audio_vae", "vocoder"))
    build_cache(Accelerator(cpu=True), encoder_only, texts, tmp_path, inputs, shard_size=3, progress=False)
    trainer = make_adapter(path, load_text_encoders=False)
    assert trainer.text_encoders == [] and trainer.pipe.connectors is None
    cached = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(PROMPTS)
    online = PromptEncoder(adapter)(PROMPTS)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    sigma = torch.tensor([0.9, 0.4])
    assert torch.equal(trainer.velocity(x, sigma, cached, GUIDANCE), adapter.velocity(x, sigma, online, GUIDANCE))


def test_audio_rewards_against_numpy():
    from rewards.audio import AudioLoudness, AudioPitch

    rate, n = 16000, 1600
    t = np.arange(n) / rate
    waves = np.stack([np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.1 * np.sin(2 * np.pi * 440 * t)]),
                      np.stack([0.05 * np.sin(2 * np.pi * 880 * t + 1.0)] * 2)])  # (2, 2 channels, n)
    audio = torch.from_numpy(waves).float()
    rms = np.sqrt((waves.astype(np.float64) ** 2).reshape(2, -1).mean(1))
    np.testing.assert_allclose(AudioLoudness(target="0.1")(None, ["", ""], audio, rate).numpy(), -np.abs(rms - 0.1),
                               rtol=1e-6)
    mono = waves.mean(1)
    peaks = np.abs(np.fft.rfft(mono - mono.mean(1, keepdims=True)))[:, 1:].argmax(1) + 1
    np.testing.assert_allclose(AudioPitch.dominant_frequency(audio, rate).numpy(), peaks * rate / n)
    np.testing.assert_allclose(AudioPitch(target="440")(None, ["", ""], audio, rate).numpy(), [0.0, -1.0], atol=1e-9)
    with pytest.raises(ValueError, match="target"):
        AudioLoudness(target="-1")


def test_scoring_gives_audio_to_the_rewards_that_want_it():
    """An audio reward is called once, with the whole video and the waveforms; an image reward on the same
    AudioVideo sees frame after frame as for any video; an audio reward without audio is one line."""
    seen = []

    class Sound:
        wants_audio = True

        def __call__(self, images, prompts, audio, sample_rate):
            seen.append((tuple(images.shape), tuple(audio.shape), sample_rate))
            return audio.flatten(1).mean(1)

    video, audio = torch.rand(2, 3, 3, 8, 8), torch.randn(2, 2, 50)
    both = AudioVideo(video, audio, 16000)
    scores = call_reward(Reward("sound", 1.0, Sound(), wants_audio=True), both, ["a", "b"])
    assert seen == [((2, 3, 3, 8, 8), (2, 2, 50), 16000)]
    torch.testing.assert_close(scores, audio.double().flatten(1).mean(1))
    brightness = Reward("bright", 1.0, lambda images, prompts: images.mean((1, 2, 3)))
    torch.testing.assert_close(call_reward(brightness, both, ["a", "b"]), call_reward(brightness, video, ["a", "b"]))
    with pytest.raises(UserError, match="scores audio, but this model makes none"):
        call_reward(Reward("sound", 1.0, Sound(), wants_audio=True), video, ["a", "b"])
    assert both[[1]].audio.shape == (1, 2, 50) and len(AudioVideo.cat([both, both])) == 4


def test_a_groupwise_audio_reward_gets_its_groups_waveforms_across_micro_batches():
    """Micro-batches of an AudioVideo are concatenated for a groupwise reward: each group's call sees its members'
    frames and waveforms, in order."""
    from common.scoring import RolloutScoring

    class Centred:
        wants_audio, groupwise = True, True

        def __call__(self, images, prompts, audio, sample_rate):
            assert images.shape[1:] == (3, 3, 8, 8) and sample_rate == 16000
            loudness = audio.flatten(1).abs().mean(1)
            return loudness - loudness.mean()

    video, audio = torch.rand(4, 3, 3, 8, 8), torch.randn(4, 2, 50)
    scoring = RolloutScoring([Reward("centred", 1.0, Centred(), groupwise=True, wants_audio=True)], ["a"] * 4,
                             torch.tensor([7, 9, 7, 9]))
    for rows in ([0, 1, 2], [3]):
        scoring.submit(AudioVideo(video[rows], audio[rows], 16000))
    loudness = audio.double().flatten(1).abs().mean(1).numpy()
    expected = np.empty(4)
    for group in ([0, 2], [1, 3]):
        expected[group] = loudness[group] - loudness[group].mean()
    np.testing.assert_allclose(scoring.collect()[:, 0].numpy(), expected, rtol=1e-5, atol=1e-7)


def test_an_audio_reward_with_a_silent_model_is_one_line(tmp_path):
    message = script_error("algos/grpo.py", "--preset", "tiny", "--reward", "audio_loudness", "--output-dir",
                           tmp_path / "run")
    assert message == "error: reward 'audio_loudness' scores audio, but flux1 makes none (use it with an audio-video " \
                      "model: --model ltx2)"
    assert not (tmp_path / "run").exists()


def test_save_wav_against_numpy(tmp_path):
    from common.tracking import save_wav

    waveform = torch.tensor([[0.0, 0.5, -0.5, 1.5], [0.25, -1.0, 0.1, -2.0]])
    save_wav(waveform, 8000, tmp_path / "a.wav")
    with wave.open(str(tmp_path / "a.wav")) as sound:
        assert (sound.getnchannels(), sound.getframerate(), sound.getnframes()) == (2, 8000, 4)
        pcm = np.frombuffer(sound.readframes(4), dtype="<i2").reshape(4, 2).T
    expected = np.round(np.clip(waveform.double().numpy(), -1, 1) * 32767).astype(np.int16)
    np.testing.assert_array_equal(pcm, expected)
    assert [p.name for p in tmp_path.iterdir()] == ["a.wav"]


def test_bad_frame_counts_and_resolutions_are_one_line(path):
    with pytest.raises(UserError, match=r"num_frames 8 is not 2k \+ 1"):
        load_adapter("ltx2", str(path), "cpu", torch.float32, 32, max_sequence_length=16, num_frames=8)
    with pytest.raises(UserError, match="resolution 30 is not a positive multiple of 4"):
        load_adapter("ltx2", str(path), "cpu", torch.float32, 30, max_sequence_length=16, num_frames=FRAMES)
    assert ADAPTERS["ltx2"].audio and not ADAPTERS["wan"].audio


@SLOW
def test_two_processes_train_on_audio_and_video(tmp_path):
    from conftest import ACCELERATE_2CPU

    run_script("algos/grpo.py", "--preset", "tiny", "--model", "ltx2", "--model-path", "tiny", "--resolution", "32",
               "--num-frames", str(FRAMES), "--max-sequence-length", "16", "--epochs", "1", "--prompts-per-epoch", "1",
               "--group-size", "4", "--batch-size", "2", "--num-steps", "3", "--updates-per-epoch", "1",
               "--eval-every", "0", "--reward", "audio_loudness", "--reward", "jpeg_compressibility",
               "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    (metrics,) = read_metrics(tmp_path)
    assert metrics["num_processes"] == 2 and metrics["grad_norm"] > 0 and metrics["ratio_dev_first"] < 1e-6
