"""The project's training-step code on a tiny FLUX.1 transformer under DeepSpeed ZeRO-2 against the same steps
run on one plain process. Run under `python -m torch.distributed.run --standalone --nproc_per_node 2` (CPU, gloo):

    deepspeed_step.py MODE OUT_JSON CHECKPOINT_DIR      (MODE: lora or full)

Every process builds the transformer twice from the same seed. The plain copy takes each optimizer step on all
4 samples; the other is prepared by accelerate's own DeepSpeed code (`Accelerator._prepare_deepspeed`, ZeRO-2
from configs/deepspeed_zero2.yaml, switched on as tests/deepspeed_launch.py does) and takes it on this process's
2 samples, one per micro-step, accumulated as the scripts do (common.distributed.micro_step): DeepSpeed must
step once per boundary, reduce the two processes' gradients and clip at --max-grad-norm. A step is what the
scripts do: the clipped ratio loss through adapter.velocity + sde_step, a KL to the reference (adapters disabled
for LoRA, a frozen copy for full fine-tuning), a term through the θ_old shadow (common.shadow), clipping, AdamW,
the EMA and the shadow blend. After two steps the DeepSpeed run is checkpointed with common.checkpoint (its
float32 masters and the AdamW state gathered from ZeRO's partitions), reloaded with diffusers and resumed into
a fresh engine for a third step. Rank 0 writes the largest differences to OUT_JSON.
"""

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("ACCELERATE_USE_CPU", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from deepspeed_launch import deepspeed_plugin  # noqa: E402

from common.checkpoint import load_full_weights_into, load_lora_into, load_training_state, save_checkpoint  # noqa: E402
from common.distributed import (configure_backend, load_optimizer_state_dict, lora_state_dict,  # noqa: E402
                                micro_step, optimizer_state_dict, save_pretrained, trainable)
from common.models import load_adapter, tiny_model_path  # noqa: E402
from common.shadow import ShadowPolicy  # noqa: E402
from step_common import batch, compare, full_states, reload_diffs, step_loss  # noqa: E402
from common.training import EMA, add_lora, trainable_parameters  # noqa: E402

mode, out_path, ckpt_dir = sys.argv[1], sys.argv[2], sys.argv[3]
FULL = mode == "full"
accelerator = Accelerator(cpu=True)
plugin, _ = deepspeed_plugin(str(Path(__file__).resolve().parent.parent / "configs" / "deepspeed_zero2.yaml"))
plugin.set_mixed_precision("no")  # float32 on CPU: the comparison is exact up to summation order
plugin.select(_from_accelerator_state=True)
accelerator.state.deepspeed_plugins = plugin
PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.DEEPSPEED
accelerator.deepspeed_engine_wrapped = None
rank, world = accelerator.process_index, accelerator.num_processes
assert world == 2, f"run under a 2-process launcher, got {world} process(es)"
cpu = torch.device("cpu")
PATH = str(tiny_model_path("flux1"))
MAX_GRAD_NORM = 0.05  # a bound the steps' gradient norms exceed: clipping acts
configure_backend(accelerator, 1, MAX_GRAD_NORM)


class Run:
    """One policy with everything a script keeps next to it."""

    def __init__(self, deepspeed: bool):
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
        self.deepspeed = deepspeed
        if deepspeed:  # accelerate's DeepSpeed prepare, then the scripts' lines after prepare
            accelerator.deepspeed_engine_wrapped = None  # this run's engine is the one `backward` drives
            self.engine, self.optimizer = accelerator.prepare(self.transformer, self.optimizer)
            self.wrapped = accelerator.deepspeed_engine_wrapped
            self.adapter.transformer = self.engine
            self.transformer = accelerator.unwrap_model(self.engine)
        self.params = trainable(self.transformer)
        self.ema = EMA(self.params, 0.5, module=self.transformer)  # made after prepare, as setup()
        # micro-steps of one optimizer step: this process's 2 samples one by one, or all 4 in two halves
        self.micro = [[2 * rank], [2 * rank + 1]] if deepspeed else [[0, 2], [1, 3]]

    def step(self, data: dict) -> float:
        """One optimizer step over this run's samples in 2 micro-steps; returns the loss (their mean)."""
        total = 0.0
        if self.deepspeed:
            accelerator.deepspeed_engine_wrapped = self.wrapped
        for k, ids in enumerate(self.micro):
            last = k == len(self.micro) - 1
            context = micro_step(accelerator, self.engine, last) if self.deepspeed else torch.enable_grad()
            with context:
                loss = step_loss(self, {key: (v[ids] if torch.is_tensor(v) and v.dim() else v) for key, v in data.items()}, FULL)
                if self.deepspeed:
                    accelerator.backward(loss / len(self.micro))
                else:
                    (loss / len(self.micro)).backward()
            total += float(loss) / len(self.micro)
        if self.deepspeed:
            self.grad_norm = accelerator.clip_grad_norm_(self.params, MAX_GRAD_NORM)  # DeepSpeed clipped already
        else:
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update()
        self.shadow.blend(0.5)
        return total

    def write_weights(self, folder, state):  # as in the scripts
        if FULL:
            save_pretrained(self.transformer, os.path.join(folder, "transformer"), state)
        else:
            self.adapter.save_lora(folder, lora_state_dict(self.transformer, state, adapter_name="default"))


plain, ds = Run(deepspeed=False), Run(deepspeed=True)
engine = ds.engine
assert type(engine).__name__ == "DeepSpeedEngine" and engine.zero_optimization_stage() == 2
assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
assert engine.gradient_clipping() == MAX_GRAD_NORM  # configure_backend wrote --max-grad-norm into the config
assert all(hasattr(p, "_hp_mapping") for p in ds.params)  # ZeRO holds float32 master partitions of each

result = {"mode": mode, "world": world, "loss_diff": 0.0, "grad_norm_diff": 0.0}
data = [batch(seed, plain.adapter) for seed in (1, 2, 3)]
initial = [p.detach().clone() for p in plain.params]
for d in data[:2]:
    loss_plain = plain.step(d)
    loss_ds = float(accelerator.reduce(torch.tensor(ds.step(d)), "mean"))  # mean of the two processes' halves
    result["loss_diff"] = max(result["loss_diff"], abs(loss_plain - loss_ds))
    result["grad_norm_diff"] = max(result["grad_norm_diff"], abs(plain.grad_norm - ds.grad_norm))
    result["grad_norm"] = plain.grad_norm
result["optimizer_steps"] = engine.global_steps
ds_states, plain_states = full_states(ds), full_states(plain)
if rank == 0:
    result["after_2_steps"] = compare(plain, ds_states, plain_states)
    result["moved"] = float(max((p.detach() - q).abs().max() for p, q in zip(plain.params, initial)))

# ---- checkpoint (masters), reload with diffusers, resume into a fresh engine ----------------------------
folder = save_checkpoint(accelerator, ckpt_dir, 1, ds.write_weights,
                         {"optimizer": optimizer_state_dict(ds.transformer, ds.optimizer),
                          "ema": ds.ema.state_dict(), "old": ds.shadow.state_dict()},
                         {"full_finetune": FULL}, model=ds.transformer)
if rank == 0:  # the saved files read back by diffusers
    result.update(reload_diffs(folder, plain, PATH, FULL, data[2]))
accelerator.wait_for_everyone()

resumed = Run(deepspeed=True)
states, meta = load_training_state(folder, rank)
(load_full_weights_into if FULL else load_lora_into)(resumed.transformer, folder)
load_optimizer_state_dict(resumed.transformer, resumed.optimizer, states["optimizer"])
resumed.ema.load_state_dict(states["ema"])
resumed.shadow.load_state_dict(states["old"])
plain.step(data[2])
resumed.step(data[2])
resumed_states, plain_states = full_states(resumed), full_states(plain)
if rank == 0:
    result["after_resume_step"] = compare(plain, resumed_states, plain_states)
    Path(out_path).write_text(json.dumps(result, indent=1))
accelerator.wait_for_everyone()
