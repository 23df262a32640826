"""The VLM judge (rewards/vlm_judge.py) against this package's OpenAI-compatible server (rewards/vlm_server.py) on
127.0.0.1, serving a tiny random Qwen2-VL: its scores equal P(yes) computed here from the same model called
directly (own prompt string, float64 softmax), for text-to-image and edit questions and a top-K that drops tokens;
the one-line errors for a server that is down, too slow, serving another model or answering without log-probs."""

import contextlib
import functools
import io
import json
import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from common.utils import UserError
from conftest import REPO, SLOW, free_port, script_error
from rewards import load_rewards, score_samples
from rewards.server import JsonHandler, RewardServer
from rewards.vlm_judge import p_yes
from rewards.vlm_server import Judge, build_tiny_judge, make_judge_server

QUESTION = "Is there {prompt} here? Answer yes or no."


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-judge")
    build_tiny_judge(folder)
    return folder


class serving:
    """The judge server of `judge` in a thread on a free port of 127.0.0.1."""

    def __init__(self, judge, name="tiny-judge", max_logprobs=20):
        self.server = make_judge_server(judge, name, "127.0.0.1", 0, max_logprobs)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def judge(judge_dir):
    return Judge(str(judge_dir))


def images_on_grid(count, seed=0, size=36):
    """Random images on the 1/255 grid, so that the PNG round trip is lossless."""
    return torch.randint(0, 256, (count, 3, size, size), generator=torch.Generator().manual_seed(seed)).float() / 255


@functools.cache
def _loaded(judge_dir):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    return (Qwen2VLForConditionalGeneration.from_pretrained(judge_dir).eval(), AutoTokenizer.from_pretrained(judge_dir),
            Qwen2VLImageProcessorPil.from_pretrained(judge_dir))


def direct_p_yes(judge_dir, images: list[torch.Tensor], question: str, k: int) -> float:
    """P(yes) from the model called here: the Qwen2-VL chat string written out, the image processor, a float64
    softmax over the whole vocabulary, then the top-k tokens' yes/no mass (0.5 when neither is among them)."""
    from PIL import Image

    model, tokenizer, processor = _loaded(judge_dir)
    pil = [Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for image in images]
    vision = processor(images=pil, return_tensors="pt")
    pads = "".join("<|vision_start|>" + "<|image_pad|>" * (int(g.prod()) // 4) + "<|vision_end|>"
                   for g in vision["image_grid_thw"])
    ids = tokenizer(f"<|im_start|>user\n{pads}{question}<|im_end|>\n<|im_start|>assistant\n",
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"],
                       mm_token_type_ids=(ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()).logits
    logits = logits[0, -1].double().numpy()
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = set(np.argsort(-probs)[:k].tolist())
    words = {i: tokenizer.decode([i]).strip().lower() for i in top}
    yes, no = (sum(probs[i] for i in top if words[i] == w) for w in ("yes", "no"))
    return 0.5 if yes + no == 0 else yes / (yes + no)


@pytest.mark.parametrize("k, edit", [(1000, False), (4, False), (1000, True)])
def test_scores_are_the_models_p_yes(judge_dir, judge, k, edit):
    vocab = len(judge.tokenizer)
    images, prompts = images_on_grid(4, seed=1), ["a red cube", "two dogs", "a red cube", "the sea"]
    conditions = [[c] for c in images_on_grid(4, seed=2, size=44)] if edit else None
    with serving(judge, max_logprobs=vocab) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},question={QUESTION},top_logprobs={min(k, vocab)},"
                                  f"connections=3" + (",conditions=true" if edit else "")])
        assert reward.wants_conditions == edit and reward.score.thread_safe and reward.score.model == "tiny-judge"
        if edit:  # score_samples reads condition files; the reward takes the tensors themselves
            got = reward.score(images, prompts, conditions)["score"]
        else:
            got = score_samples([reward], images, prompts, torch.zeros(4))[:, 0].tolist()
        assert server.server.requests_served == 1 + 4  # the load-time test question, then one per sample
    expected = [direct_p_yes(judge_dir, (conditions[i] if edit else []) + [images[i]],
                             QUESTION.replace("{prompt}", prompts[i]), k) for i in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if k > vocab:  # the whole vocabulary: the test sees scores that depend on the image, not a constant
        assert max(expected) - min(expected) > 0.1 and 0.5 not in expected


def test_p_yes_normalises_in_log_space():
    pairs = [("Yes", -1000.0), (" yes", -1002.0), (" NO", -1001.0), ("no", -1003.5), ("maybe", -0.01)]
    log_yes, log_no = np.logaddexp(-1000.0, -1002.0), np.logaddexp(-1001.0, -1003.5)
    assert p_yes(pairs) == pytest.approx(float(np.exp(log_yes - np.logaddexp(log_yes, log_no))), rel=1e-12)
    assert p_yes([("yes", -3.0), ("maybe", -0.1)]) == 1.0 and p_yes([(" No", -3.0)]) == 0.0
    assert p_yes([("maybe", -0.1), ("yess", -1.0)]) is None


def test_neither_token_in_the_top_k_scores_one_half_says_so_and_counts_it(judge, capfd):
    vocab = len(judge.tokenizer)
    with serving(judge, max_logprobs=vocab) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},top_logprobs={vocab},retries=0"])
        judge_top = judge.top_logprobs
        # what a judge that does not answer yes/no gives, for the samples about "b"
        judge.top_logprobs = lambda messages, k, *rest: [("maybe", -0.1)] if "\"b\"" in str(messages) \
            else judge_top(messages, k, *rest)
        try:
            got = reward.score(images_on_grid(3), ["a", "b", "c"])
        finally:
            judge.top_logprobs = judge_top
    assert got["score"][1] == 0.5 and got["imputed"] == [0.0, 1.0, 0.0]  # logged per epoch as the imputed share
    assert f"neither yes nor no among the top {vocab} tokens" in capfd.readouterr().err


