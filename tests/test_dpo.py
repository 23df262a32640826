"""algos/dpo.py: the Diffusion-DPO loss, its invariant at θ = ref and the σ draw against float64 numpy, and
end-to-end runs on the tiny FLUX.1 (the invariant at epoch 0, the online reference, groups without a pair, learning,
resume, 2 processes with unequal pair counts, bad input)."""

import importlib.util
import math
import re
import sys

import numpy as np
import pytest
import torch

from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script

TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu",
             "peak_memory_gb"}  # measured
LOG2 = float(np.float32(np.log(2.0)))  # −log sigmoid(0) in float32


def _script():
    spec = importlib.util.spec_from_file_location("dpo_script", REPO / "algos" / "dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the training loop sits under `if __name__ == "__main__"`
    return module


dpo = _script()


def _toy(pairs=5, seed=0):
    """Winners' and losers' velocities of θ and of the reference, and their targets ε − x0."""
    g = torch.Generator().manual_seed(seed)
    t_w, t_l = torch.randn(pairs, 3, 4, 4, generator=g), torch.randn(pairs, 3, 4, 4, generator=g)
    v_ref_w = t_w + 0.5 * torch.randn(pairs, 3, 4, 4, generator=g)
    v_ref_l = t_l + 0.5 * torch.randn(pairs, 3, 4, 4, generator=g)
    v_w = v_ref_w + 0.2 * torch.randn(pairs, 3, 4, 4, generator=g)
    v_l = v_ref_l + 0.2 * torch.randn(pairs, 3, 4, 4, generator=g)
    return v_w, v_l, v_ref_w, v_ref_l, t_w, t_l


def _numpy_dpo(v_w, v_l, v_ref_w, v_ref_l, t_w, t_l, beta):
    """algorithms.md §7 written out in float64 numpy, pair by pair: (losses, z, e_θ^w, e_θ^l, e_ref^w, e_ref^l)."""
    out = []
    for p in range(len(v_w)):
        e = [float(np.mean((v[p].double().numpy() - t[p].double().numpy()) ** 2))
             for v, t in ((v_w, t_w), (v_l, t_l), (v_ref_w, t_w), (v_ref_l, t_l))]
        z = -beta / 2 * ((e[0] - e[2]) - (e[1] - e[3]))
        out.append((np.log1p(np.exp(-z)), z, *e))  # −log sigmoid(z) = log(1 + e^−z)
    return [np.array(column) for column in zip(*out)]


@pytest.mark.parametrize("beta", [0.5, 5.0, 100.0, 2000.0])
def test_loss_and_errors_equal_a_float64_computation(beta):
    v_w, v_l, v_ref_w, v_ref_l, t_w, t_l = _toy()
    e = [dpo.flow_matching_error(v, t) for v, t in ((v_w, t_w), (v_l, t_l), (v_ref_w, t_w), (v_ref_l, t_l))]
    loss, z = dpo.dpo_loss(*e, beta=beta)
    loss_np, z_np, *e_np = _numpy_dpo(v_w, v_l, v_ref_w, v_ref_l, t_w, t_l, beta)
    assert all(x.dtype == torch.float32 and x.shape == (5,) for x in (*e, loss, z))
    for ours, expected in zip(e, e_np):
        np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6)
    # z is a difference of differences: compare it on the scale of its terms.
    np.testing.assert_allclose(z.numpy(), z_np, rtol=1e-5, atol=1e-6 * beta)
    np.testing.assert_allclose(loss.numpy(), loss_np, rtol=1e-5, atol=1e-6 * beta)


def test_a_large_beta_saturates_the_sigmoid():
    """The reason β is rescaled per target: at the tiny model's error scale β = 2000 puts almost every pair where
    the sigmoid is flat (its gradient factor sigmoid(−z) ≈ 0 or 1), while β = 5 keeps z of order 1."""
    v_w, v_l, v_ref_w, v_ref_l, t_w, t_l = _toy(pairs=64)
    e = [dpo.flow_matching_error(v, t) for v, t in ((v_w, t_w), (v_l, t_l), (v_ref_w, t_w), (v_ref_l, t_l))]
    for beta, low, high in ((5.0, 0.01, 3.0), (2000.0, 10.0, float("inf"))):
        _, z = dpo.dpo_loss(*e, beta=beta)
        assert low < float(z.abs().median()) < high


