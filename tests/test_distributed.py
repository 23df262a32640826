"""Sharded training on CPU processes (docs/distributed.md): accelerate ignores FSDP and
DeepSpeed on CPU, so the FSDP2 paths run through accelerate's own FSDP2 functions applied by
tests/fsdp_launch.py, and every test asserts that the parameters really are DTensor shards; the DeepSpeed paths
run through accelerate's own DeepSpeed code switched on by tests/deepspeed_launch.py, and the tests assert that
a ZeRO-2 engine ran, with one optimizer step per accumulation boundary."""

import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script

TORCHRUN_2CPU = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
CONFIGS = REPO / "configs"
BLOCKS = {  # the diffusers block classes each model's FSDP2 config wraps
    "flux1": ("FluxTransformer2DModel", {"FluxTransformerBlock", "FluxSingleTransformerBlock"}),
    "sd3": ("SD3Transformer2DModel", {"JointTransformerBlock"}),
    "qwen-image": ("QwenImageTransformer2DModel", {"QwenImageTransformerBlock"}),
    "wan": ("WanTransformer3DModel", {"WanTransformerBlock"}),
    "z-image": ("ZImageTransformer2DModel", {"ZImageTransformerBlock"}),
    "flux2": ("Flux2Transformer2DModel", {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"}),
    "wan2.2": ("WanTransformer3DModel", {"WanTransformerBlock"}),  # each expert (transformer/, transformer_2/)
    "wan2.2-5b": ("WanTransformer3DModel", {"WanTransformerBlock"}),
    "qwen-image-2.1": ("QwenImage21Transformer2DModel", {"QwenImage21TransformerBlock"}),
    "ltx2": ("LTX2VideoTransformer3DModel", {"LTX2VideoTransformerBlock"}),
    "wan2.2-i2v": ("WanTransformer3DModel", {"WanTransformerBlock"}),
    **{model: ("HunyuanVideo15Transformer3DModel", {"HunyuanVideo15TransformerBlock", "HunyuanVideo15PatchEmbed",
                                                    "HunyuanVideo15TokenRefiner"})
       for model in ("hunyuan-video-1.5", "hunyuan-video-1.5-i2v")},
}
SKIP = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}


def test_configs_parse_with_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    expected = {"ddp_1gpu": (DistributedType.NO, 1, 1), "ddp_8gpu": (DistributedType.MULTI_GPU, 8, 1),
                "deepspeed_zero2": (DistributedType.DEEPSPEED, 8, 1), "fsdp2_2nodes": (DistributedType.FSDP, 16, 2),
                **{f"fsdp2{suffix}": (DistributedType.FSDP, 8, 1) for suffix in ["", *[f"_{m}" for m in BLOCKS]]}}
    assert {f.stem for f in CONFIGS.glob("*.yaml")} == set(expected)
    for name, (kind, processes, machines) in expected.items():
        config = ClusterConfig.from_yaml_file(CONFIGS / f"{name}.yaml")
        assert (config.distributed_type, config.num_processes, config.num_machines) == (kind, processes, machines)
        assert config.mixed_precision == "bf16"
        if kind == DistributedType.FSDP:
            assert config.fsdp_config["fsdp_version"] == 2
            assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
            assert config.fsdp_config["fsdp_activation_checkpointing"] is True
        if kind == DistributedType.DEEPSPEED:
            assert config.deepspeed_config["zero_stage"] == 2


@pytest.mark.parametrize("model", list(BLOCKS))
def test_fsdp2_configs_wrap_every_transformer_block(model):
    """accelerate's own FSDP2 wrap policy, built from the config files, selects exactly the model's blocks (the
    generic fsdp2.yaml through the model's _no_split_modules, fsdp2_<model>.yaml through its class list)."""
    import diffusers
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from fsdp_launch import fsdp_plugin

    from common.models import tiny_model_path

    cls_name, blocks = BLOCKS[model]
    transformer = getattr(diffusers, cls_name).from_pretrained(tiny_model_path(model) / "transformer")
    # an adapter that names the blocks its transformer class leaves unnamed (LTX-2) sets them on load
    from common.models import ADAPTERS

    transformer._no_split_modules = transformer._no_split_modules or getattr(ADAPTERS[model], "no_split_modules", None)
    want = [name for name, m in transformer.named_modules() if type(m).__name__ in blocks]
    assert want
    for config in ("fsdp2.yaml", f"fsdp2_{model}.yaml"):
        policy = fsdp2_prepare_auto_wrap_policy(fsdp_plugin(str(CONFIGS / config)), transformer)
        assert [name for name, m in transformer.named_modules() if policy(m)] == want, config


def test_configure_backend_fills_deepspeed_config_and_refuses_zero3():
    """Under DeepSpeed the scripts write their micro-batch size and --max-grad-norm into the config (accelerate
    cannot infer them without a prepared DataLoader) and refuse what they cannot run; elsewhere nothing changes."""
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    from common.distributed import configure_backend
    from common.utils import UserError

    printed = []

    def accelerator(kind, **plugin):
        state = SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(**plugin) if plugin else None)
        return SimpleNamespace(distributed_type=kind, state=state, is_fsdp2=kind == DistributedType.FSDP,
                               num_processes=8, device=torch.device("cuda"), print=printed.append)

    configure_backend(accelerator(DistributedType.FSDP), 4, 1.0)  # no plugin to touch: nothing happens
    configure_backend(accelerator(DistributedType.MULTI_GPU), 4, 1.0)
    zero2 = accelerator(DistributedType.DEEPSPEED, zero_stage=2, gradient_clipping=1.0)
    configure_backend(zero2, 4, 0.5)
    config = zero2.state.deepspeed_plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_clipping"],
            config["gradient_accumulation_steps"]) == (4, 0.5, 1)
    assert printed == [f"backend: {name}, 8 process(es) on cuda" for name in ("FSDP2", "MULTI_GPU", "DeepSpeed ZeRO-2")]
    with pytest.raises(UserError, match="ZeRO stage 3 is not supported"):
        configure_backend(accelerator(DistributedType.DEEPSPEED, zero_stage=3), 4, 1.0)
    with pytest.raises(UserError, match="gradient_accumulation_steps: 1"):
        configure_backend(accelerator(DistributedType.DEEPSPEED, zero_stage=2, gradient_accumulation_steps=4), 4, 1.0)


