#!/bin/sh
# Runs a pytest file with the project's Python environment (BUILD/venv, the
# pinned vLLM; scripts/setup_venv.sh) when it exists, else with the system
# interpreter, where the file skips and says why.
# Usage: run_venv_pytest.sh SYSTEM_PYTHON BUILD_DIR TEST_FILE
py="$1"
if [ -x "$2/venv/bin/python" ]; then py="$2/venv/bin/python"; fi
export KVTIER_BUILD_DIR="$2"
exec "$py" -m pytest -q -p no:cacheprovider -rs "$3"
