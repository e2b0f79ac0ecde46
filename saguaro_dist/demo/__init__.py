"""The demo model pair: a small Llama target and its distilled draft, trained on the stdlib.

`demo_pair()` gives the shipped checkpoints' paths; `demo_prompts(n)` gives held-out stdlib
snippets for examples and benchmarks. `saguaro demo build` (see build.py) reproduces the pair.
"""
from __future__ import annotations

import json
from pathlib import Path

PAIR_DIR = Path(__file__).resolve().parent / "pair"
BUILD_HINT = "rebuild it with `saguaro demo build` or reinstall saguaro-dist"


def demo_pair() -> tuple[str, str]:
    """(target_dir, draft_dir) of the shipped demo pair, each loadable with from_pretrained."""
    paths = [PAIR_DIR / role for role in ("target", "draft")]
    for path in paths:
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"demo checkpoint missing at {path}; {BUILD_HINT}")
    return str(paths[0]), str(paths[1])


def demo_prompts(n: int) -> list[str]:
    """The first n held-out stdlib snippets shipped with the pair (deterministic, same on every machine)."""
    path = PAIR_DIR / "prompts.json"
    if not path.is_file():
        raise FileNotFoundError(f"demo prompts missing at {path}; {BUILD_HINT}")
    prompts = json.loads(path.read_text())
    if not 0 <= n <= len(prompts):
        raise ValueError(f"demo_prompts(n) needs 0 <= n <= {len(prompts)}, got {n}")
    return prompts[:n]


__all__ = ["PAIR_DIR", "demo_pair", "demo_prompts"]
