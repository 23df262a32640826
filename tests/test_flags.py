"""Flag values that no run can use are refused with one line before any model loads: non-finite floats (every
script, every float flag), 0 and negatives where they would silently change or invert the loss, more optimizer
steps than samples, and a reward module that does not compile."""

import pytest

from common.cli import check_finite
from common.training import rollout_micro_batches
from common.utils import UserError
from conftest import script_error
from rewards import load_rewards

SCRIPTS = ["grpo", "grpo_guard", "mixgrpo", "nft", "awm", "dpo", "dgpo", "crd"]


def error_of(script, *flags, env=None):
    return script_error(f"algos/{script}.py", "--epochs", "1", *flags, env=env)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag, value", [("--weight-decay", "nan"), ("--learning-rate", "inf"),
                                         ("--adv-clip-max", "-inf"), ("--ema-decay", "nan")])
def test_a_non_finite_float_flag_is_refused_by_every_script(script, flag, value):
    assert error_of(script, flag, value) == f"error: {flag} must be finite, got {float(value)}"


@pytest.mark.parametrize("script, flags, message", [
    ("nft", ["--timestep-range", "0", "nan"], "--timestep-range must be finite, got 0.0 nan"),
    ("crd", ["--old-decay", "0", "0.25", "inf", "0.9"], "--old-decay must be finite, got 0 0.25 inf 0.9"),
    ("grpo", ["--clip-range", "inf"], "--clip-range must be finite, got inf"),  # not documented as "no clip" there
    ("awm", ["--clip-range", "nan"], "--clip-range must be a finite number or inf, got nan"),
    ("dgpo", ["--clip-range", "-inf"], "--clip-range must be a finite number or inf, got -inf"),
])
def test_non_finite_values_in_tuples_and_where_inf_means_no_clip(script, flags, message):
    assert error_of(script, *flags) == f"error: {message}"


@pytest.mark.parametrize("script", ["awm", "dgpo"])
def test_clip_range_inf_stays_allowed_where_it_means_no_clip(script):
    # it passes the finite check: the first error is the one planted after it
    assert error_of(script, "--clip-range", "inf", "--group-size", "1").startswith("error: --group-size must be")


def test_check_finite_takes_any_dataclass():
    from dataclasses import dataclass

    @dataclass
    class Args:
        scale: float | None = None
        pair: tuple[float, float] = (0.0, 1.0)
        name: str = "nan"

    check_finite(Args())
    with pytest.raises(UserError, match="--scale must be finite, got nan"):
        check_finite(Args(scale=float("nan")))


@pytest.mark.parametrize("script", ["grpo", "grpo_guard", "mixgrpo", "awm", "dgpo"])
@pytest.mark.parametrize("value", ["0", "-0.1"])
def test_clip_range_zero_or_negative_is_refused(script, value):
    message = error_of(script, "--clip-range", value)
    assert message.startswith("error: --clip-range must be positive") and message.endswith(f"got {float(value)}")


@pytest.mark.parametrize("script", ["grpo", "grpo_guard", "mixgrpo", "nft", "awm", "dgpo", "crd"])
def test_a_negative_kl_beta_is_refused(script):
    message = error_of(script, "--kl-beta", "-0.01")  # awm: "--kl-beta and --ema-kl-beta must be >= 0"
    assert message.startswith("error: --kl-beta ") and "must be >= 0" in message


@pytest.mark.parametrize("script, flags, message", [
    ("nft", ["--train-timesteps", "0"], "--train-timesteps must be at least 1 (unset: the default), got 0"),
    ("dpo", ["--train-timesteps", "0"], "--train-timesteps must be at least 1, got 0"),
    ("mixgrpo", ["--iters-per-window", "0"], "--iters-per-window and --window-stride must be at least 1"),
])
def test_zero_is_not_silently_the_default(script, flags, message):
    assert error_of(script, *flags) == f"error: {message}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "dgpo"])  # dgpo: exactly one step per epoch
def test_more_updates_than_samples_is_refused(script):
    flags = ["--prompts-per-epoch", "2", "--group-size", "4", "--batch-size", "8", "--updates-per-epoch", "9"]
    assert error_of(script, *flags) == ("error: --updates-per-epoch 9 exceeds the 8 samples each process has per "
                                        "epoch (--prompts-per-epoch × --group-size / processes): every optimizer "
                                        "step needs at least one")


def test_more_updates_than_samples_counts_the_launchers_processes():
    flags = ["--prompts-per-epoch", "2", "--group-size", "4", "--updates-per-epoch", "5"]
    assert "exceeds the 4 samples each process has" in error_of("grpo", *flags, env={"WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="--updates-per-epoch 5 exceeds the 4 samples"):
        rollout_micro_batches(4, 8, 5)  # after setup: the count that runs
    assert [len(b) for b in rollout_micro_batches(4, 8, 4)] == [1, 1, 1, 1]


def test_a_reward_module_with_a_syntax_error_names_its_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import torch\n\ndef score(images, prompts)\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as info:
        load_rewards(["broken_reward_mod:score"])
    assert str(info.value) == (f"--reward 'broken_reward_mod:score': {tmp_path / 'broken_reward_mod.py'}:3: "
                               f"SyntaxError in 'broken_reward_mod': expected ':'")
