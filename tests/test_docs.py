"""The documentation stays true to the code where that can be checked mechanically: every line citation of a named
function in docs/algorithms.md (`name`, line N / lines N–M) points at lines of its section's script that hold the
name, and the README and docs/ link only to files that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTION = re.compile(r"^#{2,3} .*?\(`((?:algos|common)/\w+\.py)`")
# `name` or `name(arg)`, then within a few characters "line N" or "lines N–M"
CITATION = re.compile(r"`(\w+)(\([^`]*\))?`[^`\n]{0,3}?\(?lines? (\d+)(?:[–-](\d+))?")


def _citations():
    source = None
    for number, line in enumerate((REPO / "docs/algorithms.md").read_text().splitlines(), 1):
        header = SECTION.match(line)
        if header:
            source = header.group(1)
        elif line.startswith("## "):
            source = None  # a section of its own with no script: its citations name their file
        if source is None:
            continue
        for match in CITATION.finditer(line):
            name, call, first, last = match.groups()
            yield number, source, name + (call or ""), int(first), int(last or first)


def test_line_citations_in_algorithms_md_point_at_the_named_code():
    citations = list(_citations())
    assert len(citations) >= 15  # the pattern still finds the document's citations
    stale = []
    for doc_line, source, name, first, last in citations:
        code = (REPO / source).read_text().splitlines()
        wanted = name.split("(")[0] + ("(" if "(" in name else "")
        if not any(wanted in text for text in code[first - 1:last]):
            found = [i for i, text in enumerate(code, 1) if re.search(rf"\bdef {re.escape(wanted)}\b", text)
                     or wanted in text]
            stale.append(f"docs/algorithms.md:{doc_line}: `{name}` cited at {source}:{first}-{last}, found at "
                         f"{found[:3]}")
    assert not stale, "\n".join(stale)


def test_readme_and_docs_link_only_to_files_that_exist():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
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
