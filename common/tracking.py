"""Run outputs: metrics.jsonl (one object per epoch), wandb / TensorBoard through accelerate, console lines and
captioned image grids."""

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from common.utils import RunStopped, disk_writes, write_text_atomic

# Logged quantities that must be finite: a run stops at the first epoch where one is not.
MUST_BE_FINITE = ("reward_mean", "loss", "policy_loss", "kl", "grad_norm")


class MetricsLog:
    """Appends one JSON object per epoch to OUTPUT_DIR/metrics.jsonl on the main process."""

    def __init__(self, output_dir: str | Path, accelerator):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.accelerator = accelerator

    def read(self) -> list[dict]:
        """The complete lines; a line cut short by a killed run (only the last can be) is left out."""
        records = []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def truncate_after(self, epoch: int) -> None:
        """On resume, drop the lines of epochs after the checkpoint (a killed run may have logged past it) and any
        line cut short by the kill."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        kept = [r for r in self.read() if r.get("epoch", -1) <= epoch]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, metrics: dict) -> None:
        if self.accelerator.is_main_process:
            size = self.path.stat().st_size if self.path.exists() else 0
            try:
                with disk_writes(self.path), self.path.open("a") as handle:
                    handle.write(json.dumps(metrics) + "\n")
            except RunStopped:
                if self.path.exists():  # a full disk cut the line: the file keeps only whole lines
                    os.truncate(self.path, size)
                raise
        if self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in metrics.items() if k != "epoch"}, step=max(metrics["epoch"], 0))


def check_finite(metrics: dict) -> None:
    """Stop the run, naming the epoch and the quantity, when a loss, reward or gradient norm is not finite."""
    for key in MUST_BE_FINITE:
        if key in metrics and not math.isfinite(metrics[key]):
            raise RunStopped(f"epoch {metrics['epoch']}: {key} is {metrics[key]}; stopping before anything of this "
                             f"epoch is written (the last checkpoint is intact)")


def format_metrics(metrics: dict, keys) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                    for k in keys if k in metrics)


def _to_pixels(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] (videos (B, F, 3, H, W): their middle frame) -> (B, H, W, 3) uint8."""
    if images.ndim == 5:
        images = images[:, images.shape[1] // 2]
    return (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def image_grid(images: torch.Tensor, captions: list[str] | None = None, columns: int | None = None,
               min_cell: int = 128) -> Image.Image:
    """One picture of `images`. With `captions` (one per row of `columns` images), each row gets its caption above
    it and small images are enlarged (nearest neighbour) to at least `min_cell` pixels, so a reader sees what was
    asked and what was drawn."""
    pixels = _to_pixels(images)
    count, height, width, _ = pixels.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    scale = max(1, math.ceil(min_cell / max(height, width))) if captions else 1
    cell_h, cell_w = height * scale, width * scale
    font = ImageFont.load_default()
    caption_h = 14 if captions else 0
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + caption_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, array in enumerate(pixels):
        row, col = divmod(i, columns)
        top = row * (cell_h + caption_h)
        if captions and col == 0:
            draw.text((2, top + 1), captions[row], fill=(0, 0, 0), font=font)
        grid.paste(Image.fromarray(array).resize((cell_w, cell_h), Image.NEAREST), (col * cell_w, top + caption_h))
    return grid


def save_image_grid(images: torch.Tensor, path: str | Path, columns: int | None = None,
                    captions: list[str] | None = None) -> Image.Image:
    """Write `image_grid(...)` as a PNG, atomically; returns the picture."""
    grid = image_grid(images, captions, columns)
    # a temporary name per process: evaluate.py's --grid-dir is shared, and two processes writing one grid name
    # through one temporary file lose it to each other's rename
    tmp = Path(path).with_name(f"{Path(path).name}.{os.getpid()}.tmp.png")
    with disk_writes(path, remove=[tmp]):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        grid.save(tmp)
        os.replace(tmp, path)
    return grid


def save_wav(waveform: torch.Tensor, sample_rate: int, path: str | Path) -> None:
    """Write one waveform (channels, samples), floats in [-1, 1] (clipped), as a 16-bit PCM .wav with the stdlib
    `wave` module, atomically."""
    import wave

    pcm = (waveform.detach().float().clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous()  # interleaved
    tmp = Path(path).with_name(f"{Path(path).name}.{os.getpid()}.tmp")
    with disk_writes(path, remove=[tmp]):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(tmp), "wb") as out:
            out.setnchannels(waveform.shape[0])
            out.setsampwidth(2)
            out.setframerate(int(sample_rate))
            out.writeframes(pcm.numpy().astype("<i2").tobytes())
        os.replace(tmp, path)


def log_image(accelerator, name: str, picture: Image.Image, step: int) -> None:
    """Send a picture to the active trackers (main process only: elsewhere the trackers are stubs)."""
    if not accelerator.is_main_process:
        return
    array = np.asarray(picture)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({name: array[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({name: [array]}, step=step)
