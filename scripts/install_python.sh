#!/usr/bin/env bash
# Installs the kvtier Python package from a build tree into an interpreter's
# site-packages (a virtualenv's, or the system's), or into a directory:
#
#   scripts/install_python.sh [--build DIR] [--python PYTHON] [--target DIR]
#
#   --build   the CMake build tree (default: build); `make build` first
#   --python  the interpreter whose site-packages receive it (default:
#             /usr/bin/python3; a virtualenv's bin/python for a virtualenv,
#             made with --system-site-packages to see Debian's numpy/torch)
#   --target  a directory instead (then put it on PYTHONPATH)
#
# It copies the package (pure-Python modules and the _native extension,
# which links kvtier statically and needs only the system's shared
# libraries), so nothing is fetched from any registry.
set -euo pipefail
build=build
python=/usr/bin/python3
target=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install_python.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# The docs' command lines are checked with their flags only (test_docs.py).
if [ "${KVTIER_FLAGS_ONLY:-}" = 1 ]; then exit 0; fi
src="$build/python/kvtier"
if ! ls "$src"/_native*.so >/dev/null 2>&1; then
  echo "install_python.sh: no extension in $src: build first (make build)" >&2
  exit 1
fi
# The extension is built for one interpreter's ABI (its file name says
# which, e.g. _native.cpython-311-x86_64-linux-gnu.so): another Python
# version could not import it, so refuse to install it there.
ext="$(basename "$(ls "$src"/_native*.so | head -n 1)")"
want="$(echo "$ext" | sed -n 's/^_native\.\(.*\)\.so$/\1/p')"
if ! have="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))' 2>/dev/null)"; then
  echo "install_python.sh: $python does not run" >&2
  exit 2
fi
if [ -n "$want" ] && [ "$have" != "$want" ]; then
  echo "install_python.sh: the extension in $src is built for $want, but $python is $have;" \
       "install into an environment of that Python version (e.g. /usr/bin/python3 -m venv" \
       "--system-site-packages), or rebuild with cmake -DPython_EXECUTABLE=$python" >&2
  exit 2
fi
if [ -z "$target" ]; then
  target="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
fi
mkdir -p "$target"
rm -rf "$target/kvtier"
cp -r "$src" "$target/kvtier"
find "$target/kvtier" -name __pycache__ -prune -exec rm -rf {} +
echo "install_python.sh: kvtier installed in $target"
