#!/usr/bin/env bash
# Runs every test of the workspace: unit, property, integration and doc tests,
# with every feature on (so the etcd backend runs its conformance suite against
# a real etcd that the tests start themselves). Arguments go to `cargo test`.
#
# Installs what the tests need first, when it is missing (Debian packages):
#   etcd     etcd-server                        the tests run /usr/bin/etcd
#   protoc   protobuf-compiler, libprotobuf-dev  etcd-client compiles its protobufs
#                                               (they import google/protobuf/*.proto)
#   kubernetes-validate (PyPI, pinned below)    tests/kubernetes.rs validates deploy/kubernetes/
#                                               with it; it bundles the Kubernetes schemas, so
#                                               the test runs offline. Installed into a venv of
#                                               Debian's python3 (python3-venv) at $kube_venv.
set -euo pipefail
cd "$(dirname "$0")/.."

kube_venv=/opt/oar-test-venv
kube_validate_version=1.37.0
# Its dependencies too, as tested, so that a new release cannot change what the test sees.
kube_validate_pins=(kubernetes-validate=="$kube_validate_version" jsonschema==4.26.0
    jsonschema-specifications==2025.9.1 referencing==0.37.0 PyYAML==6.0.3 packaging==26.3
    importlib_resources==7.1.0 typing_extensions==4.16.0 attrs==26.1.0 rpds-py==2026.9.1)
kube_validate_ok() {
    [ "$("$kube_venv/bin/kubernetes-validate" --version 2>/dev/null)" = "$kube_validate_version" ]
}

as_root=()
need_root() { # $1: what for
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "scripts/test.sh: need root (or sudo) to $1" >&2
            exit 1
        fi
        as_root=(sudo)
    fi
}

missing=()
if [ ! -x /usr/bin/etcd ] && ! command -v etcd >/dev/null 2>&1; then
    missing+=(etcd-server)
fi
if [ -z "${PROTOC:-}" ]; then
    command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
    [ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
fi

kube_validate_present=true
if ! kube_validate_ok; then
    kube_validate_present=false
    /usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
fi

if [ "${#missing[@]}" -gt 0 ]; then
    echo "scripts/test.sh: installing ${missing[*]}" >&2
    need_root "run: apt-get install -y ${missing[*]}"
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q "${missing[@]}" </dev/null
fi

if ! "$kube_validate_present"; then
    echo "scripts/test.sh: installing kubernetes-validate==$kube_validate_version into $kube_venv" >&2
    need_root "create $kube_venv"
    "${as_root[@]}" /usr/bin/python3 -m venv --clear "$kube_venv"
    "${as_root[@]}" "$kube_venv/bin/pip" install -q --disable-pip-version-check "${kube_validate_pins[@]}" </dev/null
    if ! kube_validate_ok; then
        echo "scripts/test.sh: $kube_venv/bin/kubernetes-validate does not run after its install" >&2
        exit 1
    fi
fi

# The cores build without their shells, and without tokio or QUIC (quinn-proto,
# quinn-udp, rustls): Cargo, not discipline, keeps them free of I/O runtimes.
# Their libraries only: with `--tests` the check also compiled the dev-dependencies
# (the shells, tokio, QUIC) a second time in check mode, 3m13s against 1m20s
# from a clean checkout, and the tests themselves build below with every feature.
for core in oar-task-queue oar-pserver oar-trainer; do
    if cargo tree --locked -q -p "$core" --no-default-features -e normal | grep -qE '^\W*(tokio|quinn|quinn-proto|quinn-udp|rustls) '; then
        echo "scripts/test.sh: $core --no-default-features pulls in tokio, quinn-proto, quinn-udp or rustls:" >&2
        cargo tree --locked -q -p "$core" --no-default-features -e normal -i tokio >&2 || true
        exit 1
    fi
    cargo check --locked -q -p "$core" --no-default-features --lib
done

# Not the benchmarks (bench/, package oar-bench): they are measured, not tested,
# and building their 14 binaries took ~290 s of the build's compile units.
# `cargo clippy --workspace --all-targets` builds them.
exec cargo test --workspace --exclude oar-bench --locked --all-features "$@"
