"""Run under a 2-process launcher: each process holds half an epoch, gathers, and keeps its own advantages."""

import json
import os
import sys

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather

from common.advantages import compute_advantages
from common.data import shard

data, out = json.load(open(sys.argv[1])), sys.argv[2]
accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2, accelerator.num_processes
mine = shard(len(data["ids"]), accelerator.process_index, accelerator.num_processes)
values = torch.tensor(data["values"], dtype=torch.float64)[mine]
ids = torch.tensor(data["ids"])[mine]
all_values, all_ids = gather(values), gather(ids)
advantages, _ = compute_advantages(all_values, [1.0, 0.5], all_ids, "sum", global_std=True, clip=5.0)
np.save(f"{out}/adv_{accelerator.process_index}.npy", advantages[mine].numpy())
accelerator.end_training()  # destroys the process group
# Skip C++ static destructors: gloo's threads can std::terminate the interpreter's exit on CPU
# (seen about once in three runs), which would fail the launch after the work is done.
os._exit(0)
