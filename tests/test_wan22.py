"""Wan2.2 on its tiny pipelines: the A14B model's two experts (`wan2.2`) and the TI2V-5B model (`wan2.2-5b`).
Parity with diffusers' WanPipeline (each expert at its own CFG scale; per-token timesteps), the routing of every
sample to the expert the pipeline uses (at the boundary too, in gradients, in mixed batches), --train-experts, the
LoRA files in the pipeline's format, the embedding cache, and a resumed run."""

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from common.cache import PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache
from common.checkpoint import LORA_FILE, LORA_FILE_2, load_lora_into
from common.data import Prompt
from common.distributed import lora_state_dict
from common.models import load_adapter
from common.sampling import sample_generators
from common.shadow import ReferencePolicy, ShadowPolicy
from common.training import add_lora, trainable_parameters
from conftest import SLOW, ode_sample, read_metrics, run_script

MODELS = ("wan2.2", "wan2.2-5b")
GUIDANCE = {"wan2.2": (4.0, 3.0), "wan2.2-5b": 5.0}  # the references' CFG scales ((high, low) for the experts)
FRAMES = 5
PROMPTS = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}


@pytest.fixture(scope="module")
def paths():
    from common.models import tiny_model_path

    return {model: tiny_model_path(model) for model in MODELS}


def make_adapter(model, path, **kwargs):
    return load_adapter(model, str(path), "cpu", torch.float32, 32, max_sequence_length=32, num_frames=FRAMES,
                        **kwargs)


@pytest.fixture(scope="module")
def adapters(paths):
    return {model: make_adapter(model, paths[model]) for model in MODELS}


