"""Every algorithm script × every other model than FLUX.1: one tiny epoch each, through the scripts' own command
line. (FLUX.1, the scripts' default, runs in every script's own test file: tiny epochs with evaluation and
checkpoints, resume, two processes.) Conditioned models (editing, image-to-video) train on a dataset of prompts
with condition images, and the LoRA each script saves must load into the stock diffusers pipeline and change its
output for a condition image."""

import inspect
import math
import runpy

import pytest

from common.checkpoint import LORA_FILE_2
from common.data import DEFAULT_DATASET
from conftest import EXHAUSTIVE, REPO, SLOW, read_metrics, run_script

SCRIPTS = ["grpo", "grpo_guard", "mixgrpo", "nft", "awm", "dpo", "dgpo", "crd", "dppo", "vgrpo"]
# The smallest settings each tiny model takes: one group of 4 in one micro-batch, 4 (MixGRPO: 6) steps.
MODELS = {
    "sd3": ["--resolution", "32"],
    "qwen-image": ["--resolution", "32"],
    "wan": ["--resolution", "32", "--num-frames", "5"],
    "wan2.2": ["--resolution", "32", "--num-frames", "5"],  # 4 steps at shift 3: 2 per expert
    "wan2.2-5b": ["--resolution", "32", "--num-frames", "5"],
    "flux1-kontext": ["--resolution", "32", "--condition-size", "32"],
    "qwen-image-edit": ["--resolution", "32", "--condition-size", "32"],
    # Wan2.1 I2V's attention takes the last 512 context tokens as the text: the adapter pads the 16 to 512.
    "wan-i2v": ["--resolution", "32", "--num-frames", "5"],
    # FLUX.2's system prompt and template take 37 tiny tokens, klein's template 14: room for the prompt behind them.
    "flux2": ["--resolution", "32", "--max-sequence-length", "64"],
    "flux2-klein": ["--resolution", "32", "--max-sequence-length", "32"],
    # Z-Image wraps each prompt in an 8-token chat template: 32 leaves the prompt room behind it.
    "z-image": ["--resolution", "32", "--max-sequence-length", "32"],
    # Editing here (condition images); its text-to-image mode trains in tests/test_qwen_image21.py.
    "qwen-image-2.1": ["--resolution", "32", "--condition-size", "32"],
    # LTX-2's audio and video in one latent: the toy loudness reward scores the sound beside JPEG on the frames.
    "ltx2": ["--resolution", "32", "--num-frames", "9", "--reward", "audio_loudness,target=0.1", "--reward",
             "jpeg_compressibility"],
    "wan2.2-i2v": ["--resolution", "32", "--num-frames", "5"],  # 4 steps at shift 5: 2 per expert
    "hunyuan-video-1.5": ["--resolution", "32", "--num-frames", "5"],
    "hunyuan-video-1.5-i2v": ["--resolution", "32", "--num-frames", "5"],
    # the same, from a condition image: its first latent frame, which the policy never steps
    "ltx2-i2v": ["--resolution", "32", "--num-frames", "9", "--reward", "audio_loudness,target=0.1", "--reward",
                 "jpeg_compressibility"],
}
AUDIO = {"ltx2", "ltx2-i2v"}  # their runs log the audio reward and write each evaluation sample's sound beside the grid
CONDITIONED = {"flux1-kontext", "qwen-image-edit", "wan-i2v", "qwen-image-2.1", "wan2.2-i2v", "hunyuan-video-1.5-i2v",
               "ltx2-i2v"}
# Text-to-image and -video models whose trained LoRA is also loaded into the stock pipeline (first test prompt).
STOCK_LORA = {"flux2", "flux2-klein", "z-image", "wan2.2-5b", "hunyuan-video-1.5"}  # wan2.2's two files: test_wan22.py
SMALL = ["--preset", "tiny", "--epochs", "1", "--prompts-per-epoch", "1", "--group-size", "4", "--batch-size", "4",
         "--eval-every", "1", "--eval-num-prompts", "1", "--max-sequence-length", "16"]
