"""Toy audio rewards for audio-video models (`wants_audio`): how close a sample's loudness or its dominant pitch is
to a target. They read only the waveforms, which common/scoring.py passes beside the frames."""

import math

import torch


def _mono(audio: torch.Tensor) -> torch.Tensor:
    """(B, channels, samples) -> (B, samples) float64, the channels' mean."""
    if audio.ndim != 3:
        raise ValueError(f"audio is {tuple(audio.shape)}, not (batch, channels, samples)")
    return audio.double().mean(dim=1)


class AudioLoudness:
    """−|RMS − target|: the RMS over every channel and sample of the waveform (full scale 1), against `target`
    (`--reward audio_loudness,target=0.1`). 0 at the target, negative elsewhere."""

    wants_audio = True

    def __init__(self, target: str | float = 0.1):
        self.target = float(target)
        if not (math.isfinite(self.target) and self.target >= 0):
            raise ValueError(f"target={target} is not a loudness ≥ 0 (an RMS, full scale 1)")

    def __call__(self, images, prompts, audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        rms = audio.double().flatten(1).square().mean(dim=1).sqrt()
        return -(rms - self.target).abs()


class AudioPitch:
    """−|log2(f / target)|, in octaves: f is the dominant frequency of the mono mix (the largest bin of its
    magnitude spectrum, DC left out), against `target` Hz (`--reward audio_pitch,target=440`)."""

    wants_audio = True

    def __init__(self, target: str | float = 440.0):
        self.target = float(target)
        if not (math.isfinite(self.target) and self.target > 0):
            raise ValueError(f"target={target} is not a frequency > 0 Hz")

    @staticmethod
    def dominant_frequency(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        mono = _mono(audio)
        spectrum = torch.fft.rfft(mono - mono.mean(dim=1, keepdim=True)).abs()
        spectrum[:, 0] = 0
        return spectrum.argmax(dim=1).double() * sample_rate / mono.shape[1]

    def __call__(self, images, prompts, audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        frequency = self.dominant_frequency(audio, sample_rate).clamp_min(sample_rate / audio.shape[-1])
        return -torch.log2(frequency / self.target).abs()