def test_full_finetune_waits_on_the_cpu_until_prepare_under_sharding():
    """staging_device: only full fine-tuning under FSDP2 or DeepSpeed stages the transformer on the CPU; place_like
    then brings an unsharded frozen copy to wherever the trained model went (here the meta device stands in for
    a GPU: the copy's parameters must follow)."""
    from accelerate.utils import DistributedType

    from common.distributed import place_like, staging_device

    cuda = torch.device("cuda")
    cases = [(DistributedType.FSDP, True, True, "cpu"), (DistributedType.DEEPSPEED, False, True, "cpu"),
             (DistributedType.FSDP, True, False, "cuda"), (DistributedType.MULTI_GPU, False, True, "cuda")]
    for kind, fsdp2, full, want in cases:
        accelerator = SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2, device=cuda)
        assert staging_device(accelerator, full).type == want, (kind, full)
    trained, copy = torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2)
    assert place_like(copy, trained).weight.device.type == "meta"
    assert place_like(None, trained) is None


@SLOW
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_fsdp2_step_matches_unsharded(mode, tmp_path, tiny_flux_path):
    """tests/fsdp_step.py: loss, KL to the reference, θ_old shadow, EMA, clipping and AdamW on 2 shards equal the
    unsharded steps; the gathered checkpoint loads in diffusers and resumes into a fresh sharded model."""
    out = tmp_path / "result.json"
    run_script("tests/fsdp_step.py", mode, out, tmp_path / "run", launcher=TORCHRUN_2CPU)
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["local_numel"] < r["trained_numel"]
    # The same float32 math summed in another order: the loss agrees to rounding; Adam's moments (running
    # gradient means) too. Adam divides by √v, which magnifies rounding in near-zero gradients, so weights get a
    # looser bound, still far below how far two steps moved them (seen: LoRA 2e-6, full 9e-6; moved 2e-2).
    assert r["loss_diff"] < 1e-6
    assert r["moved"] > 1e-2
    for stage in ("after_2_steps", "after_resume_step"):
        assert r[stage]["optimizer"] < 1e-6, (stage, r[stage])
        for key in ("weights", "ema", "shadow"):
            assert r[stage][key] < 1e-4, (stage, key, r[stage])
    assert r["ema_eval_diff"] < 1e-4
    assert r["reload"] < 1e-4  # LoRA: FluxPipeline.load_lora_weights output; full: from_pretrained weights
    if mode == "lora":
        assert r["lora_effect"] > 1e-2  # the LoRA really changes the output the reload check compares


