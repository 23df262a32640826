"""The reward-hacking guard (common/guard.py, docs/guard.md): its rule on hand-written evaluation sequences, the
prompt gap, and end to end on the tiny FLUX.1 — a rollback restores exactly what --resume would, a run stopped by
the guard and resumed does not act twice on one event, the judges' best checkpoints survive rotation, bad flags."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.guard import Guard, judge_key, prompt_gap_notes
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, script_error


def evaluation(reward: float, **judges) -> dict:
    """Metrics of one evaluation: the training reward's eval mean and, per judge, (value, standard error)."""
    metrics = {"eval_reward_mean": reward}
    for name, (value, se) in judges.items():
        metrics[judge_key(name)], metrics[judge_key(name) + "_se"] = value, se
    return metrics


def fired(guard: Guard, sequence: list[dict]) -> list[int]:
    """The indices of the evaluations at which the guard found some judge hacked."""
    return [k for k, metrics in enumerate(sequence) if guard.observe(k - 1, metrics)[0]]


def test_fires_after_patience_evaluations_below_the_margin_while_the_reward_rises():
    # best 0.5 ± 0.05 at the first evaluation; 2 standard errors of the difference: 2·√(0.05² + 0.05²) = 0.1414
    sequence = [evaluation(0.1, j=(0.5, 0.05)), evaluation(0.2, j=(0.30, 0.05)), evaluation(0.3, j=(0.30, 0.05)),
                evaluation(0.4, j=(0.30, 0.05)), evaluation(0.5, j=(0.30, 0.05)), evaluation(0.6, j=(0.30, 0.05))]
    assert fired(Guard(["j"], patience=2), sequence) == [2, 4]  # a new streak after each event
    assert fired(Guard(["j"], patience=1), sequence) == [1, 2, 3, 4, 5]
    assert fired(Guard(["j"], patience=3), sequence) == [3]


def test_event_says_what_it_compared():
    guard = Guard(["j"], patience=2)
    guard.observe(-1, evaluation(0.1, j=(0.5, 0.05)))
    guard.observe(0, evaluation(0.2, j=(0.3, 0.04)))
    (event,), _ = guard.observe(10, evaluation(0.3, j=(0.25, 0.03)))
    assert (event.judge, event.best, event.best_epoch, event.value, event.epoch, event.since_epoch) == \
        ("j", 0.5, -1, 0.25, 10, 0)
    assert (event.reward_at_best, event.reward) == (0.1, 0.3)
    assert "0.2500" in event.line() and "epoch -1" in event.line()


def test_never_on_the_first_evaluation():
    guard = Guard(["j"], patience=1, margin=0.0)
    events, new_best = guard.observe(-1, evaluation(10.0, j=(0.0, 0.0)))  # a dreadful judge, a huge reward
    assert events == [] and new_best


def test_never_on_noise_inside_the_margin():
    # 0.5 − 2·√(0.05² + 0.05²) = 0.3586: a judge at 0.36 for ever is inside the margin
    sequence = [evaluation(0.1, j=(0.5, 0.05))] + [evaluation(0.1 * k, j=(0.36, 0.05)) for k in range(2, 12)]
    assert fired(Guard(["j"], patience=1), sequence) == []
    # at a margin of 1 standard error (0.4293) the same sequence fires
    assert fired(Guard(["j"], patience=1, margin=1.0), sequence) == list(range(1, 11))


def test_not_when_the_reward_did_not_rise():
    # the judge falls but so does the training reward: a model that got worse, not a hack
    sequence = [evaluation(0.5, j=(0.5, 0.01))] + [evaluation(0.4, j=(0.2, 0.01)) for _ in range(4)]
    assert fired(Guard(["j"], patience=1), sequence) == []


def test_a_recovery_breaks_the_streak_and_a_new_best_moves_the_reference():
    guard = Guard(["j"], patience=2)
    sequence = [evaluation(0.1, j=(0.5, 0.01)), evaluation(0.2, j=(0.3, 0.01)),  # streak 1
                evaluation(0.3, j=(0.49, 0.01)),                                  # inside the margin: streak 0
                evaluation(0.4, j=(0.3, 0.01)),                                   # streak 1
                evaluation(0.5, j=(0.8, 0.01)),                                   # a new best: streak 0
                evaluation(0.6, j=(0.6, 0.01)), evaluation(0.7, j=(0.6, 0.01))]   # below the new best twice
    assert fired(guard, sequence) == [6]
    assert guard.state["j"]["best"] == 0.8 and guard.state["j"]["best_epoch"] == 3


