#!/usr/bin/env bash
# mypy --strict over the installed layout: the sources live in top-level folders mapped onto
# kvbridge.* by setuptools, which mypy cannot follow in an editable install, so type-check a
# regular (non-editable) build of the same tree.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m pip install --quiet --no-deps --no-build-isolation --target "$tmp/site" "$root" \
  >/dev/null 2>&1 || python -m pip install --quiet --no-deps --target "$tmp/site" "$root"
cd "$tmp/site"
python -m mypy --config-file "$root/pyproject.toml" -p kvbridge
