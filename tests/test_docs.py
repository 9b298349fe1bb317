"""The user's documents stay usable: README.md is at most 300 lines, README.md and docs/ say nothing about how the
work was organised (numbered stops, branches), and every repository path or module that README.md, docs/ or
benchmarks/README.md names exists.

A path is recognised in backticks, in fenced code blocks and as a markdown link target: a token with a '/' whose
first folder is one of the repository's top-level entries (or a hidden folder), or a token ending in .py, .md,
.yaml, .yml, .toml or .sh; a dotted name starting with one of MODULE_ROOTS (`clipfinetune.`, `research.`, ...) must
resolve to a module (and its last parts to a name that module mentions). Outputs that DVC or the benchmarks produce
(data/, models/, metrics/, reports/, dvclive/, checkpoints/, benchmarks/_work/, benchmarks/results.json), the .venv/
that make creates, the user's own datasets/, templates (`<run>`, `{a,b}`, `*`, `$R`) and paths outside the repository
(absolute, `~`, URLs) are not checked. docs/methods.md and docs/evalsets.md quote the authors' repositories' files:
there only paths under one of our top-level entries are checked.

Citations of documents, in every text file of the repository (code, tests, docs, params, recipes): a Markdown document
named with an upper-case name (`DEVELOPERS.md`) or by a path under a top-level entry (`docs/methods.md`), or an
upper-case word cited by section (`NAME §3`), must be a document of the repository, and every section it is cited by
(`docs/methods.md §3.4`, `§3.2, §6.8`, "sections 1, 3.1") must be a numbered heading of that document ("## 3. ...",
"### 3.4 ..."). Nothing may point into a `shared` folder beside the repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 300
HISTORY = re.compile(r"\bstop [0-9]|branch s[0-9]", re.IGNORECASE)
OUTPUTS = ("data/", "models/", "metrics/", "reports/", "dvclive/", "checkpoints/", "datasets/", "benchmarks/_work/",
           "benchmarks/results.json", ".dvc/tmp/", ".venv/", "plots_")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".sh")
TEMPLATE_CHARS = set("<>{}*$~%[]")
MODULE_ROOTS = ("clipfinetune", "benchmarks", "research", "stages")
QUOTING_DOCS = ("docs/methods.md", "docs/evalsets.md")    # quote the authors' repositories' paths
CITING_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".sh", ".ini")
PAPERS = {"GOAL"}                          # upper-case names of papers, cited by their own sections
PROJECT_DOC = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*(?:[\w-]+/)*[A-Za-z][\w.-]*\.md)(?![\w/-])")
CAPS_CITED = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_]{2,})(?=[`'\"]?[ \t]*(?:§|sections?[ \t]+\d))")
CITED_SECTIONS = re.compile(r"[`'\"]?[\s#*]*(?::\s*)?(?:§|sections?\s+(?=\d))")
SECTION_NUMBER = re.compile(r"\d+(?:\.\d+)*")
OUTSIDE = re.compile(r"\.\./shared\b")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def repo_files(root: Path = ROOT) -> set[str]:
    """The repository's files as a fresh clone plus local edits holds them: tracked, and untracked but not ignored."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if (root / line).exists()}


def user_documents(files: set[str]) -> list[str]:
    return sorted(f for f in files if f in ("README.md", "benchmarks/README.md")
                  or (f.startswith("docs/") and f.endswith(".md")))


def references(text: str) -> list[tuple[str, bool]]:
    """(token, is_link) for every backticked token, fenced-code token and markdown link target of `text`."""
    refs = []
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    for span in fenced + re.findall(r"`([^`\n]+)`", prose):
        refs += [(token, False) for token in span.split()]
    refs += [(target, True) for target in re.findall(r"\]\(([^)\s]+)\)", prose)]
    return refs


