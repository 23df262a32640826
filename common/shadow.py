"""A frozen second copy of the trained policy that trails it by blending: DiffusionNFT's θ_old and AWM's EMA
sampler (algorithms.md §5).

With LoRA it is a second peft adapter on the SAME transformer (no model copy): `active()` switches the
module to it, and back to the trained adapter ("default") on exit. With full fine-tuning it is a frozen
deepcopy of the transformer. The adapter is switched on the unwrapped module; a DDP wrapper only forwards
to it, and every forward through the shadow runs under no_grad, so DDP never sees the switch.
"""

import copy
import warnings
from contextlib import contextmanager

import torch


class ShadowPolicy:
    def __init__(self, transformer, name: str, full_finetune: bool):
        """`transformer`: the unwrapped module holding the trained weights (LoRA adapter "default" already added).
        The shadow starts equal to the trained weights."""
        self.transformer, self.name, self.full_finetune = transformer, name, full_finetune
        if full_finetune:
            self.module = copy.deepcopy(transformer).requires_grad_(False)
            trained = [p for p in transformer.parameters() if p.requires_grad]
            shadow = [p for p, q in zip(self.module.parameters(), transformer.parameters()) if q.requires_grad]
        else:
            # Same rank, alpha and targets as the trained adapter; add_adapter activates the new one, so switch
            # back (peft's set_adapter also gives requires_grad back to "default" and takes it from the shadow).
            with warnings.catch_warnings():  # peft warns that a second adapter is being added: intended here
                warnings.simplefilter("ignore")
                transformer.add_adapter(copy.deepcopy(transformer.peft_config["default"]), adapter_name=name)
            transformer.set_adapter("default")
            params = dict(transformer.named_parameters())
            keys = [k for k in params if ".default." in k]
            trained = [params[k] for k in keys]
            shadow = [params[k.replace(".default.", f".{name}.")] for k in keys]
        self.pairs = list(zip(shadow, trained))
        with torch.no_grad():
            for s, p in self.pairs:
                s.data = p.detach().float().clone()
                s.requires_grad_(False)

    @contextmanager
    def active(self, adapter):
        """Run `adapter.velocity` with the shadow weights inside the block (call it under no_grad)."""
        if self.full_finetune:
            trained, adapter.transformer = adapter.transformer, self.module
            try:
                yield
            finally:
                adapter.transformer = trained
        else:
            self.transformer.set_adapter(self.name)
            try:
                yield
            finally:
                self.transformer.set_adapter("default")

    @torch.no_grad()
    def blend(self, decay: float) -> None:
        """shadow ← decay·shadow + (1 − decay)·θ."""
        for s, p in self.pairs:
            s.lerp_(p.detach().float(), 1.0 - decay)

    def max_abs_diff(self) -> float:
        """max |shadow − θ| over all blended weights (0 right after a blend with decay 0)."""
        return max(float((s - p.detach().float()).abs().max()) for s, p in self.pairs)

    def state_dict(self) -> dict:
        return {"weights": [s.detach().cpu() for s, _ in self.pairs]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for (s, _), saved in zip(self.pairs, state["weights"]):
                s.copy_(saved)