def test_at_theta_equal_ref_the_loss_is_log_2_and_the_gradient_is_beta_over_4_of_the_error_gap():
    """θ = ref: z ≡ 0, the loss is exactly log 2, no pair counts as correct, and ∇ mean(L) = (β/4)·mean(∇e_θ^w −
    ∇e_θ^l); with e = mean((v − t)²) over n elements, ∂/∂v_w = (β/4)·2(v_w − t_w)/(n·P) and the negative for v_l."""
    _, _, v_ref_w, v_ref_l, t_w, t_l = _toy()
    beta, pairs, n = 100.0, 5, t_w[0].numel()
    v_w, v_l = v_ref_w.clone().requires_grad_(True), v_ref_l.clone().requires_grad_(True)
    loss, z = dpo.dpo_loss(dpo.flow_matching_error(v_w, t_w), dpo.flow_matching_error(v_l, t_l),
                           dpo.flow_matching_error(v_ref_w, t_w), dpo.flow_matching_error(v_ref_l, t_l), beta)
    assert torch.equal(z, torch.zeros(pairs)) and not (z > 0).any()
    assert all(float(x) == LOG2 for x in loss.detach())
    loss.mean().backward()
    for v, ref, t, sign in ((v_w, v_ref_w, t_w, 1.0), (v_l, v_ref_l, t_l, -1.0)):
        expected = sign * beta / 4 * 2 * (ref.double().numpy() - t.double().numpy()) / (n * pairs)
        np.testing.assert_allclose(v.grad.double().numpy(), expected, rtol=1e-5, atol=1e-9)


def test_at_theta_equal_ref_on_the_tiny_model(tiny_flux_path):
    """The same invariant through the real tiny FLUX.1 transformer: a fresh LoRA (lora_B = 0) equals the
    adapters-disabled reference bit for bit, so z ≡ 0, the loss is exactly log 2, and the LoRA gradient of the
    loss equals (β/4)·∇ mean(e_θ^w − e_θ^l)."""
    from common.models import load_adapter
    from common.shadow import ReferencePolicy
    from common.training import add_lora

    torch.manual_seed(0)
    adapter = load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 32, max_sequence_length=16)
    add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
    reference = ReferencePolicy(adapter, adapter.transformer)
    cond = adapter.encode_prompts(["a cat", "a dog"] * 2)  # pairs (0, 2) and (1, 3): winners first
    g = torch.Generator().manual_seed(1)
    x0 = adapter.noise([g] * 4) * 0.5
    eps = torch.randn(x0.shape, generator=g)
    sigma = torch.tensor([0.3, 0.8, 0.3, 0.8])
    x_sigma = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
    e_ref = dpo.flow_matching_error(reference.velocity(x_sigma, sigma, cond, 3.5), eps - x0)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    e_theta = dpo.flow_matching_error(adapter.velocity(x_sigma, sigma, cond, 3.5), eps - x0)
    assert torch.equal(e_theta, e_ref)
    loss, z = dpo.dpo_loss(*e_theta.chunk(2), *e_ref.chunk(2), beta=100.0)
    assert torch.equal(z.abs(), torch.zeros(2)) and all(float(x) == LOG2 for x in loss.detach())
    grads = torch.autograd.grad(loss.mean(), params, retain_graph=True)
    e_w, e_l = e_theta.chunk(2)
    expected = torch.autograd.grad(100.0 / 4 * (e_w - e_l).mean(), params)
    assert max(float(g.abs().max()) for g in grads) > 1e-6  # lora_B gets a gradient although it is 0
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-10)


def test_logit_normal_sigmas_are_shifted_by_3_and_reproducible():
    """σ = 3u/(1 + 2u), u = sigmoid(z), z ~ N(0, 1) unstratified: the per-draw formula against numpy on the same
    normals, the mean against a float64 quadrature, and the same σ's from the same seeds."""
    seeds = list(range(400))
    sigma = dpo.logit_normal_sigmas([torch.Generator().manual_seed(s) for s in seeds], 5, 3.0)
    assert sigma.shape == (400, 5) and sigma.dtype == torch.float32
    z = np.stack([torch.randn(5, generator=torch.Generator().manual_seed(s), dtype=torch.float64).numpy()
                  for s in seeds])
    u = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(sigma.numpy(), np.clip(3 * u / (1 + 2 * u), 0.01, 1 - 1e-6), rtol=1e-6)
    grid = np.linspace(-10, 10, 200001)
    ug = 1 / (1 + np.exp(-grid))
    mean = np.trapezoid(3 * ug / (1 + 2 * ug) * np.exp(-grid**2 / 2) / np.sqrt(2 * np.pi), grid)
    assert float(sigma.double().mean()) == pytest.approx(mean, abs=0.01)  # ≈ 0.70: toward noise
    again = dpo.logit_normal_sigmas([torch.Generator().manual_seed(s) for s in seeds[:3]], 5, 3.0)
    assert torch.equal(again, sigma[:3])


