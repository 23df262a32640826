"""algos/tdmr1.py: algorithms.md §9's ten invariants — the stored trajectory, the re-noising, the query times, the
revised-x0 terms, the generator loss's modes, the surrogate's first step, the clips, the S̄ schedule and a float64
numpy re-computation of every loss — then end-to-end runs on the tiny FLUX.1 (step-0 values, exact resume of all
three adapters after SIGKILL, 2 processes, bad input) and a learning test on the toy world (full tier)."""

import importlib.util
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common import renoising, timesampling
from common.utils import RunStopped
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, script_error


def _load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the training loop sits under `if __name__ == "__main__"`
    return module


tdmr1, dgpo = _load("tdmr1"), _load("dgpo")
TINY = ["--preset", "tiny"]
# A micro-batch of 4 is one whole group of K = 4: the tiny preset's two groups, on 1 and on 2 processes.
FAST = TINY + ["--epochs", "2", "--eval-every", "1", "--eval-num-prompts", "2", "--batch-size", "4"]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---- 2. re-noising and the surrogate's target -------------------------------------------------------------------
def test_renoise_is_the_flows_forward_transition_in_float64():
    rng = _rng(1)
    y, noise = rng.normal(size=(5, 3, 4)), rng.normal(size=(5, 3, 4))
    sigma_n = np.array([0.0, 0.1, 0.4, 0.7, 0.2])
    sigma_q = np.array([0.3, 0.5, 0.45, 0.99, 0.2001])
    x, alpha, beta = renoising.renoise(torch.tensor(y), torch.tensor(sigma_n), torch.tensor(sigma_q), torch.tensor(noise))
    a = (1 - sigma_q) / (1 - sigma_n)
    b = np.sqrt(sigma_q ** 2 - a ** 2 * sigma_n ** 2)
    np.testing.assert_allclose(x.numpy(), a[:, None, None] * y + b[:, None, None] * noise, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose((alpha.numpy() * sigma_n) ** 2 + beta.numpy() ** 2, sigma_q ** 2, rtol=1e-13)
    # σ_n = 0: §5's forward process (1 − σ_q)·y + σ_q·ξ
    np.testing.assert_allclose(x[0].numpy(), (1 - sigma_q[0]) * y[0] + sigma_q[0] * noise[0], rtol=1e-14)
    # a y on the flow's path lands on it: x_q = (1 − σ_q)·x0 + noise of variance σ_q² (per element, many draws)
    x0, eps = 0.7, rng.normal(size=200_000)
    for s_n, s_q in ((0.2, 0.6), (0.0, 0.3), (0.5, 0.51)):
        xq, _, _ = renoising.renoise(torch.tensor((1 - s_n) * x0 + s_n * eps)[None],
                                 torch.tensor([s_n]), torch.tensor([s_q]), torch.tensor(rng.normal(size=200_000))[None])
        assert xq.mean().item() == pytest.approx((1 - s_q) * x0, abs=0.01)
        assert xq.std().item() == pytest.approx(s_q, rel=0.01)


def test_surrogate_target_is_the_conditional_scores_velocity():
    rng = _rng(2)
    y, z = torch.tensor(rng.normal(size=(4, 6))), torch.tensor(rng.normal(size=(4, 6)))
    sigma_n = torch.tensor([0.0, 0.2, 0.5, 0.0], dtype=torch.float64)
    sigma_q = torch.tensor([0.4, 0.35, 0.9, 0.05], dtype=torch.float64)
    x, alpha, beta = renoising.renoise(y, sigma_n, sigma_q, z)
    u = renoising.surrogate_target(x, z, beta, sigma_q).numpy()
    sq, sn, a, b = (t.numpy()[:, None] for t in (sigma_q, sigma_n, alpha, beta))
    np.testing.assert_allclose(u, (sq * z.numpy() / b - x.numpy()) / (1 - sq), rtol=1e-13, atol=1e-13)
    # the closed form −y/(1 − σ_n) + (z/β)·(σ_q + σ_n²·α/(1 − σ_n))
    closed = -y.numpy() / (1 - sn) + z.numpy() / b * (sq + sn ** 2 * a / (1 - sn))
    np.testing.assert_allclose(u, closed, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(u[[0, 3]], (z - y).numpy()[[0, 3]], rtol=1e-13, atol=1e-14)  # σ_n = 0: z − y


# ---- 3. query times -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [3.0, 1.5831])
def test_query_times_lie_above_the_boundary_and_start_at_the_margin(shift):
    lo = torch.tensor([0.0, 0.1, 0.3, 0.7, 0.95], dtype=torch.float64)
    for u in (0.0, 0.25, 0.5, 0.999999):
        q = renoising.query_sigma(lo, torch.full_like(lo, u), shift, 0.02)
        assert bool((q > lo).all() and (q < 1).all())
    phi = lambda u: shift * u / (1 + (shift - 1) * u)  # noqa: E731
    start = renoising.query_sigma(lo, torch.zeros_like(lo), shift, 0.02).numpy()
    inverse = lo.numpy() / (shift - (shift - 1) * lo.numpy())
    np.testing.assert_allclose(start, phi(inverse + 0.02), rtol=1e-14)
    np.testing.assert_allclose(renoising.unshift_time(renoising.shift_time(lo, shift), shift).numpy(), lo.numpy(), rtol=1e-14)
    # uniform in unshifted time: the mean of φ⁻¹(σ_q) over many U is the interval's midpoint
    u = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = renoising.query_sigma(torch.full_like(u, 0.3), u, shift, 0.02)
    u0 = 0.3 / (shift - (shift - 1) * 0.3) + 0.02
    assert renoising.unshift_time(q, shift).mean().item() == pytest.approx((u0 + 1) / 2, abs=2e-3)
    # σ_S ≥ t_min: the script queries above max(σ_{j+1}, t_min)
    q = renoising.query_sigma(lo.clamp_min(0.3), torch.zeros_like(lo), shift, 0.02)
    assert bool((q >= 0.3).all())


def test_the_toy_schedule_is_phi_of_a_linspace_with_the_derived_shift():
    from common.models import load_adapter, resolve_model_path

    adapter = load_adapter("flux1", resolve_model_path("flux1", "toy"), torch.device("cpu"), torch.float32, 32, 16,
                           load_text_encoders=False)
    shift = renoising.schedule_shift(adapter, 4)
    # e^μ with FLUX's μ at 64 image tokens: the toy scheduler's base_image_seq_len is 64, so μ = base_shift 0.5
    assert adapter.scheduler.config.base_image_seq_len == 64 and shift == pytest.approx(np.exp(0.5), rel=1e-12)
    for n in (1, 2, 4, 8):
        sigmas = adapter.sigmas(n)[:-1].double()
        np.testing.assert_allclose(sigmas.numpy(), renoising.shift_time(np.linspace(1, 1 / n, n), shift), rtol=1e-6)


def test_a_groups_members_share_their_draws_and_processes_draw_the_same():
    seeds = tdmr1.stream_seeds(1, 3, 4, tdmr1.SUR_QUERY, 0)
    groups = torch.tensor([2, 2, 0, 0, 3, 3])
    u = timesampling.group_uniform(seeds, groups)
    assert u[0] == u[1] and u[2] == u[3] and u[4] == u[5] and len(set(u.tolist())) == 3
    # a process holding only groups 0 and 3 draws the same numbers (a function of the group, not the batch)
    assert torch.equal(timesampling.group_uniform(seeds, torch.tensor([3, 0])), u[[4, 2]])
    like = torch.zeros(6, 2, 3)
    z = timesampling.group_noise(seeds, groups, 1, like)[:, 0]
    assert torch.equal(z[0], z[1]) and not torch.equal(z[0], z[2])
    assert torch.equal(timesampling.group_noise(seeds, torch.tensor([3]), 1, like[:1])[0, 0], z[4])
    assert tdmr1.stream_seeds(1, 3, 4, tdmr1.SUR_QUERY, 0) != tdmr1.stream_seeds(1, 3, 4, tdmr1.SUR_NOISE, 0)


def test_surrogate_steps_are_drawn_in_proportion_to_j_plus_one():
    counts = np.bincount([tdmr1.surrogate_step(1, 0, g, 0, 4) for g in range(20_000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), np.arange(1, 5) / 10, atol=0.01)
    steps = tdmr1.trained_steps(1, 0, 5, 4, 2)
    assert len(set(steps)) == 2 and set(steps) <= {0, 1, 2, 3} and steps == tdmr1.trained_steps(1, 0, 5, 4, 2)


# ---- 4.–5. the revised-x0 terms and the generator loss's modes ------------------------------------------------
def test_revised_x0_term_value_and_gradient_in_float64():
    rng = _rng(3)
    x0 = torch.tensor(rng.normal(size=(3, 4, 5)), requires_grad=True)
    c, norm = torch.tensor(rng.normal(size=(3, 4, 5))), torch.tensor([0.5, 1.3, 2.0], dtype=torch.float64)
    value = tdmr1.revised_x0_loss(x0, c, norm)
    np.testing.assert_allclose(value.detach().numpy(), (c.numpy() ** 2).reshape(3, -1).mean(1) / norm.numpy(),
                               rtol=1e-14)
    value.mean().backward()  # mean_b, as the micro-batch's weights make it
    elements, batch = 20, 3
    np.testing.assert_allclose(x0.grad.numpy(), -2 * c.numpy() / (elements * norm.numpy()[:, None, None] * batch),
                               rtol=1e-13)
    # finite differences of the surrogate's gradient: sg(x̂0 + c) is the target, so move x̂0 and keep it fixed
    target = (x0 + c).detach()
    h = 1e-6
    bump = torch.zeros_like(x0)
    bump[1, 2, 3] = h
    f = lambda x: (((x - target) ** 2).reshape(3, -1).mean(1) / norm).mean()  # noqa: E731
    assert ((f(x0.detach() + bump) - f(x0.detach() - bump)) / (2 * h)).item() == pytest.approx(
        x0.grad[1, 2, 3].item(), rel=1e-6)
    # the value does not change with x̂0; c = 0: value and gradient 0
    other = torch.tensor(rng.normal(size=(3, 4, 5)))
    np.testing.assert_allclose(tdmr1.revised_x0_loss(other, c, norm).numpy(), value.detach().numpy(), rtol=1e-13)
    x0.grad = None
    zero = tdmr1.revised_x0_loss(x0, torch.zeros_like(c), norm)
    zero.sum().backward()
    assert float(zero.detach().abs().max()) == 0 and float(x0.grad.abs().max()) == 0


def _corrections(seed=4, batch=6):
    rng = _rng(seed)
    x0 = torch.tensor(rng.normal(size=(batch, 8)), requires_grad=True)
    c_kl, c_cfg, c_r = (torch.tensor(rng.normal(size=(batch, 8))) for _ in range(3))
    norm, norm_s = (torch.tensor(rng.uniform(0.2, 2, size=batch)) for _ in range(2))
    return x0, c_kl, c_cfg, c_r, norm, norm_s


def _grad(loss, x0):
    (g,) = torch.autograd.grad(loss.sum(), x0, retain_graph=True)
    return g


def test_generator_loss_modes_and_their_gradients():
    x0, c_kl, c_cfg, c_r, norm, norm_s = _corrections()
    ell = lambda c, n: tdmr1.revised_x0_loss(x0, c, n)  # noqa: E731
    tdm = tdmr1.generator_loss(x0, c_kl, c_cfg, c_r, norm, norm_s, 0.3, "tdm")[0]
    torch.testing.assert_close(tdm, ell(c_kl, norm) + ell(c_cfg, norm), rtol=0, atol=0)
    late = tdmr1.generator_loss(x0, c_kl, c_cfg, c_r, norm, norm_s, 0.3, "late")[0]
    torch.testing.assert_close(late, 0.3 * (ell(c_kl, norm) + ell(c_cfg, norm)), rtol=1e-15, atol=0)
    # 5. w = 1: the gradient of the --no-rl loss whatever S is (at every j)
    for c_any in (c_r, 10 * c_r):
        for mode in ("reward", "late"):
            full = tdmr1.generator_loss(x0, c_kl, c_cfg, c_any, norm, norm_s, 1.0, mode)[0]
            torch.testing.assert_close(_grad(full, x0), _grad(tdm, x0), rtol=1e-14, atol=1e-16)
    # w = 0 at j < T_rl: ℓ(c_KL, n) + ℓ(c_R, n_S), no CFG term
    zero = tdmr1.generator_loss(x0, c_kl, c_cfg, c_r, norm, norm_s, 0.0, "reward")[0]
    torch.testing.assert_close(zero, ell(c_kl, norm) + ell(c_r, norm_s), rtol=1e-15, atol=0)
    # c_KL + c_CFG is one revised-x0 loss towards the guided teacher (the same gradient)
    np.testing.assert_allclose(_grad(tdm, x0).numpy(), _grad(ell(c_kl + c_cfg, norm), x0).numpy(), rtol=1e-12)


# ---- 6.–8. the surrogate: its first step, the clips -----------------------------------------------------------
def _surrogate_batch(seed=5, batch=6, group_size=3):
    rng = _rng(seed)
    target = torch.tensor(rng.normal(size=(batch, 10)))
    v_ref = torch.tensor(rng.normal(size=(batch, 10)))
    adv = torch.tensor(rng.normal(size=(2, group_size)))
    adv = (adv - adv.mean(1, keepdims=True)).flatten()
    groups = torch.arange(2).repeat_interleave(group_size)
    return target, v_ref, adv, groups


def test_first_surrogate_step_holds_the_step_zero_values_and_matches_dgpo_bitwise():
    target, v_ref, adv, groups = _surrogate_batch()
    v_s = v_ref.clone().requires_grad_(True)  # S = S̄ = R
    loss, part = tdmr1.surrogate_loss(v_s, v_ref, v_ref, target, adv, groups, 3, 2, 4, 2.0, 1e-3, 1e-3, 0.05)
    assert torch.equal(part["loss_s"], part["loss_ref"]) and torch.equal(part["loss_s"], part["loss_old"])
    assert float(part["anchor"].detach()) == 0 and not part["clipped"].any() and not part["runaway"].any()
    assert bool((part["group_weight"] == 0.5).all())
    torch.testing.assert_close(loss, 0.75 * 0.5 * adv * part["loss_s"], rtol=1e-14, atol=0)  # ω = 3/4 at j′ = 2
    # the anchor's gradient is 0 at S = R: the whole gradient is the preference term's
    (grad,) = torch.autograd.grad(loss.sum(), v_s)
    pref_only = v_ref.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((0.75 * 0.5 * adv * tdmr1.mse(pref_only, target)).sum(), pref_only)
    torch.testing.assert_close(grad, expected, rtol=1e-14, atol=1e-16)
    # the preference term and the trust region are dgpo.py's, bit for bit, on the same tensors
    rng = _rng(6)
    loss_theta, loss_ref = (torch.tensor(rng.uniform(0.5, 1.5, size=6), dtype=torch.float32) for _ in range(2))
    a32 = adv.float()
    for fn in ("dgpo_loss",):
        for left, right in zip(getattr(tdmr1, fn)(loss_theta, loss_ref, a32, groups, 2.0, 3),
                               getattr(dgpo, fn)(loss_theta, loss_ref, a32, groups, 2.0, 3)):
            assert torch.equal(left, right)
    for left, right in zip(tdmr1.dsm_clip(loss_theta, loss_ref, a32, 1e-3), dgpo.dsm_clip(loss_theta, loss_ref, a32,
                                                                                          1e-3)):
        assert torch.equal(left, right)


def test_trust_region_and_runaway_truth_tables():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    loss_s = torch.ones(6, dtype=torch.float64, requires_grad=True)
    # ρ = exp(ℓ_S̄ − ℓ_S): above, below, above, below, below, above 1 ± c
    loss_old = torch.tensor([1.1, 0.9, 1.1, 0.9, 0.9, 1.1], dtype=torch.float64)
    _, clipped = tdmr1.dsm_clip(loss_s, loss_old, adv, 0.05)
    assert clipped.tolist() == [True, False, False, True, True, False]  # A = 0 counts as A ≤ 0
    # runaway: never when D ≤ δ; when D > δ exactly those that beat R in their advantage's direction
    loss_ref = loss_old
    _, off = tdmr1.runaway_clip(loss_s, loss_ref, adv, torch.tensor(0.05), 0.05)
    _, on = tdmr1.runaway_clip(loss_s, loss_ref, adv, torch.tensor(0.0501), 0.05)
    assert not off.any() and on.tolist() == [True, False, False, True, True, False]
    # in the surrogate loss a clipped sample keeps its value and loses its gradient: ℓ_S = 1, ℓ_S̄ as above
    v = torch.zeros(6, 4, dtype=torch.float64, requires_grad=True)
    target = torch.ones(6, 4, dtype=torch.float64)
    v_old = (1 - loss_old.sqrt())[:, None].expand(6, 4)
    loss, part = tdmr1.surrogate_loss(v, torch.zeros(6, 4, dtype=torch.float64), v_old, target, adv,
                                      torch.tensor([0, 0, 0, 1, 1, 1]), 3, 3, 4, 2.0, 0.0, 0.05, 1e9)
    assert part["clipped"].tolist() == clipped.tolist() and not part["runaway"].any()
    unclipped = tdmr1.surrogate_loss(v, torch.zeros(6, 4, dtype=torch.float64), v_old, target, adv,
                                     torch.tensor([0, 0, 0, 1, 1, 1]), 3, 3, 4, 2.0, 0.0, float("inf"), 1e9)[0]
    torch.testing.assert_close(loss, unclipped, rtol=0, atol=0)  # the value is unchanged
    (grad,) = torch.autograd.grad(loss.sum(), v)
    assert float(grad[clipped].abs().max()) == 0 and float(grad[[1, 2]].abs().min()) > 0


# ---- 9. the S̄ schedule --------------------------------------------------------------------------------------
def test_slow_surrogate_schedule():
    assert tdmr1.old_decay(0, 0.001, 0.3) == pytest.approx(0.001)
    assert tdmr1.old_decay(299, 0.001, 0.3) == pytest.approx(0.3)
    assert tdmr1.old_decay(5000, 0.001, 0.3) == 0.3
    assert all(tdmr1.old_decay(k, 0.001, 0.3) <= tdmr1.old_decay(k + 1, 0.001, 0.3) for k in range(400))


# ---- 10. every loss against float64 numpy --------------------------------------------------------------------
def test_every_loss_against_float64_numpy_with_its_detach_points():
    """B = 6, K = 3, two groups, N = 4: L_f, ℓ_S, D, L_pref, L_S and the three generator terms from the script's
    functions against numpy, and their gradients against hand-derived ones."""
    rng = _rng(7)
    B, E, K, N = 6, 10, 3, 4
    v_f, u_f, v_r = (rng.normal(size=(B, E)) for _ in range(3))
    vf = torch.tensor(v_f, requires_grad=True)
    loss_f = tdmr1.fake_loss(vf, torch.tensor(u_f), torch.tensor(v_r), 0.02)
    np.testing.assert_allclose(loss_f.detach().numpy(), ((v_f - u_f) ** 2).mean(1) + 0.02 * ((v_f - v_r) ** 2).mean(1),
                               rtol=1e-12)
    (g,) = torch.autograd.grad(loss_f.sum(), vf)
    np.testing.assert_allclose(g.numpy(), 2 * (v_f - u_f) / E + 0.04 * (v_f - v_r) / E, rtol=1e-12)

    # surrogate: S moved away from R and S̄, so ρ, D and the weights are not trivial; big δ, inf c: nothing clipped
    target, v_ref, adv, groups = _surrogate_batch(8, B, K)
    v_old = v_ref + 0.01 * torch.tensor(rng.normal(size=(B, E)))
    vs = (v_ref + 0.05 * torch.tensor(rng.normal(size=(B, E)))).requires_grad_(True)
    beta_pref, beta_ref, step = 2.0, 1e-3, 1
    loss_s, part = tdmr1.surrogate_loss(vs, v_ref, v_old, target, adv, groups, K, step, N, beta_pref, beta_ref,
                                        float("inf"), 1e9)
    s, r, t, a, g_ = vs.detach().numpy(), v_ref.numpy(), target.numpy(), adv.numpy(), groups.numpy()
    l_s, l_r = ((s - t) ** 2).mean(1), ((r - t) ** 2).mean(1)
    d = ((s - r) ** 2).mean()
    logit = np.array([beta_pref / K * np.sum(a[g_ == k] * (l_s[g_ == k] - l_r[g_ == k])) for k in g_])
    w = 1 / (1 + np.exp(-logit))
    omega = (step + 1) / N
    expected = omega * (w * a * l_s + beta_ref * d)
    np.testing.assert_allclose(part["loss_s"].detach().numpy(), l_s, rtol=1e-12)
    np.testing.assert_allclose(float(part["anchor"].detach()), d, rtol=1e-12)
    np.testing.assert_allclose(part["pref"].detach().numpy(), w * a * l_s, rtol=1e-12)
    np.testing.assert_allclose(loss_s.detach().numpy(), expected, rtol=1e-10)
    # the group weight is detached: d/dv_S = ω·(w·A·2(v_S − u)/E + β_ref·2(v_S − v_R)/(E·B)) per sample
    (g,) = torch.autograd.grad(loss_s.sum(), vs)
    hand = omega * (w[:, None] * a[:, None] * 2 * (s - t) / E + B * beta_ref * 2 * (s - r) / (E * B))
    np.testing.assert_allclose(g.numpy(), hand, rtol=1e-10, atol=1e-15)

    # the three generator terms
    x0, c_kl, c_cfg, c_r, norm, norm_s = _corrections(9, B)
    loss, tdm, cfg, reward = tdmr1.generator_loss(x0, c_kl, c_cfg, c_r, norm, norm_s, 0.3, "reward")
    kl_np, cfg_np, r_np = ((c.numpy() ** 2).mean(1) / n.numpy() for c, n in ((c_kl, norm), (c_cfg, norm),
                                                                              (c_r, norm_s)))
    for got, want in ((tdm, kl_np), (cfg, cfg_np), (reward, r_np), (loss, kl_np + 0.3 * cfg_np + 0.7 * r_np)):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), x0)
    hand = -2 / 8 * (c_kl.numpy() / norm.numpy()[:, None] + 0.3 * c_cfg.numpy() / norm.numpy()[:, None]
                     + 0.7 * c_r.numpy() / norm_s.numpy()[:, None])
    np.testing.assert_allclose(g.numpy(), hand, rtol=1e-12)
    # normalisers: max(mean |x̂0_G − x̂0_other|, 1e-6), float64
    other = x0.detach() + torch.tensor(rng.normal(size=(B, 8)))
    np.testing.assert_allclose(tdmr1.normaliser(x0, other).numpy(),
                               np.maximum(np.abs(x0.detach().numpy() - other.numpy()).mean(1), 1e-6), rtol=1e-14)
    assert float(tdmr1.normaliser(x0, x0)[0]) == 1e-6


# ---- roles: each loss reaches its own adapter only ------------------------------------------------------------
def test_each_roles_gradient_reaches_only_its_own_adapter(tiny_flux_path):
    from common.models import load_adapter
    from common.roles import RoleOptimizer, TrainedRole
    from common.shadow import ReferencePolicy, ShadowPolicy
    from common.training import add_lora, trainable_parameters

    torch.manual_seed(0)
    adapter = load_adapter("flux1", tiny_flux_path, torch.device("cpu"), torch.float32, 64, 32)
    transformer = adapter.transformer
    add_lora(transformer, 4, 4, adapter.lora_target_modules)
    generator = trainable_parameters(transformer)
    roles = {name: TrainedRole(adapter, transformer, name, RoleOptimizer(1e-3), 0.0, "constant", 0, 10)
             for name in ("fake", "surrogate")}
    old = ShadowPolicy(adapter, transformer, "surrogate_old", False, source="surrogate")
    reference = ReferencePolicy(adapter, transformer)
    for p in [*generator, *roles["fake"].params, *roles["surrogate"].params]:  # move every adapter off zero
        p.data.add_(0.01 * torch.randn_like(p))
    old.blend(0.0)
    assert old.max_abs_diff() == 0  # S̄ copies the surrogate, not the generator
    assert [p.requires_grad for p in generator] == [True] * len(generator)
    assert not any(p.requires_grad for r in roles.values() for p in r.params)
    cond = adapter.encode_prompts(["a red circle", "two dogs"])
    x = torch.randn(2, *adapter.noise([torch.Generator().manual_seed(0)]).shape[1:])
    sigma = torch.tensor([0.5, 0.7])

    def grads():
        out = {"default": any(p.grad is not None for p in generator)}
        out.update({n: any(p.grad is not None for p in r.params) for n, r in roles.items()})
        return out

    # frozen queries, then one role's forward and backward: only that adapter's weights get a gradient
    reference.velocity(x, sigma, cond, 1.0)
    old.velocity(x, sigma, cond, 1.0)
    with roles["fake"].trained():
        adapter.velocity(x, sigma, cond, 1.0).pow(2).mean().backward()
    assert grads() == {"default": False, "fake": True, "surrogate": False}
    roles["surrogate"].velocity(x, sigma, cond, 1.0)  # a role's frozen query leaves the others as they are
    with roles["surrogate"].trained():
        adapter.velocity(x, sigma, cond, 1.0).pow(2).mean().backward()
    assert grads() == {"default": False, "fake": True, "surrogate": True}
    fake_grad = [p.grad.clone() for p in roles["fake"].params]
    reference.velocity(x, sigma, cond, 1.0)
    roles["fake"].velocity(x, sigma, cond, 1.0)
    adapter.velocity(x, sigma, cond, 1.0).pow(2).mean().backward()  # the generator: "default" is active
    assert grads() == {"default": True, "fake": True, "surrogate": True}
    assert all(torch.equal(a, p.grad) for a, p in zip(fake_grad, roles["fake"].params))
    assert old.max_abs_diff() == 0 and not any(p.grad is not None for p, _ in old.pairs)
    # each role's step moves only its own weights
    before = {n: [p.detach().clone() for p in r.params] for n, r in roles.items()}
    generator_before = [p.detach().clone() for p in generator]
    roles["fake"].step(SimpleNamespace(num_processes=1), 0)
    assert not all(torch.equal(a, p) for a, p in zip(before["fake"], roles["fake"].params))
    assert all(torch.equal(a, p) for a, p in zip(before["surrogate"], roles["surrogate"].params))
    assert all(torch.equal(a, p) for a, p in zip(generator_before, generator))
    assert all(p.grad is None for p in roles["fake"].params) and roles["fake"].steps == 1
    # a non-finite gradient stops the run, naming the role, before its weights or its schedule change
    with roles["surrogate"].trained():
        (adapter.velocity(x, sigma, cond, 1.0).sum() * float("nan")).backward()
    lr = roles["surrogate"].scheduler.get_last_lr()
    with pytest.raises(RunStopped, match="^epoch 3: the surrogate gradient norm is nan; stopping before the optimizer"):
        roles["surrogate"].step(SimpleNamespace(num_processes=1), 3)
    assert all(torch.equal(a, p) for a, p in zip(before["surrogate"], roles["surrogate"].params))
    assert roles["surrogate"].scheduler.get_last_lr() == lr and roles["surrogate"].steps == 0


# ---- 1. and end to end on the tiny FLUX.1 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory, tiny_flux_path):
    out = tmp_path_factory.mktemp("tdmr1")
    run_script("algos/tdmr1.py", *FAST, "--output-dir", out)
    return out


def test_two_epochs_write_metrics_and_hold_the_step_zero_invariants(two_epoch_run):
    """Epoch 0: the generator, the fake score and the surrogate all equal the teacher (fresh adapters), so the
    replayed Euler point is the stored state (1.), the TDM and learned-reward terms are exactly 0 (6.), and the
    surrogate's first step has ℓ_S = ℓ_R = ℓ_S̄, D = 0, every group weight ½ and nothing clipped (7.)."""
    metrics = read_metrics(two_epoch_run)
    assert [m["epoch"] for m in metrics] == [0, 1]
    required = {"loss", "tdm_term", "cfg_term", "reward_term", "norm", "norm_surrogate", "fake_loss",
                "fake_dsm_loss", "surrogate_loss", "surrogate_dsm_loss", "surrogate_value_delta", "pref_loss", "anchor",
                "group_weight_mean", "clipfrac", "runaway_frac", "surrogate_drift", "sigma_tau", "sigma_reward",
                "sigma_surrogate", "replay_error", "grad_norm", "fake_grad_norm", "surrogate_grad_norm",
                "surrogate_old_decay", "zero_std_frac", "eval_reward_mean", "eval_hf_ratio"}
    assert all(required <= m.keys() for m in metrics)
    first = metrics[0]
    assert all(m["replay_error"] == 0 for m in metrics)
    assert first["tdm_term"] == first["reward_term"] == first["loss"] == first["grad_norm"] == 0
    assert first["anchor"] == 0 and first["surrogate_value_delta"] == 0 and first["surrogate_drift"] == 0
    assert first["group_weight_mean"] == 0.5 and first["clipfrac"] == 0 and first["runaway_frac"] == 0
    assert first["fake_grad_norm"] > 0 and first["surrogate_grad_norm"] > 0
    assert [m["surrogate_old_decay"] for m in metrics] == pytest.approx([0.001, 0.002])
    second = metrics[1]  # f and S have moved: the generator's terms are on
    assert second["tdm_term"] > 0 and second["reward_term"] > 0 and second["grad_norm"] > 0 and second["anchor"] > 0
    states = torch.load(two_epoch_run / "checkpoints" / "epoch_000001" / "training_state.pt", weights_only=True)
    assert {"role_fake", "role_surrogate", "surrogate_old", "ema", "optimizer"} <= states.keys()
    assert states["role_fake"]["steps"] == 2 and states["role_surrogate"]["steps"] == 2


def test_no_rl_is_plain_tdm(tmp_path, tiny_flux_path):
    run_script("algos/tdmr1.py", *FAST, "--no-rl", "--group-size", "1", "--prompts-per-epoch", "4",
               "--output-dir", tmp_path)
    metrics = read_metrics(tmp_path)
    assert "surrogate_loss" not in metrics[0] and "reward_term" not in metrics[0]
    assert metrics[0]["loss"] == metrics[0]["tdm_term"] == 0 and metrics[1]["loss"] == metrics[1]["tdm_term"] > 0
    states = torch.load(tmp_path / "checkpoints" / "epoch_000001" / "training_state.pt", weights_only=True)
    assert "role_fake" in states and "role_surrogate" not in states


@pytest.mark.parametrize("reference_cfg", [False, True])
def test_a_true_cfg_model_at_step_zero(tmp_path, reference_cfg):
    """6. on the tiny SD3 (true CFG; the authors' w_R 4.5, λ 3.5, w_S 4.5): with every adapter fresh the TDM term is
    0, the CFG term is not, and the learned-reward term is (w_S − 1)·(x̂0_c − x̂0_u) ≠ 0 in the authors' form, 0 with
    --surrogate-ref-cfg (Flow-Factory's: the teacher at w_S too)."""
    run_script("algos/tdmr1.py", *TINY, "--model", "sd3", "--model-path", "tiny", "--resolution", "32",
               "--max-sequence-length", "16", "--epochs", "1", "--prompts-per-epoch", "1", "--group-size", "4",
               "--batch-size", "4", "--eval-every", "1", "--eval-num-prompts", "1",
               *(["--surrogate-ref-cfg"] if reference_cfg else []), "--output-dir", tmp_path)
    (m,) = read_metrics(tmp_path)
    assert m["tdm_term"] == 0 and m["cfg_term"] > 0 and m["replay_error"] == 0
    assert (m["reward_term"] == 0) == reference_cfg
    assert m["group_weight_mean"] == 0.5 and m["anchor"] == 0


@SLOW
def test_kill_and_resume_restores_every_role_exactly(tmp_path, tiny_flux_path):
    """SIGKILL after the epoch-3 checkpoint; the resumed run's metrics (every role's losses and gradient norms, S̄'s
    drift, the EMA's evaluation) and final weights equal the uninterrupted run's."""
    args = TINY + ["--epochs", "6", "--save-every", "2", "--eval-every", "3", "--eval-num-prompts", "2",
                   "--batch-size", "4"]
    run_script("algos/tdmr1.py", *args, "--output-dir", tmp_path / "full")
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(REPO / "algos/tdmr1.py"), *args, "--output-dir", str(killed)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() == "epoch_000003") and time.time() < deadline:
        time.sleep(0.02)
    still_running = process.poll() is None
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert still_running, "the run finished before it could be killed"
    run_script("algos/tdmr1.py", *args, "--output-dir", killed, "--resume")
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(killed, base=True)) == strip(read_metrics(tmp_path / "full", base=True))
    last = [folder / "checkpoints" / "epoch_000005" for folder in (killed, tmp_path / "full")]
    weights = [load_file(folder / "pytorch_lora_weights.safetensors") for folder in last]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
    states = [torch.load(folder / "training_state.pt", weights_only=True) for folder in last]
    for key in ("role_fake", "role_surrogate"):
        assert all(torch.equal(a, b) for a, b in zip(states[0][key]["weights"], states[1][key]["weights"]))
    assert all(torch.equal(a, b) for a, b in zip(states[0]["surrogate_old"]["weights"],
                                                 states[1]["surrogate_old"]["weights"]))


