"""The frozen policies a script evaluates beside the trained one, each with a `velocity(x, sigma, cond, guidance)`
like the adapter's: `ReferencePolicy` (the model before training: LoRA adapters disabled, or a frozen copy when
fully fine-tuning) and `ShadowPolicy`, a second copy that trails the trained policy by blending (DiffusionNFT's
θ_old, AWM's EMA sampler; algorithms.md §5).

A LoRA shadow is a second peft adapter on the SAME transformer (no model copy): its `velocity` switches the
module to it, and back to the trained adapter ("default") before returning. With full fine-tuning it is a frozen
deepcopy of the transformer, passed to `adapter.velocity(..., transformer=...)`. The adapter is switched on the
unwrapped module; a DDP wrapper only forwards to it, and every forward of a frozen policy runs under no_grad, so
DDP never sees the switch.
Under FSDP2 the parameters are looked up by name at each use (`prepare` replaces them by DTensor shards) and a
full copy is sharded like the trained model, so blending works shard by shard; a copy made while the model waited
on the CPU (common.distributed.staging_device) follows it to the GPU.
"""

import copy
import warnings

import torch

from common.distributed import copy_full_, full_tensor, named_parameters, place_like, reshard
from common.training import adapters_disabled


class ReferencePolicy:
    """The policy before training: the same module with its LoRA adapters switched off (no copy), or `copy`, a
    frozen copy of the transformer made before full fine-tuning changed it (placed like the trained model after
    `prepare`: common.distributed.place_like)."""

    def __init__(self, adapter, transformer, copy: torch.nn.Module | None = None):
        self.adapter, self.transformer, self.copy = adapter, transformer, copy

    @torch.no_grad()
    def velocity(self, x, sigma, cond, guidance_scale):
        if self.copy is not None:
            return self.adapter.velocity(x, sigma, cond, guidance_scale, transformer=self.copy)
        with adapters_disabled(self.transformer):
            return self.adapter.velocity(x, sigma, cond, guidance_scale)


class ShadowPolicy:
    def __init__(self, adapter, transformer, name: str, full_finetune: bool, source: str = "default"):
        """`transformer`: the unwrapped module holding the trained weights (LoRA adapter "default" already added).
        The shadow starts equal to the trained weights. `source`: the LoRA adapter it trails (another trained role's,
        common.roles; "default": the run's own)."""
        self.adapter, self.transformer, self.name, self.full_finetune = adapter, transformer, name, full_finetune
        self.source = source
        if full_finetune:
            self.module = copy.deepcopy(transformer).requires_grad_(False)
            self.keys = [k for k, p in transformer.named_parameters() if p.requires_grad]
        else:
            # Same rank, alpha and targets as the trained adapter; add_adapter activates the new one, so switch
            # back (peft's set_adapter also gives requires_grad back to "default" and takes it from the shadow).
            with warnings.catch_warnings():  # peft warns that a second adapter is being added: intended here
                warnings.simplefilter("ignore")
                transformer.add_adapter(copy.deepcopy(transformer.peft_config[source]), adapter_name=name)
            transformer.set_adapter("default")
            self.keys = [k for k, _ in transformer.named_parameters() if f".{source}." in k]
        with torch.no_grad():
            for s, p in self.pairs:
                s.data = p.detach().float().clone()
                s.requires_grad_(False)

    @property
    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(shadow, trained) parameter pairs, looked up now (the shards, under FSDP2)."""
        reshard(self.transformer)
        trained = named_parameters(self.transformer)
        if not self.full_finetune:
            pairs = [(trained[k.replace(f".{self.source}.", f".{self.name}.")], trained[k]) for k in self.keys]
            for s, _ in pairs:
                if s.dtype != torch.float32:  # DeepSpeed bf16 casts the whole module, this adapter too: a blend
                    s.data = s.data.float()   # with decay near 1 would move it by less than one bf16 step
            return pairs
        reshard(self._full_copy())
        shadow = named_parameters(self.module)
        return [(shadow[k], trained[k]) for k in self.keys]

    def _full_copy(self) -> torch.nn.Module:
        """The frozen copy of a full fine-tune, placed like the trained model once that is prepared (sharded
        under FSDP2; moved to the GPU if it was made while the model waited on the CPU)."""
        self.module = place_like(self.module, self.transformer)
        return self.module

    @torch.no_grad()
    def velocity(self, x, sigma, cond, guidance_scale):
        if self.full_finetune:
            return self.adapter.velocity(x, sigma, cond, guidance_scale, transformer=self._full_copy())
        self.transformer.set_adapter(self.name)
        try:
            return self.adapter.velocity(x, sigma, cond, guidance_scale)
        finally:
            self.transformer.set_adapter("default")

    @torch.no_grad()
    def blend(self, decay: float) -> None:
        """shadow ← decay·shadow + (1 − decay)·θ, for decay in [0, 1] (outside it the lerp would extrapolate)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ShadowPolicy.blend: decay must be in [0, 1], got {decay}")
        for s, p in self.pairs:
            s.lerp_(p.detach().float(), 1.0 - decay)

    def max_abs_diff(self) -> float:
        """max |shadow − θ| over all blended weights (0 right after a blend with decay 0)."""
        return max(float(full_tensor((s - p.detach().float()).abs().max())) for s, p in self.pairs)

    def state_dict(self) -> dict:
        return {"weights": [full_tensor(s.detach()).cpu() for s, _ in self.pairs]}  # a collective when sharded

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for (s, _), saved in zip(self.pairs, state["weights"]):
                copy_full_(s, saved)
