"""Write the toy edit world's dataset, data/toy_edit/{train,test}.jsonl and images/, deterministically.

    python worlds/toy_edit/make_dataset.py                 # rewrites data/toy_edit/'s dataset
    python worlds/toy_edit/make_dataset.py --out /tmp/ds   # elsewhere (the tests compare the two)

Each line is {"prompt": INSTRUCTION, "image": "images/NAME.png"}: the model sees the instruction and the 32×32
source render, never the source prompt. The lines (worlds/toy_edit/world.py `dataset_records`): per edit kind, 128
training and 32 held-out pairs drawn from the split's pairs, each with one fixed source render.
"""

import argparse
import json
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worlds.toy_edit.world import TOY_EDIT_DIR, dataset_records, render_edit  # noqa: E402


def write_dataset(out: Path) -> None:
    (out / "images").mkdir(parents=True, exist_ok=True)
    written = set()
    for split in ("train", "test"):
        lines = []
        for record in dataset_records(split):
            source, _ = render_edit(record.source, record.instruction, record.seed)
            Image.fromarray(source).save(out / record.name, optimize=False)
            written.add(record.name)
            lines.append(json.dumps({"prompt": record.instruction, "image": record.name}))
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    for stale in (out / "images").glob("*.png"):  # images of an earlier, larger dataset
        if f"images/{stale.name}" not in written:
            stale.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TOY_EDIT_DIR)
    args = parser.parse_args()
    write_dataset(args.out)
    print(f"wrote {args.out}/train.jsonl, test.jsonl and images/")


if __name__ == "__main__":
    main()
