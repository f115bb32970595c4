#!/usr/bin/env bash
# Runs every test of the workspace: unit, property, integration and doc tests,
# with every feature on (so the etcd backend runs its conformance suite against
# a real etcd that the tests start themselves). Arguments go to `cargo test`.
#
# Installs what the tests need first, when it is missing (Debian packages):
#   etcd     etcd-server                        the tests run /usr/bin/etcd
#   protoc   protobuf-compiler, libprotobuf-dev  etcd-client compiles its protobufs
#                                               (they import google/protobuf/*.proto)
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
if [ ! -x /usr/bin/etcd ] && ! command -v etcd >/dev/null 2>&1; then
    missing+=(etcd-server)
fi
if [ -z "${PROTOC:-}" ]; then
    command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
    [ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
fi

if [ "${#missing[@]}" -gt 0 ]; then
    echo "scripts/test.sh: installing ${missing[*]}" >&2
    as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "scripts/test.sh: need root (or sudo) to run: apt-get install -y ${missing[*]}" >&2
            exit 1
        fi
        as_root=(sudo)
    fi
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q "${missing[@]}" </dev/null
fi

exec cargo test --workspace --locked --all-features "$@"