# A reward that scores four prompts by brightness and ties every other group at 0 (such a group gives no pair). With
# seed 1, M = 4, K = 4 the scored prompts sit in slots (1, 2), (2), (1, 2) and none at epochs 0-3: 2, 1, 2 and 0 pairs.
# On 2 processes (slots 0-1 and 2-3) epoch 1 leaves process 0 with padding only while process 1 trains a pair, and
# epoch 3 leaves both with padding only.
TIES = '''
SCORED = {"a photo of a frog", "a horse in the snow", "a pencil sketch of a rabbit", "a watercolor painting of a deer"}


def few_prompts(images, prompts):
    return [float(image.mean()) if prompt in SCORED else 0.0 for image, prompt in zip(images, prompts)]
'''
ONLINE = ["--preset", "tiny", "--epochs", "4", "--batch-size", "4", "--eval-every", "1", "--eval-num-prompts", "2",
          "--save-every", "1", "--ref-update-every", "2", "--reward", "dpo_ties:few_prompts"]
PAIR_KEYS = {"loss", "implicit_acc", "z_abs_mean", "e_theta_w", "e_theta_l", "e_ref_w", "e_ref_l", "implicit_reward_w",
             "implicit_reward_l", "adv_w_mean", "adv_l_mean", "adv_margin"}


@pytest.fixture(scope="module")
def ties_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo_reward")
    (folder / "dpo_ties.py").write_text(TIES)
    return {"PYTHONPATH": str(folder)}


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, tiny_flux_path, ties_env):
    out = tmp_path_factory.mktemp("dpo_online") / "full"
    run_script("algos/dpo.py", *ONLINE, "--output-dir", out, env=ties_env)
    return out


def test_online_reference_and_groups_without_a_pair(online_run):
    """--ref-update-every 2: the reference (a second adapter that also samples) is θ at epoch 0 and again after the
    2nd optimizer step, so epochs 0 and 2 sit exactly at θ = ref (loss log 2, accuracy 0, equal errors) while epoch 1
    does not. Tied groups give no pair; at epoch 3 no group gives one: the step runs on padding with a zero gradient
    and the pair keys are left out instead of logging 0/0."""
    metrics = read_metrics(online_run)
    assert [m["epoch"] for m in metrics] == [0, 1, 2, 3]
    assert [m["pairs"] for m in metrics] == [2, 1, 2, 0]
    assert [m["tie_frac"] for m in metrics] == [0.5, 0.75, 0.5, 1.0]
    assert [m["ref_updates"] for m in metrics] == [0, 1, 1, 2]  # refreshed after steps 2 and 4
    assert [m["optimizer_steps"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics[:3]:
        assert PAIR_KEYS <= m.keys() and all(math.isfinite(m[k]) for k in PAIR_KEYS)
        assert m["adv_w_mean"] > 0 > m["adv_l_mean"] and m["adv_margin"] > 0
    for m in (metrics[0], metrics[2]):
        assert m["loss"] == LOG2 and m["implicit_acc"] == 0 and m["z_abs_mean"] == 0
        assert m["e_theta_w"] == m["e_ref_w"] and m["e_theta_l"] == m["e_ref_l"] and m["implicit_reward_w"] == 0
        assert m["grad_norm"] > 0  # z = 0 still has the gradient (β/4)·∇(e_w − e_l)
    assert metrics[1]["loss"] != LOG2 and metrics[1]["z_abs_mean"] > 0
    assert metrics[1]["e_theta_w"] != metrics[1]["e_ref_w"]
    assert metrics[3]["grad_norm"] == 0 and not PAIR_KEYS & metrics[3].keys() and metrics[3]["zero_std_frac"] == 1
    assert all("eval_reward_mean" in m for m in metrics)


@SLOW
def test_resume_equals_the_uninterrupted_run(online_run, tmp_path, ties_env):
    """Stopped after epoch 1 (the checkpoint holds θ and the reference adapter, refreshed there) and resumed for
    epochs 2-3: every metric but the timings is bitwise equal."""
    run_script("algos/dpo.py", *ONLINE, "--epochs", "2", "--output-dir", tmp_path, env=ties_env)
    run_script("algos/dpo.py", *ONLINE, "--resume", "--output-dir", tmp_path, env=ties_env)
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path)) == strip(read_metrics(online_run))


