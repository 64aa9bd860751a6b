"""The README and docs/ keep their shape: a README a newcomer reads in two minutes, links that lead
somewhere, an index that lists every page, and measured data beside the benches that write it.

Each check is a pure function over text or a directory tree, so a planted violation can be handed to
it and its report asserted; the tests at the bottom run each check on the repository. No model, no
Ray: only the commands of the results pages are composed (Hydra and the schema's rules), as
tests/unit/test_docs_commands.py composes those of README.md and docs/*.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_WORD_LIMIT = 2000
FIRST_COMMAND = "bash scripts/setup.sh && .venv/bin/hybridflow"
FIRST_COMMAND_BY_LINE = 30
DATA_SUFFIXES = (".json", ".png")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w/.-]+?\.md\b")


# ---- the README ----------------------------------------------------------------------------------


def readme_problems(text: str) -> list[str]:
    """What keeps a README from being a user's entry: more than README_WORD_LIMIT words (counted as
    `wc -w` counts them), the first command missing or past line FIRST_COMMAND_BY_LINE, a commit hash,
    or a table row with a date (a dated table is a results page's, not the README's)."""
    problems = []
    words = len(text.split())
    if words > README_WORD_LIMIT:
        problems.append(f"{words} words, over the limit of {README_WORD_LIMIT}: move detail to a page of docs/")
    lines = text.splitlines()
    first = next((n for n, line in enumerate(lines, 1) if line.strip() == FIRST_COMMAND), None)
    if first is None:
        problems.append(f"no line holding the first command `{FIRST_COMMAND}` alone")
    elif first > FIRST_COMMAND_BY_LINE:
        problems.append(f"the first command is at line {first}, past line {FIRST_COMMAND_BY_LINE}")
    for number, line in enumerate(lines, 1):
        for commit in COMMIT.findall(line):
            problems.append(f"line {number}: a commit hash ({commit}); histories belong on a results page")
        if line.lstrip().startswith("|") and DATE.search(line):
            problems.append(f"line {number}: a dated table row; measurements belong on a results page")
    return problems


# ---- links -----------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower-cased, every character that
    is not a letter, digit, space, hyphen or underscore dropped, each space a hyphen."""
    text = INLINE_CODE.sub(lambda m: m[2], heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*|~~)", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def anchors(text: str) -> set[str]:
    """Every anchor of a markdown page: its headings' slugs, a repeated one suffixed -1, -2, ... as
    GitHub does, and any explicit <a name=...> / id=... ."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading[2])
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of the inline links and images outside code (fenced or inline)."""
    out = []
    for number, line in prose_lines(text):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            out.append((number, target))
    return out


def link_problems(root: Path, pages: list[Path]) -> list[str]:
    """Every relative link of `pages` (markdown files under `root`) that leads nowhere: a file or
    folder that does not exist, or a `#anchor` its page (this one, or the markdown file linked) lacks.
    Links with a scheme (https:, mailto:) are not followed."""
    problems, cache = [], {}

    def page_anchors(path: Path) -> set[str]:
        if path not in cache:
            cache[path] = anchors(path.read_text())
        return cache[path]

    for page in pages:
        where = page.relative_to(root)
        for number, target in links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if file_part and not linked.exists():
                problems.append(f"{where}:{number}: {target}: no file {file_part}")
                continue
            if anchor and linked.suffix == ".md" and anchor not in page_anchors(linked):
                problems.append(f"{where}:{number}: {target}: no heading #{anchor} in {linked.relative_to(root)}")
    return problems


def doc_path_problems(root: Path, pages: list[Path]) -> list[str]:
    """Every `docs/....md` a page names in its text (in code spans too: the docs cite pages by path)
    that does not exist under `root`, e.g. a page that was moved or split."""
    problems = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for path in DOC_PATH.findall(line):
                if not (root / path).is_file():
                    problems.append(f"{page.relative_to(root)}:{number}: names {path}, which does not exist")
    return problems


# ---- docs/ as a whole --------------------------------------------------------------------------------


def index_problems(docs: Path) -> list[str]:
    """Every markdown page under `docs` that docs/index.md does not link (and no index at all)."""
    index = docs / "index.md"
    if not index.is_file():
        return ["no docs/index.md"]
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index.read_text())}
    return [
        f"docs/index.md does not list {page.relative_to(docs)}"
        for page in sorted(docs.rglob("*.md"))
        if page != index and page.resolve() not in linked
    ]


def data_problems(docs: Path) -> list[str]:
    """JSON and PNG files under `docs`: measured data lives beside the bench that writes it."""
    return [
        f"{path.relative_to(docs.parent)}: result data among the docs; move it to bench/results/"
        for path in sorted(docs.rglob("*"))
        if path.suffix in DATA_SUFFIXES
    ]


def repo_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ---- the repository --------------------------------------------------------------------------------------


