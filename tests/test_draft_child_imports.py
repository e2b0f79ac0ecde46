"""What the one-host draft's child process imports: every engine pays its start-up (the product's, and each
process/split engine of this suite), so it loads what the draft needs and not the target's round loop."""
from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest

from saguaro_dist.config import Config
from saguaro_dist.engine.build import fit_draft
from saguaro_dist.engine.draft_process_parent import DraftProcess
from saguaro_dist.model.hf_config import load_config

# The target's side: the engine, its round loops, the split backend (the child runs none of them)
NOT_IN_CHILD = ("saguaro_dist.engine.engine", "saguaro_dist.engine.sd_loop", "saguaro_dist.engine.ssd_loop",
                "saguaro_dist.engine.split_draft")


def test_the_draft_child_does_not_import_the_target_round_loop():
    # The imports of draft_process.main, in a fresh interpreter as the child is (python -m ...draft_process)
    code = textwrap.dedent(f"""
        import sys
        import saguaro_dist.engine.draft_process
        from saguaro_dist.engine.build import build_draft_worker
        from saguaro_dist.engine.heap import freeze_startup_heap
        print(sorted(m for m in {NOT_IN_CHILD!r} if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_draft_child_does_not_import_transformers(tiny_llama_pair, monkeypatch, capfd):
    # transformers is ~2.5 of the child's ~5 CPU s of start-up: the parent's fit_draft parsed the draft's
    # config.json (class defaults from transformers' config classes) and the DraftFit carries it to the child
    target, draft = tiny_llama_pair
    config = Config(model=target, draft=draft, mode="ssd", draft_executor="process", draft_threads=1, device="cpu")
    fit = fit_draft(config, None)
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    DraftProcess(config, fit).close()
    imported = {line.rsplit("|", 1)[-1].strip() for line in capfd.readouterr().err.splitlines()
                if line.startswith("import time:")}
    assert "saguaro_dist.engine.build" in imported  # the log is the child's, past its draft build's imports
    assert "transformers" not in imported


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen3"])
def test_the_draft_fit_carries_the_draft_config_through_a_pickle(tiny_checkpoint, kind):
    # The pipe to the child and Ray's calls to the draft actors pickle the DraftFit
    path = tiny_checkpoint(kind)
    fit = pickle.loads(pickle.dumps(fit_draft(Config(model=path, draft=path, mode="sd"), None)))
    assert fit.draft_config == load_config(path)