def _metrics(output_dir):
    return [{k: v for k, v in m.items() if k not in SKIP} for m in read_metrics(output_dir)]


@SLOW
def test_grpo_script_under_fsdp2_matches_ddp_and_resumes(tmp_path, tiny_flux_path):
    """algos/grpo.py unchanged, its transformer sharded by accelerate's FSDP2 code (configs/fsdp2.yaml: block
    wrapping + activation checkpointing), LoRA with KL and EMA: the first epoch equals the DDP run, and a run
    stopped after 2 epochs and resumed equals the uninterrupted one."""
    args = ["--preset", "tiny", "--eval-every", "1", "--eval-num-prompts", "4", "--batch-size", "4", "--ema",
            "--kl-beta", "0.01", "--save-every", "1"]
    fsdp = ["tests/fsdp_launch.py", "configs/fsdp2.yaml", "algos/grpo.py"]
    full = run_script(*fsdp, *args, "--epochs", "3", "--output-dir", tmp_path / "fsdp", launcher=TORCHRUN_2CPU)
    assert "fsdp_launch: FSDPModule=True DTensor parameters 102/102" in full.stdout
    run_script(*fsdp, *args, "--epochs", "2", "--output-dir", tmp_path / "resumed", launcher=TORCHRUN_2CPU)
    run_script(*fsdp, *args, "--epochs", "3", "--output-dir", tmp_path / "resumed", "--resume", launcher=TORCHRUN_2CPU)
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "fsdp")

    run_script("algos/grpo.py", *args, "--epochs", "1", "--output-dir", tmp_path / "ddp", launcher=ACCELERATE_2CPU)
    (sharded,), (ddp,) = _metrics(tmp_path / "fsdp")[:1], _metrics(tmp_path / "ddp")
    assert sharded["num_processes"] == ddp["num_processes"] == 2
    assert sharded["reward_mean"] == ddp["reward_mean"]  # the same rollouts before any update
    for key in ("loss", "policy_loss", "kl", "approx_kl", "ratio_mean"):
        assert sharded[key] == pytest.approx(ddp[key], rel=1e-4, abs=1e-9), key
    # The sharded checkpoint is a plain diffusers LoRA file.
    from safetensors.torch import load_file

    lora = load_file(tmp_path / "fsdp" / "checkpoints" / "epoch_000002" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") and "lora_" in k and "_checkpoint" not in k for k in lora)


@SLOW
def test_nft_full_finetune_under_fsdp2_matches_ddp(tmp_path, tiny_flux_path):
    """algos/nft.py full fine-tuning with a KL reference: the frozen reference and the θ_old copy are sharded
    like the trained model (place_like); the first epoch equals DDP and the checkpoint loads with from_pretrained."""
    from diffusers import FluxTransformer2DModel

    args = ["--preset", "tiny", "--epochs", "1", "--full-finetune", "--learning-rate", "1e-3", "--kl-beta", "0.01",
            "--eval-every", "1", "--eval-num-prompts", "4", "--batch-size", "4"]
    out = run_script("tests/fsdp_launch.py", "configs/fsdp2.yaml", "algos/nft.py", *args, "--output-dir",
                     tmp_path / "fsdp", launcher=TORCHRUN_2CPU)
    assert "fsdp_launch: FSDPModule=True DTensor parameters 66/66" in out.stdout
    run_script("algos/nft.py", *args, "--output-dir", tmp_path / "ddp", launcher=ACCELERATE_2CPU)
    (sharded,), (ddp,) = _metrics(tmp_path / "fsdp"), _metrics(tmp_path / "ddp")
    assert sharded["num_processes"] == ddp["num_processes"] == 2
    assert sharded["reward_mean"] == ddp["reward_mean"]
    for key in ("loss", "kl", "eval_reward_mean"):
        assert sharded[key] == pytest.approx(ddp[key], rel=1e-4, abs=1e-9), key
    folder = tmp_path / "{}" / "checkpoints" / "epoch_000000" / "transformer"
    a = FluxTransformer2DModel.from_pretrained(str(folder).format("fsdp")).state_dict()
    b = FluxTransformer2DModel.from_pretrained(str(folder).format("ddp")).state_dict()
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


# ---- DeepSpeed ZeRO-2 ---------------------------------------------------------------------------------------
DEEPSPEED = ["tests/deepspeed_launch.py", "configs/deepspeed_zero2.yaml"]


@SLOW
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_deepspeed_zero2_step_matches_plain(mode, tmp_path, tiny_flux_path):
    """tests/deepspeed_step.py: two micro-steps per optimizer step on a ZeRO-2 engine (2 processes) equal the
    plain run's steps on all samples: one DeepSpeed step per boundary, gradients averaged, clipped at
    --max-grad-norm; the checkpoint holds ZeRO's float32 masters and full AdamW state, loads in diffusers, and
    resumes into a fresh engine."""
    out = tmp_path / "result.json"
    run_script("tests/deepspeed_step.py", mode, out, tmp_path / "run", launcher=TORCHRUN_2CPU)
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["optimizer_steps"] == 2  # 4 backward calls, 2 boundaries
    assert r["grad_norm"] > 0.05  # above the bound: clipping acted in both runs
    assert r["loss_diff"] < 1e-6 and r["grad_norm_diff"] < 1e-6
    assert r["moved"] > 1e-2
    for stage, steps in (("after_2_steps", 2), ("after_resume_step", 3)):
        assert r[stage]["adam_step"] == steps
        assert r[stage]["optimizer"] < 1e-6, (stage, r[stage])
        for key in ("weights", "ema", "shadow"):  # seen: 2e-6 (LoRA), 4e-6 (full)
            assert r[stage][key] < 1e-4, (stage, key, r[stage])
    assert r["reload"] < 1e-4
    if mode == "lora":
        assert r["lora_effect"] > 1e-2


@SLOW
def test_grpo_script_under_deepspeed_matches_ddp_and_resumes(tmp_path, tiny_flux_path):
    """algos/grpo.py unchanged under accelerate's DeepSpeed ZeRO-2 path, LoRA with KL and EMA: in float32 its
    first epoch equals the DDP run; in bf16 (DeepSpeed casts the module, the optimizer keeps float32 masters) a
    run stopped after 2 epochs and resumed equals the uninterrupted one, and the saved LoRA is the masters."""
    from safetensors.torch import load_file

    args = ["--preset", "tiny", "--eval-every", "1", "--eval-num-prompts", "4", "--batch-size", "4", "--ema",
            "--kl-beta", "0.01", "--save-every", "1"]
    out = run_script(*DEEPSPEED, "algos/grpo.py", *args, "--epochs", "1", "--output-dir", tmp_path / "ds",
                     launcher=TORCHRUN_2CPU)
    # tiny preset: 2 optimizer steps per epoch, each over 2 micro-batches x 7 trained steps of backward calls
    assert "engine=DeepSpeedEngine zero_stage=2 optimizer=DeepSpeedZeroOptimizer world=2 optimizer_steps=2" \
        in out.stdout
    run_script("algos/grpo.py", *args, "--epochs", "1", "--output-dir", tmp_path / "ddp", launcher=ACCELERATE_2CPU)
    (ds,), (ddp,) = _metrics(tmp_path / "ds"), _metrics(tmp_path / "ddp")
    assert ds["reward_mean"] == ddp["reward_mean"]  # the same rollouts before any update
    for key in ("loss", "policy_loss", "kl", "approx_kl", "ratio_mean", "eval_reward_mean"):
        assert ds[key] == pytest.approx(ddp[key], rel=1e-4, abs=1e-9), key

    bf16 = {"DEEPSPEED_LAUNCH_MIXED_PRECISION": "bf16"}
    args += ["--dtype", "bfloat16"]
    run_script(*DEEPSPEED, "algos/grpo.py", *args, "--epochs", "3", "--output-dir", tmp_path / "full",
               launcher=TORCHRUN_2CPU, env=bf16)
    run_script(*DEEPSPEED, "algos/grpo.py", *args, "--epochs", "2", "--output-dir", tmp_path / "resumed",
               launcher=TORCHRUN_2CPU, env=bf16)
    out = run_script(*DEEPSPEED, "algos/grpo.py", *args, "--epochs", "3", "--output-dir", tmp_path / "resumed",
                     "--resume", launcher=TORCHRUN_2CPU, env=bf16)
    assert "optimizer_steps=2" in out.stdout  # the resumed run took only the third epoch's steps
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "full")
    lora = load_file(tmp_path / "full" / "checkpoints" / "epoch_000002" / "pytorch_lora_weights.safetensors")
    assert lora and {v.dtype for v in lora.values()} == {torch.float32}
    assert any((v.float() != v.bfloat16().float()).any() for v in lora.values())  # not bf16 values


