"""Rewards for tests/test_rewards_overlap.py and benchmarks/rewards_overlap.py, loaded as MODULE:ATTR (the tests put
this folder on PYTHONPATH)."""

import time


class GroupContrast:
    """Groupwise: each sample's mean brightness minus its group's mean (so a score depends on the whole group)."""

    groupwise = True

    def __call__(self, images, prompts):
        brightness = images.double().flatten(1).mean(1)
        return brightness - brightness.mean()


class Channels:
    """Pointwise with named columns: the mean red and blue values; the score is their mean (one sample's score depends
    on that sample only, so every way of batching gives the same columns)."""

    def __call__(self, images, prompts):
        red, blue = images[:, 0].double().flatten(1).mean(1), images[:, 2].double().flatten(1).mean(1)
        return {"score": (red + blue) / 2, "red": red, "blue": blue}


class Boom:
    """Raises on its second call (the first micro-batch scores, the second fails)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("boom on the second micro-batch")
        return [0.0] * len(prompts)


class OneShort:
    """Returns one score fewer than images."""

    def __call__(self, images, prompts):
        return [0.0] * (len(prompts) - 1)


class Sleepy:
    """Waits `seconds` per call, then scores mean brightness: a stand-in for a slow model or API."""

    def __init__(self, seconds: str = "0.1"):
        self.seconds = float(seconds)

    def __call__(self, images, prompts):
        time.sleep(self.seconds)
        return images.double().flatten(1).mean(1)


class StopsTheRun:
    """Sends SIGTERM to its own process on its first call, from whichever thread calls it (a scheduler's
    preemption arriving while the epoch is being scored), then scores mean brightness."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts):
        import os
        import signal

        self.calls += 1
        if self.calls == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # still scoring when the signal lands
        return images.double().flatten(1).mean(1)


class Busy:
    """Spends about `seconds` per call inside large torch matmuls (C++ with the GIL released), then scores 0: a
    local model's reward still running when another reward fails."""

    def __init__(self, seconds: str = "2"):
        self.seconds = float(seconds)

    def __call__(self, images, prompts):
        import torch

        start, a = time.monotonic(), torch.randn(1500, 1500, generator=torch.Generator().manual_seed(0))
        while time.monotonic() - start < self.seconds:
            a = torch.tanh(a @ a)
        return [0.0] * len(prompts)
