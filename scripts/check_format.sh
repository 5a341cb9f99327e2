#!/usr/bin/env bash
# The C++ style check CI runs (.ci/run): every tracked .cc and .h outside
# generated code is as clang-format (.clang-format: Google's style, 100
# columns) writes it. Lists the files that are not and exits 1; --fix
# rewrites them in place. Needs clang-format (Debian's clang-format, 14).
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
if [ "${1:-}" = "--fix" ]; then fix=1; fi
if ! command -v clang-format >/dev/null; then
  echo "check_format.sh: clang-format is not installed (apt-get install clang-format)" >&2
  exit 2
fi
bad=()
while IFS= read -r f; do
  if [ "$fix" = 1 ]; then
    clang-format -i "$f"
  elif ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
    bad+=("$f")
  fi
done < <(git ls-files '*.cc' '*.h')
if [ "${#bad[@]}" -gt 0 ]; then
  echo "check_format.sh: ${#bad[@]} file(s) differ from clang-format's layout (scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format.sh: $(git ls-files '*.cc' '*.h' | wc -l) files formatted"
