"""The project's training-step code on an FSDP2-sharded tiny FLUX.1 transformer against the same steps run
unsharded. Run under `python -m torch.distributed.run --standalone --nproc_per_node 2` (CPU, gloo):

    fsdp_step.py MODE OUT_JSON CHECKPOINT_DIR      (MODE: lora or full)

Every process builds the transformer twice from the same seed: one copy stays whole and takes the steps on the
full batch of 4 samples (the single-process result), the other is sharded by accelerate's FSDP2 code as
configs/fsdp2.yaml asks (tests/fsdp_launch.py: activation checkpointing, fully_shard per block then the root)
and takes them on this process's half (FSDP averages the two halves' gradients: the full-batch mean).
A step is what the scripts do: the clipped ratio loss through adapter.velocity + sde_step, a KL to the
reference (adapters disabled for LoRA, a frozen copy for full fine-tuning), a term through the θ_old shadow
(common.shadow), gradient clipping, AdamW, the EMA (common.training) and the shadow blend. After two steps the
sharded run is checkpointed with common.checkpoint (weights gathered by common.distributed), reloaded with
diffusers (`load_lora_weights` / `from_pretrained`) and resumed into a fresh sharded model for a third step.
Rank 0 writes the largest differences to OUT_JSON.
"""

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("ACCELERATE_USE_CPU", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from fsdp_launch import fsdp2_prepare  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from common.checkpoint import load_full_weights_into, load_lora_into, load_training_state, save_checkpoint  # noqa: E402
from common.distributed import (load_optimizer_state_dict, lora_state_dict, optimizer_state_dict,  # noqa: E402
                                place_like, save_pretrained, trainable)
from common.models import load_adapter, tiny_model_path  # noqa: E402
from common.shadow import ShadowPolicy  # noqa: E402
from step_common import BATCH, GUIDANCE, batch, compare, full_states, reload_diffs, step_loss  # noqa: E402
from common.training import EMA, add_lora, trainable_parameters  # noqa: E402

mode, out_path, ckpt_dir = sys.argv[1], sys.argv[2], sys.argv[3]
FULL = mode == "full"
accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
assert world == 2, f"run under a 2-process launcher, got {world} process(es)"
cpu = torch.device("cpu")
PATH = str(tiny_model_path("flux1"))
CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "fsdp2.yaml")  # with activation checkpointing


class Run:
    """One policy with everything a script keeps next to it."""

    def __init__(self, sharded: bool):
        torch.manual_seed(0)  # same weights and LoRA init in every build
        self.adapter = load_adapter("flux1", PATH, cpu, torch.float32, 64, 32, load_text_encoders=False)
        self.transformer = self.adapter.transformer
        self.reference = None
        if FULL:
            self.reference = copy.deepcopy(self.transformer).requires_grad_(False)
            self.transformer.requires_grad_(True)
        else:
            add_lora(self.transformer, 4, 8, self.adapter.lora_target_modules)
        params = trainable_parameters(self.transformer)
        self.shadow = ShadowPolicy(self.adapter, self.transformer, "old", FULL)  # made before prepare, as setup()
        self.optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-4)
        if sharded:  # what accelerate's FSDP2 prepare does, then the scripts' lines after prepare
            self.transformer = fsdp2_prepare(accelerator, self.transformer, self.optimizer, CONFIG)
            self.adapter.transformer = self.transformer
            self.reference = place_like(self.reference, self.transformer)
        self.params = trainable(self.transformer)
        self.ema = EMA(self.params, 0.5, module=self.transformer)  # made after prepare, as setup()
        self.samples = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2) if sharded else slice(0, BATCH)

    def step(self, data: dict) -> float:
        """One optimizer step on this run's samples; returns the loss (a mean over them)."""
        mine = {k: (v[self.samples] if torch.is_tensor(v) and v.dim() else v) for k, v in data.items()}
        loss = step_loss(self, mine, FULL)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update()
        self.shadow.blend(0.5)
        return float(loss)

    def write_weights(self, folder, state):  # as in the scripts
        if FULL:
            save_pretrained(self.transformer, os.path.join(folder, "transformer"), state)
        else:
            self.adapter.save_lora(folder, lora_state_dict(self.transformer, state, adapter_name="default"))


single, sharded = Run(sharded=False), Run(sharded=True)
assert isinstance(sharded.transformer, FSDPModule)
assert all(isinstance(p, DTensor) for p in sharded.transformer.parameters())
assert all(isinstance(p, DTensor) for p, _ in sharded.shadow.pairs)  # the shadow found the new shards
assert all(isinstance(s, DTensor) for s in sharded.ema.shadow)
assert not any(isinstance(p, DTensor) for p in single.transformer.parameters())
local = sum(p.to_local().numel() for p in sharded.params)
total = sum(p.numel() for p in single.params)
assert local < total, (local, total)  # each process holds only part of the trained weights
assert any("_checkpoint_wrapped_module" in n for n, _ in sharded.transformer.named_parameters())
if FULL:
    assert isinstance(sharded.reference, FSDPModule) and isinstance(sharded.shadow.module, FSDPModule)

result = {"mode": mode, "world": world, "trained_numel": total, "local_numel": local, "loss_diff": 0.0}
data = [batch(seed, single.adapter) for seed in (1, 2, 3)]
initial = [p.detach().clone() for p in single.params]
for d in data[:2]:
    loss_single = single.step(d)
    loss_sharded = float(accelerator.reduce(torch.tensor(sharded.step(d)), "mean"))  # mean of the two halves
    result["loss_diff"] = max(result["loss_diff"], abs(loss_single - loss_sharded))
    # an evaluation with the EMA weights in between, as the scripts run it: a no-grad forward leaves the
    # sharded root gathered, and the next step must still see the restored weights
    outs = []
    for run in (single, sharded):
        with torch.no_grad(), run.ema.applied():
            outs.append(run.adapter.velocity(d["x"], d["sigma"], d, GUIDANCE))
    result["ema_eval_diff"] = max(result.get("ema_eval_diff", 0.0), float((outs[0] - outs[1]).abs().max()))
sharded_states = full_states(sharded)
plain_states = full_states(single)
if rank == 0:
    result["after_2_steps"] = compare(single, sharded_states, plain_states)
    # the steps moved the weights, so a zero difference is not a vacuous one
    result["moved"] = float(max((p.detach() - q).abs().max() for p, q in zip(single.params, initial)))

# ---- checkpoint (gathered weights), reload with diffusers, resume into a fresh sharded model -------------
folder = save_checkpoint(accelerator, ckpt_dir, 1, sharded.write_weights,
                         {"optimizer": optimizer_state_dict(sharded.transformer, sharded.optimizer),
                          "ema": sharded.ema.state_dict(), "old": sharded.shadow.state_dict()},
                         {"full_finetune": FULL}, model=sharded.transformer)
if rank == 0:  # the saved files read back by diffusers
    result.update(reload_diffs(folder, single, PATH, FULL, data[2]))
accelerator.wait_for_everyone()

resumed = Run(sharded=True)
states, meta = load_training_state(folder, rank)
(load_full_weights_into if FULL else load_lora_into)(resumed.transformer, folder)
load_optimizer_state_dict(resumed.transformer, resumed.optimizer, states["optimizer"])
resumed.ema.load_state_dict(states["ema"])
resumed.shadow.load_state_dict(states["old"])
single.step(data[2])
resumed.step(data[2])
resumed_states = full_states(resumed)
plain_states = full_states(single)
if rank == 0:
    result["after_resume_step"] = compare(single, resumed_states, plain_states)
    Path(out_path).write_text(json.dumps(result, indent=1))
accelerator.end_training()
