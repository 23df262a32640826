"""Run under ACCELERATE_2CPU (one sequence-parallel group of 2): the epoch's scoring (common.scoring.RolloutScoring
over common.parallel.DataParallel, as the scripts run it) calls each reward on one process of the group and hands
the scores to the other; a reward's failure stops both with its one line.

usage: sp_scoring.py OUT_JSON
Writes, per rank, how many samples each reward was called with, the scores `collect` returned and the error line.

`CountedBrightness` is also a reward for the scripts (`--reward sp_scoring:CountedBrightness,folder=DIR`, this folder
on PYTHONPATH): it appends each call's rank, sample count and scores to DIR/calls_rank<r>.jsonl.
"""

import json
import sys
from pathlib import Path

import torch


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class CountedBrightness:
    """Mean brightness, each call written down by the process that makes it."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def __call__(self, images, prompts):
        scores = images.double().flatten(1).mean(1)
        with open(self.folder / f"calls_rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"count": len(prompts), "scores": scores.tolist()}) + "\n")
        return scores


if __name__ == "__main__":
    from accelerate import Accelerator

    from common.parallel import DataParallel, device_mesh
    from common.scoring import Reward, RolloutScoring
    from common.utils import UserError

    accelerator = Accelerator(cpu=True)
    data = DataParallel(accelerator, 2, device_mesh(accelerator, 2))
    calls = {"brightness": 0, "contrast": 0, "judge": 0}

    def brightness(images, prompts):
        calls["brightness"] += len(prompts)
        return images.double().flatten(1).mean(1)

    def contrast(images, prompts):  # groupwise
        calls["contrast"] += len(prompts)
        values = images.double().flatten(1).mean(1)
        return {"score": values - values.mean(), "below_best": values.max() - values}

    def judge(images, prompts):
        calls["judge"] += len(prompts)
        raise ConnectionError("the judge has stopped")

    # The group's samples: the same on both processes.
    images = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts, ids = [f"prompt {i // 2}" for i in range(8)], torch.tensor([1, 1, 2, 2, 1, 1, 2, 2])
    scoring = RolloutScoring([Reward("brightness", 1.0, brightness), Reward("contrast", 0.5, contrast, groupwise=True)],
                             prompts, ids, accelerator=data, workers=1)
    for start in (0, 4):
        scoring.submit(images[start:start + 4])
    scores = scoring.collect()
    failing = RolloutScoring([Reward("judge", 1.0, judge)], prompts, ids, accelerator=data, workers=1)
    for start in (0, 4):
        failing.submit(images[start:start + 4])
    try:
        failing.collect()
        error = None
    except UserError as raised:
        error = str(raised)
    report = {"rank": accelerator.process_index, "calls": calls, "scores": scores.tolist(),
              "columns": {key: values.tolist() for key, values in scoring.columns.items()}, "error": error}
    reports = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(reports, report)
    if accelerator.is_main_process:
        Path(sys.argv[1]).write_text(json.dumps(reports))
