"""algos/opd.py: ℓ against float64 closed forms, the invariants of docs/algorithms.md §8 on the tiny FLUX.1 (student =
teacher ⇒ L = 0 and ∇L = 0; the base as teacher ⇒ grpo's KL; teachers independent of each other's rows), routing and
bad input, learning on tiny, resume after SIGKILL, two processes, and the models the matrix does not run it on."""

import importlib.util
import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, script_error

TINY = ["--preset", "tiny"]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}


def _script():
    spec = importlib.util.spec_from_file_location("opd_script", REPO / "algos" / "opd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- ℓ against float64 closed forms ---------------------------------------------------------------------------
def _closed_form(dynamics, x, v_s, v_t, sigma, sigma_next, eta, sigma_1):
    """ℓ in float64 from §8's closed forms: the x terms cancel, so μ_S − μ_T = c·(v_S − v_T)."""
    dt = sigma_next - sigma
    gap = ((v_s - v_t) ** 2).reshape(len(x), -1).mean(1)
    if dynamics == "ode":
        return 0.5 * dt ** 2 * gap
    if dynamics == "flow-sde":
        s = eta * math.sqrt(sigma / (1 - (sigma_1 if sigma >= 1 else sigma)))
        c, var = dt * (1 + s ** 2 * (1 - sigma) / (2 * sigma)), s ** 2 * -dt
    elif dynamics == "dance-sde":
        c, var = dt * (1 + eta ** 2 * (1 - sigma) / (2 * sigma)), eta ** 2 * -dt
    else:  # cps: μ = (1 − σ')(x − σv) + √(σ'² − S²)(x + (1 − σ)v)
        std = sigma_next * math.sin(eta * math.pi / 2)
        c, var = -(1 - sigma_next) * sigma + math.sqrt(sigma_next ** 2 - std ** 2) * (1 - sigma), std ** 2
    return 0.5 * c ** 2 * gap / var


@pytest.mark.parametrize("dynamics", ["ode", "flow-sde", "dance-sde", "cps"])
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.8), (0.6, 0.45), (0.2, 0.05)])
def test_loss_equals_the_float64_closed_form(dynamics, sigma, sigma_next):
    opd = _script()
    rng = np.random.default_rng(0)
    x, v_s, v_t = (rng.standard_normal((3, 4, 8, 8)) for _ in range(3))
    eta = 0.7
    means = [opd.sde_step(dynamics, torch.tensor(v, dtype=torch.float32), torch.tensor(x, dtype=torch.float32), sigma,
                          sigma_next, eta, prev_sample=torch.tensor(x, dtype=torch.float32))
             for v in (v_s, v_t)]
    loss = opd.opd_loss(dynamics, means[0][2], means[1][2], means[0][3])
    expected = _closed_form(dynamics, x, v_s, v_t, sigma, sigma_next, eta, 0.8)
    assert loss.shape == (3,) and (loss >= 0).all()
    np.testing.assert_allclose(loss.double().numpy(), expected, rtol=2e-5)


def test_the_variance_is_clamped_and_ode_divides_by_one():
    opd = _script()
    mean, teacher = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.equal(opd.opd_loss("ode", mean, teacher, torch.zeros(2, 1)), torch.full((2,), 0.5))
    assert torch.allclose(opd.opd_loss("cps", mean, teacher, torch.zeros(())), torch.full((2,), 0.5e8))


# ---- the invariants on the tiny FLUX.1 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_flux_path, tmp_path_factory):
    """The tiny FLUX.1 with a fresh student LoRA ("default", B = 0) and LoRA files of two teachers: `base` (B = 0,
    i.e. the base model) and `other` (random B)."""
    from peft.utils import get_peft_model_state_dict

    from common.cache import PromptEncoder
    from common.models import load_adapter
    from common.training import add_lora

    torch.manual_seed(0)
    adapter = load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 64, 32)
    transformer = adapter.transformer
    add_lora(transformer, 8, 8, adapter.lora_target_modules)
    folders = {}
    for name in ("base", "other"):
        folder = tmp_path_factory.mktemp(f"teacher-{name}")
        state = get_peft_model_state_dict(transformer, adapter_name="default")
        if name == "other":
            state = {k: v + 0.3 * torch.randn_like(v) if "lora_B" in k else v for k, v in state.items()}
        adapter.save_lora(folder, state)
        folders[name] = folder
    cond = PromptEncoder(adapter, None)(["a red cat", "a dog", "a blue car", "a tree"])
    return adapter, transformer, folders, cond


