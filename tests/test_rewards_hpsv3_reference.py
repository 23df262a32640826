"""HPSv3 against the released `hpsv3` package (PyPI hpsv3==1.0.0): the instruction pinned to the released text (fast
tier), and the scores of `--reward hpsv3` equal to the package's own inferencer on the same tiny checkpoint (full
tier; the package runs in the reference venv that .ci/install-reference-rewards.sh makes, through
tests/reference_hpsv3.py)."""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SLOW
from PIL import Image

from rewards import load_rewards, score_samples
from rewards.qwen_vl import HPSV3_INSTRUCTION, save_tiny_qwen_vl

REFERENCE_PYTHON = REPO / ".venv-reference" / "bin" / "python"

# hpsv3==1.0.0's hpsv3/dataset/data_collator_qwen.py: the block of INSTRUCTION that the fork's text lacked, and the
# SHA-256 of INSTRUCTION + prompt_with_special_token (what its inferencer sends after the image).
RELEASED_TEXT_ALIGNMENT = """
**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}
"""  # the trailing spaces are the released text's
RELEASED_SHA256 = "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"


def test_hpsv3_instruction_is_the_released_text():
    assert RELEASED_TEXT_ALIGNMENT in HPSV3_INSTRUCTION
    assert hashlib.sha256(HPSV3_INSTRUCTION.encode()).hexdigest() == RELEASED_SHA256
    filled = HPSV3_INSTRUCTION.format(text_prompt="a {red} cat")
    assert filled.count("a {red} cat") == 1
    assert filled.endswith("Textual prompt - a {red} cat\n\n\n\nPlease provide the overall ratings of this image: "
                           "<|Reward|>\n\nEND\n")


def require_reference_venv() -> None:
    """Skip when the reference venv is missing, naming the command that makes it; under CI (`CI=true`) fail instead,
    so that CI's coverage never shrinks silently (.ci/run makes it)."""
    if REFERENCE_PYTHON.exists():
        return
    message = ("needs the reference venv .venv-reference with the hpsv3 package: "
               "`bash .ci/install-reference-rewards.sh` (as .ci/run does)")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and this test {message}")
    pytest.skip(message)


def release_key(key: str) -> str:
    """A transformers 5 key of Qwen2VLForConditionalGeneration under its transformers 4.45 name, the names of the
    released HPSv3.safetensors (Qwen2VLRewardModelBT saved by the package's pinned transformers)."""
    if key.startswith("model.language_model."):
        return "model." + key.removeprefix("model.language_model.")
    return key.removeprefix("model.") if key.startswith("model.visual.") else key


def save_tiny_release(folder: Path) -> tuple[Path, Path]:
    """A tiny random HPSv3 in the release's layout: `HPSv3.safetensors` with the 4.45 key names and the package's
    rm_head (hidden→1024→16→2: HPSv3_7B.yaml's ranknet without rm_head_kwargs), and its base folder."""
    from safetensors.torch import load_file, save_file

    state = load_file(save_tiny_qwen_vl(folder, "Qwen2VLModel", ("<|Reward|>",), ("rm_head.",), seed=3,
                                        head_widths=(1024, 16)))
    checkpoint = folder / "HPSv3.safetensors"
    save_file({release_key(key): value for key, value in state.items()}, checkpoint)
    return checkpoint, folder / "base"


@SLOW
def test_hpsv3_equals_the_hpsv3_package(tmp_path):
    require_reference_venv()
    checkpoint, base = save_tiny_release(tmp_path)
    # Pairs of one size each (a square and two not: smart_resize's rounding); prompts of different lengths in each
    # pair, so that both sides pad on the right.
    generator = torch.Generator().manual_seed(0)
    sizes = ((32, 48), (32, 48), (40, 40), (40, 40), (64, 32), (64, 32))
    images = [torch.randint(0, 256, (3, height, width), generator=generator, dtype=torch.uint8)
              for height, width in sizes]
    prompts = ["a cat", "two dogs on the grass at night, {in} the style of an oil painting", "x", "a red cube",
               "three birds", "y"]
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"image{i}.png"))
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(paths[-1])
    (tmp_path / "inputs.json").write_text(json.dumps({"images": paths, "prompts": prompts}))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(REFERENCE_PYTHON), str(REPO / "tests" / "reference_hpsv3.py"), str(checkpoint),
                             str(base), str(tmp_path / "inputs.json")], check=False, capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    reference = json.loads(result.stdout.strip().splitlines()[-1])
    assert reference["instruction"] == HPSV3_INSTRUCTION

    (reward,) = load_rewards([f"hpsv3,path={checkpoint},base={base},batch_size=2"])
    ours = torch.cat([score_samples([reward], torch.stack(images[i:i + 2]).float() / 255, prompts[i:i + 2],
                                    torch.arange(2))[:, 0] for i in range(0, len(images), 2)])
    expected = np.array(reference["scores"])[:, 0]  # (μ, σ): μ is the score
    # The margin means something: the images' scores differ by far more than float32 rounding.
    assert np.ptp(expected) > 1e-4
    np.testing.assert_allclose(ours.double().numpy(), expected, rtol=0, atol=1e-6)
