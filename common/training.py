"""Trainable parameters: LoRA through peft, the frozen reference, and an EMA of the trained weights."""

from contextlib import contextmanager

import torch

from common.distributed import copy_full_, full_tensor, reshard


def add_lora(transformer, rank: int, alpha: float, target_modules: list[str]) -> None:
    """Attach a peft LoRA adapter. Gaussian init makes lora_B zero, so the model starts equal to the base."""
    from peft import LoraConfig

    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=target_modules))


def trainable_parameters(module) -> list[torch.nn.Parameter]:
    """The parameters being trained, cast to float32 (master weights) whatever the model dtype."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


@contextmanager
def adapters_disabled(transformer):
    """The reference policy of a LoRA run: the same module with its adapters switched off, no copy."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


class EMA:
    """Exponential moving average of a list of parameters, kept in float32 on their device (shard by shard
    when they are FSDP2 DTensors: pass the parameters read after `prepare`, and the module holding them so
    that it is resharded before the EMA writes into them)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, module: torch.nn.Module | None = None):
        self.params = params
        self.decay = decay
        self.module = module
        self.shadow = [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        reshard(self.module)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - d)

    @contextmanager
    def applied(self):
        """Temporarily put the EMA weights into the model (e.g. for evaluation)."""
        reshard(self.module)
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            reshard(self.module)
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [full_tensor(s).cpu() for s in self.shadow]}  # collective if sharded

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        reshard(self.module)
        for s, saved in zip(self.shadow, state["shadow"]):
            copy_full_(s, saved)