def _clean(token: str) -> str:
    token = token.strip("'\"(),;")
    token = re.sub(r"^[\w-]+=", "", token)                                 # --flag=path, key=path
    match = re.match(r"^(.+?\.(?:py|md|yaml|yml|toml|sh))(?::.*)?$", token)   # file.py:Name, file.md#anchor
    token = match.group(1) if match else token
    return token.split("#")[0].rstrip(".:")


def _module_exists(dotted: str, root: Path) -> bool:
    """`a.b.c.name`: the longest prefix that is a module or package, then at most two names its source mentions."""
    parts = dotted.split(".")
    path, i = root / parts[0], 1
    if not path.is_dir():
        return False
    source = (path / "__init__.py").read_text() if (path / "__init__.py").is_file() else ""
    while i < len(parts):
        if (path / parts[i]).is_dir():
            path = path / parts[i]
            init = path / "__init__.py"
            source = init.read_text() if init.is_file() else ""
        elif (path / f"{parts[i]}.py").is_file():
            path = path / f"{parts[i]}.py"
            source = path.read_text()
            i += 1
            break
        else:
            break
        i += 1
    rest = parts[i:]
    return len(rest) <= 2 and (not rest or re.search(rf"\b{re.escape(rest[0])}\b", source) is not None)


def missing_paths(text: str, doc: str, files: set[str], root: Path = ROOT) -> list[str]:
    """The repository paths and modules `text` (the document `doc`) names that `files` does not hold."""
    dirs = {"/".join(f.split("/")[:k]) + "/" for f in files for k in range(1, f.count("/") + 1)}
    top = {f.split("/")[0] for f in files}
    basenames = {Path(f).name for f in files}
    missing = []
    for raw, is_link in references(text):
        if raw.startswith(("http://", "https://", "mailto:", "#")):
            continue
        token = _clean(raw)
        if not token or TEMPLATE_CHARS & set(token) or token.startswith(("/", "~")):
            continue
        if doc in QUOTING_DOCS and token.split("/")[0] not in top and not re.fullmatch(r"[\w.]+", token):
            continue                                                      # another repository's file
        if doc in QUOTING_DOCS and "/" not in token and token.endswith(FILE_SUFFIXES):
            continue
        if re.fullmatch(rf"(?:{'|'.join(MODULE_ROOTS)})(?:\.\w+)+", token) and "/" not in token:
            if not token.endswith(FILE_SUFFIXES) and not _module_exists(token, root):
                missing.append(token)
            continue
        if is_link:                                                       # relative to the document's folder
            parts = []
            for part in f"{Path(doc).parent.as_posix()}/{token}".split("/"):
                if part == ".." and parts and parts[-1] != "..":
                    parts.pop()
                elif part not in (".", ""):
                    parts.append(part)
            token = "/".join(parts) + ("/" if token.endswith("/") else "")
        if token.startswith(OUTPUTS):
            continue
        first = token.split("/")[0]
        if "/" in token:
            if not (first in top or first.startswith(".") or token.endswith(FILE_SUFFIXES) or is_link):
                continue
            if token.endswith("/"):
                found = token in dirs
            else:
                found = token in files or token + "/" in dirs
        elif token.endswith(FILE_SUFFIXES):
            found = token in basenames
        else:
            continue
        if not found:
            missing.append(raw)
    return missing


def sections(path: Path) -> set[str]:
    """The numbers of a Markdown document's numbered headings ("## 3. Title" -> "3", "### 3.4 Title" -> "3.4")."""
    return set(HEADING.findall(path.read_text()))