def test_the_judge_scores_micro_batches_concurrently_while_the_rollout_goes_on(judge):
    from common.scoring import RolloutScoring

    images, prompts = images_on_grid(8, seed=4), [f"thing {i}" for i in range(8)]
    with serving(judge) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},connections=4"])
        expected = score_samples([reward], images, prompts, torch.zeros(8))
        judge_top = judge.top_logprobs
        in_flight, most = [0], [0]
        lock = threading.Lock()

        def slow_top_logprobs(messages, k, *rest):  # counts the requests being answered at once
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            time.sleep(0.3)
            with lock:
                in_flight[0] -= 1
            return judge_top(messages, k, *rest)

        judge.top_logprobs = slow_top_logprobs
        try:
            scoring = RolloutScoring([reward], prompts, torch.zeros(8), workers=2)
            for s in range(0, 8, 4):  # two micro-batches, scored by the reward workers
                scoring.submit(images[s:s + 4])
            got = scoring.collect()
        finally:
            judge.top_logprobs = judge_top
    # `connections` requests in flight at once (one at a time: 1), whatever the machine's load
    assert torch.equal(got, expected) and most[0] >= 2, most[0]


def test_server_down_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError) as info:
        load_rewards([f"vlm_judge,url={url},retries=1,backoff=0.05,timeout=2"])
    message = str(info.value)
    assert message.startswith(f"judge server {url} is not reachable") and "after 2 tries" in message
    assert "vllm serve" in message and "\n" not in message


def test_a_judge_slower_than_the_timeout_is_reported_as_stuck(judge):
    with serving(judge) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},retries=1,backoff=0.05,timeout=0.3"])
        judge_top = judge.top_logprobs
        judge.top_logprobs = lambda messages, k, *rest: (time.sleep(0.6), judge_top(messages, k, *rest))[1]
        try:
            with pytest.raises(UserError, match=f"judge server {server.url} did not answer /v1/chat/completions "
                                                r"\(no answer within 0.3 s.*\) after 2 tries; it is running but stuck"):
                score_samples([reward], images_on_grid(1), ["a"], torch.zeros(1))
        finally:
            judge.top_logprobs = judge_top


