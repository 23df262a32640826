"""Run under ACCELERATE_2CPU: groupwise rewards scored across two processes must equal one process's scores.

usage: rewards_groupwise_dist.py TINY_CLIP_DIR OUT_JSON
Four groups of K = 4 whose samples are interleaved and split unevenly (6 / 10) between the two processes.
"""

import json
import os
import sys

import torch


class GroupSize:
    """Groupwise: every sample scores the size of the group it was scored with."""

    groupwise = True

    def __call__(self, images, prompts):
        return [len(prompts)] * len(prompts)


if __name__ == "__main__":
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from rewards import load_rewards, score_samples

    clip_dir, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    rewards = load_rewards([f"pickscore,path={clip_dir}", f"pickscore_rank,path={clip_dir}",
                            "rewards_groupwise_dist:GroupSize"])
    images = torch.randint(0, 256, (16, 3, 32, 32), generator=torch.Generator().manual_seed(0)).float() / 255
    group_ids = torch.tensor([7, 5, 3, 1] * 4)
    prompts = [f"prompt {int(g)}" for g in group_ids]
    mine = slice(0, 6) if accelerator.process_index == 0 else slice(6, 16)
    raw = score_samples(rewards, images[mine], prompts[mine], group_ids[mine], accelerator)
    everything = gather_object([(accelerator.process_index, raw.tolist())])
    if accelerator.is_main_process:
        distributed = torch.tensor([row for _, rows in sorted(everything) for row in rows], dtype=torch.float64)
        single = score_samples(rewards, images, prompts, group_ids)
        diff = (distributed - single).abs()
        result = {"num_processes": accelerator.num_processes, "counts": [len(rows) for _, rows in sorted(everything)],
                  "group_sizes": distributed[:, 2].tolist(),
                  "max_abs_diff_pointwise": float(diff[:, 0].max()), "max_abs_diff_groupwise": float(diff[:, 1].max())}
        with open(out, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    # Skip C++ static destructors: gloo's threads can std::terminate the interpreter's exit on CPU
    # (seen about once in three runs), which would fail the launch after the work is done.
    os._exit(0)