@SLOW
def test_two_processes(tmp_path, two_epoch_run):
    """One group per process: every draw is a function of the group, and the roles' gradients are all-reduced by
    hand (no DDP reduction with several adapters), so both epochs match the single process's."""
    run_script("algos/tdmr1.py", *FAST, "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    m1, m2 = read_metrics(two_epoch_run), read_metrics(tmp_path)
    assert [m["num_processes"] for m in m2] == [2, 2]
    for key in ("reward_mean", "fake_loss", "surrogate_loss", "surrogate_dsm_loss", "fake_grad_norm",
                "surrogate_grad_norm"):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5), key
    for key in ("reward_mean", "loss", "tdm_term", "reward_term", "anchor", "grad_norm", "fake_loss"):
        assert m2[1][key] == pytest.approx(m1[1][key], rel=1e-3, abs=1e-7), key


def _error_of(*args):
    return script_error("algos/tdmr1.py", *args)


@pytest.mark.parametrize("flags,message", [
    (["--train-steps", "4"], "--train-steps must be in [1, 3] (distinct steps of the N), got 4"),
    (["--rl-steps", "5"], "--rl-steps must be in [0, 3], got 5"),
    (["--tdm-weight", "1.5"], "--tdm-weight must be in [0, 1], got 1.5"),
    (["--group-size", "1"], "--group-size must be at least 2 (advantages compare a sample with its group; --no-rl"),
    (["--updates-per-epoch", "2"], "--updates-per-epoch must be 1"),
    (["--full-finetune"], "--full-finetune would need three transformer copies"),
    (["--teacher-cfg", "4.5"], "--teacher-cfg 4.5: flux1 has no true CFG"),
    (["--surrogate-cfg", "2"], "--surrogate-cfg 2.0: flux1 has no true CFG"),
    (["--cfg-reward-scale", "3.5"], "--cfg-reward-scale 3.5 needs the teacher's CFG"),
    (["--fake-updates", "0"], "--fake-updates must be at least 1"),
    (["--reward-tmin", "1"], "--reward-tmin must be in [0, 1), got 1.0"),
    (["--beta-pref", "0"], "--beta-pref must be positive"),
    (["--query-shift", "-1"], "--query-shift must be positive"),
    (["--init-lora", "/nonexistent"], "--init-lora /nonexistent is not a folder"),
])
def test_bad_input_gives_one_line_error(tmp_path, flags, message):
    assert message in _error_of(*TINY, "--epochs", "1", "--output-dir", tmp_path / "out", *flags)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_sd3_ocr_preset_holds_the_authors_setting():
    preset = tdmr1.PRESETS["sd3-ocr"]
    assert preset["num_steps"] == 4 and preset["group_size"] == 24 and preset["prompts_per_epoch"] == 48
    assert (preset["beta_pref"], preset["reward_tmin"], preset["surrogate_tmin"], preset["surrogate_cfg"]) == \
        (10.0, 0.3, 0.3, 4.5)
    assert (preset["teacher_cfg"], preset["cfg_reward_scale"], preset["tdm_weight"], preset["train_steps"]) == \
        (4.5, 3.5, 0.3, 2)
    assert (preset["learning_rate"], preset["fake_learning_rate"], preset["surrogate_learning_rate"]) == \
        (7.5e-5, 3e-4, 3e-4)
    geneval = tdmr1.PRESETS["sd3-geneval"]
    assert (geneval["beta_pref"], geneval["reward_tmin"], geneval["surrogate_tmin"], geneval["surrogate_cfg"]) == \
        (1.0, 0.25, 0.55, 2.5)