def test_wrong_model_and_too_many_logprobs_are_one_line(judge):
    with serving(judge) as server:
        with pytest.raises(UserError, match=f"judge server {server.url} does not serve model 'other'; it serves: "
                                            "tiny-judge"):
            load_rewards([f"vlm_judge,url={server.url},model=other"])
        url = server.url + "/v1"  # as OpenAI clients take it
        with pytest.raises(UserError, match=f"judge server {url} refused a test question: server {url} answered 400: "
                                            "top_logprobs must be an integer from 0 to 20"):
            load_rewards([f"vlm_judge,url={url},top_logprobs=21"])
    with pytest.raises(UserError, match="the vlm_judge question 'Is it red' has no {prompt}"):
        load_rewards(["vlm_judge,url=http://127.0.0.1:1,question=Is it red"])
    with pytest.raises(UserError, match="vlm_judge question_file=/nonexistent/q.txt: cannot read it"):
        load_rewards(["vlm_judge,url=http://127.0.0.1:1,question_file=/nonexistent/q.txt"])
    with pytest.raises(UserError, match="vlm_judge option conditions= takes true or false, got 'yes'"):
        load_rewards(["vlm_judge,url=http://127.0.0.1:1,conditions=yes"])


class _NoLogprobs(JsonHandler):
    """An OpenAI-compatible server that ignores `logprobs` (as some do)."""

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):
        self._read_json()
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes"},
                                      "logprobs": None}]})


