#!/usr/bin/env bash
# Lints protos/ with buf (the npm package @bufbuild/buf, installed into .tools/ on first use).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
buf="$root/.tools/node_modules/.bin/buf"
if [ ! -x "$buf" ]; then
  npm install --silent --no-audit --no-fund --prefix "$root/.tools" @bufbuild/buf@1.75.0 >/dev/null
fi
cd "$root/protos"
"$buf" lint
echo "buf lint: ok ($("$buf" --version))"
