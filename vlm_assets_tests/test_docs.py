"""The docs stay true to the repository: every path they name exists, every command they show accepts the
flags it is shown with, the README stays a map (at most 200 lines, each at most 120 characters, linking
every docs page), no word of the docs or the package names a commit of this repository, and the asset
graph picture is drawn from the current definitions (``scripts/asset_graph.py --check``).

Fast and offline: it reads files, asks git, and runs each documented program's ``--help`` once (only
programs that have an argument parser: a bench without one would run the benchmark)."""

import concurrent.futures
import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# Bare file names with these endings are taken for repository files (artifact names such as eval.json
# or adapter.safetensors are not).
CODE_SUFFIXES = (".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".cfg", ".ini")
FENCE = re.compile(r"^(```|~~~)(.*?)$(.*?)^\1\s*$", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEX_WORD = re.compile(r"(?<![0-9A-Za-z])[0-9a-fA-F]{7,40}(?![0-9A-Za-z])")
MODULE = re.compile(r"^vlm_assets(\.[A-Za-z_]\w*)+$")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), REPO / "vlm_assets_tests" / "README.md"]


@functools.cache
def listed() -> frozenset[str]:
    """Every path git tracks (a file not committed does not count), and every folder above one."""
    out = subprocess.run(
        ["git", "ls-files", "--cached"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    paths = {p for p in out if p and (REPO / p).exists()}
    folders = {str(Path(p).parents[i]) for p in paths for i in range(len(Path(p).parents) - 1)}
    return frozenset(paths | folders)


@functools.cache
def basenames() -> frozenset[str]:
    return frozenset(Path(p).name for p in listed())


def prose_and_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text outside fenced code blocks, and each block as (info string, body)."""
    blocks = [(m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]
    return FENCE.sub("", text), blocks


def in_repo(path: str, base: Path) -> str | None:
    """``path`` (relative to ``base``) as a repository path, or None when it is outside the repository."""
    try:
        return str((base / path).resolve().relative_to(REPO))
    except ValueError:
        return None


def path_problem(word: str, base: Path) -> str | None:
    """Why ``word``, written in a doc in ``base``, names no repository file (None: it does, or it is not a
    repository path at all: an artifact's file, a placeholder, a URL, a path on the user's machine)."""
    if any(c in word for c in "<>{}*$~=:@\\") or "..." in word or word.startswith(("/", "-")):
        return None
    if MODULE.match(word):
        return module_problem(word)
    if "/" not in word:
        if word.endswith(CODE_SUFFIXES) and word not in basenames():
            return f"no file named {word}"
        return None
    first = word.split("/")[0]
    for root in (REPO, base):  # repository-relative first, then relative to the doc
        if in_repo(first, root) in listed():
            target = in_repo(word.rstrip("/"), root)
            return None if target in listed() else f"{word} does not exist"
    return None


def module_problem(dotted: str) -> str | None:
    """``vlm_assets.a.b[.name]``: the module must exist, and a name after it must be in its source."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        stem = REPO.joinpath(*parts[:n])
        source = stem.with_suffix(".py") if stem.with_suffix(".py").is_file() else stem / "__init__.py"
        if source.is_file():
            rest = parts[n:]
            if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
                return f"{dotted}: {rest[0]} is not in {source.relative_to(REPO)}"
            return None
    return f"{dotted}: no such module"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    prose, _ = prose_and_fences(doc.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.M)}


def link_problem(target: str, base: Path) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
        return None
    path, _, anchor = target.partition("#")
    doc = (base / path).resolve() if path else None
    if path and in_repo(path.rstrip("/"), base) not in listed():
        return f"link to {target}: {path} does not exist"
    if anchor and doc is not None and doc.suffix == ".md" and anchor not in anchors(doc):
        return f"link to {target}: {path} has no heading #{anchor}"
    return None


def doc_problems(doc: Path, text: str) -> tuple[list[str], int]:
    """Problems with the paths, modules and links ``text`` (the doc ``doc``) names, and how many it names."""
    prose, _ = prose_and_fences(text)
    problems, named = [], 0
    for span in CODE_SPAN.findall(prose):
        for word in span.split():
            problem = path_problem(re.split(r"[(\[]", word)[0].strip(".,;"), doc.parent)
            named += 1
            if problem:
                problems.append(f"{doc.relative_to(REPO)}: `{span}`: {problem}")
    for target in LINK.findall(prose):
        named += 1
        if problem := link_problem(target, doc.parent):
            problems.append(f"{doc.relative_to(REPO)}: {problem}")
    return problems, named


def test_every_path_module_and_link_the_docs_name_exists():
    problems, named = [], 0
    for doc in doc_files():
        found, count = doc_problems(doc, doc.read_text())
        problems += found
        named += count
    assert not problems, "\n".join(problems)
    assert named > 200, f"only {named} names read from the docs: is the extraction broken?"


def test_the_path_check_catches_what_is_not_there():
    doc = DOCS / "assets.md"
    text = (
        "`vlm_assets/defs/platform/nothing.py`, `vlm_assets.defs.platform.memo.no_such_function`, "
        "`missing_helper.py`, [a page](no-such-page.md), [a section](assets.md#no-such-heading), "
        "and what is fine: `vlm_assets/defs/platform/memo.py`, `eval.json`, `var/artifacts/`, "
        "`checkpoints/<asset>/<hash>`, [assets](assets.md#profiles)"
    )
    problems, _ = doc_problems(doc, text)
    assert problems == [
        "docs/assets.md: `vlm_assets/defs/platform/nothing.py`: vlm_assets/defs/platform/nothing.py does not exist",
        "docs/assets.md: `vlm_assets.defs.platform.memo.no_such_function`: "
        "vlm_assets.defs.platform.memo.no_such_function: no_such_function is not in vlm_assets/defs/platform/memo.py",
        "docs/assets.md: `missing_helper.py`: no file named missing_helper.py",
        "docs/assets.md: link to no-such-page.md: no-such-page.md does not exist",
        "docs/assets.md: link to assets.md#no-such-heading: assets.md has no heading #no-such-heading",
    ]


def test_the_readme_is_a_map():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: depth goes in docs/)"
    long = [f"README.md:{i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, "\n".join(long)
    linked = {in_repo(t.partition("#")[0], REPO) for t in LINK.findall(README.read_text())}
    pages = {str(p.relative_to(REPO)) for p in DOCS.glob("*.md")}
    assert len(pages) >= 8, sorted(pages)
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert "docs/asset-graph.png" in linked, "the README shows the asset graph"


def commit_words(texts: dict[str, str]) -> list[str]:
    """``file:line: word`` for each word of ``texts`` that names a commit of this repository."""
    where: dict[str, list[str]] = {}
    for name, text in texts.items():
        for number, line in enumerate(text.splitlines(), 1):
            for word in HEX_WORD.findall(line):
                if re.search(r"[0-9]", word) and re.search(r"[a-fA-F]", word):
                    where.setdefault(word.lower(), []).append(f"{name}:{number}")
    words = sorted(where)
    answers = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        cwd=REPO,
        input="".join(f"{word}^{{commit}}\n" for word in words),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(answers) == len(words), answers
    # "<sha> commit <size>" for a commit, "<word>^{commit} missing" for anything else, "... ambiguous" for
    # a prefix of several objects (which may be commits: named too)
    return [
        f"{place}: {word} ({'ambiguous' if answer.endswith(' ambiguous') else 'a commit'})"
        for word, answer in zip(words, answers)
        if not answer.endswith(" missing")
        for place in where[word]
    ]


def test_no_commit_of_this_repository_is_named_in_the_docs_or_the_package():
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True, text=True)
    assert inside.stdout.strip() == "true", "the docs tests need the git checkout (CI runs in one)"
    files = [*doc_files(), *sorted(p for p in (REPO / "vlm_assets").rglob("*") if p.suffix in (".py", ".yaml", ".yml"))]
    assert len(files) > 50, len(files)
    named = commit_words({str(f.relative_to(REPO)): f.read_text() for f in files})
    assert not named, "commits belong in git history, not in docs or code:\n" + "\n".join(named)


