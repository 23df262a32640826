"""Reward models on Qwen-VL backbones (HPSv3, EditReward, VideoAlign): tiny random models of the real transformers
classes saved in the references' checkpoint layout, loaded through the same path as the published checkpoints, and
scored against an independent computation: transformers' own processor and ForConditionalGeneration model on the
same weights, the heads by hand in float64."""

import numpy as np
import pytest
import torch
from PIL import Image

from common.scoring import call_reward
from common.utils import UserError
from rewards import load_rewards, score_samples
from rewards.qwen_vl import (
    EDITREWARD_FOLLOWING,
    EDITREWARD_PIXELS,
    EDITREWARD_QUALITY,
    EDITREWARD_SUFFIX,
    HPSV3_INSTRUCTION,
    HPSV3_PIXELS,
    TINY_LORA_TARGETS,
    VIDEOALIGN_PROMPT,
    VIDEOALIGN_TOKENS,
    save_tiny_qwen_vl,
    save_tiny_videoalign,
)

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hpsv3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hpsv3")
    return save_tiny_qwen_vl(folder, "Qwen2VLModel", ("<|Reward|>",), ("rm_head.",)), folder / "base"


@pytest.fixture(scope="module")
def editreward(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-editreward")
    checkpoint = save_tiny_qwen_vl(folder, "Qwen2_5_VLModel", ("<|Reward|>",), ("rm_heads.head_0.", "rm_heads.head_1."))
    return checkpoint, folder / "base"


def quantised(count, height, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, height, width), generator=generator).float() / 255


def ranknet(state, prefix, hidden):
    """The ranknet MLP in float64: Linear at 0, 3, 5 with ReLU after the first two."""
    w = {k.removeprefix(prefix): v.double().numpy() for k, v in state.items() if k.startswith(prefix)}
    x = np.maximum(hidden @ w["0.weight"].T + w["0.bias"], 0)
    x = np.maximum(x @ w["3.weight"].T + w["3.bias"], 0)
    return x @ w["5.weight"].T + w["5.bias"]


def pil(image):
    return Image.fromarray((image.numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0))


def reference_hidden(checkpoint, base, model_class, special_tokens, text, images, pixels, sequential_positions=False):
    """Last hidden states at the reward tokens, from transformers' processor and ForConditionalGeneration model on
    the checkpoint's weights (one sample, no padding); `sequential_positions`: positions 0..L-1 instead of the
    model's 3-D M-RoPE ones (HPSv3, trained under transformers 4.45.2's forward)."""
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    vision = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels)(images=images, return_tensors="pt")
    for grid in vision["image_grid_thw"]:  # each placeholder becomes t·h·w / merge² tokens, as the processor does
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    ids = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == image_token).long(), **vision)
    if sequential_positions:
        inputs["position_ids"] = torch.arange(ids.shape[1])[None]
    state = load_file(checkpoint)
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
    model = getattr(transformers, model_class)(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and all(k.startswith("rm_head") for k in unexpected)  # rm_head or rm_heads
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state[0].double().numpy()
    ids = inputs["input_ids"][0].tolist()
    return hidden[[ids.index(t) for t in tokenizer.convert_tokens_to_ids(list(special_tokens))]], state


def test_hpsv3_matches_transformers_and_hand_head(hpsv3):
    checkpoint, base = hpsv3
    images, prompts = quantised(3, 32, 48), ["a cat", "two dogs on the grass at night", "x"]
    (reward,) = load_rewards([f"hpsv3,path={checkpoint},base={base},batch_size=2"])  # batches pad on the right
    scores = score_samples([reward], images, prompts, torch.arange(3))[:, 0].numpy()
    expected = []
    for image, prompt in zip(images, prompts):
        text = SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>" + HPSV3_INSTRUCTION.format(
            text_prompt=prompt) + ASSISTANT
        hidden, state = reference_hidden(checkpoint, base, "Qwen2VLForConditionalGeneration", ("<|Reward|>",),
                                         text, [pil(image)], HPSV3_PIXELS, sequential_positions=True)
        expected.append(ranknet(state, "rm_head.", hidden[0])[0])  # (μ, σ): μ is the score
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-6)  # float32 rounding
    assert HPSV3_INSTRUCTION.endswith("Please provide the overall ratings of this image: <|Reward|>\n\nEND\n")


