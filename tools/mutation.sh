#!/usr/bin/env bash
# Mutation testing of the modules listed under [tool.mutmut] in pyproject.toml
# (pip install -e '.[mutation]' first).
#
#   PYTHON=.venv/bin/python tools/mutation.sh             # every module, one worker (the build hosts are shared)
#   PYTHON=.venv/bin/python tools/mutation.sh control.supervisor  # only flodl_async/control/supervisor.py's mutants
#   MUTMUT_WORKERS=4 tools/mutation.sh                     # on a machine of your own
#
# It starts from an empty mutants/ every time: mutmut's cache keeps old verdicts after tests
# change, and a run takes minutes at most.
# Survivors: `mutmut results`, then `mutmut show <name>` for the diff of one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
rm -rf mutants
# mutmut runs the tests from mutants/, which holds its own copy of the package; the PYTHONPATH
# of the caller must not point back at the unmutated sources.
unset PYTHONPATH
mkdir -p mutants
# Module names narrow the run to those modules' mutants (mutmut still generates them all).
patterns=()
for module in "$@"; do
    patterns+=("flodl_async.${module}.*")
done
# The run draws a progress spinner; keep it in a log and show its tail only when the run fails.
if ! "$PYTHON" -m mutmut run --max-children "${MUTMUT_WORKERS:-1}" "${patterns[@]}" >mutants/run.log 2>&1; then
    tr '\r' '\n' <mutants/run.log | tail -n 40
    exit 1
fi
"$PYTHON" - <<'PY'
import re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
rows = [(m.group(1), m.group(2)) for m in re.finditer(r"^\s*([\w.]+)__mutmut_\d+:\s*(\w[\w ]*)$", out, re.M)]
# The module of a mutant is its dotted name up to the function's trampoline (x_ or xǁ).
modules = sorted({re.sub(r"\.x[_ǁ].*$", "", name) for name, _ in rows})
for module in modules:
    status = [s for name, s in rows if re.sub(r"\.x[_ǁ].*$", "", name) == module]
    if status.count("not checked") == len(status):
        continue  # left out of this run by the module names given
    killed = status.count("killed")
    print(f"{module}: mutants: {len(status)}, killed: {killed} ({100 * killed / max(len(status), 1):.1f}%)")
for line in out.splitlines():
    if not line.rstrip().endswith(("killed", "not checked")):
        print(line)
PY
