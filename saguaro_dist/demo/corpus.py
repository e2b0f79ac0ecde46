"""The demo corpus: the Python standard library's own source files, split by file."""
from __future__ import annotations

import hashlib
import logging
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Test suites, vendored packages and data-table modules (encodings, pydoc topics) are not the
# code a newcomer prompts with; they would only dilute the tiny training budget.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__", "pydoc_data", "encodings"})
MAX_FILE_BYTES = 256_000
# What the build itself generates (_sysconfigdata*.py: its paths and compiler flags; config-*/: python-config.py),
# unlike the stdlib proper, differs between machines running the same CPython.
BUILD_FILE_PREFIX, BUILD_DIR_PREFIX = "_sysconfigdata", "config-"


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[Path]:
    """All eligible .py files under root, sorted by their relative POSIX path."""
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a directory")
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if is_excluded(rel) or path.is_symlink() or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_excluded(rel: Path) -> bool:
    # A symlinked file is skipped by the caller: its text lives outside the stdlib (Debian's
    # sitecustomize.py -> /etc/python3.x/) or duplicates a file that is read anyway.
    dirs = rel.parts[:-1]
    return (bool(EXCLUDED_DIRS.intersection(dirs)) or rel.name.startswith(BUILD_FILE_PREFIX)
            or any(d.startswith(BUILD_DIR_PREFIX) for d in dirs))


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    # A hash of the path, not a random draw: a file's side never depends on which other files exist.
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < heldout_percent


def split_corpus(root: Path | None = None, heldout_percent: int = 5, max_files: int | None = None) -> CorpusSplit:
    root = Path(root) if root is not None else stdlib_root()
    files = list_sources(root)
    if max_files is not None:
        files = files[:max_files]
    if len(files) < 2:
        raise ValueError(f"corpus root {root} has {len(files)} usable .py files; need at least 2")
    train, heldout = [], []
    for path in files:
        (heldout if is_heldout(path.relative_to(root).as_posix(), heldout_percent) else train).append(path)
    # Tiny corpora (tests) may land on one side only; move the last file so both sides exist.
    if not heldout:
        heldout.append(train.pop())
    elif not train:
        train.append(heldout.pop())
    log.info("corpus %s: %d train files, %d held-out files", root, len(train), len(heldout))
    return CorpusSplit(root, tuple(train), tuple(heldout))


def read_source(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 (a few stdlib files are latin-1 on purpose)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def read_sources(paths) -> list[str]:
    texts = [read_source(p) for p in paths]
    return [t for t in texts if t and t.strip()]


def sample_snippets(texts: list[str], n: int, max_chars: int, seed: int) -> list[str]:
    """n deterministic snippets: whole lines, ending at a line boundary inside a file, <= max_chars. No two start
    on one line of a file: a draw that would is skipped. Drawn with replacement, 23 of the 256 shipped prompts
    were repeats, and more were one prompt once a bench cut them to their first tokens (windows that start on
    one line); now the snippets are the ones those draws gave, such draws left out, then more draws."""
    rng = random.Random(seed)
    candidates = [t.splitlines(keepends=True) for t in texts]
    candidates = [lines for lines in candidates if len(lines) >= 8]
    if not candidates:
        raise ValueError("no held-out file has enough lines for a prompt")
    if n > 0:
        check_windows(candidates, n, max_chars)  # else the draws below would never end
    snippets: list[str] = []
    starts: set[tuple[int, int]] = set()  # (file, first line) of every snippet so far
    while len(snippets) < n:
        file = rng.randrange(len(candidates))
        lines = candidates[file]
        end = rng.randrange(4, len(lines))
        start = window_start(lines, end, max_chars)
        text = "".join(lines[start:end])
        if text.strip() and (file, start) not in starts:
            starts.add((file, start))
            snippets.append(text)
    return snippets


def check_windows(candidates: list[list[str]], n: int, max_chars: int) -> None:
    """At least n windows of whole lines with text in them, no two starting on one line, or a ValueError."""
    found = len({(file, window_start(lines, end, max_chars)) for file, lines in enumerate(candidates)
                 for end in range(4, len(lines)) if window(lines, end, max_chars).strip()})
    if not found:
        raise ValueError(f"no held-out window of whole lines fits {max_chars} characters (prompt_chars) with any "
                         "text in it: every line is longer, or the lines that fit are blank")
    if found < n:
        raise ValueError(f"{n} prompts asked for, but the held-out files have {found} windows of whole lines that "
                         f"fit {max_chars} characters (prompt_chars) with text in them and a first line of their own")


def window(lines: list[str], end: int, max_chars: int) -> str:
    """The most whole lines ending before lines[end] that fit max_chars ("" where lines[end - 1] alone is longer)."""
    return "".join(lines[window_start(lines, end, max_chars):end])


def window_start(lines: list[str], end: int, max_chars: int) -> int:
    """The first line of window(lines, end, max_chars) (end where it is empty)."""
    start, size = end, 0
    while start > 0 and size + len(lines[start - 1]) <= max_chars:
        start -= 1
        size += len(lines[start])
    return start
