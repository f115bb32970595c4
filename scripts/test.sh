#!/usr/bin/env bash
# Runs every test of the workspace: unit, property, integration and doc tests.
# Installs what the tests need first (nothing beyond cargo yet).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked "$@"