@SLOW
@pytest.mark.parametrize("script", ["grpo_guard", "mixgrpo", "nft", "awm", "dpo", "dgpo", "crd"])
def test_other_scripts_run_under_deepspeed(script, tmp_path, tiny_flux_path):
    """Every other script, unchanged, LoRA and (nft) full fine-tuning, in bf16 as on GPUs (DeepSpeed casts the
    module, θ_old and EMA-sampler adapters included): one epoch under ZeRO-2 with one optimizer step per
    --updates-per-epoch, and a checkpoint."""
    extra = {"nft": ["--full-finetune", "--learning-rate", "1e-3", "--kl-beta", "0.01"],
             "awm": ["--off-policy"]}.get(script, [])  # awm samples with its EMA adapter
    out = run_script(*DEEPSPEED, f"algos/{script}.py", "--preset", "tiny", "--epochs", "1", "--batch-size", "4",
                     "--eval-every", "0", "--dtype", "bfloat16", *extra, "--output-dir", tmp_path / "ds",
                     launcher=TORCHRUN_2CPU, env={"DEEPSPEED_LAUNCH_MIXED_PRECISION": "bf16"})
    (metrics,) = read_metrics(tmp_path / "ds")
    line = next(x for x in out.stdout.splitlines() if x.startswith("deepspeed_launch:"))
    assert "zero_stage=2" in line and "world=2" in line
    # (another process may write on the same line after it: read the number only)
    assert int(re.search(r"optimizer_steps=(\d+)", line)[1]) == _updates_per_epoch(script)
    assert all(v == v for v in metrics.values() if isinstance(v, float))  # no NaN
    checkpoint = tmp_path / "ds" / "checkpoints" / "epoch_000000"
    assert (checkpoint / ("transformer" if script == "nft" else "pytorch_lora_weights.safetensors")).exists()