@SLOW
def test_two_processes_with_unequal_pair_counts(online_run, tmp_path, ties_env):
    """2 processes, 2 whole groups each: at epoch 1 process 0 has no pair and runs padding only, as many backward
    calls as process 1 (at epoch 3 both do). Each pair's (σ, ε) come from its slot's seed and DDP averages over all
    pairs, so the run follows the single-process one."""
    run_script("algos/dpo.py", *ONLINE, "--output-dir", tmp_path, launcher=ACCELERATE_2CPU, env=ties_env)
    one, two = read_metrics(online_run), read_metrics(tmp_path)
    assert [m["num_processes"] for m in two] == [2, 2, 2, 2]
    assert [m["pairs"] for m in two] == [2, 1, 2, 0]
    assert two[0]["reward_mean"] == pytest.approx(one[0]["reward_mean"], abs=1e-9)
    assert two[0]["loss"] == LOG2 and two[2]["loss"] == LOG2
    for key in ("reward_mean", "loss", "e_theta_w", "e_theta_l", "grad_norm", "eval_reward_mean"):
        assert two[2][key] == pytest.approx(one[2][key], rel=1e-3, abs=1e-6), key
    assert two[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-3)
    assert two[3]["grad_norm"] == 0 and two[3]["eval_reward_mean"] == pytest.approx(one[3]["eval_reward_mean"], rel=1e-3)


@SLOW
def test_reward_rises_on_tiny_flux(tmp_path):
    """Fixed seed, the tiny preset (50 epochs, adapters-disabled reference, β = 1): epoch 0 sits exactly at θ = ref,
    and the mean JPEG reward of the last 10 epochs beats the first 10's by > 0.4 kB (seen: +0.95/+0.88/+0.69 for
    seeds 1-3)."""
    run_script("algos/dpo.py", "--preset", "tiny", "--seed", "1", "--eval-every", "0", "--output-dir", tmp_path)
    metrics = read_metrics(tmp_path)
    assert metrics[0]["loss"] == LOG2 and metrics[0]["implicit_acc"] == 0 and metrics[0]["z_abs_mean"] == 0
    rewards = [m["reward_mean"] for m in metrics]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    print(f"first-10 mean {first:.3f} kB, last-10 mean {last:.3f} kB")
    assert last - first > 0.4


def _error_of(*args, launcher=None, env=None):
    """The one `error:` line of a run that must refuse its input (exit status 2; a launcher reports its own)."""
    result = run_script("algos/dpo.py", *args, check=False, launcher=launcher, env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert (result.returncode == 2 if launcher is None else result.returncode != 0), result.stderr[-2000:]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("flags,message", [
    (["--dpo-beta", "0"], "--dpo-beta must be positive, got 0.0"),
    (["--ref-update-every", "-1"], "--ref-update-every must be >= 0 (0: never), got -1"),
    (["--train-timesteps", "0"], "--train-timesteps must be at least 1, got 0"),
    (["--time-shift", "-1"], "--time-shift must be positive (1: no shift), got -1.0"),
    (["--dynamics", "heun"], "Expected one of ('ode', 'dpm', 'flow-sde', 'dance-sde', 'cps')"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, message, monkeypatch, tmp_path):
    """The script's own checks, run in this process (runpy, as `python algos/dpo.py` would): each raises the
    UserError that the hook prints as one line (the subprocess test below checks the line and exit status 2)."""
    import runpy

    from common.utils import UserError

    monkeypatch.setattr(sys, "argv", ["dpo.py", "--preset", "tiny", "--output-dir", str(tmp_path / "out"), *flags])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # parse_args installs its hook: restore it afterwards
    with pytest.raises(UserError, match=re.escape(message)):
        runpy.run_path(str(REPO / "algos" / "dpo.py"), run_name="__main__")
    assert not (tmp_path / "out").exists()


def test_groups_must_split_evenly_over_the_processes_one_line_exit_2(tmp_path):
    """Refused before anything loads, from the launchers' WORLD_SIZE (set here by hand: a real 2-process launch costs
    three interpreter start-ups; by hand, `accelerate launch --num_processes 2 ... --prompts-per-epoch 3` printed the
    same line once)."""
    message = _error_of("--preset", "tiny", "--prompts-per-epoch", "3", "--output-dir", tmp_path / "out",
                        env={"WORLD_SIZE": "2"})
    assert message == ("error: --prompts-per-epoch 3 must be a multiple of the 2 processes (each process holds "
                       "whole groups, where its pairs are formed)")
    assert not (tmp_path / "out").exists()
