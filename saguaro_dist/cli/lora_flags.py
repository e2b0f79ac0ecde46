"""`saguaro serve`'s LoRA flags, vLLM's names and meaning: --enable-lora, --lora-modules, --max-loras, --max-lora-rank,
--max-cpu-loras.

enable_lora, max_loras, max_lora_rank and max_cpu_loras are engine Config fields (serve.py's ENGINE_FLAGS); lora_modules is an app
arg (serve/lora_modules.py), checked here before Ray starts: each adapter is read against the base model."""
from __future__ import annotations

import argparse

from saguaro_dist.lora_request import MAX_LORA_RANKS

LORA_ENGINE_FLAGS = {"enable_lora": "enable_lora", "max_loras": "max_loras", "max_lora_rank": "max_lora_rank",
                     "max_cpu_loras": "max_cpu_loras"}


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (vLLM's flags)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve PEFT LoRA adapters: a request's `model` naming one runs the base model through it")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help='adapters served by name: name=path, or JSON {"name": ..., "path": ..., "base_model_name": '
                        '...}; each is read against the base model at start-up (needs --enable-lora)')
    g.add_argument("--max-loras", type=int, help="adapters one batch runs at once (default 1; others' requests wait)")
    g.add_argument("--max-lora-rank", type=int, choices=MAX_LORA_RANKS, metavar="RANK",
                   help=f"the largest adapter rank served, one of {', '.join(map(str, MAX_LORA_RANKS))} (default 16)")
    g.add_argument("--max-cpu-loras", type=int, help="adapters kept read in host memory, >= --max-loras (default: "
                   "--max-loras): one evicted from its slot reloads without reading its files again")


def check_adapters_here(modules, config, embedded: bool) -> None:
    """Each --lora-modules adapter loads against the base model, before Ray starts: on the embedded cluster
    always (its replica reads the same paths); with --address only the folders on this machine (the others may
    live on the cluster alone, whose replicas check them as they start)."""
    from saguaro_dist.model.lora_adapter import local_adapter_dir
    from saguaro_dist.serve.lora_modules import check_adapter
    for m in modules:
        if embedded or local_adapter_dir(m.path) is not None:
            check_adapter(m.name, m.path, config)
