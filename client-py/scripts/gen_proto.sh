#!/usr/bin/env bash
# Regenerates the committed gRPC stubs (src/weightstream/v1) from proto/ with grpcio-tools
# 1.84.0 (gencode for protobuf >= 7.35.1, the GPU machine's grpcio 1.84 / protobuf 7.36).
#   client-py/scripts/gen_proto.sh            write the stubs
#   client-py/scripts/gen_proto.sh --check    fail if the committed stubs are out of date
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py=${PYTHON:-python3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$py" -m grpc_tools.protoc -I"$root/proto" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "$root/proto/weightstream/v1/weightstream.proto"
dest="$root/client-py/src/weightstream/v1"
if [ "${1:-}" = "--check" ]; then
  for f in weightstream_pb2.py weightstream_pb2.pyi weightstream_pb2_grpc.py; do
    if ! diff -q "$out/weightstream/v1/$f" "$dest/$f" >/dev/null; then
      echo "client-py/src/weightstream/v1/$f is out of date: run client-py/scripts/gen_proto.sh" >&2
      exit 1
    fi
  done
  echo "generated stubs are current"
else
  cp "$out"/weightstream/v1/weightstream_pb2*.py* "$dest/"
  echo "stubs written to $dest"
fi
