"""Fixtures for the serving, client and CLI tests, loaded as a pytest plugin by those modules
(`pytest_plugins = ["test_serve_fixtures"]`) so the Ray cluster and the Serve app exist once per session.

The checkpoints are real tiny Llamas written by transformers, with a real (tiny) tokenizer saved next
to them, since serving needs text in and out.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

from saguaro_dist.serve.ingress import free_port  # noqa: F401 - the serve tests' spare ports come from here


def ipv6_loopback() -> bool:
    """Whether this machine can bind IPv6's loopback (a container may have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


API_KEY = "sk-test-saguaro"
MODEL_NAME = "tiny-ssd"
APP_NAME = "saguaro"
# The engine settings of the shared server; the reference LLM uses the same ones.
# A fixed speculation path (explicit fan-out, a tree every round, x_K always run after a hit, neural
# fallback): a seeded request then reproduces exactly, which one test checks over HTTP (README:
# "Reproducible sampling"). A tree is waited for however late (a loaded box can stall the draft past the 5 s
# default): one given up on is a miss, a round on another path, whose draws differ.
ENGINE_ARGS = {"mode": "ssd", "k": 2, "max_batch_size": 16, "max_model_len": 256, "fan_out": [3, 3, 3],
               "tree_policy": "always", "hit_glue": "always", "fallback": "neural", "tree_timeout_s": 600.0}
SENTENCES = [
    "the cat sat on the mat", "a dog ran in the park", "hello world from the desert",
    "def add ( a , b ) : return a + b", "class Stack : pass", "import os", "for i in range ( 10 ) :",
    "speculative decoding drafts tokens and the target verifies them", "saguaro cactus grows slowly",
]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def write_llama(path, tokenizer, *, hidden: int, layers: int, seed: int, max_positions: int = 256) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def serving_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) tiny Llamas sharing one saved tokenizer (no chat template: the plain one applies)."""
    tokenizer = make_tokenizer()
    target = write_llama(tmp_path_factory.mktemp("serve_target"), tokenizer, hidden=64, layers=2, seed=1)
    draft = write_llama(tmp_path_factory.mktemp("serve_draft"), tokenizer, hidden=32, layers=1, seed=2)
    return target, draft


@dataclass(frozen=True)
class Server:
    url: str          # http://127.0.0.1:PORT
    api_key: str
    model: str
    target: str
    draft: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}


@pytest.fixture(scope="session")
def server(ray_cluster, serving_pair) -> Server:
    """The real Serve app on loopback, as `saguaro serve` deploys it."""
    from ray import serve

    from saguaro_dist.serve.app import build_app

    target, draft = serving_pair
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": target, "draft": draft, **ENGINE_ARGS, "api_key": API_KEY, "served_model_name": MODEL_NAME}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    return Server(f"http://127.0.0.1:{port}", API_KEY, MODEL_NAME, target, draft)


@pytest.fixture(scope="session")
def reference_llm(serving_pair):
    """The same engine in-process: what HTTP outputs must equal."""
    from saguaro_dist import LLM

    target, draft = serving_pair
    llm = LLM(model=target, draft=draft, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def app_stats() -> dict:
    """The replica's in-flight / cancelled generation counts, through a Serve deployment handle."""
    from ray import serve

    return serve.get_app_handle(APP_NAME).stats.remote().result(timeout_s=30)


@pytest.fixture(scope="module")
def metrics_url(ray_cluster) -> str:
    """The Ray node's Prometheus endpoint the serving metrics are scraped from (conftest's ray_cluster)."""
    if ray_cluster is None:
        pytest.skip("Ray was started outside the tests: its metrics port is unknown")
    return ray_cluster
