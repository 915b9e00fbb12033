"""Pointers hold: every README.md / docs/ page cited anywhere exists, every section a source file
cites by name is a heading of that page, and every repository path the README and the docs name
exists. (``docs/learning-history.md`` is dated history: the sections it cites are as they were on
the day each entry was written, so only its pages and paths are checked.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from test_docs import _FENCE, _HEADING

ROOT = Path(__file__).resolve().parent.parent
HISTORY = {"docs/learning-history.md"}
TOP = ("actor", "bench", "common", "configs", "deploy", "docs", "envs", "judge", "learner", "tests", "tools", "worldloop")

# a page cited by path: README.md, docs/x.md (optionally tests/README.md); and a quoted section after it
_PAGE = re.compile(r"(?<![\w/.-])((?:tests/)?README(?:\.md)?|docs/[\w-]+\.md)(?:'s)?(?:,|:)?\s*(?:section\s*)?(?:[\"“]([^\"”\n]{3,80})[\"”])?")
# a repository path in a code span: `common/contracts/config.py`, `envs/grid/`, `bench/chaos.py --minutes 10`
# (a file with a suffix, or a folder with its slash; `worldloop/Sokoban-v0` is an env id, not a path)
_PATH = re.compile(r"`((?:%s)/[\w./-]*(?:\.\w+|/))(?=[`\s#:,)])" % "|".join(TOP))
# the tests of these checks hold made-up citations on purpose
SELF = {"tests/test_docs.py", "tests/test_doc_pointers.py"}


def tracked(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split() if (ROOT / p).is_file()]


def headings(page: Path) -> set[str]:
    """The headings of a page as written (code spans kept), outside fenced code blocks."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.add(m.group(2).strip())
    return out


def is_heading(section: str, names: set[str]) -> bool:
    """A section is cited by its heading, or by the heading's words before a parenthesis
    ("Evaluation" for "Evaluation (`worldloop eval`)")."""
    return any(h == section or h.startswith(section + " (") for h in names)


def _page_path(name: str) -> Path:
    return ROOT / (name if name.endswith(".md") else name + ".md")


def page_citations(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _PAGE.finditer(text)]


def broken_citations(files: list[str], check_sections: bool) -> list[str]:
    bad = []
    for f in files:
        text = (ROOT / f).read_text(errors="replace")
        for page, section in page_citations(text):
            path = _page_path(page)
            if not path.is_file():
                bad.append(f"{f}: cites {page}, which does not exist")
            elif check_sections and section and not is_heading(section.strip(), headings(path)):
                bad.append(f"{f}: cites {page} \"{section}\", which is no heading there")
    return bad


def test_every_cited_page_and_section_exists() -> None:
    code = [p for p in tracked("*.py", "*.sh", "*.yaml", "*.yml", "*.conf", "*.toml", ".ci/run") if p not in SELF]
    docs = [p for p in tracked("*.md") if p not in HISTORY]
    assert broken_citations(code + docs, check_sections=True) == []
    assert broken_citations(sorted(HISTORY), check_sections=False) == []


def test_every_repository_path_in_the_readme_and_docs_exists() -> None:
    bad = []
    for f in tracked("*.md"):
        for no, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            for m in _PATH.finditer(line):
                rel = m.group(1).rstrip(".,:")
                if any(ch in rel for ch in "*<{"):
                    continue
                if not (ROOT / rel).exists():
                    bad.append(f"{f}:{no}: {rel}")
    assert bad == []


def test_the_checks_find_a_missing_page_section_and_path(tmp_path: Path) -> None:
    assert page_citations('see docs/architecture.md "Durability" and README.md') == [
        ("docs/architecture.md", "Durability"), ("README.md", None)]
    assert page_citations("README's \"Set-up\"") == [("README", "Set-up")]
    assert "Durability" in headings(ROOT / "docs/architecture.md")
    assert _PATH.findall("`common/contracts/config.py` and `envs/grid/` and `worldloop/Sokoban-v0`") == [
        "common/contracts/config.py", "envs/grid/"]
    assert is_heading("Evaluation", {"Evaluation (`worldloop eval`)"}) and not is_heading("Eval", {"Evaluation"})


def test_only_the_transport_room_speaks_redis_streams() -> None:
    # README and docs/architecture.md: no role or application issues a stream command itself
    call = re.compile(r"\.(xadd|xread|xreadgroup|xack|xdel|xrange|xrevrange|xlen|xtrim|xpending|xpending_range|"
                      r"xautoclaim|xclaim|xgroup_create|xgroup_destroy|xinfo_stream|xinfo_groups)\(", re.I)
    speakers = sorted({f for f in tracked("actor/*.py", "judge/*.py", "learner/*.py", "worldloop/*.py", "envs/*.py",
                                          "common/*.py")
                       if call.search((ROOT / f).read_text())})
    assert speakers and all(f.startswith("common/transport/") for f in speakers), speakers


def test_the_readme_layout_names_every_module() -> None:
    # each module of the installed folders is named in the README's Layout section, by file or stem
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## The processes")]
    missing = [f for f in tracked("actor/*.py", "judge/*.py", "learner/*.py", "envs/*.py", "common/*.py", "worldloop/*.py")
               if not f.endswith("__init__.py") and not re.search(rf"\b{re.escape(Path(f).stem)}(\.py)?\b", layout)]
    assert missing == []