STEPS = {"grpo": ["--num-steps", "4", "--updates-per-epoch", "1"],
         "grpo_guard": ["--num-steps", "4", "--updates-per-epoch", "1"],
         "mixgrpo": ["--num-steps", "6", "--window-size", "2", "--updates-per-epoch", "1"],
         "nft": ["--num-steps", "4", "--train-timesteps", "2"], "awm": ["--num-steps", "4", "--train-timesteps", "2"],
         "dpo": ["--num-steps", "4"], "dgpo": ["--num-steps", "4", "--trunc-steps", "3", "--train-timesteps", "2"],
         "crd": ["--num-steps", "4"],
         "dppo": ["--num-steps", "4", "--updates-per-epoch", "1"],
         "vgrpo": ["--num-steps", "4", "--train-timesteps", "2"]}


# The fast tier runs a diagonal (model i with script i mod 10: every model once, every script at least once); the
# full tier every model with one script of each family (coupled grpo, forward-process nft, preference dpo) besides
# its diagonal script and the one that checks its LoRA in the stock pipeline; --exhaustive every pair (the scripts of
# a family share their rollout, storage and model calls: what differs between them is the loss).
DIAGONAL = [(SCRIPTS[i % len(SCRIPTS)], model) for i, model in enumerate(MODELS)]
FAMILIES = ("grpo", "nft", "dpo")


# Every script saves its LoRA through the same `save` (common/setup.py): one script per model, in turn, checks it in
# the stock pipeline (each script covers one or two models).
LATER = ("ltx2", "ltx2-i2v")  # added after the others, so that their turns stay: their fast-tier script checks
STOCK_CHECK = {model: SCRIPTS[i % len(SCRIPTS)] for i, model in enumerate(sorted((CONDITIONED | STOCK_LORA) - {*LATER}))}
STOCK_CHECK.update({model: {m: s for s, m in DIAGONAL}[model] for model in LATER})


def matrix_cases():
    cases = []
    for script in SCRIPTS:
        for model in MODELS:
            if (script, model) in DIAGONAL:
                cases.append((script, model))
            elif script in FAMILIES or STOCK_CHECK.get(model) == script:
                cases.append(pytest.param(script, model, marks=SLOW))
            else:
                cases.append(pytest.param(script, model, marks=EXHAUSTIVE))
    return cases


@pytest.mark.parametrize("script, model", matrix_cases())
def test_one_epoch(script, model, tmp_path, request):
    data = ["--dataset", request.getfixturevalue("edit_dataset")] if model in CONDITIONED else []
    run_script(f"algos/{script}.py", *SMALL, *STEPS[script], "--model", model, "--model-path", "tiny",
               *MODELS[model], *data, "--output-dir", tmp_path)
    (metrics,) = read_metrics(tmp_path)
    assert metrics["num_processes"] == 1 and metrics["samples_seen"] == 4
    assert all(math.isfinite(metrics[k]) for k in ("reward_mean", "loss", "grad_norm", "eval_reward_mean"))
    if model in AUDIO:
        assert math.isfinite(metrics["reward_audio_loudness_mean"]) and metrics["reward_audio_loudness_std"] > 0
        assert (tmp_path / "eval" / "epoch_000000_audio" / "prompt000_seed0.wav").stat().st_size > 44  # header + PCM
    if "ratio_dev_first" in metrics:
        assert metrics["ratio_dev_first"] < 1e-6
    lora = tmp_path / "checkpoints" / "epoch_000000"
    assert (lora / "pytorch_lora_weights.safetensors").exists()
    if STOCK_CHECK.get(model) == script:
        assert_lora_changes_the_stock_pipeline(model, lora, data[1] if data else DEFAULT_DATASET)




