"""The generated stubs committed in saguaro_dist/distributed/proto/ match protos/saguaro.proto."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from saguaro_dist.distributed.proto import SERVICE_NAME, saguaro_pb2, saguaro_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUBS = ROOT / "saguaro_dist" / "distributed" / "proto"
STUB_FILES = ("saguaro_pb2.py", "saguaro_pb2_grpc.py", "saguaro_pb2.pyi")


def _compiled_descriptor(tmp_path) -> descriptor_pb2.FileDescriptorProto:
    out = tmp_path / "saguaro.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}",
                    f"--descriptor_set_out={out}", str(ROOT / "protos" / "saguaro.proto")], check=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    _clear_json_names(files[0].message_type)  # --descriptor_set_out fills them; embedded stubs leave them out
    return files[0]


def _clear_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)


def test_committed_descriptor_equals_the_proto(tmp_path):
    # Independent of the grpcio-tools version: the schema itself must be identical.
    committed = descriptor_pb2.FileDescriptorProto()
    saguaro_pb2.DESCRIPTOR.CopyToProto(committed)
    assert committed == _compiled_descriptor(tmp_path)


def test_grpc_stub_has_every_service_method():
    service = saguaro_pb2.DESCRIPTOR.services_by_name["DraftService"]
    assert service.full_name == SERVICE_NAME
    assert {m.name for m in service.methods} == {"Prefill", "JitDraft", "Release", "Speculate"}
    speculate = service.methods_by_name["Speculate"]
    assert speculate.client_streaming and speculate.server_streaming
    for method in service.methods:
        assert hasattr(saguaro_pb2_grpc.DraftServiceServicer, method.name)


def _generated_with() -> str | None:
    text = (STUBS / "saguaro_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    return match.group(1) if match else None


def test_regenerated_stubs_are_identical(tmp_path):
    """scripts/gen_protos.sh reproduces the committed files byte for byte (same grpcio-tools)."""
    tools = importlib.metadata.version("grpcio-tools")
    if tools != _generated_with():
        pytest.skip(f"stubs were generated with grpcio-tools {_generated_with()}, {tools} installed")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True)
    for name in STUB_FILES:
        assert (tmp_path / name).read_text() == (STUBS / name).read_text(), f"{name} is stale: run scripts/gen_protos.sh"
