"""A setting the mode leaves unused (SSD's tree knobs in ar / sd, the draft's in ngram) is said in a warning
naming the field and the mode, never dropped silently; defaults and the settings a mode uses say nothing."""
from __future__ import annotations

import dataclasses
import logging

import pytest

import saguaro_dist.config as config_module
from saguaro_dist.config import Config

MODE_ARGS = {"ar": {}, "ngram": {}, "sd": {"draft": "d"}, "ssd": {"draft": "d"}}


@pytest.fixture
def warnings_(caplog):
    """The warnings Config logs, each test from a clean slate (they are said once per process)."""
    config_module._warn_once.cache_clear()
    caplog.set_level(logging.WARNING, logger="saguaro_dist.config")
    return caplog


@pytest.mark.parametrize("mode, field, value", [
    ("ar", "k", 6), ("ar", "fan_out", 6), ("ar", "saguaro_c", 0.5), ("ar", "fallback", "fast"),
    ("ar", "prompt_lookup_max", 5), ("ar", "proposal_top_k", 8), ("ar", "tree_policy", "never"),
    ("sd", "fan_out", 6), ("sd", "saguaro_c", 0.5), ("sd", "fallback", "neural"), ("sd", "hit_glue", "skip"),
    ("sd", "ngram_rounds", False), ("ngram", "proposal_top_k", 8), ("ngram", "fan_out_kind", "uniform"),
    ("ngram", "adaptive_fan_out", True), ("ngram", "draft_executor", "thread"), ("ngram", "draft_device", "cpu"),
])
def test_a_setting_the_mode_leaves_unused_is_warned_naming_field_and_mode(warnings_, mode, field, value):
    Config(model="m", mode=mode, **MODE_ARGS[mode], **{field: value})
    assert f"Config {field} = {value!r} is unused in mode {mode!r}" in warnings_.text


@pytest.mark.parametrize("mode", list(MODE_ARGS))
def test_defaults_say_nothing(warnings_, mode):
    Config(model="m", mode=mode, **MODE_ARGS[mode])
    assert not warnings_.records


def test_the_settings_a_mode_uses_say_nothing(warnings_):
    Config(model="m", mode="ssd", draft="d", k=3, fan_out=[2, 2, 2, 2], saguaro_c=0.5, fallback="fast",
           tree_policy="always", proposal_top_k=8, prompt_lookup_max=5, draft_device="cpu")
    Config(model="m", mode="sd", draft="d", k=6, proposal_top_k=8, prompt_lookup_min=2)
    Config(model="m", mode="ngram", k=6, prompt_lookup_max=5)
    Config(model="m", mode="ar", max_batch_size=4, dtype="bfloat16")  # every mode's settings
    assert not warnings_.records


def test_each_warning_is_said_once(warnings_):
    for _ in range(3):  # the CLI validates a Config, then builds its engine's from the same settings
        Config(model="m", mode="sd", draft="d", fan_out=7)
    assert len(warnings_.records) == 1 and "fan_out = 7" in warnings_.text


def test_one_table_serves_config_and_the_cli():
    from saguaro_dist.cli.flag_checks import MODE_FLAGS
    from saguaro_dist.config import MODE_FIELDS
    assert set(MODE_FIELDS) <= {f.name for f in dataclasses.fields(Config)}
    assert all(MODE_FLAGS[name] is modes for name, modes in MODE_FIELDS.items())