def _teachers(opd, tiny, names):
    adapter, transformer, folders, _ = tiny
    for name in list(transformer.peft_config):
        if name.startswith("teacher_"):
            transformer.delete_adapters(name)
    return [opd.Teacher(opd.TeacherSpec(n, folders[f], 1.0, None), folders[f], adapter, transformer, 3.5)
            for n, f in names]


def _state(adapter):
    from common.sampling import sample_generators

    return adapter.noise(sample_generators(torch.tensor([1, 2, 3, 4]), "cpu"))


def _rows_and_grads(opd, tiny, teachers, who, dynamics, rows=None):
    """ℓ per row at one state of every row, and the gradient of Σ ℓ over `rows` (all: None) w.r.t. the student."""
    adapter, transformer, _, cond = tiny
    x = _state(adapter)
    sigma, sigma_next = 0.7, 0.55
    mean_t = opd.teacher_means(teachers, who, x, sigma, sigma_next, cond, dynamics, 0.7)
    transformer.zero_grad(set_to_none=True)
    v = adapter.velocity(x, sigma, cond, 3.5)
    _, _, mean, std = opd.sde_step(dynamics, v, x, sigma, sigma_next, 0.7, prev_sample=x)
    loss = opd.opd_loss(dynamics, mean, mean_t, std)
    (loss if rows is None else loss[rows]).sum().backward()
    grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}
    return loss.detach(), grads, mean.detach(), std


@pytest.mark.parametrize("dynamics", ["ode", "flow-sde"])
def test_student_equal_to_its_teacher_gives_zero_loss_and_zero_gradient(tiny, dynamics):
    opd = _script()
    teachers = _teachers(opd, tiny, [("base", "base")])
    loss, grads, _, _ = _rows_and_grads(opd, tiny, teachers, torch.zeros(4, dtype=torch.long), dynamics)
    assert torch.equal(loss, torch.zeros(4))
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


@pytest.mark.parametrize("dynamics", ["flow-sde", "dance-sde", "cps"])
def test_the_base_model_as_teacher_gives_grpos_kl(tiny, dynamics):
    """A student away from the base (random B), the base as its only teacher: ℓ = sde_kl/(−dt) for flow-sde and
    dance-sde, ℓ = sde_kl for cps (Flow-GRPO's KL term with the reference's adapters disabled)."""
    from common.dynamics import sde_kl
    from common.shadow import ReferencePolicy

    opd = _script()
    adapter, transformer, _, cond = tiny
    teachers = _teachers(opd, tiny, [("base", "base")])
    saved = {n: p.detach().clone() for n, p in transformer.named_parameters() if ".default." in n}
    try:
        with torch.no_grad():
            for n, p in transformer.named_parameters():
                if ".default." in n and "lora_B" in n:
                    p.add_(0.2 * torch.randn_like(p))
        loss, _, mean, std = _rows_and_grads(opd, tiny, teachers, torch.zeros(4, dtype=torch.long), dynamics)
        x = _state(adapter)
        v_ref = ReferencePolicy(adapter, transformer).velocity(x, 0.7, cond, 3.5)
        mean_ref = opd.sde_step(dynamics, v_ref, x, 0.7, 0.55, 0.7, prev_sample=x)[2]
        kl = sde_kl(dynamics, mean, mean_ref, std, 0.7, 0.55)
    finally:
        with torch.no_grad():
            for n, p in transformer.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
    assert (loss > 0).all()
    expected = kl / 0.15 if dynamics != "cps" else kl
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


def test_changing_teacher_b_leaves_task_a_rows_bitwise_unchanged(tiny):
    opd = _script()
    transformer = tiny[1]
    who = torch.tensor([0, 1, 0, 1])
    rows_a = who == 0
    teachers = _teachers(opd, tiny, [("a", "base"), ("b", "other")])
    loss1, grads1, _, _ = _rows_and_grads(opd, tiny, teachers, who, "flow-sde", rows_a)
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            if ".teacher_b." in n:
                p.mul_(-3.0).add_(0.5)
    loss2, grads2, _, _ = _rows_and_grads(opd, tiny, teachers, who, "flow-sde", rows_a)
    assert not torch.equal(loss1[~rows_a], loss2[~rows_a])  # teacher b did change
    assert torch.equal(loss1[rows_a], loss2[rows_a])
    assert grads1.keys() == grads2.keys() and all(torch.equal(grads1[k], grads2[k]) for k in grads1)
    assert all(".default." in k for k in grads1)  # only the student is trained