def test_the_commit_check_catches_a_commit():
    shas = subprocess.run(["git", "rev-list", "-20", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    # a short hash of digits alone reads as a number, which the check leaves alone: take one with a letter
    sha = next(sha for sha in shas.stdout.split() if not sha[:7].isdigit())
    named = commit_words({"note.md": f"measured on {sha[:7]}\nand on {sha}\nnot on c58f30108f718f92721af3b95e74349a"})
    assert [n.split(":")[1] for n in named] == ["1", "2"], named


def commands(text: str) -> list[list[str]]:
    """The simple commands of the text's shell blocks, as words (continuations joined, comments and
    ``VAR=value`` prefixes dropped, split at ``&&``, ``||``, ``;``, ``|`` and ``&``)."""
    _, blocks = prose_and_fences(text)
    found = []
    for info, body in blocks:
        if info not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token in ("&&", "||", ";", "|", "&", ";;"):
                    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                        words.pop(0)
                    if words:
                        found.append(words)
                    words = []
                else:
                    words.append(token)
    return found


def program_of(words: list[str]) -> tuple[str, list[str]] | None:
    """(the repository program, its arguments) of a command, or None for any other program."""
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].startswith("vlm_assets"):
            return f"-m {words[2]}", words[3:]
        if words[1].endswith(".py"):
            return words[1], words[2:]
        return None
    if words[0].startswith(("scripts/", "bench/")):
        return words[0], words[1:]
    return None


def source_of(program: str) -> Path:
    if program.startswith("-m "):
        stem = REPO.joinpath(*program[3:].split("."))
        return stem.with_suffix(".py") if stem.with_suffix(".py").is_file() else stem / "__main__.py"
    return REPO / program


def help_text(program: str) -> str:
    command = [sys.executable, *program.split(), "--help"] if program.startswith("-m ") else None
    command = command or [sys.executable, program, "--help"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{program} --help failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_every_documented_command_accepts_its_flags():
    uses: dict[str, set[str]] = {}
    for doc in doc_files():
        for words in commands(doc.read_text()):
            if (found := program_of(words)) is not None:
                program, args = found
                flags = {a.split("=")[0] for a in args if a.startswith("--") and a != "--"}
                uses.setdefault(program, set()).update(flags)
    assert len(uses) >= 10 and sum(map(len, uses.values())) >= 20, uses
    missing = sorted(p for p in uses if not source_of(p).is_file())
    assert not missing, f"documented programs that do not exist: {missing}"
    sources = {p: source_of(p).read_text() for p in uses}
    with_parser = [p for p in uses if p.endswith(".py") or p.startswith("-m ")]
    with_parser = [p for p in with_parser if "ArgumentParser" in sources[p]]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(with_parser, pool.map(help_text, with_parser)))
    problems = []
    for program, flags in sorted(uses.items()):
        # a shell script (or a program without a parser) must at least mention the flag
        said = helps.get(program, sources[program])
        problems += [
            f"{program}: {flag} is not in its {'--help' if program in helps else 'source'}"
            for flag in sorted(flags)
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", said)
        ]
    assert not problems, "\n".join(problems)


def test_the_command_check_reads_what_a_reader_would_type():
    text = (
        "```bash\nsource .venv/bin/activate && X=1 python bench/soak.py --runs 2 \\\n"
        "  --seed 3  # a comment --no\nscripts/demo.sh\n```\n"
    )
    assert commands(text) == [
        ["source", ".venv/bin/activate"],
        ["python", "bench/soak.py", "--runs", "2", "--seed", "3"],
        ["scripts/demo.sh"],
    ]
    assert program_of(["python", "-m", "vlm_assets.chat", "MODEL", "--top-p", "0.9"]) == (
        "-m vlm_assets.chat",
        ["MODEL", "--top-p", "0.9"],
    )
    assert program_of(["dagster", "job", "execute"]) is None


def test_the_asset_graph_picture_is_drawn_from_the_current_definitions():
    proc = subprocess.run(
        [sys.executable, "scripts/asset_graph.py", "--check"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edges = (DOCS / "asset-graph.txt").read_text().splitlines()
    assert len(edges) >= 8 and all(" -> " in e for e in edges), edges
    assert (DOCS / "asset-graph.png").stat().st_size > 10_000