def test_an_answer_without_logprobs_is_one_line():
    server = RewardServer(("127.0.0.1", 0), _NoLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(UserError) as info:
            load_rewards([f"vlm_judge,url={url}"])
    finally:
        server.shutdown()
        server.server_close()
    message = str(info.value)
    assert message.startswith(f"judge server {url} answered without top log-probabilities (") and "\n" not in message
    assert "--max-logprobs" in message


class _Scripted(JsonHandler):
    """An OpenAI-compatible server of model "m" whose answers the test sets through `server.answer`: the "model"
    it names and the (token, log-probability) pairs of its top log-probabilities."""

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):
        self._read_json()
        model, top = self.server.answer["model"], [{"token": t, "logprob": lp} for t, lp in self.server.answer["top"]]
        self._send(200, {"model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                      "logprobs": {"content": [{**top[0], "top_logprobs": top}]}}]})


@contextlib.contextmanager
def scripted(model="m", top=(("Yes", -0.2), ("No", -1.8))):
    server = RewardServer(("127.0.0.1", 0), _Scripted)
    server.answer = {"model": model, "top": list(top)}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.answer
    finally:
        server.shutdown()
        server.server_close()


def test_another_model_answering_mid_run_stops_the_run():
    with scripted() as (url, answer):
        (reward,) = load_rewards([f"vlm_judge,url={url}"])
        assert reward.score(images_on_grid(2), ["a", "b"])["score"] == [pytest.approx(1 / (1 + math.exp(-1.6)))] * 2
        answer["model"] = "m-v2"  # e.g. the server restarted with another checkpoint, or a load balancer's other one
        with pytest.raises(UserError) as info:
            reward.score(images_on_grid(2), ["a", "b"])
    message = str(info.value)
    assert message.startswith(f"judge server {url} answered as model 'm-v2', but as 'm' at load")
    assert "\n" not in message


def test_the_load_time_question_needs_a_yes_or_no():
    with scripted(top=[("maybe", -0.1), ("Sure", -2.5)]) as (url, _):
        with pytest.raises(UserError) as info:
            load_rewards([f"vlm_judge,url={url},top_logprobs=2"])
    message = str(info.value)
    assert message.startswith(f"judge server {url} (m) answered the test question") and "\n" not in message
    assert "with neither yes nor no among its top 2 tokens" in message


def test_answers_without_yes_or_no_stop_the_run_after_max_neither_in_a_row(capfd):
    with scripted() as (url, answer):
        (reward,) = load_rewards([f"vlm_judge,url={url}"])
        answer["top"] = [("maybe", -0.1)]
        got = reward.score(images_on_grid(63, size=8), ["a"] * 63)  # 63 in a row: still under max_neither=64
        assert got == {"score": [0.5] * 63, "imputed": [1.0] * 63}
        assert "neither yes nor no among the top 20 tokens" in capfd.readouterr().err
        answer["top"] = [("no", -0.1)]
        assert reward.score(images_on_grid(1, size=8), ["a"]) == {"score": [0.0], "imputed": [0.0]}  # resets the count
        answer["top"] = [("maybe", -0.1)]
        reward.score(images_on_grid(63, size=8), ["a"] * 63)
        with pytest.raises(UserError) as info:  # the 64th: a constant reward, which would train nothing
            score_samples([reward], images_on_grid(1, size=8), ["a"], torch.zeros(1))
    message = str(info.value)
    assert message.startswith(f"judge server {url} (m) answered 64 questions in a row with neither yes nor no") \
        and "\n" not in message and "max_neither=" in message


@SLOW
def test_server_command_line(judge_dir):
    command = [sys.executable, "-m", "rewards.vlm_server", "--model-path", str(judge_dir), "--port", "0",
               "--served-model-name", "judge"]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline()
            assert "serving judge 'judge' on http://127.0.0.1:" in line, line or process.stderr.read()
            (reward,) = load_rewards([f"vlm_judge,url={line.split(' on ')[-1].strip()},top_logprobs=5"])
            (score,) = reward.score(images_on_grid(1), ["a cat"])["score"]
            assert 0 <= score <= 1 and math.isfinite(score) and json.dumps(score)
        finally:
            process.terminate()


# ---- evaluate.py --benchmark geneval2 ----------------------------------------------------------------------------

def evaluate_here(*args) -> str:
    """evaluate.py's output for `args`, run in this process (its imports are paid already; the script's command
    line itself is tested by test_evaluate.py)."""
    import evaluate

    saved = sys.argv, sys.excepthook
    sys.argv = ["evaluate.py", *map(str, args)]
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            evaluate.main()
    finally:
        sys.argv, sys.excepthook = saved
    return printed.getvalue()


def test_geneval2_on_a_tiny_flux_against_an_independent_aggregation(tmp_path, judge_dir, judge, tiny_flux_path):
    from PIL import Image

    atoms = ["Is there a cube?", "Is it red?"]
    lines = [{"prompt": "a red cube", "category": "attribute", "atoms": atoms, "seeds": [0, 5]},
             {"prompt": "two dogs", "category": "count", "atoms": ["Are there dogs?", "Are there two?", "Yes?"],
              "seed": 7},
             {"prompt": "a red cube", "category": "again", "atoms": atoms, "seeds": [5]}]  # a pinned seed, again
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    vocab, out = len(judge.tokenizer), tmp_path / "bench"
    judge_top = judge.top_logprobs
    # the atom "Yes?" gets an answer with neither yes nor no: imputed as 0.5, and counted
    judge.top_logprobs = lambda messages, k, *rest: [("maybe", -0.1)] if "Yes?" in str(messages) \
        else judge_top(messages, k, *rest)
    try:
        with serving(judge, max_logprobs=vocab) as server:
            printed = evaluate_here("--benchmark", "geneval2", "--benchmark-prompts", prompts, "--model", "flux1",
                                    "--model-path", "tiny", "--max-sequence-length", "32", "--eval-num-steps", "2",
                                    "--batch-size", "1", "--reward",
                                    f"vlm_judge,url={server.url},top_logprobs={vocab}", "--benchmark-dir", out,
                                    "--output", tmp_path / "summary.json")
            assert server.server.requests_served == 1 + 2 * 2 + 3 + 2  # the test question, then one per atom
    finally:
        judge.top_logprobs = judge_top
    result = json.loads((out / "base-geneval2.json").read_text())
    samples = [(i, x) for i, p in enumerate(result["prompts"]) for x in p["samples"]]
    assert [(i, x["seed"]) for i, x in samples] == [(0, 0), (0, 5), (1, 7), (2, 5)]
    # each atom is the judge's P(yes) for the sample written out, computed here from the model itself
    for i, x in samples:
        image = torch.from_numpy(np.array(Image.open(out / "base-geneval2" / f"{i:04d}_seed{x['seed']}.png")))
        image = image.permute(2, 0, 1).float() / 255
        expected = [0.5 if q == "Yes?" else direct_p_yes(judge_dir, [image], q, vocab) for q in lines[i]["atoms"]]
        np.testing.assert_allclose(x["atoms"], expected, rtol=1e-5, atol=1e-6)
        assert x["imputed"] == lines[i]["atoms"].count("Yes?")
    assert (result["imputed_atoms"], result["atoms"]) == (1, 9)
    assert samples[1][1]["atoms"] == samples[3][1]["atoms"] != samples[0][1]["atoms"]  # pinned: same seed, same image

    # Soft-TIFA: per sample the mean, the geometric mean and all-atoms-yes; per prompt the mean over its seeds; the
    # aggregate and each category the mean over prompts ± the standard error over prompts
    def per_prompt(p):
        a = [np.asarray(x["atoms"], dtype=np.float64) for x in p["samples"]]
        return {"soft": np.mean([v.mean() for v in a]), "gm": np.mean([np.exp(np.log(v).mean()) for v in a]),
                "strict": np.mean([float((v > 0.5).all()) for v in a])}

    scores = [per_prompt(p) for p in result["prompts"]]
    for metric in ("soft", "gm", "strict"):
        values = np.array([s[metric] for s in scores])
        assert result["tables"]["all"][metric] == pytest.approx(values.mean(), abs=1e-12)
        assert result["tables"]["all"][metric + "_se"] == pytest.approx(values.std(ddof=1) / np.sqrt(3), abs=1e-12)
        assert result[f"geneval2_{metric}"] == result["tables"]["all"][metric]
        cells = result["tables"]["categories"]
        assert cells["attribute"][metric] == pytest.approx(values[0], abs=1e-12) and cells["count"][metric + "_se"] == 0
    assert 0 < result["tables"]["all"]["soft"] < 1 and len({round(s["soft"], 6) for s in scores[:2]}) == 2
    table = (out / "base-geneval2.md").read_text()
    assert table in printed and f"| all | 3 | {result['geneval2_soft']:.4f} ± {result['geneval2_soft_se']:.4f} |" \
        in table and "| again | 1 |" in table
    assert f"imputed atoms: 1 of 9 (the judge's answer held neither yes nor no among its top {vocab} tokens" in table
    (summary,) = json.loads((tmp_path / "summary.json").read_text())
    assert summary["geneval2_gm"] == result["geneval2_gm"] and "prompts" not in summary


def test_geneval2_bad_input_is_one_line(tmp_path):
    from common.benchmarks import load_geneval2

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat", "category": "object", "atoms": [], "seeds": [1, 1]}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:1: needs \"atoms\" \(a non-empty list of yes/no questions\), "
                                        r"\"seed\" or \"seeds\" \(distinct"):
        load_geneval2(bad)
    assert len(load_geneval2(REPO / "data" / "geneval2" / "example.jsonl")) == 10  # the shipped example reads
    assert "asks its atoms through a VLM judge: give --reward vlm_judge,url=" in script_error(
        "evaluate.py", "--benchmark", "geneval2", "--model-path", "tiny")
    assert "unknown --benchmark 'geneval3'; choose from: geneval2" in script_error(
        "evaluate.py", "--benchmark", "geneval3")
