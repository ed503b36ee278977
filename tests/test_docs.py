"""The course's texts point at things that exist: every link into docs/reference.md (or any
other page) names a file that is there and a heading that is in it.

GitHub turns a heading into an anchor by lower-casing it, dropping everything but letters,
digits, spaces, hyphens and underscores, and writing spaces as hyphens; a repeated heading
gets -1, -2, ...
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXTS = sorted([ROOT / "README.md", *ROOT.glob("lessons/*.md"), *ROOT.glob("docs/*.md")])
# Code whose docstrings and printed lines cite the reference page by section.
CODE = [ROOT / "minidist/lessons/harness.py", ROOT / "minidist/lessons/00_single_process.py",
        ROOT / "minidist/lessons/01_collectives.py"]


def anchors(page):
    """The anchors of a Markdown page's headings (outside code blocks)."""
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} +(.*?) *#*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def markdown_links(page):
    """(target file, anchor or None) for every relative Markdown link of a page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):            # http:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        yield (page.parent / path).resolve() if path else page, anchor or None


def test_the_slug_rule():
    assert re.sub(r"[^\w\- ]", "", "The alpha-beta cost model".lower()).replace(" ", "-") == \
        "the-alpha-beta-cost-model"


@pytest.mark.parametrize("page", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_text_resolves(page):
    links = list(markdown_links(page))
    for target, anchor in links:
        assert target.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            assert target.suffix == ".md", f"{page.name}: an anchor into a non-Markdown file {target}"
            assert anchor in anchors(target), (
                f"{page.name} links to {target.name}#{anchor}; its headings give {sorted(anchors(target))}")


@pytest.mark.parametrize("source", TEXTS + CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_citation_of_the_reference_page_names_a_section(source):
    have = anchors(ROOT / "docs/reference.md")
    text = source.read_text()
    assert "REFERENCE.md" not in text, f"{source.name} cites REFERENCE.md, which is not in the project"
    for anchor in re.findall(r"reference\.md#([\w-]+)", text):
        assert anchor in have, f"{source.name} cites docs/reference.md#{anchor}; the sections are {sorted(have)}"


def test_the_lessons_cite_the_reference_page_and_the_course_map_exists():
    assert (ROOT / "lessons/README.md").exists() and (ROOT / "docs/reference.md").exists()
    for name in ("00_single_process.md", "01_collectives.md", "02_data_parallel.md", "03_tensor_parallel.md",
                 "04_pipeline_parallel.md", "07_3d_parallel.md", "08_activation_recompute.md", "05_zero.md", "06_fsdp.md",
                 "10_precision_and_compression.md"):
        assert "docs/reference.md#" in (ROOT / "lessons" / name).read_text(), name


@pytest.mark.parametrize("page", sorted(ROOT.glob("lessons/[0-9][0-9]_*.md")), ids=lambda p: p.name)
def test_each_lesson_text_ends_with_its_exercises(page):
    headings = re.findall(r"^## (.*)$", page.read_text(), flags=re.M)
    assert headings[-1] == "Exercises", f"{page.name} ends with '{headings[-1]}'"
    exercise_file = ROOT / "lessons/exercises" / page.name.replace(".md", ".py")
    stem = page.name.split("_")[0]
    files = list((ROOT / "lessons/exercises").glob(f"{stem}_*.py"))
    assert files, f"no exercise file for {page.name}"
    assert any(f"lessons/exercises/{f.name}" in page.read_text() for f in files), \
        f"{page.name} does not name its exercise file ({exercise_file.name})"
