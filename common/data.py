"""Prompt sets and the per-epoch K-repeat draw.

A dataset is a folder with `train.jsonl`/`test.jsonl` (one JSON object per line, field `prompt`, optional
`negative_prompt`, and for conditioned models (editing, image-to-video) `image` or `images`: condition image
paths relative to the folder, PNG, JPEG or WebP, and `task`: the name of the prompt's task, which algos/opd.py
routes to that task's teacher) or `train.txt`/`test.txt` (one prompt per line). All K samples of a group share their
prompt's conditions.
"""

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError

DEFAULT_DATASET = str(Path(__file__).resolve().parent.parent / "data" / "prompts")
# Conditioned models need a condition image per prompt: their default is the toy edit world's prompts and scenes.
DEFAULT_CONDITIONED_DATASET = str(Path(__file__).resolve().parent.parent / "data" / "toy_edit")


def default_dataset(model: str) -> str:
    """The dataset a run reads when --dataset is unset: data/prompts, or data/toy_edit for conditioned models."""
    from common.models.registry import CONDITIONED_MODELS

    return DEFAULT_CONDITIONED_DATASET if model in CONDITIONED_MODELS else DEFAULT_DATASET


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
EXIF_ORIENTATION = 0x0112  # the EXIF tag that diffusers' load_image (ImageOps.exif_transpose) turns images by