def test_each_judge_on_its_own():
    sequence = [evaluation(0.1, a=(0.5, 0.01), b=(0.5, 0.01)), evaluation(0.2, a=(0.2, 0.01), b=(0.5, 0.01)),
                evaluation(0.3, a=(0.2, 0.01), b=(0.5, 0.01))]
    guard = Guard(["a", "b"], patience=2)
    events = [guard.observe(k - 1, m)[0] for k, m in enumerate(sequence)]
    assert [[e.judge for e in es] for es in events] == [[], [], ["a"]]
    assert guard.best_epochs() == {-1}


def test_state_round_trips_through_json():
    guard = Guard(["j"], patience=2)
    guard.observe(-1, evaluation(0.1, j=(0.5, 0.01)))
    guard.observe(0, evaluation(0.2, j=(0.3, 0.01)))  # a streak of 1 is part of the state
    guard.rollbacks, guard.kl_beta = 1, 0.1
    again = Guard(["j"], patience=2)
    again.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert again.state_dict() == guard.state_dict()
    assert again.observe(1, evaluation(0.3, j=(0.3, 0.01)))[0]  # the streak goes on: fires now, as the original


def test_prompt_gap_notes_name_the_rewards_within_noise():
    metrics = {"prompt_gap_jpeg_compressibility": 0.0, "prompt_gap_jpeg_compressibility_se": 0.0,
               "prompt_gap_toy": 0.4, "prompt_gap_toy_se": 0.05, "prompt_gap_clip": 0.01, "prompt_gap_clip_se": 0.01}
    lines = prompt_gap_notes(metrics)
    assert len(lines) == 2 and "'clip'" in lines[0] and "'jpeg_compressibility'" in lines[1]
    assert all(line.startswith("note: ") and "\n" not in line for line in lines)


# ---- end to end on the tiny FLUX.1: trained on JPEG compressibility, judged by incompressibility (its negation on
# the same images), so every rise of the reward is a fall of the judge and the guard must act -----------------------

HACK = ["--preset", "tiny", "--reward", "jpeg_compressibility", "--judge", "jpeg_incompressibility",
        "--eval-every", "1", "--eval-num-prompts", "2", "--guard-margin", "0", "--save-every", "100"]


def meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def test_rollback_restores_exactly_the_checkpoint_of_the_judges_best_evaluation(tmp_path):
    out = tmp_path / "run"
    run_script("algos/grpo.py", *HACK, "--epochs", "6", "--guard", "rollback", "--guard-patience", "1",
               "--guard-max-rollbacks", "5", "--keep-checkpoints", "20", "--output-dir", out)
    lines = read_metrics(out)
    rolled = [m for m in lines if "guard_rollbacks" in m]
    assert rolled, "the guard never acted: the test no longer builds a hack"
    first = rolled[0]
    assert first["guard_kl_beta"] == 0.01 and first["guard_hacking_jpeg_incompressibility"] == 1.0  # 0 → the floor
    event = meta(out / "checkpoints" / f"epoch_{first['epoch']:06d}")["guard"]["events"][0]
    assert event["action"] == "rollback" and event["epoch"] == first["epoch"]
    # The checkpoint written right after the rollback holds the state the rollback restored: file for file the
    # best evaluation's checkpoint (weights, optimizer, schedule, RNG), which is what --resume from it loads.
    after, best = (out / "checkpoints" / f"epoch_{e:06d}" for e in (first["epoch"], event["best_epoch"]))
    weights = load_file(after / "pytorch_lora_weights.safetensors")
    assert weights.keys() == load_file(best / "pytorch_lora_weights.safetensors").keys()
    assert all(torch.equal(v, load_file(best / "pytorch_lora_weights.safetensors")[k]) for k, v in weights.items())
    for name in ("training_state.pt", "rng_0.pt"):
        a, b = (torch.load(f / name, weights_only=True) for f in (after, best))
        assert _equal(a, b), name
    assert meta(after)["optimizer_steps"] == meta(best)["optimizer_steps"]
    assert meta(after)["guard"]["kl_beta"] == 0.01  # and the raised KL weight is part of the state
    # The same command resumes it (the raise is the guard's state, not a changed --kl-beta), at the raised weight.
    last = lines[-1]["epoch"]
    run_script("algos/grpo.py", *HACK, "--epochs", str(last + 2), "--guard", "rollback", "--guard-patience", "1",
               "--guard-max-rollbacks", "5", "--keep-checkpoints", "20", "--output-dir", out, "--resume")
    resumed = meta(out / "checkpoints" / f"epoch_{last + 1:06d}")
    assert resumed["args"]["kl_beta"] == 0.0 and resumed["guard"]["kl_beta"] >= 0.01


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_stop_names_the_judge_and_its_checkpoint_and_a_resume_does_not_act_twice(tmp_path):
    out = tmp_path / "run"
    stopped = run_script("algos/grpo.py", *HACK, "--epochs", "30", "--guard", "stop", "--guard-patience", "2",
                         "--output-dir", out, check=False)
    assert stopped.returncode == 3, stopped.stderr[-2000:]
    (line,) = [x for x in stopped.stderr.splitlines() if x.startswith("error: ")]
    event = [m for m in read_metrics(out) if "guard_hacking_jpeg_incompressibility" in m]
    assert len(event) == 1
    epoch = event[0]["epoch"]
    saved = meta(out / "checkpoints" / f"epoch_{epoch:06d}")["guard"]
    best = saved["events"][0]["best_epoch"]
    assert "judge 'jpeg_incompressibility'" in line and f"at epoch {epoch}" in line and f"(epoch {best})" in line
    folder = out / "checkpoints" / f"epoch_{best:06d}"
    assert str(folder) in line and folder.is_dir()
    # Resumed for one more epoch: the event of `epoch` is not met again (its streak was spent), nothing stops.
    run_script("algos/grpo.py", *HACK, "--epochs", str(epoch + 2), "--guard", "stop", "--guard-patience", "2",
               "--output-dir", out, "--resume")
    lines = read_metrics(out)
    assert [m["epoch"] for m in lines if "guard_hacking_jpeg_incompressibility" in m] == [epoch]
    assert [m["epoch"] for m in lines][-2:] == [epoch, epoch + 1]
    final = meta(out / "checkpoints" / f"epoch_{epoch + 1:06d}")["guard"]
    assert len(final["events"]) == 1 and final["state"]["jpeg_incompressibility"]["streak"] == 1


def test_the_judges_best_checkpoint_survives_rotation(tmp_path):
    out = tmp_path / "run"
    run_script("algos/grpo.py", *HACK, "--epochs", "5", "--guard", "rollback", "--guard-patience", "100",
               "--save-every", "1", "--keep-checkpoints", "1", "--output-dir", out)
    kept = sorted(p.name for p in (out / "checkpoints").glob("epoch_*"))
    best = meta(out / "checkpoints" / "epoch_000004")["guard"]["state"]["jpeg_incompressibility"]["best_epoch"]
    assert kept == sorted({f"epoch_{best:06d}", "epoch_000004"})  # the rest rotated away


@pytest.mark.parametrize("flags, message", [
    (["--guard", "stop"], "--guard stop watches judges: give at least one --judge"),
    (["--judge", "toy", "--guard-patience", "0"], "--guard-patience must be at least 1"),
    (["--judge", "toy", "--guard-margin", "-1"], "--guard-margin must be at least 0"),
    (["--judge", "toy", "--guard-kl-factor", "0.5"], "--guard-kl-factor must be at least 1"),
    (["--judge", "toy", "--guard-kl-floor", "0"], "--guard-kl-floor must be positive"),
    (["--judge", "toy", "--guard-max-rollbacks", "0"], "--guard-max-rollbacks must be at least 1"),
    (["--judge", "toy", "--guard", "warn", "--eval-every", "0"], "--guard warn acts at evaluations"),
    (["--judge", "toy", "--guard", "often"], "often"),
    (["--judge", "nonsense"], "unknown reward 'nonsense'"),
    (["--judge", "pickscore_rank,path=tiny"], "is groupwise"),
    (["--judge", "jpeg_compressibility"], "two rewards or judges are named 'jpeg_compressibility'"),
])
def test_bad_guard_flags_get_one_line(tmp_path, flags, message):
    error = script_error("algos/grpo.py", "--preset", "tiny", "--reward", "jpeg_compressibility", *flags,
                         "--output-dir", tmp_path / "run")
    assert message in error
    assert not (tmp_path / "run").exists()