def test_hpsv3_wrong_base_is_one_line(hpsv3, tmp_path):
    checkpoint, _ = hpsv3
    with pytest.raises(UserError, match="cannot load the reward's base model"):
        load_rewards([f"hpsv3,path={checkpoint},base={tmp_path / 'nothing'}"])
    with pytest.raises(UserError, match="cannot load the reward checkpoint"):
        load_rewards([f"hpsv3,path={tmp_path / 'missing.safetensors'}"])


def test_editreward_matches_transformers_and_hand_heads(editreward):
    checkpoint, base = editreward
    images, prompts = quantised(2, 32, 48), ["make the cube blue", "remove the dog"]
    sources = quantised(2, 24, 24, seed=1)  # conditions come at their files' own size
    (reward,) = load_rewards([f"editreward,path={checkpoint.parent},base={base}"])  # a folder: model.safetensors
    assert reward.wants_conditions
    columns = {}
    scores = call_reward(reward, images, prompts, [[s] for s in sources], columns).numpy()
    for i, prompt in enumerate(prompts):
        heads = []
        for head, instruction in (("head_0", EDITREWARD_FOLLOWING), ("head_1", EDITREWARD_QUALITY)):
            text = SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>" * 2 + instruction.format(
                text_prompt=prompt) + EDITREWARD_SUFFIX + ASSISTANT
            hidden, state = reference_hidden(checkpoint, base, "Qwen2_5_VLForConditionalGeneration", ("<|Reward|>",),
                                             text, [pil(sources[i]), pil(images[i])], EDITREWARD_PIXELS)
            heads.append(ranknet(state, f"rm_heads.{head}.", hidden[0])[0])
        np.testing.assert_allclose(columns["editreward_instruction_following"][i], heads[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(columns["editreward_visual_quality"][i], heads[1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(scores[i], (heads[0] + heads[1]) / 2, rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="judges samples against their condition images"):
        call_reward(reward, images, prompts, None)


@pytest.fixture(scope="module")
def videoalign(tmp_path_factory):
    norm = {"VQ_mean": 0.1, "VQ_std": 2.0, "MQ_mean": -0.2, "MQ_std": 0.5, "TA_mean": 0.3, "TA_std": 1.5}
    return save_tiny_videoalign(tmp_path_factory.mktemp("tiny-videoalign"), inference_config=norm), norm


def test_video_patches_match_the_image_processor():
    """Two equal frames give exactly the image processor's patches of that frame (its temporal patch repeats the
    image): the clip layout (t, h-blocks, w-blocks, merge, merge | C, temporal, patch, patch) is the tower's."""
    from transformers import Qwen2VLImageProcessorPil

    from rewards.qwen_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, patchify_frames

    frame = quantised(1, 56, 84)[0]
    processed = Qwen2VLImageProcessorPil(do_resize=False)(images=[pil(frame)], return_tensors="np")
    normalised = (frame.double().numpy() - np.array(OPENAI_CLIP_MEAN)[:, None, None]) / np.array(
        OPENAI_CLIP_STD)[:, None, None]
    patches, grid = patchify_frames(np.stack([normalised, normalised]), 14, 2, 2)
    assert grid == processed["image_grid_thw"][0].tolist() == [1, 4, 6]
    np.testing.assert_allclose(patches, processed["pixel_values"], atol=1e-5)


def test_videoalign_matches_peft_model_and_hand_head(videoalign):
    """The merged LoRA (W + s·B·A) against PEFT's own unmerged LoRA layers on the same files, the head by hand."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    folder, norm = videoalign
    base = folder / "base"
    (reward,) = load_rewards([f"videoalign,path={folder},base={base},fps=8"])
    assert reward.video
    clips, prompts = quantised(2, 20, 24).unsqueeze(1).repeat(1, 9, 1, 1, 1), ["a cat runs", "rain"]
    clips = clips + 0.3 * quantised(18, 20, 24, seed=3).view(2, 9, 3, 20, 24)  # frames differ
    clips = clips.clamp(0, 1)
    columns = {}
    raw = score_samples([reward], clips, prompts, torch.arange(2), columns=columns)[:, 0].numpy()

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VIDEOALIGN_TOKENS)})
    model = Qwen2VLForConditionalGeneration.from_pretrained(base).eval()
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    non_lora = torch.load(folder / "checkpoint-7" / "non_lora_state_dict.pth", weights_only=True)
    model.model.language_model.embed_tokens.weight.data.copy_(
        non_lora["base_model.model.model.language_model.embed_tokens.weight"])
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TINY_LORA_TARGETS), model)
    adapter = load_file(folder / "checkpoint-7" / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, {k.removeprefix("base_model.model."): v for k, v in adapter.items()})
    assert not result.unexpected_keys
    head = non_lora["base_model.model.rm_head.weight"].double().numpy()
    mean = np.array([norm["VQ_mean"], norm["MQ_mean"], norm["TA_mean"]])
    std = np.array([norm["VQ_std"], norm["MQ_std"], norm["TA_std"]])
    for i, prompt in enumerate(prompts):
        # 9 frames at 8 fps resampled at the checkpoint's 2 fps: 2.25 -> at least 4 frames, linspace-rounded.
        assert reward.score.frame_count(9) == 4
        pixel_values, grid = reward.score.video_inputs(clips[i])
        assert grid[0] == 2
        text = SYSTEM + "<|vision_start|>" + "<|video_pad|>" * (int(np.prod(grid)) // 4) + "<|vision_end|>" + \
            VIDEOALIGN_PROMPT.format(text_prompt=prompt) + ASSISTANT
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        video_token = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        with torch.no_grad():
            hidden = model.model(input_ids=ids, mm_token_type_ids=2 * (ids == video_token).long(),
                                 pixel_values_videos=pixel_values, video_grid_thw=torch.tensor([grid])
                                 ).last_hidden_state[0].double().numpy()
        positions = [ids[0].tolist().index(t) for t in tokenizer.convert_tokens_to_ids(list(VIDEOALIGN_TOKENS))]
        dims = (np.einsum("kh,kh->k", hidden[positions], head) - mean) / std  # token k through output k
        for k, name in enumerate(["visual_quality", "motion_quality", "text_alignment"]):
            np.testing.assert_allclose(columns[f"videoalign_{name}"][i], dims[k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(raw[i], dims.sum(), rtol=1e-4, atol=1e-5)


def test_video_reward_refuses_images(videoalign):
    folder, _ = videoalign
    (reward,) = load_rewards([f"videoalign,path={folder},base={folder / 'base'}"])
    with pytest.raises(UserError, match="'videoalign' scores whole video clips .* use it with a video model"):
        score_samples([reward], quantised(2, 16, 16), ["a", "b"], torch.arange(2))


def test_video_reward_on_an_image_model_stops_before_anything_is_written(videoalign, tmp_path):
    from conftest import script_error

    folder, _ = videoalign
    out = tmp_path / "run"
    message = script_error("algos/grpo.py", "--preset", "tiny", "--output-dir", out, "--reward",
                           f"videoalign,path={folder},base={folder / 'base'}")
    assert message.startswith("error: reward 'videoalign' scores video clips, but --model flux1 makes images; "
                              "choose a video model: wan, ")
    assert not out.exists()