def test_task_draw_is_per_task_and_a_function_of_seed_and_epoch():
    opd = _script()
    tasks = np.array([0] * 10 + [1] * 5)
    draw = opd.task_draw(tasks, [4, 2], 3, seed=1, epoch=2)
    assert len(draw) == 18 and np.array_equal(draw, opd.task_draw(tasks, [4, 2], 3, seed=1, epoch=2))
    assert len(set(draw[tasks[draw] == 0])) == 4 and len(set(draw[tasks[draw] == 1])) == 2
    assert all((draw == i).sum() == 3 for i in set(draw))
    assert not np.array_equal(draw, opd.task_draw(tasks, [4, 2], 3, seed=1, epoch=3))


def test_a_task_enters_the_group_key_only_when_set(tmp_path):
    from common.data import Prompt, load_prompts

    (tmp_path / "train.jsonl").write_text('{"prompt": "a cat", "task": "count"}\n{"prompt": "a cat"}\n')
    tagged, plain = load_prompts(tmp_path, "train")
    assert tagged.task == "count" and plain.task == "" and plain.key == Prompt("a cat").key != tagged.key
    assert tagged.entry() == plain.entry()  # the embedding cache's entry is the text's


# ---- end to end -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory, tiny_flux_path):
    """A teacher trained by another script: nft.py's tiny preset, 4 epochs."""
    out = tmp_path_factory.mktemp("opd-teacher")
    run_script("algos/nft.py", *TINY, "--epochs", "4", "--eval-every", "0", "--output-dir", out)
    return out


@pytest.fixture(scope="module")
def tasks_data(tmp_path_factory, tiny):
    """A dataset whose prompts carry the tasks `base` and `nft`, and the fresh (B = 0) teacher's folder."""
    data = tmp_path_factory.mktemp("opd-data")
    lines = [("a red cat", "base"), ("a dog", "nft"), ("a blue car", "nft"), ("a tree", "nft"), ("a boat", "base"),
             ("a house", "nft")]
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "task": t}) + "\n" for p, t in lines))
    (data / "test.txt").write_text("a red cat\na dog\n")
    return data


def test_two_teachers_kl_per_teacher_rows(tmp_path, teacher_run, tasks_data, tiny):
    """Epoch 0 trains before its only optimizer step: the `base` teacher equals the fresh student, so kl_base is 0 (to
    float rounding: the teacher runs on its one row, the student on the micro-batch of four) while kl_nft is not,
    and the loss is the row-weighted mean (1 base prompt, 3 nft prompts per epoch)."""
    folders = tiny[2]
    run_script("algos/opd.py", *TINY, "--epochs", "2", "--eval-every", "0", "--dataset", tasks_data,
               "--teacher", f"nft={teacher_run}:3", "--teacher", f"base={folders['base']}",
               "--output-dir", tmp_path)
    metrics = read_metrics(tmp_path)
    first = metrics[0]
    assert first["kl_base"] < 1e-9 * first["kl_nft"] and metrics[1]["kl_base"] > 1e-6 * first["kl_nft"]
    assert first["loss"] == pytest.approx((first["kl_base"] + 3 * first["kl_nft"]) / 4, rel=1e-6)
    assert {"reward_jpeg_compressibility_base_mean", "reward_jpeg_compressibility_nft_mean"} <= first.keys()


def test_the_students_kl_to_a_tiny_teacher_falls(tmp_path, teacher_run):
    """Fixed seed, the tiny preset's first 12 epochs (one nft teacher on untagged prompts): the mean kl of the last 3
    epochs is below half of the first 3's (over the preset's 30 epochs it fell 20×: 0.0064 → 0.00032 for 5 and 5)."""
    run_script("algos/opd.py", *TINY, "--epochs", "12", "--eval-every", "0", "--teacher", f"t={teacher_run}",
               "--output-dir", tmp_path)
    kl = [m["kl_t"] for m in read_metrics(tmp_path)]
    first, last = np.mean(kl[:3]), np.mean(kl[-3:])
    print(f"kl first-3 {first:.3g}, last-3 {last:.3g}")
    assert len(kl) == 12 and last < 0.5 * first


@SLOW
def test_kill_and_resume_equals_the_uninterrupted_run(tmp_path, teacher_run):
    args = TINY + ["--epochs", "6", "--save-every", "2", "--eval-every", "3", "--eval-num-prompts", "2",
                   "--teacher", f"t={teacher_run}"]
    run_script("algos/opd.py", *args, "--output-dir", tmp_path / "full")
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(REPO / "algos/opd.py"), *args, "--output-dir", str(killed)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() == "epoch_000003") and time.time() < deadline:
        time.sleep(0.02)
    still_running = process.poll() is None
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert still_running, "the run finished before it could be killed"
    run_script("algos/opd.py", *args, "--output-dir", killed, "--resume")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(killed)) == strip(read_metrics(tmp_path / "full"))


