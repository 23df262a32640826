"""Run outputs: metrics.jsonl (one object per epoch), wandb through accelerate, console lines, image grids."""

import json
import math
import os
from pathlib import Path

import torch
from PIL import Image


class MetricsLog:
    """Appends one JSON object per epoch to OUTPUT_DIR/metrics.jsonl on the main process."""

    def __init__(self, output_dir: str | Path, accelerator):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.accelerator = accelerator

    def truncate_after(self, epoch: int) -> None:
        """On resume, drop lines of epochs after the checkpoint (a killed run may have logged past it)."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["epoch"] <= epoch]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, metrics: dict) -> None:
        if self.accelerator.is_main_process:
            with self.path.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        if self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in metrics.items() if k != "epoch"}, step=metrics["epoch"])


def format_metrics(metrics: dict, keys) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
                    for k in keys if k in metrics)


def save_image_grid(images: torch.Tensor, path: str | Path, columns: int | None = None) -> None:
    """images (B, 3, H, W) in [0, 1] -> one PNG grid; videos (B, F, 3, H, W) show their middle frame."""
    if images.ndim == 5:
        images = images[:, images.shape[1] // 2]
    count, _, height, width = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    grid = Image.new("RGB", (columns * width, rows * height))
    for i, array in enumerate(pixels):
        grid.paste(Image.fromarray(array), ((i % columns) * width, (i // columns) * height))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(Path(path).name + ".tmp.png")
    grid.save(tmp)
    os.replace(tmp, path)
