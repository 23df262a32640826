"""Scores of the released `hpsv3` package (PyPI hpsv3==1.0.0) on a tiny checkpoint, for tests/test_rewards_hpsv3_reference.py.

Runs in the reference venv (.ci/install-reference-rewards.sh: transformers 4.45.2, the package's pin), not the
project's, and imports nothing of this project:

    .venv-reference/bin/python tests/reference_hpsv3.py CHECKPOINT TINY_BASE INPUTS.json

CHECKPOINT: a tiny HPSv3.safetensors in the release's layout (Qwen2VLRewardModelBT's state dict: `model.*`, `visual.*`,
`lm_head.*`, `rm_head.*`); TINY_BASE: the tiny Qwen2-VL the test built as the base (its config.json and tokenizer);
INPUTS.json: {"images": [PNG paths], "prompts": [...]}. Prints one JSON line: {"scores": [[μ, σ], ...],
"instruction": the text the package puts after the image, with `{text_prompt}`}.

The package's own code runs end to end: HPSv3RewardInferencer (hpsv3/inference.py) parses the yaml, builds the model
and processor with create_model_and_processor (train.py: AutoProcessor with right padding, the added `<|Reward|>`,
Qwen2VLRewardModelBT.from_pretrained, resize_token_embeddings), loads the checkpoint strictly, and `reward()` builds
the batch (process_vision_info of dataset/utils.py at min_pixels = max_pixels = 256·28·28, INSTRUCTION +
prompt_with_special_token of dataset/data_collator_qwen.py, the processor's chat template) and runs
Qwen2VLRewardModelBT.forward (model/qwen2vl_trainer.py). What stands in for the hub: the base model
`Qwen/Qwen2-VL-7B-Instruct` is a tiny folder written here (the test's tiny config and tokenizer in transformers
4.45.2's format, the Qwen2-VL image processor settings and chat template below, random weights that the strict load
replaces), and the yaml is the wheel's config/HPSv3_7B.yaml with model_name_or_path pointing at it and float32
instead of bfloat16 (`bf16: false`, `torch_dtype: float32`), so that the comparison holds to float32 rounding.
"""

import json
import sys
import tempfile
from pathlib import Path

import hpsv3
import torch
import yaml
from hpsv3.dataset.data_collator_qwen import INSTRUCTION, prompt_with_special_token
from hpsv3.inference import HPSv3RewardInferencer
from transformers import (
    AutoTokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
)

# Qwen/Qwen2-VL-7B-Instruct's chat_template.json, verbatim: the default system turn when the first message is not one.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen/Qwen2-VL-7B-Instruct's preprocessor_config.json pixel bounds (the package resizes before, to 256·28·28).
QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS = 3136, 12845056


def base_folder(tiny_base: Path, folder: Path) -> Path:
    """The tiny base in transformers 4.45.2's format: Qwen2VLConfig with the text settings at the top level."""
    saved = json.loads((tiny_base / "config.json").read_text())
    text, vision = saved["text_config"], saved["vision_config"]
    rope = text.get("rope_parameters") or {"rope_theta": text["rope_theta"], **text["rope_scaling"]}
    config = Qwen2VLConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"], num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"], hidden_act=text["hidden_act"],
        max_position_embeddings=text["max_position_embeddings"], rms_norm_eps=text["rms_norm_eps"],
        rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
        bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
        tie_word_embeddings=saved.get("tie_word_embeddings", False),
        vision_config={"depth": vision["depth"], "embed_dim": vision["embed_dim"], "hidden_size": vision["hidden_size"],
                       "hidden_act": vision["hidden_act"], "mlp_ratio": vision["mlp_ratio"],
                       "num_heads": vision["num_heads"], "in_chans": vision.get("in_channels", 3),
                       "patch_size": vision["patch_size"], "spatial_merge_size": vision["spatial_merge_size"],
                       "temporal_patch_size": vision["temporal_patch_size"]},
        **{key: saved[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                       "vision_end_token_id")})
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=QWEN2_VL_MIN_PIXELS, max_pixels=QWEN2_VL_MAX_PIXELS),
        tokenizer=AutoTokenizer.from_pretrained(tiny_base), chat_template=QWEN2_VL_CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


def main(checkpoint: str, tiny_base: str, inputs: str) -> None:
    request = json.loads(Path(inputs).read_text())
    with tempfile.TemporaryDirectory() as work:
        base = base_folder(Path(tiny_base), Path(work) / "Qwen2-VL-7B-Instruct")
        settings = yaml.safe_load((Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml").read_text())
        settings.update(model_name_or_path=str(base), bf16=False, torch_dtype="float32")
        config_path = Path(work) / "HPSv3_7B.yaml"
        config_path.write_text(yaml.safe_dump(settings))
        inferencer = HPSv3RewardInferencer(config_path=str(config_path), checkpoint_path=checkpoint, device="cpu")
        with torch.no_grad():
            scores = inferencer.reward(request["images"], request["prompts"])
    print(json.dumps({"scores": scores.double().tolist(), "instruction": INSTRUCTION + prompt_with_special_token}))


if __name__ == "__main__":
    main(*sys.argv[1:])
