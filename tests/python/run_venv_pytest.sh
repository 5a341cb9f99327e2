#!/bin/sh
# Runs a pytest file with the project's Python environment (BUILD/venv, the
# pinned vLLM; scripts/setup_venv.sh) when it exists, else with the system
# interpreter, where the file skips and says why. Under CI=true the
# environment must exist and no test may skip (conftest.py fails the run,
# naming each skipped test): CI runs the real engines or fails.
# Usage: run_venv_pytest.sh SYSTEM_PYTHON BUILD_DIR TEST_FILE
py="$1"
if [ -x "$2/venv/bin/python" ]; then
  py="$2/venv/bin/python"
elif [ "${CI:-}" = "true" ]; then
  echo "kvtier CI: the project's Python environment $2/venv is missing" \
       "($(cat "$2/venv.unavailable" 2>/dev/null || echo 'make venv was not run'));" \
       "under CI=true $3 must run in it" >&2
  exit 1
fi
if [ "${CI:-}" = "true" ]; then export KVTIER_REQUIRE_ENGINES=1; fi
export KVTIER_BUILD_DIR="$2"
exec "$py" -m pytest -q -p no:cacheprovider -rs "$3"
