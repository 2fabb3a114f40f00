#!/usr/bin/env bash
# tools/ensure-protoc.sh — makes sure this machine can build the workspace's gRPC code: etcd-client's
# build script runs `protoc` on etcd's API, which imports protobuf's well-known types
# (google/protobuf/descriptor.proto, struct.proto). Debian ships protoc in protobuf-compiler and
# those files in libprotobuf-dev, which protoc only recommends: a machine with protoc alone passes
# `protoc --version` and still fails the build. So the check compiles a file that imports them,
# and installs both packages (as root) only when it fails; with --check it only checks.
# Used by tools/test.sh and tools/vm/lib.sh.
set -euo pipefail

protoc_works() {
    local dir status
    dir=$(mktemp -d)
    printf '%s\n' 'syntax = "proto3";' 'import "google/protobuf/descriptor.proto";' \
        'import "google/protobuf/struct.proto";' 'message Probe { google.protobuf.Value value = 1; }' > "$dir/probe.proto"
    status=0
    protoc --proto_path="$dir" --descriptor_set_out=/dev/null "$dir/probe.proto" > /dev/null 2>&1 || status=1
    rm -rf "$dir"
    return $status
}

protoc_works && exit 0
if [ "${1:-}" = --check ]; then
    echo "tools/ensure-protoc.sh: protoc cannot compile a file importing protobuf's well-known types (packages protobuf-compiler and libprotobuf-dev)" >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "tools/ensure-protoc.sh: protoc with protobuf's well-known types is needed: install protobuf-compiler and libprotobuf-dev (or run as root)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
packages=(protobuf-compiler libprotobuf-dev)
if ! apt-get install -y -q --no-install-recommends "${packages[@]}" > /dev/null 2>&1; then
    apt-get update -q > /dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends "${packages[@]}" > /dev/null ||
        { echo "tools/ensure-protoc.sh: apt-get install ${packages[*]} failed" >&2; exit 1; }
fi
protoc_works || { echo "tools/ensure-protoc.sh: protoc still cannot compile a file importing google/protobuf/descriptor.proto after installing ${packages[*]}" >&2; exit 1; }
