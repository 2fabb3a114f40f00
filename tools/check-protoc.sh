#!/usr/bin/env bash
# tools/check-protoc.sh — whether this machine can build the workspace's gRPC code: etcd-client's
# build script runs `protoc` on etcd's API, which imports protobuf's well-known types
# (google/protobuf/descriptor.proto, struct.proto). Debian ships protoc in protobuf-compiler and
# those files in libprotobuf-dev, which protoc only recommends: a machine with protoc alone passes
# `protoc --version` and still fails the build. So the check compiles a file that imports them.
# tools/test.sh (ensure_installed) and tools/vm/lib.sh (vm_install_host_tools) install both
# packages when it fails.
set -euo pipefail

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf '%s\n' 'syntax = "proto3";' 'import "google/protobuf/descriptor.proto";' \
    'import "google/protobuf/struct.proto";' 'message Probe { google.protobuf.Value value = 1; }' > "$dir/probe.proto"
if ! protoc --proto_path="$dir" --descriptor_set_out=/dev/null "$dir/probe.proto" > /dev/null 2>&1; then
    echo "tools/check-protoc.sh: protoc cannot compile a file importing protobuf's well-known types (Debian: protobuf-compiler, libprotobuf-dev)" >&2
    exit 1
fi
