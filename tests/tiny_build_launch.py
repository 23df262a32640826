"""Launched on 2 processes by tests/test_models.py: both ranks ask for the same tiny pipeline at once, under
torch.distributed (as `setup` does after the Accelerator is made), in an empty cache ($FLOWRL_CACHE)."""

import sys

from accelerate import PartialState

from common.models import tiny_model_path

state = PartialState(cpu=True)
path = tiny_model_path(sys.argv[1])
state.wait_for_everyone()
print(f"rank {state.process_index}: {path}")
