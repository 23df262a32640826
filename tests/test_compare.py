"""benchmarks/compare.py end to end on a 1-seed, 2-epoch smoke setting: the table's numbers against a
computation of our own from the runs' metrics.jsonl, and the plot."""

import importlib.util
import math

import numpy as np
from PIL import Image

from conftest import REPO, SLOW, read_metrics, run_script

COLUMNS = ["algorithm", "M×K", "epochs", "final", "reached", "epochs to threshold", "samples to threshold",
           "time to threshold (s)", "CPU min to threshold", "rollout s/epoch", "reward s/epoch", "train s/epoch",
           "epoch s", "run wall s", "CPU min"]
# The tiny FLUX.1 and the JPEG reward (each script's `tiny` preset: M·K = 16), 2 epochs, 2 runs side by side.
SMOKE = ["--algos", "grpo", "nft", "--seeds", "1", "--preset", "tiny", "--model-path", "tiny", "--reward",
         "jpeg_compressibility", "--resolution", "64", "--budget", "32", "--metric", "eval", "--eval-every", "1",
         "--eval-num-prompts", "2", "--eval-seeds", "1", "--warmup", "1", "--start-points", "1", "--smooth", "1",
         "--threshold-gain", "0.15"]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of the text: its rows (header first, the --- row left out) as lists of cells."""
    found, current = [], None
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current = (current or []) + [[c.strip() for c in line.strip("|").split("|")]]
        elif current:
            found.append([row for row in current if set("".join(row)) != {"-"}])
            current = None
    return found


def parse_table(text: str) -> dict[str, dict[str, str]]:
    rows = [line for line in text.split("\n\n| algorithm | seed")[0].splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == COLUMNS
    assert set(rows[1].replace("|", "")) == {"-"}
    table = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS)
        table[cells[0]] = dict(zip(COLUMNS, cells))
    return table


def check_cell(cell: str, values: list[float]):
    """A `mean ± std` cell against the values over seeds (the table rounds to 3 decimals)."""
    if not values:
        assert cell == "–"
        return
    mean, std = (float(x) for x in cell.split("±"))
    assert abs(mean - np.mean(values)) <= 5e-4 + 1e-9 and abs(std - np.std(values)) <= 5e-4 + 1e-9, (cell, values)


def expected(metrics: list[dict], threshold: float, warmup: int, samples_per_epoch: int) -> dict:
    """Our own reading of one run: eval points (the first: the untrained model's, at 0 s and 0 epochs), training
    seconds so far, and the threshold crossing."""
    seconds, points = 0.0, []
    for m in metrics:
        if m["epoch"] >= 0:
            seconds += m["rollout_time_s"] + m["reward_time_s"] + m["train_time_s"]
        if "eval_reward_mean" in m:
            points.append((m["eval_reward_mean"], seconds, m["epoch"] + 1))
    n_final = max(1, math.ceil(len(points) / 10))
    crossing = next((p for p in points if p[0] >= threshold), None)  # --smooth 1: the points themselves
    timed = [m for m in metrics if m["epoch"] >= 0][warmup:]
    return {
        "final": sum(p[0] for p in points[-n_final:]) / n_final,
        "epochs_to": [crossing[2]] if crossing else [],
        "time_to": [crossing[1]] if crossing else [],
        "rollout": sum(m["rollout_time_s"] for m in timed) / len(timed),
        "reward": sum(m["reward_time_s"] for m in timed) / len(timed),
        "train": sum(m["train_time_s"] for m in timed) / len(timed),
        "first": points[0][0],
        "points": [p[0] for p in points],
    }


def test_compare_smoke(tmp_path):
    out = tmp_path / "compare"
    run_script("benchmarks/compare.py", *SMOKE, "--output-dir", out, timeout=300)
    runs = {algo: read_metrics(out / f"{algo}-1", base=True) for algo in ("grpo", "nft")}
    for algo, metrics in runs.items():
        assert [m["epoch"] for m in metrics] == [-1, 0, 1] and all("eval_reward_mean" in m for m in metrics), algo
        assert metrics[-1]["samples_seen"] == 32

    # threshold: each run's own base (its first point, the evaluation before the first update) + --threshold-gain
    mine = {algo: expected(m, -math.inf, 1, 16) for algo, m in runs.items()}
    threshold = np.mean([e["first"] for e in mine.values()]) + 0.15  # the caption's mean
    table = parse_table((out / "results.md").read_text())
    assert list(table) == ["grpo", "nft"]
    for algo, metrics in runs.items():
        e = expected(metrics, mine[algo]["first"] + 0.15, 1, 16)
        row = table[algo]
        assert row["M×K"] == "2×8" and row["epochs"] == "2"
        check_cell(row["final"], [e["final"]])
        assert row["reached"] == f"{len(e['epochs_to'])}/1"
        check_cell(row["epochs to threshold"], e["epochs_to"])
        check_cell(row["time to threshold (s)"], e["time_to"])
        check_cell(row["rollout s/epoch"], [e["rollout"]])
        check_cell(row["reward s/epoch"], [e["reward"]])
        check_cell(row["train s/epoch"], [e["train"]])
        check_cell(row["epoch s"], [e["rollout"] + e["reward"] + e["train"]])
        check_cell(row["samples to threshold"], [16 * n for n in e["epochs_to"]])
        wall = float((out / f"{algo}-1" / "wall_time_s.txt").read_text())
        assert wall > sum(m["epoch_time_s"] for m in metrics if m["epoch"] >= 0)  # the process also loads the model
        check_cell(row["run wall s"], [wall])
        cpu = float((out / f"{algo}-1" / "cpu_time_s.txt").read_text())
        assert 0 < cpu < 2 * wall  # one thread: the CPU time of the run's own process
        check_cell(row["CPU min"], [cpu / 60])
    text = (out / "results.md").read_text()
    assert f"Threshold (mean) {threshold:.3f}" in text
    assert text.startswith("`python benchmarks/compare.py --algos grpo nft")  # the caption holds the command

    image = Image.open(out / "compare.png")
    image.verify()
    image = Image.open(out / "compare.png").convert("RGB")
    assert image.size == (1400, 560)
    pixels = np.asarray(image).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50  # text, grid, curves: not blank
    for color in [(31, 119, 180), (255, 127, 14)]:  # each algorithm's curve and legend colour is drawn
        assert (pixels == color).all(1).sum() > 100, color

    # Analysis again on the same runs (--reuse: nothing reruns) with a threshold that grpo's second eval
    # point reaches by construction, so the crossing columns hold numbers.
    stamp = {algo: (out / f"{algo}-1" / "metrics.jsonl").stat().st_mtime_ns for algo in runs}
    level = max(mine["grpo"]["points"])
    run_script("benchmarks/compare.py", *SMOKE, "--output-dir", out, "--reuse", "--threshold", repr(level))
    assert {algo: (out / f"{algo}-1" / "metrics.jsonl").stat().st_mtime_ns for algo in runs} == stamp
    table = parse_table((out / "results.md").read_text())
    for algo, metrics in runs.items():
        e = expected(metrics, level, 1, 16)
        assert table[algo]["reached"] == f"{len(e['epochs_to'])}/1"
        check_cell(table[algo]["epochs to threshold"], e["epochs_to"])
        check_cell(table[algo]["time to threshold (s)"], e["time_to"])
    assert table["grpo"]["reached"] == "1/1"

    # The per-seed table: base, threshold, samples and CPU-seconds to it; the ratio table: grpo's over each one's.
    per_seed, ratios = tables((out / "results.md").read_text())[1:]
    assert per_seed[0] == ["algorithm", "seed", "base", "threshold", "final", "best", "samples to threshold",
                           "CPU s to threshold"]
    cpu_to = {}
    for row in per_seed[1:]:
        algo, e = row[0], expected(runs[row[0]], level, 1, 16)
        assert row[1] == "1" and float(row[2]) == round(e["first"], 3) and float(row[3]) == round(level, 3)
        assert row[6] == (f"{16 * e['epochs_to'][0]}" if e["epochs_to"] else "–")
        if e["epochs_to"]:
            seconds = [m["rollout_time_s"] + m["reward_time_s"] + m["train_time_s"] for m in runs[algo] if m["epoch"] >= 0]
            cpu = float((out / f"{algo}-1" / "cpu_time_s.txt").read_text())
            wall = float((out / f"{algo}-1" / "wall_time_s.txt").read_text())
            assert wall > sum(seconds)  # start-up and evaluation are in the process's wall time, not in training's
            cpu_to[algo] = cpu * e["time_to"][0] / wall
            assert abs(float(row[7]) - cpu_to[algo]) <= 0.5 + 1e-9
    assert ratios[0] == ["algorithm", "reached", "samples ratio", "CPU-seconds ratio"] and ratios[1][0] == "nft"
    if "nft" in cpu_to and all(expected(runs[a], level, 1, 16)["epochs_to"][0] > 0 for a in ("grpo", "nft")):
        e_grpo, e_nft = (expected(runs[a], level, 1, 16) for a in ("grpo", "nft"))
        ratio = e_grpo["epochs_to"][0] / e_nft["epochs_to"][0]
        assert ratios[1][2] == f"{ratio:.2f} ({ratio:.2f}–{ratio:.2f})"
    else:
        assert ratios[1][2] == ratios[1][3] == "–"


def load_compare():
    """benchmarks/compare.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare


def test_first_reach_and_ticks():
    compare = load_compare()
    values = np.array([0.0, 1.0, 0.0, 3.0])
    assert compare.first_reach(values, 1.0, 1) == 1
    assert compare.first_reach(values, 1.0, 2) == 3  # trailing means 0, 0.5, 0.5, 1.5
    assert compare.first_reach(values, 5.0, 1) is None
    assert compare.nice_ticks(0.0, 93.0) == [0.0, 20.0, 40.0, 60.0, 80.0]
    assert np.allclose(compare.nice_ticks(-3.61, -3.38), [-3.6, -3.55, -3.5, -3.45, -3.4])
    # every script can be drawn in a colour of its own (a 9th script once fell off the plot and its legend)
    assert len(set(compare.COLORS)) == len(compare.COLORS) >= len(compare.ALGOS)


def test_next_run_starts_each_algorithm_once_then_the_longest():
    compare = load_compare()
    waiting = ["a", "b", "c", "a", "b", "c"]  # seeds 1 and 2, seed-major
    assert compare.next_run(waiting, {}) == 0
    assert compare.next_run(waiting, {"a": 5.0}) == 1  # b is not timed yet: its first run before a's second
    measured = {"a": 5.0, "b": 9.0, "c": 1.0}
    order = []
    waiting = ["a", "b", "c"]
    while waiting:
        order.append(waiting.pop(compare.next_run(waiting, measured)))
    assert order == ["b", "a", "c"]


def test_repeated_reward_flags_all_reach_the_script(tmp_path):
    """`--reward A --reward B` passes both, as the scripts' own --reward does (once only B reached them)."""
    import tyro

    compare = load_compare()
    args = tyro.cli(compare.Args, args=["--algos", "grpo", "--reward", "toy_edit,mode=strict",
                                        "--reward", "toy_edit:0.25,name=partial"])
    command = compare.command_of(args, "grpo", 1, 2, tmp_path, "toy")
    rewards = [command[i + 1] for i, flag in enumerate(command) if flag == "--reward"]
    assert rewards == ["toy_edit,mode=strict", "toy_edit:0.25,name=partial"]
    unset = tyro.cli(compare.Args, args=["--algos", "grpo"])
    assert "reward" not in compare.task_overrides(unset)  # no --reward: each preset keeps its own


def test_a_run_stopped_at_its_base_evaluation():
    """A run stopped at threshold before any epoch line was written (its base evaluation already reached the
    threshold; CI caught this race): 0 samples and 0 CPU-seconds to threshold, no error."""
    compare = load_compare()
    args = compare.Args(algos=["nft"], seeds=[1], metric="eval", threshold=-1000.0, start_points=1, smooth=1)
    base_only = [{"epoch": -1, "eval_reward_mean": 0.5}]
    two_epochs = base_only + [{"epoch": e, "samples_seen": 16 * (e + 1), "rollout_time_s": 1.0, "reward_time_s": 0.5,
                               "train_time_s": 0.5, "eval_reward_mean": 0.6} for e in range(2)]
    summary, start, threshold = compare.summarise(args, {"nft": [base_only], "grpo": [two_epochs]},
                                                  {"nft": [3.0], "grpo": [8.0]}, {"nft": [4.0], "grpo": [9.0]})
    assert start == 0.5 and threshold == -1000.0
    for algo in ("nft", "grpo"):
        row = summary[algo]
        assert row["reached"] == 1 and row["per_seed_samples_to"] == [0.0] and row["per_seed_cpu_s_to"] == [0.0]
        assert row["epochs_to"] == [0.0] and row["cpu_min_to"] == [0.0]
    assert math.isnan(summary["nft"]["epoch"][0]) and summary["grpo"]["epoch"] == [2.0]


def test_cpu_to_threshold_leaves_out_start_up_and_evaluation():
    """CPU-seconds to threshold are the run's CPU time × the share of its wall time spent training up to the
    crossing: the 25 of its 40 wall seconds that start-up and evaluation took do not count as training."""
    compare = load_compare()
    args = compare.Args(algos=["grpo"], seeds=[1], metric="eval", threshold=0.65, start_points=1, smooth=1)
    metrics = [{"epoch": -1, "eval_reward_mean": 0.5}] + [
        {"epoch": e, "samples_seen": 16 * (e + 1), "rollout_time_s": 3.0, "reward_time_s": 0.5, "train_time_s": 1.5,
         "eval_reward_mean": v} for e, v in enumerate([0.6, 0.7, 0.8])]
    # 15 training seconds in a 40-second process that used 30 CPU-seconds; the crossing is after 2 epochs (10 s)
    summary = compare.summarise(args, {"grpo": [metrics]}, {"grpo": [30.0]}, {"grpo": [40.0]})[0]["grpo"]
    assert summary["epochs_to"] == [2.0] and summary["time_to"] == [10.0]
    assert summary["per_seed_cpu_s_to"] == [30.0 * 10.0 / 40.0] and summary["cpu_min_to"] == [7.5 / 60]


def test_bad_flags():
    result = run_script("benchmarks/compare.py", "--algos", "grpo", "ppo", check=False)
    assert result.returncode == 2 and "error: unknown --algos ppo; choose from: awm, crd, dgpo, dpo, " in result.stderr
    result = run_script("benchmarks/compare.py", "--algos", "grpo", "--budget", "8", check=False)
    assert result.returncode == 2 and "less than one epoch of grpo's M·K" in result.stderr, result.stderr
    result = run_script("benchmarks/compare.py", "--extra-args=--seed 3", check=False)
    assert result.returncode == 2 and "--extra-args sets --seed" in result.stderr, result.stderr


@SLOW
def test_stop_at_threshold(tmp_path):
    """--stop-at-threshold ends a run once its curve reaches its threshold: here the untrained model's own
    evaluation does, so the run stops long before its 20 epochs, and --reuse keeps the stopped run."""
    out = tmp_path / "compare"
    flags = ["--algos", "nft", *SMOKE[3:]]
    flags[flags.index("--budget") + 1] = "320"  # 20 epochs of M·K = 16
    run_script("benchmarks/compare.py", *flags, "--output-dir", out, "--threshold", "-1000", "--stop-at-threshold",
               timeout=300)
    metrics = read_metrics(out / "nft-1", base=True)
    assert metrics[0]["epoch"] == -1 and len(metrics) < 1 + 20
    assert (out / "nft-1" / "stopped_at_threshold.txt").exists()
    table = parse_table((out / "results.md").read_text())
    assert table["nft"]["reached"] == "1/1" and table["nft"]["epochs to threshold"].startswith("0.000")
    stamp = (out / "nft-1" / "metrics.jsonl").stat().st_mtime_ns
    run_script("benchmarks/compare.py", *flags, "--output-dir", out, "--threshold", "-1000", "--reuse")
    assert (out / "nft-1" / "metrics.jsonl").stat().st_mtime_ns == stamp


def test_a_run_folder_in_use_is_left_alone(tmp_path):
    """A second compare.py on a run folder another process holds (its .lock) stops with one line and clears
    nothing: it used to empty the live run's metrics.jsonl and logs before the script refused the folder."""
    import fcntl
    import os

    out = tmp_path / "compare"
    run_dir = out / "nft-1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"epoch": -1}\n')
    (run_dir / "stdout.log").write_text("epoch=-1\n")
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242 elsewhere\n")
    try:
        result = run_script("benchmarks/compare.py", "--algos", "nft", *SMOKE[3:], "--output-dir", out, check=False)
    finally:
        os.close(fd)
    assert result.returncode == 2
    assert "in use by another run (process 4242 elsewhere)" in result.stderr.strip().splitlines()[-1]
    assert (run_dir / "metrics.jsonl").read_text() == '{"epoch": -1}\n'
    assert (run_dir / "stdout.log").read_text() == "epoch=-1\n"