def test_the_readme_is_short_and_starts_with_its_command():
    assert readme_problems((ROOT / "README.md").read_text()) == []


def test_every_relative_link_and_anchor_leads_somewhere():
    assert link_problems(ROOT, repo_pages()) == []


def test_every_page_the_docs_name_by_path_exists():
    assert doc_path_problems(ROOT, repo_pages()) == []


def test_the_index_lists_every_page_of_docs():
    assert index_problems(ROOT / "docs") == []


def test_no_result_data_among_the_docs():
    assert data_problems(ROOT / "docs") == []


# ---- each check catches a planted violation ----------------------------------------------------------


def test_a_long_readme_a_late_command_a_hash_and_a_dated_table_are_reported():
    good = f"# X\n\n```bash\n{FIRST_COMMAND}\n```\n"
    assert readme_problems(good) == []
    late = "# X\n" + "text\n" * 40 + f"```bash\n{FIRST_COMMAND}\n```\n"
    assert readme_problems(late) == [f"the first command is at line 43, past line {FIRST_COMMAND_BY_LINE}"]
    assert readme_problems("# X\n") == [f"no line holding the first command `{FIRST_COMMAND}` alone"]
    long = good + "word " * README_WORD_LIMIT
    assert readme_problems(long) == [
        f"{README_WORD_LIMIT + 8} words, over the limit of {README_WORD_LIMIT}: move detail to a page of docs/"
    ]
    history = good + "Measured at 9151a8f.\n\n| day | time |\n| --- | --- |\n| 2026-11-29 | 9:05 |\n"
    assert readme_problems(history) == [
        "line 6: a commit hash (9151a8f); histories belong on a results page",
        "line 10: a dated table row; measurements belong on a results page",
    ]
    assert readme_problems(good + "deadbeef, 1234567 and avx512_bf16 are no commits\n") == []


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Two commands", "two-commands"),
        ("Metrics (`metrics.jsonl`, one object per step)", "metrics-metricsjsonl-one-object-per-step"),
        ("Advantage estimators — `ADVANTAGE_ESTIMATORS`", "advantage-estimators--advantage_estimators"),
        ("On a GPU (what ran, and what did not)", "on-a-gpu-what-ran-and-what-did-not"),
        ("Start-up: one copy of the model per node", "start-up-one-copy-of-the-model-per-node"),
        ("**Bold** and [a link](x.md)", "bold-and-a-link"),
    ],
)
def test_anchors_follow_githubs_slugs(heading, slug):
    assert github_slug(heading) == slug


def test_a_missing_file_or_anchor_is_reported(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "plot.png").write_bytes(b"")
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Setup\n\n## Setup\n\n```\n[not a link](gone.md)\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# R\n\n[guide](docs/guide.md#setup), [again](docs/guide.md#setup-1), "
        "[web](https://example.com/x#y), ![plot](bench/plot.png), `[code](gone.md)`\n\n"
        "[gone](docs/gone.md) [no anchor](docs/guide.md#install) [here](#r) [not here](#nowhere)\n"
    )
    results = tmp_path / "docs" / "results" / "r.md"
    results.write_text("# R\n\n[up](../guide.md#setup) [plot](../../bench/plot.png) [wrong level](bench/plot.png)\n")
    pages = [readme, tmp_path / "docs" / "guide.md", results]
    assert link_problems(tmp_path, pages) == [
        "README.md:5: docs/gone.md: no file docs/gone.md",
        "README.md:5: docs/guide.md#install: no heading #install in docs/guide.md",
        "README.md:5: #nowhere: no heading #nowhere in README.md",
        "docs/results/r.md:3: bench/plot.png: no file bench/plot.png",
    ]


def test_a_page_named_by_a_path_that_moved_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "memory.md").write_text("# M\n")
    page = tmp_path / "README.md"
    page.write_text('See `docs/memory.md` and docs/performance.md "Memory"; bench/docs/x.md is not a page.\n')
    assert doc_path_problems(tmp_path, [page]) == ["README.md:1: names docs/performance.md, which does not exist"]


def test_a_page_the_index_leaves_out_is_reported(tmp_path):
    docs = tmp_path / "docs"
    assert index_problems(docs) == ["no docs/index.md"]
    (docs / "results").mkdir(parents=True)
    for name in ("guide.md", "design.md", "results/ci.md"):
        (docs / name).write_text("# X\n")
    (docs / "index.md").write_text("# Index\n\n- [guide](guide.md)\n- [ci](results/ci.md#x)\n")
    assert index_problems(docs) == ["docs/index.md does not list design.md"]


def test_result_data_among_the_docs_is_reported(tmp_path):
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    for name in ("guide.md", "seeds.json", "results/curve.png", "results/page.md"):
        (docs / name).write_text("")
    assert data_problems(docs) == [
        "docs/results/curve.png: result data among the docs; move it to bench/results/",
        "docs/seeds.json: result data among the docs; move it to bench/results/",
    ]