def test_rollback_needs_a_kl_weight(tmp_path):
    error = script_error("algos/opd.py", "--preset", "tiny", "--judge", "jpeg_incompressibility", "--guard",
                         "rollback", "--output-dir", tmp_path / "run")
    assert "this script has none (--kl-beta)" in error


# ---- the prompt gap on the shipped toy model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_clip(tmp_path_factory):
    """A tiny CLIPModel (the real class, rewards/clip.py's tiny layout) trained contrastively for a few hundred steps
    on the toy world's renders of its training prompts, so that its score follows the prompt (a random one does not:
    no hub here for the real CLIP)."""
    from transformers import CLIPModel, CLIPProcessor

    from worlds.toy.world import load_toy_split, render_batch
    from rewards.clip import build_tiny_clip, to_pil

    folder = tmp_path_factory.mktemp("toy-clip")
    build_tiny_clip(folder, projection_dim=64)
    model, processor = CLIPModel.from_pretrained(folder), CLIPProcessor.from_pretrained(folder)
    train, _ = load_toy_split()
    rng = np.random.default_rng(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(300):
            prompts = list(rng.choice(train, 32, replace=False))
            inputs = processor(text=prompts, images=to_pil(render_batch(prompts, rng)), return_tensors="pt",
                               padding=True)
            loss = model(**inputs, return_loss=True).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, float(loss.detach())


@SLOW
def test_prompt_gap_separates_rewards_that_follow_the_prompt(toy_clip):
    """On the untrained toy model's evaluation samples (36 held-out prompts × 2 seeds): the toy checks and a CLIP
    that knows the world score a sample higher against its own prompt than against another; JPEG size and the
    aesthetic head never read the prompt (gap exactly 0, so within noise: the run names them)."""
    from accelerate import Accelerator

    from common.cache import PromptEncoder
    from common.data import load_prompts
    from common.evaluation import evaluate_prompts
    from common.models import load_adapter
    from rewards import load_rewards

    clip, loss = toy_clip
    assert loss < 2.8  # it learned something (log 32 = 3.47 at chance; prompts of one colour share a batch)
    adapter = load_adapter("flux1", "toy", "cpu", torch.float32, resolution=32, max_sequence_length=16)
    rewards = load_rewards(["toy", f"clip,path={clip}", "jpeg_compressibility", "aesthetic,path=tiny"])
    metrics = evaluate_prompts(adapter, Accelerator(cpu=True), PromptEncoder(adapter, None), rewards,
                               load_prompts(str(REPO / "data" / "toy"), "test"), 2, 8, 36, 1.0, prompt_gap=True)
    for name in ("toy", "clip"):
        assert metrics[f"prompt_gap_{name}"] > 3 * metrics[f"prompt_gap_{name}_se"] > 0, name
    for name in ("jpeg_compressibility", "aesthetic"):
        assert metrics[f"prompt_gap_{name}"] == metrics[f"prompt_gap_{name}_se"] == 0.0, name
    notes = prompt_gap_notes(metrics)
    assert len(notes) == 2 and "'aesthetic'" in notes[0] and "'jpeg_compressibility'" in notes[1]
    # the gap is mean(own) − mean(shuffled), paired: own is the evaluation's own mean
    assert metrics["eval_reward_toy"] - metrics["prompt_gap_toy"] < metrics["eval_reward_toy"]


@SLOW
def test_rollback_on_two_processes(tmp_path):
    """The guard acts the same on every process (each has the gathered evaluation): both roll back to the best
    checkpoint, each from its own rng file, and training goes on under DDP."""
    out = tmp_path / "run"
    run_script("algos/grpo.py", *HACK, "--epochs", "6", "--guard", "rollback", "--guard-patience", "1",
               "--guard-max-rollbacks", "5", "--keep-checkpoints", "20", "--output-dir", out, launcher=ACCELERATE_2CPU)
    lines = read_metrics(out)
    rolled = [m for m in lines if "guard_rollbacks" in m]
    assert rolled and lines[-1]["epoch"] == 5 and lines[-1]["num_processes"] == 2
    event = meta(out / "checkpoints" / f"epoch_{rolled[0]['epoch']:06d}")["guard"]["events"][0]
    after, best = (out / "checkpoints" / f"epoch_{e:06d}" for e in (rolled[0]["epoch"], event["best_epoch"]))
    for name in ("training_state.pt", "rng_0.pt", "rng_1.pt"):
        assert _equal(*(torch.load(f / name, weights_only=True) for f in (after, best))), name
