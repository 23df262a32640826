"""Benchmarks that `evaluate.py --benchmark NAME` scores a model on: a prompt set of their own with pinned seeds,
asked through a VLM judge, and their own aggregation. GenEval 2 (arXiv:2512.16853): JSONL prompts whose atoms are
yes/no questions, Soft-TIFA per sample, means ± standard errors over prompts, overall and per category."""

import json
import math
from argparse import Namespace
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import gather_object

from common.data import Prompt, text_lines
from common.sampling import sample, sample_generators
from common.tracking import save_image_grid
from common.utils import UserError, write_text_atomic
from rewards.vlm_judge import VlmJudge

REPO = Path(__file__).resolve().parent.parent

@dataclass(frozen=True)
class BenchmarkPrompt:
    prompt: str
    category: str
    atoms: tuple[str, ...]  # geneval2: the yes/no questions, one per atom of the prompt
    seeds: tuple[int, ...]  # the noise seeds of its samples, pinned by the file
    source: str             # "file:line", for error messages


def load_geneval2(path: Path) -> list[BenchmarkPrompt]:
    """GenEval2-style JSONL, one prompt a line: {"prompt": str, "category": str, "atoms": [yes/no questions],
    "seed": int or "seeds": [int, ...]} (data/geneval2/example.jsonl; docs/running.md#benchmarks)."""
    if not path.is_file():
        raise UserError(f"--benchmark-prompts {str(path)!r} is not a file")
    records = []
    for number, line in enumerate(text_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: malformed JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise UserError(f"{where}: expected an object with \"prompt\", \"category\", \"atoms\" and \"seed\" or "
                            f"\"seeds\"")
        seeds = item.get("seeds", [item["seed"]] if "seed" in item else None)
        problems = []
        if not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            problems.append("\"prompt\" (a non-empty string)")
        if not isinstance(item.get("category"), str) or not item["category"].strip():
            problems.append("\"category\" (a non-empty string)")
        if not (isinstance(item.get("atoms"), list) and item["atoms"]
                and all(isinstance(a, str) and a.strip() for a in item["atoms"])):
            problems.append("\"atoms\" (a non-empty list of yes/no questions)")
        if not (isinstance(seeds, list) and seeds and all(type(x) is int and 0 <= x < 2**63 for x in seeds)
                and len(set(seeds)) == len(seeds)):  # int64, as every seed of the package
            problems.append("\"seed\" or \"seeds\" (distinct integers from 0 to 2^63 - 1)")
        if problems:
            raise UserError(f"{where}: needs {', '.join(problems)}")
        records.append(BenchmarkPrompt(item["prompt"], item["category"].strip(), tuple(item["atoms"]), tuple(seeds),
                                       where))
    if not records:
        raise UserError(f"{path} holds no prompts")
    return records


def score_geneval2(atoms: list[float]) -> dict:
    """Soft-TIFA (GenEval 2, arXiv:2512.16853) of one sample from its atoms' P(yes): the arithmetic mean (`soft`,
    the atom-level estimate, Soft-TIFA AM), the geometric mean (`gm`, the prompt-level one, Soft-TIFA GM) and the
    strict all-atoms check (`strict`: 1 when every atom's P(yes) > 0.5)."""
    return {"soft": sum(atoms) / len(atoms),
            "gm": 0.0 if min(atoms) <= 0 else math.exp(sum(math.log(a) for a in atoms) / len(atoms)),
            "strict": float(all(a > 0.5 for a in atoms))}


# name -> (prompt file loader, example file, per-sample score from the atoms' P(yes), metric names)
BENCHMARKS = {"geneval2": (load_geneval2, REPO / "data" / "geneval2" / "example.jsonl",
                           score_geneval2, ("soft", "gm", "strict"))}


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation / √n; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    return mean, (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0.0)


def aggregate(prompts: list[dict], metrics) -> dict:
    """A prompt's score is the mean over its seeds; the aggregate and each category's are means over prompts,
    ± the standard error over prompts (the unit GenEval2 reports; seeds of one prompt are not independent)."""
    def table(rows):
        return {"prompts": len(rows), **{k: v for m in metrics for k, v in
                                         zip((m, m + "_se"), mean_se([r[m] for r in rows]))}}

    categories = sorted({p["category"] for p in prompts})
    return {"all": table(prompts), "categories": {c: table([p for p in prompts if p["category"] == c])
                                                  for c in categories}}


def benchmark_table(name: str, benchmark: str, tables: dict, metrics, imputed: int, asked: int, judge: VlmJudge) -> str:
    lines = [f"{benchmark} of {name}", "", "| category | prompts | " + " | ".join(metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for category, row in [*tables["categories"].items(), ("all", tables["all"])]:
        cells = [f"{row[m]:.4f} ± {row[m + '_se']:.4f}" for m in metrics]
        lines.append(f"| {category} | {row['prompts']} | " + " | ".join(cells) + " |")
    lines += ["", f"imputed atoms: {imputed} of {asked} (the judge's answer held neither yes nor no among its top "
                  f"{judge.top_logprobs} tokens: scored 0.5)"]
    return "\n".join(lines)


def run_benchmark(benchmark: str, name: str, epoch: int, s: Namespace, adapter, encode, judge: VlmJudge,
                  records: list[BenchmarkPrompt], accelerator, folder: Path, ema=None) -> dict:
    """Euler-ODE samples of every prompt at its pinned seeds, split over the processes in batches of
    s.batch_size, each atom asked through `judge`; writes NAME-BENCHMARK.json/.md and the samples under `folder`."""
    _, _, score_sample, metrics = BENCHMARKS[benchmark]
    guidance = s.guidance_scale if s.guidance_scale is not None else (
        s.guidance if s.guidance is not None else adapter.default_guidance_scale)
    items = [(i, seed) for i, record in enumerate(records) for seed in record.seeds]
    sigmas, samples_dir = adapter.sigmas(s.eval_num_steps), folder / f"{name}-{benchmark}"
    adapter.transformer.eval()
    results = []
    with ema.applied() if ema is not None else nullcontext(), torch.no_grad(), \
            accelerator.split_between_processes(items) as mine:
        for start in range(0, len(mine), s.batch_size):
            batch = mine[start:start + s.batch_size]
            cond = encode([Prompt(records[i].prompt) for i, _ in batch])
            velocity = lambda x, sigma, cond=cond: adapter.velocity(x, sigma, cond, guidance)
            x0 = sample(velocity, adapter.noise(sample_generators([seed for _, seed in batch], accelerator.device)),
                        sigmas, "ode")
            images = adapter.decode(x0, cond).float().cpu()
            questions = [(row, atom) for row, (i, _) in enumerate(batch) for atom in records[i].atoms]
            answers = judge.ask(images[[row for row, _ in questions]], [atom for _, atom in questions])
            for row, (i, seed) in enumerate(batch):
                atoms = [a for (r, _), a in zip(questions, answers) if r == row]
                save_image_grid(images[row:row + 1], samples_dir / f"{i:04d}_seed{seed}.png", columns=1)
                results.append(((i, seed), atoms))
    by_item = dict(gather_object(results))  # (prompt, seed) -> its atoms' P(yes), None where imputed
    prompts = []
    for i, record in enumerate(records):
        samples = []
        for seed in record.seeds:
            atoms = [0.5 if a is None else a for a in by_item[(i, seed)]]
            samples.append({"seed": seed, "atoms": atoms, "imputed": sum(a is None for a in by_item[(i, seed)]),
                            **score_sample(atoms)})
        prompts.append({"prompt": record.prompt, "category": record.category, "questions": list(record.atoms),
                        "samples": samples, **{m: sum(x[m] for x in samples) / len(samples) for m in metrics}})
    tables = aggregate(prompts, metrics)
    every = [x for p in prompts for x in p["samples"]]
    imputed, asked = sum(x["imputed"] for x in every), sum(len(x["atoms"]) for x in every)
    result = {"name": name, "epoch": epoch, "benchmark": benchmark, "judge": f"{judge.model} at {judge.url}",
              **{f"{benchmark}_{m}{tail}": tables["all"][m + tail] for m in metrics for tail in ("", "_se")},
              "imputed_atoms": imputed, "atoms": asked, "tables": tables, "prompts": prompts}
    if accelerator.is_main_process:
        text = benchmark_table(name, benchmark, tables, metrics, imputed, asked, judge)
        print(text, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / f"{name}-{benchmark}.md", text + "\n")
        write_text_atomic(folder / f"{name}-{benchmark}.json", json.dumps(result, indent=1) + "\n")
    return result


def benchmark_judge(rewards, benchmark: str) -> VlmJudge:
    """The first vlm_judge of `rewards` (main checked that --reward names one)."""
    judges = [r.score for r in rewards if isinstance(r.score, VlmJudge)]
    if judges[0].wants_conditions:
        raise UserError(f"--benchmark {benchmark} judges text-to-image samples: drop conditions=true from its "
                        f"vlm_judge")
    return judges[0]