# ---- learning on the toy world (full tier) ---------------------------------------------------------------------
@pytest.mark.parametrize("state,message", [
    (dict(is_fsdp2=True, distributed_type="FSDP"), "FSDP2 and DeepSpeed are not supported yet"),
    (dict(is_fsdp2=False, distributed_type="DEEPSPEED"), "FSDP2 and DeepSpeed are not supported yet"),
])
def test_trained_roles_refuse_fsdp2_and_deepspeed_in_one_line(state, message):
    """accelerate runs DDP on CPUs whatever its config asks, so the refusal is checked on the accelerator's state."""
    from accelerate.utils import DistributedType

    from common.roles import check_roles
    from common.utils import UserError

    accelerator = SimpleNamespace(is_fsdp2=state["is_fsdp2"], distributed_type=DistributedType[state["distributed_type"]])
    with pytest.raises(UserError, match=message):
        check_roles(SimpleNamespace(full_finetune=False, sequence_parallel=1), accelerator)
    with pytest.raises(UserError, match="--sequence-parallel"):
        check_roles(SimpleNamespace(full_finetune=False, sequence_parallel=2), SimpleNamespace(
            is_fsdp2=False, distributed_type=DistributedType.MULTI_GPU))
@SLOW
def test_the_toy_student_beats_the_teacher_at_its_steps(tmp_path):
    """--preset toy-student for its first 50 iterations, seed 1: the 4-step student's held-out strict success (36
    prompts × 4 seeds, its EMA) passes the untrained generator's — the teacher run at 4 steps, 0.306 (pinned) — by
    0.06, about half of the +0.13 seen when written (0.4375 at iteration 50 of the shipped student's run)."""
    run_script("algos/tdmr1.py", "--preset", "toy-student", "--epochs", "50", "--eval-every", "100", "--save-every",
               "0", "--output-dir", tmp_path, timeout=1800)
    metrics = read_metrics(tmp_path, base=True)
    base, last = metrics[0], metrics[-1]
    print(f"held-out strict {base['eval_toy_strict']:.3f} -> {last['eval_toy_strict']:.3f}, blur ratio "
          f"{base['eval_blur_ratio']:.3f} -> {last['eval_blur_ratio']:.3f}")
    assert base["epoch"] == -1 and base["eval_toy_strict"] == pytest.approx(0.3056, abs=1e-3)
    assert last["epoch"] == 49 and last["eval_toy_strict"] > base["eval_toy_strict"] + 0.06
