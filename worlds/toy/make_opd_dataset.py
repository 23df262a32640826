"""Write the toy world's two-task split for on-policy distillation (algos/opd.py, docs/toy-world.md):

    python worlds/toy/make_opd_dataset.py

from data/toy's train/test split: `count` = the prompts that name two or three objects, `shape` = those that name
one. Writes data/toy_opd/{train,test}.jsonl with a "task" field on every line (the student's data, routed to the
task's teacher), and the plain subsets count/{train,test}.txt and shape/{train,test}.txt that each teacher trains on.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worlds.toy.world import REPO, load_toy_split, parse_prompt  # noqa: E402

OUT = REPO / "data" / "toy_opd"


def task_of(prompt: str) -> str:
    return "shape" if parse_prompt(prompt).count == 1 else "count"


if __name__ == "__main__":
    for split, prompts in zip(("train", "test"), load_toy_split()):
        (OUT / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p, "task": task_of(p)}) + "\n"
                                                    for p in prompts))
        for task in ("count", "shape"):
            (OUT / task).mkdir(exist_ok=True)
            (OUT / task / f"{split}.txt").write_text("".join(p + "\n" for p in prompts if task_of(p) == task))
    print(f"wrote {OUT}/{{train,test}}.jsonl, count/ and shape/")