def stock_pipeline(path, loras=()):
    """diffusers' WanPipeline with UniPC at order 1 and no corrector: for flow matching that is exactly the Euler
    step over the same σ and timesteps (as tests/test_adapters.py runs Wan2.1)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    for folder, weight_name, second in loras:
        pipe.load_lora_weights(str(folder), weight_name=weight_name, load_into_transformer_2=second)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, solver_order=1,
                                                         disable_corrector=list(range(100)))
    return pipe


def pipeline_latents(pipe, guidance, steps, seeds):
    scales = guidance if isinstance(guidance, tuple) else (guidance, None)
    if pipe.config.boundary_ratio is None:
        scales = scales[:1]
    return pipe(prompt=[p.prompt for p in PROMPTS], negative_prompt=[p.negative_prompt for p in PROMPTS],
                height=32, width=32, num_frames=FRAMES, num_inference_steps=steps, guidance_scale=scales[0],
                **({"guidance_scale_2": scales[1]} if len(scales) > 1 else {}),
                generator=sample_generators(seeds, "cpu"), output_type="latent", max_sequence_length=32).frames


@pytest.mark.parametrize("model", MODELS)
def test_ode_rollout_reproduces_the_diffusers_pipeline(adapters, paths, model):
    adapter, pipe = adapters[model], stock_pipeline(paths[model])
    cond = PromptEncoder(adapter)(PROMPTS)
    finals = {}
    for guidance in (1.0, GUIDANCE[model]):
        final = ode_sample(adapter, cond, 6, [3, 4], guidance)
        torch.testing.assert_close(final, pipeline_latents(pipe, guidance, 6, [3, 4]), rtol=0, atol=2e-5)
        finals[guidance] = final
    assert (finals[1.0] - finals[GUIDANCE[model]]).abs().max() > 0.01  # the guided path was tested
    if model == "wan2.2":
        # Both experts ran: 6 steps at shift 3 have timesteps on both sides of 875, and the low-noise expert's
        # own scale matters (3 vs the pipeline's default of guidance_scale for both).
        t = adapter._timestep(adapter.sigmas(6)[:-1])
        assert (t >= 875).any() and (t < 875).any()
        same = ode_sample(adapter, cond, 6, [3, 4], 4.0)
        torch.testing.assert_close(same, pipeline_latents(pipe, (4.0, 4.0), 6, [3, 4]), rtol=0, atol=2e-5)
        assert (same - finals[GUIDANCE[model]]).abs().max() > 1e-3


def lora_adapter(path, seed=0, **kwargs):
    """The tiny wan2.2 with a LoRA on both experts whose B is random (peft starts it at 0: no gradient reaches A)."""
    adapter = make_adapter("wan2.2", path, **kwargs)
    torch.manual_seed(seed)
    add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return adapter


def lora_grads(adapter):
    """{expert: total |gradient| over its LoRA weights} (0 for an expert the backward never reached)."""
    return {name: sum(float(p.grad.abs().sum()) for k, p in expert.named_parameters()
                      if "lora_" in k and p.grad is not None)
            for name, expert in zip(("high", "low"), adapter.experts.experts)}


def test_each_step_trains_only_its_expert_and_the_boundary_timestep_is_high_noise(paths):
    """WanPipeline sends t ≥ boundary_ratio · 1000 = 875 to `transformer`: σ = 0.875 (t = 875) must change only the
    high-noise expert's gradients and σ = 0.8749 (t = 874) only the low-noise one's. Routing with `t > 875` would
    train the low-noise expert at σ = 0.875 and fail here."""
    adapter = lora_adapter(paths["wan2.2"])
    cond = PromptEncoder(adapter)(PROMPTS)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert adapter._timestep(torch.tensor([0.875, 0.8749])).tolist() == [875, 874]
    for sigma, trained, untouched in ((0.875, "high", "low"), (0.8749, "low", "high"), (0.99, "high", "low"),
                                      (0.2, "low", "high")):
        adapter.transformer.zero_grad(set_to_none=True)
        adapter.velocity(x, sigma, cond, GUIDANCE["wan2.2"]).square().mean().backward()
        grads = lora_grads(adapter)
        assert grads[trained] > 0 and grads[untouched] == 0, (sigma, grads)
    # The same boundary in the outputs: at t = 875 the velocity is the high-noise expert's alone.
    with torch.no_grad():
        v = adapter.velocity(x, 0.875, cond, 1.0)
        high = adapter.experts.transformer(hidden_states=x, timestep=torch.tensor([875, 875]),
                                           encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
    torch.testing.assert_close(v, high, rtol=0, atol=0)


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_of_per_sample_sigmas_equals_each_sample_alone(adapters, paths, model):
    """Training batches carry one σ per sample (e.g. DiffusionNFT's): a batch with samples on both sides of the
    boundary (wan2.2), or of per-token timesteps (wan2.2-5b), gives each sample's velocity and gradient alone."""
    adapter = lora_adapter(paths[model]) if model == "wan2.2" else adapters[model]
    prompts = PROMPTS + [Prompt("a red car", "dark")]
    cond = PromptEncoder(adapter)(prompts)
    x = adapter.noise(sample_generators([0, 1, 2], "cpu"))
    sigma = torch.tensor([0.95, 0.5, 0.875])
    guidance = GUIDANCE[model]
    with torch.no_grad():
        batch = adapter.velocity(x, sigma, cond, guidance)
        alone = torch.cat([adapter.velocity(x[i:i + 1], sigma[i], {k: v[i:i + 1] for k, v in cond.items()}, guidance)
                           for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-5)
    if model == "wan2.2":
        params = [p for p in adapter.transformer.parameters() if p.requires_grad]
        grads = torch.autograd.grad(adapter.velocity(x, sigma, cond, guidance).square().sum(), params)
        summed = [torch.zeros_like(p) for p in params]
        for i in range(3):
            part = adapter.velocity(x[i:i + 1], sigma[i], {k: v[i:i + 1] for k, v in cond.items()}, guidance)
            for total, g in zip(summed, torch.autograd.grad(part.square().sum(), params, allow_unused=True)):
                total += 0 if g is None else g
        for g, s in zip(grads, summed):
            torch.testing.assert_close(g, s, rtol=1e-3, atol=1e-5)  # float32 sums in another order


def test_train_experts_high_leaves_the_low_noise_lora_unchanged(paths):
    """--train-experts high: after an optimizer step (AdamW with weight decay, which would move any parameter it
    held) on a batch that runs both experts, the low-noise expert's LoRA is as it was, also after the frozen
    policies switched adapters (peft's set_adapter makes the active adapter trainable again)."""
    adapter = lora_adapter(paths["wan2.2"], train_experts="high")
    module = adapter.transformer
    shadow = ShadowPolicy(adapter, module, "old", full_finetune=False)
    cond = PromptEncoder(adapter)(PROMPTS)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    sigma = torch.tensor([0.95, 0.3])
    shadow.velocity(x, sigma, cond, GUIDANCE["wan2.2"])
    params = trainable_parameters(module)
    low = {k: p.detach().clone() for k, p in module.transformer_2.named_parameters() if "lora_" in k}
    high = {k: p.detach().clone() for k, p in module.transformer.named_parameters() if ".default." in k}
    assert low and high and len(params) == len(high)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    adapter.velocity(x, sigma, cond, GUIDANCE["wan2.2"]).square().mean().backward()
    optimizer.step()
    assert all(torch.equal(p, low[k]) for k, p in module.transformer_2.named_parameters() if "lora_" in k)
    assert any(not torch.equal(p, high[k]) for k, p in module.transformer.named_parameters() if k in high)
    # The KL reference (adapters disabled) is the base model on both experts.
    base = make_adapter("wan2.2", paths["wan2.2"])
    torch.testing.assert_close(ReferencePolicy(adapter, module).velocity(x, sigma, cond, 4.0),
                               base.velocity(x, sigma, cond, 4.0), rtol=0, atol=1e-6)


def test_train_experts_is_refused_for_other_models(tmp_path):
    result = run_script("algos/grpo.py", "--model", "wan", "--train-experts", "high", "--output-dir", tmp_path,
                        check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        "error: --train-experts applies to two-expert models (wan2.2, wan2.2-i2v), not to wan"


@pytest.mark.parametrize("model", MODELS)
def test_lora_files_load_into_the_stock_pipeline(paths, model, tmp_path):
    """save_lora writes what WanPipeline.load_lora_weights reads (wan2.2: the low-noise expert's file with
    load_into_transformer_2=True); the stock pipeline with it gives our rollout's latents, and each file changes
    them. Resume reads the same files back."""
    if model == "wan2.2":
        adapter = lora_adapter(paths[model])
    else:
        adapter = make_adapter(model, paths[model])
        torch.manual_seed(0)
        add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
        with torch.no_grad():
            for name, p in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    adapter.save_lora(tmp_path, lora_state_dict(adapter.transformer, adapter.transformer.state_dict()))
    files = [(tmp_path, LORA_FILE, False)] + ([(tmp_path, LORA_FILE_2, True)] if model == "wan2.2" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f[1] for f in files)
    cond = PromptEncoder(adapter)(PROMPTS)
    ours = ode_sample(adapter, cond, 6, [3, 4], GUIDANCE[model])
    theirs = pipeline_latents(stock_pipeline(paths[model], files), GUIDANCE[model], 6, [3, 4])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-5)
    for subset in ([], *([f] for f in files)) if len(files) > 1 else ([],):
        other = pipeline_latents(stock_pipeline(paths[model], subset), GUIDANCE[model], 6, [3, 4])
        assert (other - theirs).abs().max() > 1e-3, [f[1] for f in subset]
    fresh = make_adapter(model, paths[model])
    add_lora(fresh.transformer, 4, 4, fresh.lora_target_modules)
    load_lora_into(fresh.transformer, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.transformer.state_dict().values(),
                                                  adapter.transformer.state_dict().values()))


@pytest.mark.parametrize("model", MODELS)
def test_cached_embeddings_equal_online_and_preprocess_loads_no_transformer(adapters, paths, model, tmp_path):
    from accelerate import Accelerator

    adapter = adapters[model]
    texts = cache_texts(PROMPTS, [], with_negatives=True)
    inputs = fingerprint_inputs(model, str(paths[model]), 32, torch.float32, texts)
    build_cache(Accelerator(cpu=True), make_adapter(model, paths[model], text_only=True), texts, tmp_path, inputs,
                shard_size=3, progress=False)
    trainer = make_adapter(model, paths[model], load_text_encoders=False)
    cached, online = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(PROMPTS), \
        PromptEncoder(adapter)(PROMPTS)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == []
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    sigma = torch.tensor([0.9, 0.4])
    assert torch.equal(trainer.velocity(x, sigma, cached, GUIDANCE[model]),
                       adapter.velocity(x, sigma, online, GUIDANCE[model]))
    encoder_only = make_adapter(model, paths[model], text_only=True)
    assert encoder_only.pipe.transformer is None and encoder_only.pipe.transformer_2 is None


def test_nft_resume_equals_the_uninterrupted_run_and_its_lora_loads_into_the_pipeline(tmp_path):
    """DiffusionNFT draws σ per sample (both experts in one batch) and keeps θ_old as a second LoRA adapter on both
    experts: 2 epochs equal 1 + a resumed 1, bit for bit, and the trained LoRA of both experts loads into the stock
    pipeline and changes its output."""
    args = ["--preset", "tiny", "--model", "wan2.2", "--model-path", "tiny", "--resolution", "32", "--num-frames",
            "5", "--max-sequence-length", "16", "--epochs", "2", "--prompts-per-epoch", "1", "--group-size", "4",
            "--batch-size", "4", "--num-steps", "4", "--train-timesteps", "2", "--eval-every", "0",
            "--save-every", "1"]
    run_script("algos/nft.py", *args, "--output-dir", tmp_path / "full")
    run_script("algos/nft.py", *args, "--epochs", "1", "--output-dir", tmp_path / "split")
    run_script("algos/nft.py", *args, "--resume", "--output-dir", tmp_path / "split")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    full, split = strip(read_metrics(tmp_path / "full")), strip(read_metrics(tmp_path / "split"))
    assert [m["epoch"] for m in split] == [0, 1] and split == full
    from safetensors.torch import load_file

    folder = tmp_path / "full" / "checkpoints" / "epoch_000001"
    for name in (LORA_FILE, LORA_FILE_2):
        a, b = load_file(folder / name), load_file(tmp_path / "split" / "checkpoints" / "epoch_000001" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # each expert was trained
    from common.models import tiny_model_path

    path = tiny_model_path("wan2.2")
    base = pipeline_latents(stock_pipeline(path), GUIDANCE["wan2.2"], 4, [0, 1])
    tuned = pipeline_latents(stock_pipeline(path, [(folder, LORA_FILE, False), (folder, LORA_FILE_2, True)]),
                             GUIDANCE["wan2.2"], 4, [0, 1])
    assert (tuned - base).abs().max() > 1e-4


@SLOW
def test_two_processes_train_when_a_backward_uses_one_expert(tmp_path):
    """GRPO trains one step (one σ, one expert) per backward; under DDP every trained weight of the other expert must
    still get a gradient (its one-token forward), or DDP stops at the next step ("parameters that were not used in
    producing loss")."""
    from conftest import ACCELERATE_2CPU

    args = ["--preset", "tiny", "--model", "wan2.2", "--model-path", "tiny", "--resolution", "32", "--num-frames",
            "5", "--max-sequence-length", "16", "--epochs", "2", "--prompts-per-epoch", "1", "--group-size", "4",
            "--batch-size", "2", "--num-steps", "4", "--updates-per-epoch", "1", "--eval-every", "0"]
    run_script("algos/grpo.py", *args, "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    metrics = read_metrics(tmp_path)
    assert [m["num_processes"] for m in metrics] == [2, 2] and all(m["grad_norm"] > 0 for m in metrics)


def test_each_wan_model_refuses_the_others_checkpoint(paths):
    from common.models import tiny_model_path
    from common.utils import UserError

    for model, other, message in (("wan2.2", tiny_model_path("wan"), "has no second expert"),
                                  ("wan2.2-5b", paths["wan2.2"], "is not a Wan2.2 TI2V checkpoint"),
                                  ("wan", paths["wan2.2"], "use --model wan2.2 or wan2.2-5b"),
                                  ("wan", paths["wan2.2-5b"], "use --model wan2.2 or wan2.2-5b")):
        with pytest.raises(UserError, match=message):
            load_adapter(model, str(other), "cpu", torch.float32, 32, max_sequence_length=32, num_frames=FRAMES)