@dataclass(frozen=True)
class Prompt:
    prompt: str
    negative_prompt: str = ""
    images: tuple[str, ...] = ()         # condition images (absolute paths), in the order the model sees them
    image_digests: tuple[str, ...] = ()  # sha256 of each file's bytes when it was loaded
    task: str = ""                       # the record's "task" (algos/opd.py's routing); "" when it has none
    source: str = field(default="", compare=False)  # "file:line" of the record, for error messages

    @property
    def key(self) -> int:
        """Group key: a hash of the texts and condition images (not a dataset index), as a non-negative int64."""
        task = f"\x00task:{self.task}" if self.task else ""  # only when set: untagged keys stay as they were
        digest = hashlib.sha256(f"{self.prompt}\x00{self.negative_prompt}{self._images_part}{task}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    @property
    def _images_part(self) -> str:
        return "".join(f"\x00image:{d}" for d in self.image_digests)

    def entry(self, negative: bool = False) -> str:
        """What an encoding depends on, as one string (the embedding cache's key): the text, and the contents of
        the condition images (a changed file is a new entry). Negative prompts see the same images."""
        return (self.negative_prompt if negative else self.prompt) + self._images_part


def prompts_digest(records: list[Prompt]) -> str:
    """sha256 of the records in order (texts, condition images and tasks, through their keys), which a checkpoint
    records for its training prompts: a resume then sees an edited dataset, not only a moved one."""
    return hashlib.sha256(b"".join(record.key.to_bytes(8, "little") for record in records)).hexdigest()


def _as_rgb(image):
    """A condition image as diffusers' `load_image` gives it to the pipelines: turned by its EXIF orientation, then
    RGB. A 16-bit greyscale PNG (mode I;16 or I, values to 65535), which convert("RGB") would clip at 255, is scaled
    to 8 bits first (16-bit colour PNGs open as 8-bit RGB already)."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I"):
        scaled = np.round(np.asarray(image, dtype=np.float64) / 257).clip(0, 255)
        image = Image.fromarray(scaled.astype(np.uint8), "L")
    return image.convert("RGB")


def load_images(paths) -> list:
    """The condition images at `paths` as RGB PIL images (`_as_rgb`)."""
    from PIL import Image

    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(_as_rgb(image))
    return images


def condition_image_size(path: str) -> tuple[int, int]:
    """(width, height) of the condition image at `path` as the model receives it (`load_images`): an EXIF orientation
    that turns it a quarter swaps them. Reads the header, not the pixels."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        turned = image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)  # transposed or a quarter turn
    return (height, width) if turned else (width, height)


def _condition_images(item: dict, folder: Path, where: str,
                      decoded: set) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The `image`/`images` field of a JSONL record: checked (each file decoded in full, once per contents, in
    `decoded`), resolved against the dataset folder, hashed."""
    from PIL import Image

    if "image" in item and "images" in item:
        raise UserError(f"{where}: has both \"image\" and \"images\": give one")
    names = [item["image"]] if "image" in item else item.get("images", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or \
            ("images" in item and not names):
        raise UserError(f"{where}: \"image\" must be a path and \"images\" a non-empty list of paths")
    paths, digests = [], []
    for name in names:
        path = (folder / name).resolve()
        if not path.is_file():
            raise UserError(f"{where}: condition image {name!r} does not exist ({path})")
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        try:
            with Image.open(io.BytesIO(data)) as image:
                image.verify()
                kind = image.format
            if kind in IMAGE_FORMATS and digest not in decoded:
                # verify() checks a PNG's chunk checksums, not its compressed pixels: decode them all now, as
                # the encoder will, rather than fail there (hours in, and again at every resume)
                with Image.open(io.BytesIO(data)) as image:
                    _as_rgb(image)
                decoded.add(digest)
        except Exception as err:  # PIL's decoders raise many kinds (OSError, SyntaxError, struct.error, ...)
            raise UserError(f"{where}: condition image {name!r} is not a readable image ({err})") from None
        if kind not in IMAGE_FORMATS:
            raise UserError(f"{where}: condition image {name!r} is {kind}; use PNG, JPEG or WebP")
        paths.append(str(path))
        digests.append(digest)
    return tuple(paths), tuple(digests)


def text_lines(path: Path) -> list[str]:
    """The file's lines, without a UTF-8 byte-order mark (editors on Windows write one; it would stay in the first
    prompt, or break the first JSON line); a byte sequence that is not UTF-8 is reported with its file and line."""
    lines = path.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n")
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path}:{number}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                            f"{err.start + 1})") from None
    return [line.decode("utf-8").rstrip("\r") for line in lines]


def load_prompts(dataset: str | Path, split: str) -> list[Prompt]:
    folder = Path(dataset)
    if folder.is_file():
        raise UserError(f"--dataset {str(folder)!r} is a file, not a folder: give the folder that holds {split}.jsonl "
                        f"or {split}.txt")
    if not folder.is_dir():
        raise UserError(f"dataset folder {str(folder)!r} does not exist")
    jsonl, txt = folder / f"{split}.jsonl", folder / f"{split}.txt"
    if jsonl.exists() and txt.exists():
        raise UserError(f"dataset folder {str(folder)!r} has both {split}.jsonl and {split}.txt: keep one")
    records, decoded = [], set()
    if jsonl.exists():
        for number, line in enumerate(text_lines(jsonl), start=1):
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
            task = item.get("task") or ""
            if not isinstance(task, str):
                raise UserError(f"{jsonl}:{number}: \"task\" must be a string")
            images, digests = _condition_images(item, folder, f"{jsonl}:{number}", decoded)
            records.append(Prompt(item["prompt"], negative, images, digests, task.strip(), source=f"{jsonl}:{number}"))
        source = jsonl
    elif txt.exists():
        records = [Prompt(line.strip(), source=f"{txt}:{number}")
                   for number, line in enumerate(text_lines(txt), start=1) if line.strip()]
        source = txt
    else:
        raise UserError(f"dataset folder {str(folder)!r} has neither {split}.jsonl nor {split}.txt")
    if not records:
        raise UserError(f"{source} holds no prompts")
    return records


def check_conditions(records: list[Prompt], fewest: int, most: int | None, model: str) -> None:
    """Every record carries between `fewest` and `most` (None: any number) condition images, as `model` takes;
    else one line naming the record's file and line."""
    for record in records:
        count = len(record.images)
        if fewest == most == 0 and count:
            raise UserError(f"{record.source}: has a condition image, but {model} is a text-only model (choose an "
                            f"editing or image-to-video model, or drop \"image\")")
        if count < fewest:
            raise UserError(f"{record.source}: {model} needs a condition image (\"image\": \"path\") on every line")
        if most is not None and count > most:
            raise UserError(f"{record.source}: {count} condition images, but {model} takes at most {most}")


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
