"""What tests/fsdp_step.py and tests/deepspeed_step.py share: the toy batch, the scripts' loss on it, the
comparison helpers and the diffusers reload check. A `run` is either script's Run: it has adapter, transformer
(unwrapped), reference (full fine-tuning), shadow (θ_old), ema, optimizer and params."""

import torch

from common.distributed import model_state_dict, optimizer_state_dict
from common.dynamics import sde_kl, sde_step
from common.training import adapters_disabled

BATCH, CLIP, ETA, GUIDANCE = 4, 1e-2, 0.8, 3.5


def batch(seed: int, adapter) -> dict:
    """A toy micro-batch of BATCH samples at one denoising step, with rollout log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    cfg = adapter.config
    tokens = adapter.latent_h * adapter.latent_w // 4
    sigmas = adapter.sigmas(4)
    x = torch.randn(BATCH, tokens, cfg.in_channels, generator=g)
    return {"x": x, "x_next": x + 0.1 * torch.randn(x.shape, generator=g),
            "log_prob_old": -1.5 + 0.01 * torch.randn(BATCH, generator=g),
            "adv": torch.tensor([1.0, -0.5, 0.8, -1.3]),
            "prompt_embeds": torch.randn(BATCH, 32, cfg.joint_attention_dim, generator=g),
            "pooled_prompt_embeds": torch.randn(BATCH, cfg.pooled_projection_dim, generator=g),
            "sigma": sigmas[1], "sigma_next": sigmas[2]}


def step_loss(run, d: dict, full: bool) -> torch.Tensor:
    """What the scripts' losses are made of, on the samples in `d`: the clipped ratio loss through
    adapter.velocity + sde_step, a KL to the reference (adapters disabled for LoRA, the frozen copy for full
    fine-tuning) and a term through the θ_old shadow."""
    adapter, s0, s1 = run.adapter, d["sigma"], d["sigma_next"]
    x, x_next, log_prob_old, adv = d["x"], d["x_next"], d["log_prob_old"], d["adv"]
    v = adapter.velocity(x, s0, d, GUIDANCE)
    _, log_prob, mean, std = sde_step("flow-sde", v, x, s0, s1, ETA, prev_sample=x_next)
    ratio = torch.exp(log_prob - log_prob_old)
    policy_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)).mean()
    with torch.no_grad():
        if full:
            v_ref = adapter.velocity(x, s0, d, GUIDANCE, transformer=run.reference)
        else:
            with adapters_disabled(run.transformer):
                v_ref = adapter.velocity(x, s0, d, GUIDANCE)
        _, _, mean_ref, _ = sde_step("flow-sde", v_ref, x, s0, s1, ETA, prev_sample=x_next)
        v_old = run.shadow.velocity(x, s0, d, GUIDANCE)
    kl = sde_kl("flow-sde", mean, mean_ref, std, s0, s1).mean()
    return policy_loss + 0.5 * kl + 0.5 * ((v - v_old) ** 2).mean()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def full_states(run) -> dict:
    """Everything a checkpoint holds, as whole tensors (collectives on a sharded or DeepSpeed run: call on all
    ranks)."""
    return {"model": model_state_dict(run.transformer), "optimizer": optimizer_state_dict(run.transformer, run.optimizer),
            "ema": run.ema.state_dict()["shadow"], "shadow": run.shadow.state_dict()["weights"]}


def compare(plain_run, other: dict, plain: dict) -> dict:
    """Largest differences between another run's gathered states and the plain run's (optimizer: torch's
    index-keyed state against the name-keyed full state)."""
    names = [n for n, p in plain_run.transformer.named_parameters() if p.requires_grad]
    by_index = plain["optimizer"]["state"]
    adam = {f"{n}.{k}": by_index[i][k] for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq")}
    adam_other = {f"{n}.{k}": other["optimizer"]["state"][n][k] for n in names for k in ("exp_avg", "exp_avg_sq")}
    steps = {float(s["step"]) for s in other["optimizer"]["state"].values()} | {float(by_index[0]["step"])}
    assert len(steps) == 1, steps  # as many AdamW steps as the plain run took
    return {"weights": max_diff(other["model"], plain["model"]), "optimizer": max_diff(adam_other, adam),
            "ema": max_diff(dict(enumerate(other["ema"])), dict(enumerate(plain["ema"]))),
            "shadow": max_diff(dict(enumerate(other["shadow"])), dict(enumerate(plain["shadow"]))),
            "adam_step": steps.pop()}


@torch.no_grad()
def reload_diffs(folder, plain_run, model_path: str, full: bool, probe: dict) -> dict:
    """The saved checkpoint read back by diffusers against the plain run: full fine-tuning's transformer through
    `from_pretrained` (weights), a LoRA through `FluxPipeline.load_lora_weights` (velocity on `probe`), with how
    much the LoRA changes that velocity (so a zero difference is not a vacuous one)."""
    if full:
        from diffusers import FluxTransformer2DModel

        loaded = FluxTransformer2DModel.from_pretrained(folder / "transformer")
        return {"reload": max_diff(loaded.state_dict(), plain_run.transformer.state_dict())}
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_path)
    pipe.load_lora_weights(folder)
    adapter = plain_run.adapter
    trained = adapter.transformer
    want = adapter.velocity(probe["x"], probe["sigma"], probe, GUIDANCE)
    adapter.transformer = pipe.transformer
    got = adapter.velocity(probe["x"], probe["sigma"], probe, GUIDANCE)
    adapter.transformer = trained
    with adapters_disabled(trained):
        base = adapter.velocity(probe["x"], probe["sigma"], probe, GUIDANCE)
    return {"reload": float((got - want).abs().max()), "lora_effect": float((want - base).abs().max())}
