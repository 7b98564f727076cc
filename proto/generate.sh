#!/usr/bin/env bash
# Regenerate the Python modules of the .proto files into pdserve_proto/ (committed; a unit test
# checks they are current).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
  proto/pdserve_proto/inference.proto proto/pdserve_proto/kv.proto proto/pdserve_proto/worker.proto
