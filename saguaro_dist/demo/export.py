"""The demo pair's export: fp16 HF directories written in a staging folder beside `out`, then swapped in whole.

`out` is at every moment the old complete pair or the new one: the staging folder takes its place in one atomic
renameat2(RENAME_EXCHANGE); where the filesystem cannot, in two renames, and the next build's check puts the
previous pair back if a kill fell between them.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

ROLES = ("target", "draft")
LEGACY_STAGE_PREFIX = ".export-"  # out/.export-*: where exports before the whole-folder swap staged (and left) a pair
PAIR_ENTRIES = frozenset({*ROLES, "prompts.json", "build_info.json"})  # all a pair folder holds
RENAME_EXCHANGE = 2  # <linux/fs.h>: renameat2 swaps the two names atomically
AT_FDCWD = -100


def check_swappable(out: Path) -> None:
    """The export stages beside out and swaps the folder itself: a mount point cannot be renamed, and the
    parent must take the staging folder."""
    if os.path.ismount(out):
        raise ValueError(f"--out {out} is a mount point, which cannot be swapped; give a folder inside it")
    try:
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as err:
        raise ValueError(f"--out {out}: its parent {out.parent} must be writable too: the new pair is staged "
                         f"there ({err.strerror or err})") from err


def restore_interrupted_swap(out: Path) -> None:
    previous = previous_dir(out)
    if not (out.exists() or out.is_symlink()) and previous.is_dir() and not previous.is_symlink():
        log.warning("%s: an export was killed while swapping folders; restoring the previous pair", out)
        os.replace(previous, out)


def stage_prefix(out: Path) -> str:
    return f".{out.name}.export-"  # a sibling of out: same filesystem, and outside package data (demo/pair/**)


def previous_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.previous"  # the old pair while the two-rename fallback runs


@contextmanager
def staged_pair(out: Path):
    """Yield an empty sibling folder for the whole new pair; when the block ends without error it takes out's
    place in one atomic step (renameat2 RENAME_EXCHANGE), so out is at every moment the old complete pair or
    the new one. Swapping out/target and out/draft one by one showed readers (and left, if killed between the
    renames) a new target beside the old draft, or no target at all."""
    out = out.resolve()
    drop_stale_exports(out)
    stage = out.parent / (stage_prefix(out) + secrets.token_hex(4))
    stage.mkdir()  # not mkdtemp: its 0700 would become the pair folder's mode, unreadable to other users
    try:
        if out.is_dir():
            os.chmod(stage, stat.S_IMODE(out.stat().st_mode))
        yield stage
        swap_in(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # after a swap: the old pair


def swap_in(stage: Path, out: Path) -> None:
    if not out.exists():
        os.replace(stage, out)  # one rename: nothing there to tear
        return
    try:
        exchange_dirs(stage, out)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise
        log.warning("%s: this filesystem cannot swap folders atomically (%s); replacing it in two renames",
                    out, err.strerror)
        swap_by_renames(stage, out)


def exchange_dirs(a: Path, b: Path) -> None:
    """Atomically swap two directory entries (Linux renameat2; ENOSYS elsewhere)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_by_renames(stage: Path, out: Path) -> None:
    # Not atomic: a kill between the renames leaves no out; the next build's check_out puts the old pair back.
    previous = previous_dir(out)
    os.replace(out, previous)
    try:
        os.replace(stage, out)
    except BaseException:
        os.replace(previous, out)
        raise
    os.replace(previous, stage)  # the staging folder's cleanup deletes the old pair


def export_pair(models: dict, fast_tok, out: Path) -> None:
    """fp16 safetensors + tokenizer in out/target and out/draft (each a complete HF directory), swapped in whole."""
    with staged_pair(Path(out)) as stage:
        save_pair(models, fast_tok, stage)


def save_pair(models: dict, fast_tok, dest: Path) -> None:
    for role in ROLES:
        save_model_dir(models[role], fast_tok, dest / role)


def save_model_dir(model, fast_tok, dest: Path) -> None:
    import torch

    model.to(torch.float16).save_pretrained(dest, safe_serialization=True)
    model.to(torch.float32)
    fast_tok.save_pretrained(dest)
    portable_tokenizer_class(dest / "tokenizer_config.json")


def drop_stale_exports(out: Path) -> None:
    # A killed export's staging folders (a concurrent export into one out is not supported anyway).
    stale = [*out.parent.glob(glob.escape(stage_prefix(out)) + "*"), *out.glob(LEGACY_STAGE_PREFIX + "*")]
    if out.is_dir():
        stale.append(previous_dir(out))
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def portable_tokenizer_class(path: Path) -> None:
    # transformers 5 writes its own class name, which 4.x cannot resolve; both load this one.
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2))
