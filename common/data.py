"""Prompt sets and the per-epoch K-repeat draw.

A dataset is a folder with `train.jsonl`/`test.jsonl` (one JSON object per line, field `prompt`, optional
`negative_prompt`) or `train.txt`/`test.txt` (one prompt per line).
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError

DEFAULT_DATASET = str(Path(__file__).resolve().parent.parent / "data" / "prompts")


@dataclass(frozen=True)
class Prompt:
    prompt: str
    negative_prompt: str = ""

    @property
    def key(self) -> int:
        """Group key: a hash of the texts (not a dataset index), as a non-negative int64."""
        digest = hashlib.sha256(f"{self.prompt}\x00{self.negative_prompt}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _lines(path: Path) -> list[str]:
    """The file's lines; a byte sequence that is not UTF-8 is reported with its file and line."""
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path}:{number}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                            f"{err.start + 1})") from None
    return [line.decode("utf-8").rstrip("\r") for line in lines]


def load_prompts(dataset: str | Path, split: str) -> list[Prompt]:
    folder = Path(dataset)
    if not folder.is_dir():
        raise UserError(f"dataset folder {str(folder)!r} does not exist")
    jsonl, txt = folder / f"{split}.jsonl", folder / f"{split}.txt"
    if jsonl.exists() and txt.exists():
        raise UserError(f"dataset folder {str(folder)!r} has both {split}.jsonl and {split}.txt: keep one")
    records = []
    if jsonl.exists():
        for number, line in enumerate(_lines(jsonl), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{jsonl}:{number}: malformed JSON ({err.msg})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
                raise UserError(f"{jsonl}:{number}: expected an object with a non-empty string field \"prompt\"")
            negative = item.get("negative_prompt") or ""
            if not isinstance(negative, str):
                raise UserError(f"{jsonl}:{number}: \"negative_prompt\" must be a string")
            records.append(Prompt(item["prompt"], negative))
        source = jsonl
    elif txt.exists():
        records = [Prompt(line.strip()) for line in _lines(txt) if line.strip()]
        source = txt
    else:
        raise UserError(f"dataset folder {str(folder)!r} has neither {split}.jsonl nor {split}.txt")
    if not records:
        raise UserError(f"{source} holds no prompts")
    return records


def epoch_draw(num_prompts: int, prompts_per_epoch: int, group_size: int, seed: int, epoch: int,
               whole_groups: bool = False) -> np.ndarray:
    """Dataset indices of the epoch's M·K samples: M distinct prompts, each K times, in a shuffled order.
    It depends only on (seed, epoch), so every process (and a resumed run) draws the same list. With
    `whole_groups` each group's K samples are contiguous (groups in a shuffled order), so when M is a multiple of the
    number of processes every process holds whole groups (what a pairwise loss needs)."""
    if prompts_per_epoch > num_prompts:
        raise UserError(f"--prompts-per-epoch {prompts_per_epoch} exceeds the {num_prompts} training prompts")
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    chosen = rng.permutation(num_prompts)[:prompts_per_epoch]
    if whole_groups:
        return np.repeat(chosen, group_size)
    return rng.permutation(np.repeat(chosen, group_size))


def sample_seeds(seed: int, epoch: int, count: int) -> list[int]:
    """Noise seed of each of the epoch's samples (by position in the epoch's draw)."""
    return np.random.default_rng([seed, epoch, 0xD1CE]).integers(0, 2**62, size=count).tolist()


def shard(count: int, rank: int, world: int) -> slice:
    """The contiguous part of `count` items that process `rank` of `world` handles."""
    if count % world:
        raise UserError(f"{count} samples per epoch do not split evenly over {world} processes")
    size = count // world
    return slice(rank * size, (rank + 1) * size)


def epoch_samples(prompts: list[Prompt], prompts_per_epoch: int, group_size: int, seed: int, epoch: int,
                  local: slice, whole_groups: bool = False) -> tuple[list[Prompt], torch.Tensor]:
    """This process's part of the epoch's draw: its prompt records and each sample's noise seed (int64)."""
    draw = epoch_draw(len(prompts), prompts_per_epoch, group_size, seed, epoch, whole_groups)
    seeds = sample_seeds(seed, epoch, prompts_per_epoch * group_size)
    return [prompts[i] for i in draw[local]], torch.tensor(seeds[local], dtype=torch.int64)