@SLOW
def test_rewards_scored_during_the_rollout_equal_serial_scoring(tmp_path, teacher_run):
    """--reward-workers 0 (score after the rollout) and the default (score each micro-batch on threads while the next
    is denoised) log the same rewards and metrics and train the same weights."""
    from safetensors.torch import load_file

    args = TINY + ["--epochs", "2", "--eval-every", "0", "--batch-size", "2", "--teacher", f"t={teacher_run}"]
    run_script("algos/opd.py", *args, "--reward-workers", "0", "--output-dir", tmp_path / "serial")
    run_script("algos/opd.py", *args, "--output-dir", tmp_path / "overlapped")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path / "serial")) == strip(read_metrics(tmp_path / "overlapped"))
    a, b = (load_file(tmp_path / run / "checkpoints" / "epoch_000001" / "pytorch_lora_weights.safetensors")
            for run in ("serial", "overlapped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@SLOW
def test_two_processes(tmp_path, teacher_run, tasks_data, tiny):
    args = TINY + ["--epochs", "1", "--eval-every", "0", "--batch-size", "2", "--dataset", tasks_data,
                   "--teacher", f"nft={teacher_run}:3", "--teacher", f"base={tiny[2]['base']}"]
    run_script("algos/opd.py", *args, "--output-dir", tmp_path / "one")
    run_script("algos/opd.py", *args, "--output-dir", tmp_path / "two", launcher=ACCELERATE_2CPU)
    (m1,), (m2,) = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert m2["num_processes"] == 2 and m2["kl_base"] < 1e-9 * m2["kl_nft"]
    # The same samples and states, before the only optimizer step: the same rewards and losses.
    for key in ("reward_mean", "loss", "kl_nft", "grad_norm"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key


@pytest.mark.parametrize("model,flags", [("sd3", []), ("flux1-kontext", ["--condition-size", "32"])])
def test_one_epoch_on_other_models(tmp_path, model, flags, request):
    """The matrix (tests/test_matrix.py) passes no teacher; here each model gets a fresh LoRA of its own (saved by
    the adapter, B = 0: the base model) as its teacher, with true CFG on SD3.5 for both."""
    from peft.utils import get_peft_model_state_dict

    from common.models import load_adapter
    from common.models import tiny_model_path
    from common.training import add_lora

    adapter = load_adapter(model, str(tiny_model_path(model)), "cpu", torch.float32, 32, 16)
    add_lora(adapter.transformer, 8, 8, adapter.lora_target_modules)
    adapter.save_lora(tmp_path / "teacher", get_peft_model_state_dict(adapter.transformer, adapter_name="default"))
    data = ["--dataset", request.getfixturevalue("edit_dataset")] if model == "flux1-kontext" else []
    run_script("algos/opd.py", *TINY, "--epochs", "1", "--prompts-per-epoch", "2", "--batch-size", "2",
               "--num-steps", "4", "--eval-every", "1", "--eval-num-prompts", "1", "--max-sequence-length", "16",
               "--resolution", "32", "--model", model, "--model-path", "tiny", *flags, *data,
               "--teacher", f"base={tmp_path / 'teacher'}", "--output-dir", tmp_path / "out")
    (metrics,) = read_metrics(tmp_path / "out")
    # The student starts as the base: its teacher; epoch 0's loss is taken before the optimizer step.
    assert metrics["kl_base"] == 0.0 and math.isfinite(metrics["eval_reward_mean"])
    assert (tmp_path / "out" / "checkpoints" / "epoch_000000" / "pytorch_lora_weights.safetensors").exists()


# ---- bad input ------------------------------------------------------------------------------------------------
def test_a_reward_flag_replaces_the_presets_reward():
    from common.cli import parse_args

    opd = _script()
    saved = sys.argv
    try:
        sys.argv = ["opd.py", "--preset", "toy", "--reward", "toy,mode=count"]
        assert parse_args(opd.Args, opd.PRESETS, check=opd.check_opd_args).reward == ["toy,mode=count"]
        sys.argv = ["opd.py", "--preset", "toy"]
        assert parse_args(opd.Args, opd.PRESETS, check=opd.check_opd_args).reward == ["toy"]
    finally:
        sys.argv = saved


def test_parse_teacher():
    opd = _script()
    spec = opd.parse_teacher("count=runs/a:b/teacher-1:2.5,guidance=4.5")
    assert (spec.name, str(spec.path), spec.weight, spec.guidance) == ("count", "runs/a:b/teacher-1", 2.5, 4.5)
    assert opd.parse_teacher("x=/tmp/t").weight == 1.0 and opd.parse_teacher("x=/tmp/t").guidance is None


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd-bad")
    for name, lines in {"tagged": [("a cat", "a"), ("a dog", "b")], "untagged": [("a cat", ""), ("a dog", "")],
                        "mixed": [("a cat", "a"), ("a dog", "")]}.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps({"prompt": p, **({"task": t} if t else {})})
                                                         + "\n" for p, t in lines))
        (root / name / "test.txt").write_text("a cat\n")
    (root / "full" / "checkpoints" / "epoch_000000" / "transformer").mkdir(parents=True)
    (root / "experts").mkdir()  # a Wan2.2 checkpoint's two LoRA files (their content is not read)
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"):
        (root / "experts" / name).write_bytes(b"")
    return root


@pytest.mark.parametrize("flags,message", [
    ([], "give at least one --teacher NAME=LORA_DIR"),
    (["--teacher", "nonsense"], "--teacher 'nonsense': expected NAME=LORA_DIR[:WEIGHT][,guidance=G]"),
    (["--teacher", "a=TEACHER:0"], "WEIGHT must be a positive number, got 0.0"),
    (["--teacher", "a=TEACHER,cfg=2"], "unknown option 'cfg=2'; the only option is guidance=G"),
    (["--teacher", "a=TEACHER", "--teacher", "a=TEACHER"], "--teacher 'a' is given twice"),
    (["--teacher", "a=/nonexistent/teacher"], "--teacher a: /nonexistent/teacher is not a folder"),
    (["--teacher", "a=BAD/full"], "(it is a full fine-tune: teachers are LoRA adapters)"),
    (["--teacher", "a=BAD/experts"], "(a two-expert model); opd's teachers are single-transformer LoRAs"),
    (["--teacher", "a=TEACHER", "--dataset", "BAD/tagged"], "task 'b' has no teacher (teachers: a)"),
    (["--teacher", "a=TEACHER", "--teacher", "b=TEACHER", "--teacher", "c=TEACHER", "--dataset", "BAD/tagged",
      "--prompts-per-epoch", "3"], "--teacher c: no training prompt has task 'c' (tasks: a, b)"),
    (["--teacher", "a=TEACHER", "--teacher", "b=TEACHER", "--dataset", "BAD/untagged"],
     "no \"task\", but 2 teachers are given"),
    (["--teacher", "a=TEACHER", "--teacher", "b=TEACHER", "--dataset", "BAD/mixed"], "no \"task\", but 2 teachers"),
    (["--teacher", "a=TEACHER", "--teacher", "b=TEACHER", "--dataset", "BAD/tagged", "--prompts-per-epoch", "3"],
     "gives task 'a' 1.5 prompts"),
    (["--teacher", "a=TEACHER", "--teacher", "b=TEACHER:3", "--dataset", "BAD/tagged", "--prompts-per-epoch", "4"],
     "task 'b' has 1 training prompts, fewer than the 3 drawn per epoch"),
    (["--teacher", "a=TEACHER", "--model", "sd3"], "was trained on flux1, the student is sd3"),
    (["--teacher", "a=TEACHER", "--full-finetune"], "--full-finetune: the teachers are LoRA adapters"),
    (["--teacher", "a=TEACHER", "--dynamics", "cps", "--timestep-range", "0", "1"], "the last step (σ' = 0) has S = 0"),
    (["--teacher", "a=TEACHER", "--timestep-range", "0.5", "0.6"], "trains no step of 6"),
    (["--teacher", "a=TEACHER", "--group-size", "0"], "--group-size must be at least 1, got 0"),
    (["--teacher", "a=TEACHER", "--dynamics", "langevin"], "'--dynamics'. Expected one of ('ode', 'flow-sde'"),
])
def test_bad_input_gives_one_line_error(tmp_path, teacher_run, bad_data, flags, message):
    flags = [str(f).replace("TEACHER", str(teacher_run)).replace("BAD", str(bad_data)) for f in flags]
    assert message in script_error("algos/opd.py", *TINY, "--epochs", "1", "--output-dir", tmp_path / "out", *flags)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
