#!/usr/bin/env bash
# The seed's entry point, kept verbatim:
#   bash scripts/merge_fast_io_budget.sh --db DB --base ID_OR_DIR --experts A B ... \
#        --out DIR --model-id ID [--budget 25%] [any other `mergepipe merge` option]
# --base/--experts may be registered ids or checkpoint directories (registered on
# the fly). Uses the repository's .venv when present, else `mergepipe` on PATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$here/.venv/bin/mergepipe" ]; then
  exec "$here/.venv/bin/mergepipe" merge "$@"
fi
exec mergepipe merge "$@"
