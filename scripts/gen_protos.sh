#!/usr/bin/env bash
# Regenerates the Python stubs of protos/saguaro.proto into saguaro_dist/distributed/proto/ (or into
# the directory given as $1, which tests use to check the committed stubs). Needs grpcio-tools.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/saguaro_dist/distributed/proto}"
mkdir -p "$out"
python -m grpc_tools.protoc -I"$root/protos" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root/protos/saguaro.proto"
# protoc writes an absolute import; the stubs live inside a package, so make it relative.
sed -i 's/^import saguaro_pb2 as saguaro__pb2$/from . import saguaro_pb2 as saguaro__pb2/' \
  "$out/saguaro_pb2_grpc.py"
