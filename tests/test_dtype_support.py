"""bfloat16 on a GPU without it (compute capability < 8.0), as vLLM: an explicit bfloat16 is refused with a
hint to float16, dtype auto falls back to float16 with a warning. The rules are pure functions of the device's
kind, so CI (no GPU) checks them with a described V100 / T4 / A100."""
from __future__ import annotations

import logging

import pytest
import torch

from saguaro_dist.model.device import DeviceKind, auto_dtype, check_dtype_supported, device_kind, resolve_dtype

V100 = DeviceKind("cuda", (7, 0), "Tesla V100-SXM2-16GB")
T4 = DeviceKind("cuda", (7, 5), "Tesla T4")
A100 = DeviceKind("cuda", (8, 0), "NVIDIA A100-SXM4-40GB")
H100 = DeviceKind("cuda", (9, 0), "NVIDIA H100 80GB HBM3")
BF16_CKPT = {"dtype": "bfloat16"}


@pytest.mark.parametrize("kind, has_bf16", [(V100, False), (T4, False), (A100, True), (H100, True),
                                            (DeviceKind("cpu"), True), (DeviceKind("cuda"), True)])
def test_bf16_support_follows_the_compute_capability(kind, has_bf16):
    assert kind.has_bf16 is has_bf16  # capability unknown (DeviceKind("cuda")): taken as capable


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16])
@pytest.mark.parametrize("gpu", [V100, T4])
def test_explicit_bfloat16_on_a_gpu_without_it_is_refused_naming_float16(dtype, gpu):
    with pytest.raises(ValueError, match=r"compute capability of at least 8\.0.*"
                                         rf"{gpu.name}' \(compute capability {gpu.capability[0]}\.{gpu.capability[1]}\)"
                                         r".*dtype float16"):
        resolve_dtype(dtype, BF16_CKPT, gpu)


def test_auto_falls_back_to_float16_on_a_gpu_without_bfloat16_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.model.device"):
        assert resolve_dtype("auto", BF16_CKPT, T4) == torch.float16
    assert "does not support bfloat16" in caplog.text and "Tesla T4" in caplog.text and "float16" in caplog.text


@pytest.mark.parametrize("saved, want", [("float32", "float16"), ("float16", "float16")])
def test_auto_on_an_older_gpu_is_unchanged_for_other_checkpoints(saved, want, caplog):
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.model.device"):
        assert auto_dtype({"dtype": saved}, V100) == want
    assert not caplog.text


@pytest.mark.parametrize("kind", [A100, H100, DeviceKind("cpu")])
def test_bfloat16_where_supported_passes(kind):
    assert resolve_dtype("auto", BF16_CKPT, kind) == torch.bfloat16
    assert resolve_dtype("bfloat16", {}, kind) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_pass_on_an_older_gpu(dtype):
    check_dtype_supported(dtype, V100)


def test_device_kind_of_a_name():
    assert device_kind("cpu") == DeviceKind("cpu")
    assert device_kind(torch.device("cpu")) == DeviceKind("cpu")
    assert device_kind(V100) is V100
    if not torch.cuda.is_available():  # no GPU to read: its capability stays unknown, never a crash here
        assert device_kind("cuda") == DeviceKind("cuda")
    else:
        kind = device_kind("cuda")
        assert kind.capability == torch.cuda.get_device_capability() and kind.name
