"""The documentation stays true to the code where that can be checked mechanically: docs/algorithms.md cites code by
name, never by line number, and every name it cites exists where it says (a step `# ---- N. title` of its section's
script, a name used inside that step, a function or variable of the script or of common/); the README and docs/ link
only to files that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALGORITHMS_MD = REPO / "docs/algorithms.md"
# a section about one file: "## ... (`algos/x.py`" or "### ... (`common/x.py`"; any other section cites no file
SECTION = re.compile(r"^#{2,3} .*?\(`((?:algos|common)/\w+\.py)`")
# a step of a script's loop: "step `# ---- 4. update`", or "`grpo.py` step `# ---- 4. update`" for another script
STEP = re.compile(r"(?:`(?P<file>(?:algos/|common/)?\w+\.py)` )?step `# ---- (?P<number>\d+)\. (?P<title>[^`]+)`")
# a name used inside a step: "`sde_step(..., prev_sample=x_next)` in step `# ---- 4. update`"
NAME_IN_STEP = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)(?:\([^`]*\))?` in " + STEP.pattern)
# any other code name: `name`, `name(...)`, `object.name`; what holds an underscore, a dot or a call is code
NAME = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)(?P<call>\([^`]*\))?`")
# names of the reference implementations' code or configs (not ours), and metric names built from a teacher's name
NOT_OURS = {"ref_update_step", "clip_kl", "weight_temp", "kl_base",
            # TDM-R1's, TDM's and Flow-Factory's (algorithms.md §9)
            "inv_convert", "t_min_dgpo", "t_min_dgpo_reward", "tdm_fake_loss", "reg_threshold", "use_tweight",
            "rl_cfg", "trunc_steps", "coop_samples", "TDM_R1_DEFAULT_OPTIMIZERS", "ema_decay_g", "lora_remap",
            "use_ada_weight"}
LINE_NUMBER = re.compile(r"\blines?\s+\d+")


def _script(name: str | None, section: str | None) -> str | None:
    if name is None:
        return section
    return name if "/" in name else f"algos/{name}"


def _step_block(code: list[str], number: str, title: str) -> list[str] | None:
    """The lines of the step whose comment starts `# ---- N. title`, up to the next step comment."""
    starts = [i for i, text in enumerate(code) if text.strip().startswith(f"# ---- {number}. {title}")]
    if len(starts) != 1:
        return None
    end = next((i for i in range(starts[0] + 1, len(code)) if code[i].strip().startswith("# ---- ")), len(code))
    return code[starts[0]:end]


def _sections():
    """(doc line number, text, the file its section is about or None)."""
    source = None
    for number, line in enumerate(ALGORITHMS_MD.read_text().splitlines(), 1):
        header = SECTION.match(line)
        if header:
            source = header.group(1)
        elif line.startswith("## ") or line.startswith("### "):
            source = None  # a section with no file of its own: its citations name their file
        yield number, line, source


def test_algorithms_md_cites_code_by_name_not_by_line_number():
    text = ALGORITHMS_MD.read_text()
    numbered = [f"docs/algorithms.md:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
                for m in LINE_NUMBER.finditer(text)]  # "line\n  219" too: the whole text, not line by line
    assert not numbered, "\n".join(numbered)


def test_cited_steps_exist_and_names_cited_in_a_step_are_used_there():
    checked, stale = 0, []
    for doc_line, line, section in _sections():
        for match in STEP.finditer(line):
            source = _script(match.group("file"), section)
            where = f"docs/algorithms.md:{doc_line}: step `# ---- {match['number']}. {match['title']}`"
            if source is None:
                stale.append(f"{where} names no file (no section file, no `script.py` before it)")
            elif _step_block((REPO / source).read_text().splitlines(), match["number"], match["title"]) is None:
                stale.append(f"{where} is not one step comment of {source}")
            checked += 1
        for match in NAME_IN_STEP.finditer(line):
            source = _script(match.group("file"), section)
            block = _step_block((REPO / source).read_text().splitlines(), match["number"], match["title"]) or []
            last = match["name"].split(".")[-1]
            if not any(re.search(rf"\b{re.escape(last)}\b", text) for text in block):
                stale.append(f"docs/algorithms.md:{doc_line}: `{match['name']}` is not used in step "
                             f"`# ---- {match['number']}. {match['title']}` of {source}")
    assert checked >= 40  # the pattern still finds the document's step citations
    assert not stale, "\n".join(stale)


def test_cited_names_exist_in_the_sections_script_or_in_common():
    # common/ holds the shared code, recipes/ the presets the scripts merge in
    common = "\n".join(p.read_text() for folder in ("common", "recipes") for p in sorted((REPO / folder).rglob("*.py")))
    checked, stale = 0, []
    for doc_line, line, section in _sections():
        if section is None:
            continue
        code = (REPO / section).read_text()
        for match in NAME.finditer(line):
            name = match["name"]
            if re.search(r"\.(py|yaml|sh|jsonl?|md)$", name) or name.startswith("test_") or name in NOT_OURS:
                continue  # a file or a test (their own checks), or not our code
            if not ("_" in name or "." in name or match["call"]):
                continue  # a value such as `ode` or `t2`, not a name
            last = name.split(".")[-1]
            pattern = rf"\b{re.escape(last)}\b" + (r"\s*\(" if match["call"] else "")
            if not re.search(pattern, code) and not re.search(pattern, common):
                stale.append(f"docs/algorithms.md:{doc_line}: `{name}` is in neither {section} nor common/ or recipes/")
            checked += 1
    assert checked >= 100  # the pattern still finds the document's names
    assert not stale, "\n".join(stale)


def test_readme_and_docs_link_only_to_files_that_exist():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} links to {target}")
    assert not broken, "\n".join(broken)


def _models_md_bullet(start: str) -> str:
    text = (REPO / "docs" / "models.md").read_text()
    return " ".join(next(b for b in text.split("\n- ") if b.startswith(start)).split())


def test_models_md_names_each_model_s_lora_loader():
    """The loader bullet says `load_lora_weights` and names as its exceptions exactly the models whose stock pipeline
    class has no `load_lora_weights`, with the call that loads theirs."""
    import diffusers

    from common.models import ADAPTERS

    bullet = _models_md_bullet("Checkpoints")
    exceptions = bullet.split(" except ", 1)[1].split(":", 1)[0] if " except " in bullet else ""
    lacking = {model for model, adapter in ADAPTERS.items()
               if not hasattr(getattr(diffusers, adapter.pipeline_class_name), "load_lora_weights")}
    assert "load_lora_weights" in bullet and set(re.findall(r"`([\w.-]+)`", exceptions)) == lacking
    assert "pipe.transformer.load_lora_adapter(folder" in bullet


def test_models_md_gives_each_model_s_default_text_length():
    from common.models import ADAPTERS, default_max_sequence_length

    bullet = _models_md_bullet("Text length")
    listed = {model: int(length) for length, models in re.findall(r"(\d+) for ((?:`[\w.-]+`(?:,| and| )*)+)", bullet)
              for model in re.findall(r"`([\w.-]+)`", models)}
    assert "512 for every other model" in bullet
    assert {model: listed.get(model, 512) for model in ADAPTERS} == \
        {model: default_max_sequence_length(model) for model in ADAPTERS}
