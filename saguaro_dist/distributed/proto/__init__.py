"""Generated gRPC / protobuf stubs of protos/saguaro.proto (package saguaro.v1).

Do not edit the *_pb2* modules by hand: regenerate them with scripts/gen_protos.sh.
tests/test_proto_stubs.py proves they match the .proto.
"""
from saguaro_dist.distributed.proto import saguaro_pb2, saguaro_pb2_grpc

SERVICE_NAME = "saguaro.v1.DraftService"

__all__ = ["saguaro_pb2", "saguaro_pb2_grpc", "SERVICE_NAME"]
