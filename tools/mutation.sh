#!/usr/bin/env bash
# Mutation testing of the modules listed under [tool.mutmut] in pyproject.toml.
#
#   PYTHON=.venv/bin/python tools/mutation.sh     # one worker (the build hosts are shared)
#   MUTMUT_WORKERS=4 tools/mutation.sh             # on a machine of your own
#
# It starts from an empty mutants/ every time: mutmut's cache keeps old verdicts after tests
# change, and the membership run takes seconds anyway.
# Survivors: `mutmut results`, then `mutmut show <name>` for the diff of one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
rm -rf mutants
# mutmut runs the tests from mutants/, which holds its own copy of the package; the PYTHONPATH
# of the caller must not point back at the unmutated sources.
unset PYTHONPATH
mkdir -p mutants
# The run draws a progress spinner; keep it in a log and show its tail only when the run fails.
if ! "$PYTHON" -m mutmut run --max-children "${MUTMUT_WORKERS:-1}" >mutants/run.log 2>&1; then
    tr '\r' '\n' <mutants/run.log | tail -n 40
    exit 1
fi
"$PYTHON" - <<'PY'
import re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
status = [m.group(1) for m in re.finditer(r":\s*(\w[\w ]*)$", out, re.M)]
killed = status.count("killed")
print(f"mutants: {len(status)}, killed: {killed} ({100 * killed / max(len(status), 1):.1f}%)")
for line in out.splitlines():
    if not line.rstrip().endswith("killed"):
        print(line)
PY