def assert_lora_changes_the_stock_pipeline(model, lora, dataset):
    """The stock pipeline (diffusers' own, from the tiny folder) loads the trained LoRA and, for the first test
    prompt's condition image and a fixed noise seed, generates other latents than without it."""
    import diffusers
    import torch
    from PIL import Image

    from common.data import load_prompts
    from common.models import ADAPTERS
    from common.models import tiny_model_path

    record = load_prompts(dataset, "test")[0]
    # the adapter's pipeline: LTX-2's one checkpoint names LTX2Pipeline, whichever mode loads it
    pipe = getattr(diffusers, ADAPTERS[model].pipeline_class_name).from_pretrained(str(tiny_model_path(model)))
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=record.prompt, num_inference_steps=4, output_type="latent", **PIPELINE_ARGS[model])
    if "height" in inspect.signature(pipe.__call__).parameters:  # HunyuanVideo-1.5 I2V sizes from its image
        call.update(height=32, width=32)
    if record.images:
        call["image"] = Image.open(record.images[0]).convert("RGB")
    outputs = []
    for lora_path in (None, lora):
        if lora_path is not None and hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(str(lora_path))
            if (lora_path / LORA_FILE_2).exists():  # Wan2.2's low-noise expert (a script may train only it)
                pipe.load_lora_weights(str(lora_path), weight_name=LORA_FILE_2, load_into_transformer_2=True)
        elif lora_path is not None:  # HunyuanVideo-1.5's pipelines have no LoRA mixin: into the transformer itself
            pipe.transformer.load_lora_adapter(str(lora_path), prefix="transformer",
                                               weight_name="pytorch_lora_weights.safetensors")
        result = pipe(generator=torch.Generator().manual_seed(0), **call)
        outputs.append(result.frames if hasattr(result, "frames") else result.images)
    base, tuned = outputs
    assert (tuned - base).abs().max() > 1e-4, float((tuned - base).abs().max())


# The stock pipelines' calls at the tiny size: Kontext without its 1024² auto-resize, Wan I2V at 5 frames.
PIPELINE_ARGS = {"flux1-kontext": dict(max_area=32 * 32, _auto_resize=False, max_sequence_length=16),
                 "qwen-image-edit": dict(), "qwen-image-2.1": dict(output_resolution=32),
                 "wan-i2v": dict(num_frames=5, max_sequence_length=512),
                 "wan2.2-i2v": dict(num_frames=5, max_sequence_length=16),  # the high-noise expert's LoRA file
                 "hunyuan-video-1.5": dict(num_frames=5), "hunyuan-video-1.5-i2v": dict(num_frames=5),
                 "flux2": dict(max_sequence_length=64), "flux2-klein": dict(max_sequence_length=32),
                 "z-image": dict(max_sequence_length=32, guidance_scale=0.0),
                 "wan2.2-5b": dict(num_frames=5, max_sequence_length=16),
                 # LTX2Pipeline with CFG only: its spatio-temporal guidance needs blocks the tiny model has not
                 "ltx2": dict(num_frames=9, max_sequence_length=16, stg_scale=0.0, audio_stg_scale=0.0,
                              spatio_temporal_guidance_blocks=None),
                 "ltx2-i2v": dict(num_frames=9, max_sequence_length=16, stg_scale=0.0, audio_stg_scale=0.0,
                                  spatio_temporal_guidance_blocks=None, image_crf=0)}  # the adapter's encoding


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_paper_preset_sets_its_reward(script):
    """A preset named after a paper's setting trains on that paper's reward (flux1-flowgrpo once trained on JPEG
    unless --reward was added); the toy presets on the toy world's."""
    presets = runpy.run_path(str(REPO / "algos" / f"{script}.py"))["PRESETS"]
    for name, preset in presets.items():
        if name.endswith("-ocr"):
            assert preset.get("reward") == ["ocr"], (name, preset.get("reward"))
        elif name.startswith("flux1"):  # PickScore, or OCR where the paper's headline setting is OCR (crd)
            assert preset.get("reward") in (["pickscore"], ["ocr"]), (name, preset.get("reward"))
        if name == "toy":
            assert preset["reward"] == ["toy"] and preset["model_path"] == "toy", name