def _cited_document(token: str, citing: str, files: set[str], top: set[str]) -> str | None:
    """The repository file a document token names, "" when it names none, None when the token is not ours to
    check (another repository's or a data set's file)."""
    name = token.split("/")[-1]
    if "/" in token and token.lstrip("./").split("/")[0] not in top and not token.startswith("."):
        return None
    if "/" not in token and not re.fullmatch(r"[A-Z][A-Z0-9_-]*\.md", name):
        return None
    here = Path(citing).parent.as_posix()
    parts: list[str] = []
    for part in f"{here}/{token}".split("/"):
        if part == "..":
            if not parts:
                return ""                                                  # above the repository
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    for candidate in (token, "/".join(parts)):
        if candidate in files:
            return candidate
    if "/" not in token:
        at_root = sorted((f for f in files if f.split("/")[-1] == name), key=lambda f: f.count("/"))
        return at_root[0] if at_root else ""
    return ""


def citation_problems(text: str, citing: str, files: set[str], root: Path = ROOT) -> list[str]:
    """Citations in `text` (the file `citing`) of a document the repository does not hold, or of a section that
    document does not have, as "line: what"."""
    top = {f.split("/")[0] for f in files}
    text = text.replace("\\u00a7", "§")                                 # JSON's escaped section sign
    problems = []

    def line(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in OUTSIDE.finditer(text):
        problems.append(f"{line(m.start())}: {m.group(0)} is outside the repository")
    cites = [(m.start(), m.end(), m.group(1)) for m in PROJECT_DOC.finditer(text)]
    cites += [(m.start(), m.end(), m.group(1) + ".md") for m in CAPS_CITED.finditer(text)
              if m.group(1) not in PAPERS]
    cites.sort()
    for k, (start, end, token) in enumerate(cites):
        doc = _cited_document(token, citing, files, top)
        if doc is None:
            continue
        if not doc:
            problems.append(f"{line(start)}: {token} is not a document of the repository")
            continue
        lead = CITED_SECTIONS.match(text, end)
        if not lead or not doc.endswith(".md"):
            continue
        stop = min([cites[k + 1][0]] if k + 1 < len(cites) else [len(text)])
        span = re.split(r"[);]|\n\s*\n", text[lead.start():min(stop, lead.start() + 160)])[0]
        numbers = re.findall(r"§\s*(\d+(?:\.\d+)*)", span)
        listed = re.match(r"[`'\"]?[\s#*]*(?::\s*)?sections?\s+([\d.,\s]+(?:and\s+[\d.]+)?)", span)
        if listed:
            numbers += SECTION_NUMBER.findall(listed.group(1))
        have = sections(root / doc)
        problems += [f"{line(start)}: {token} has no section {n}" for n in numbers if n.rstrip(".") not in have]
    return problems


def citing_files(files: set[str]) -> list[str]:
    """Every text file that may cite a document, but this one, whose examples of bad citations test the check."""
    return sorted(f for f in files if (f.endswith(CITING_SUFFIXES) or f.split("/")[-1] == "Makefile")
                  and f != "tests/test_docs.py")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_no_word_about_how_the_work_was_organised():
    files = repo_files()
    found = [f"{doc}:{n}: {line.strip()}" for doc in user_documents(files) if doc != "benchmarks/README.md"
             for n, line in enumerate((ROOT / doc).read_text().splitlines(), start=1) if HISTORY.search(line)]
    assert not found, "README.md / docs/ speak of stops or branches:\n" + "\n".join(found)


def test_every_path_the_documents_name_exists():
    files = repo_files()
    docs = user_documents(files)
    assert {"README.md", "benchmarks/README.md"} <= set(docs) and any(d.startswith("docs/") for d in docs)
    dangling = [f"{doc}: {path}" for doc in docs for path in missing_paths((ROOT / doc).read_text(), doc, files)]
    assert not dangling, "paths or modules named but not in the repository:\n" + "\n".join(dangling)


def test_the_path_check_recognises_dangling_and_ignores_outputs():
    files = {"README.md", "docs/a.md", "docs/research/b.md", "stages/_common.py", "research/binding_oracle.py",
             "clipfinetune/eval/encode.py", "recipes/goal.yaml", "tests/scale/test_x.py"}
    text = """
Run `python -m research.binding_oracle` and read `stages/_common.py:StageParams`, `recipes/goal.yaml`,
`tests/scale/`, [the note](research/b.md), `encode.py` in `clipfinetune/eval/`, the output `metrics/summary.json`,
`data/shards/train-coco-000000.tar`, `datasets/coco`, `recipes/<method>.yaml`, `models/<run>/`, `/mnt/data`,
`dvclive/train/<run>/plots/metrics`, `treeverse/dvc#10549`, [DVC](https://dvc.org).
Gone: `.probe/seed35.py`, `research/binding_sweep/`, `eval/encode.py`, `seed35.py`, [x](missing.md),
`clipfinetune.nowhere`, `research.binding_oracle.no_such_name`.
```bash
python stages/_common.py --out benchmarks/_work/x && python tools/run.py
```
"""
    # _module_exists reads the real repository's sources: pick names that exist there
    assert missing_paths(text, "docs/a.md", files) == [
        "tools/run.py", ".probe/seed35.py", "research/binding_sweep/", "eval/encode.py", "seed35.py",
        "clipfinetune.nowhere", "research.binding_oracle.no_such_name", "missing.md"]


def test_the_history_pattern_is_the_issue_grep():
    assert HISTORY.search("at Stop 41 the probe") and HISTORY.search("on branch s39-i35-levers")
    assert not HISTORY.search("a nonstop 4-step run") and not HISTORY.search("the branch of a tree")


def test_every_cited_document_and_section_is_in_the_repository():
    files = repo_files()
    found = []
    for f in citing_files(files):
        try:
            text = (ROOT / f).read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{f}:{problem}" for problem in citation_problems(text, f, files)]
    assert not found, "citations of documents or sections the repository does not have:\n" + "\n".join(found)


def test_the_design_documents_have_numbered_sections():
    """The documents the code cites by section: design, methods (with §6's items as sections) and evaluation sets."""
    assert {"1", "3", "8", "12.1", "12.2"} <= sections(ROOT / "docs/design.md")
    assert {"0.1", "0.3", "1.2", "3.4", "4.3", "5", "6.8", "6.17"} <= sections(ROOT / "docs/methods.md")
    assert {"1.7", "3.2", "4.2", "5.1", "7.1", "8"} <= sections(ROOT / "docs/evalsets.md")


def test_the_citation_check_recognises_missing_documents_and_sections():
    files = {"README.md", "DEVELOPERS.md", "docs/methods.md", "docs/design.md", "clipfinetune/losses/goal.py",
             "tests/test_x.py"}
    # the old names spelled in parts, so that a grep for them finds nothing in this file
    old_name, old_design, shared = "METH" + "ODS", "DES" + "IGN", ".." + "/shared"
    text = "\n".join([
        "ok: docs/methods.md §3.4 bug 2, `docs/methods.md` §3.2, §3.4 item 6, §6.8; DEVELOPERS.md; GOAL §3.1",
        "ok: docs/design.md\n  §12.1, docs/design.md sections 1, 3 and 8; sugarcrepe/README.md; Long-CLIP `train/x.md`",
        f"gone: {old_name}.md §3.4; {old_name} §3.4; {old_design} section 8; {shared}/x",
        "gone: docs/methods.md §3.9 and docs/design.md §12.7, §13; docs/nowhere.md; ../../../README.md",
    ])
    problems = citation_problems(text, "clipfinetune/losses/goal.py", files)
    assert problems == [                            # line 2 holds a citation across a line break: lines 4 and 5
        f"4: {shared} is outside the repository",
        f"4: {old_name}.md is not a document of the repository",
        f"4: {old_name}.md is not a document of the repository",
        f"4: {old_design}.md is not a document of the repository",
        "5: docs/methods.md has no section 3.9", "5: docs/design.md has no section 12.7",
        "5: docs/design.md has no section 13", "5: docs/nowhere.md is not a document of the repository",
        "5: ../../../README.md is not a document of the repository"]

