#!/usr/bin/env bash
# Build the beeswarm bundle into dist/beeswarm/ from the project's venv (make bundle runs this).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m PyInstaller --version >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check 'pyinstaller>=6.10'
"$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/beeswarm.spec
echo "built dist/beeswarm/beeswarm ($(du -sh dist/beeswarm | cut -f1))"