@SLOW
def test_nft_lora_under_deepspeed_bf16_blends_theta_old_in_float32(tmp_path, tiny_flux_path):
    """DeepSpeed bf16 casts the whole module, the θ_old LoRA adapter too; its blends (decay up to 0.999 in the
    FLUX preset, below one bf16 step) must still happen in float32."""
    out = run_script(*DEEPSPEED, "algos/nft.py", "--preset", "tiny", "--epochs", "2", "--batch-size", "4",
                     "--eval-every", "0", "--dtype", "bfloat16", "--decay-flat", "0", "--decay-uprate", "0.4",
                     "--output-dir", tmp_path / "ds", launcher=TORCHRUN_2CPU,
                     env={"DEEPSPEED_LAUNCH_MIXED_PRECISION": "bf16"})
    assert "zero_stage=2" in out.stdout
    state = torch.load(tmp_path / "ds" / "checkpoints" / "epoch_000001" / "training_state.pt", weights_only=True)
    old = state["old"]["weights"]
    assert old and {w.dtype for w in old} == {torch.float32}
    assert any((w != w.bfloat16().float()).any() for w in old)  # blended values bf16 cannot hold


def _updates_per_epoch(script: str) -> int:
    """The tiny preset's optimizer steps per epoch."""
    import runpy
    from dataclasses import replace

    module = runpy.run_path(str(REPO / "algos" / f"{script}.py"))
    return replace(module["Args"](), **module["PRESETS"]["tiny"]).updates_per_epoch
