#!/usr/bin/env bash
# Build the documentation site (MkDocs with Material; the API reference from the docstrings by mkdocstrings) with
# --strict: a broken link, a page missing from the nav or an API name that does not resolve fails the build.
#   bash scripts/docs.sh              into site/ (gitignored); open site/index.html
#   bash scripts/docs.sh DIR          into DIR (a folder outside the repository, say)
#   bash scripts/docs.sh serve        preview on http://127.0.0.1:8000, rebuilt on every change
# Sets up .venv as train.sh and test.sh do (the dev extra brings MkDocs); DeepSpeed's ops are not built for it.
set -euo pipefail
site=$(realpath -m "${1:-site}")
[ "${1:-}" = "" ] && site=""
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export LIGHTNING_GAUDI_DS_SKIP_OP_BUILD=${LIGHTNING_GAUDI_DS_SKIP_OP_BUILD:-1}
. scripts/setup.sh
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, printed on every build
if [ "${1:-}" = "serve" ]; then
  exec python -m mkdocs serve --strict
fi
python -m mkdocs build --strict --clean ${site:+--site-dir "$site"}
echo "docs.sh: the site is in ${site:-$(pwd)/site}"
