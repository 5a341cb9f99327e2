#!/usr/bin/env bash
# The C++ style check CI runs (.ci/run): every tracked .cc and .h outside
# generated code is as clang-format (.clang-format: Google's style, 100
# columns) writes it. Lists the files that are not and exits 1; --fix
# rewrites them in place. Needs clang-format (Debian's clang-format, 14).
# The Rust crate in frontend/text is checked with rustfmt where cargo has it.
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
# The Rust crate of the frontend's text layer, as rustfmt writes it.
cargo_bin="$(command -v cargo || echo "$HOME/.cargo/bin/cargo")"
if "$cargo_bin" fmt --version >/dev/null 2>&1; then
  if [ "$fix" = 1 ]; then
    "$cargo_bin" fmt --manifest-path frontend/text/Cargo.toml
  elif ! "$cargo_bin" fmt --check --manifest-path frontend/text/Cargo.toml >/dev/null 2>&1; then
    bad+=(frontend/text/src/lib.rs)
  fi
fi
if [ "${#bad[@]}" -gt 0 ]; then
  echo "check_format.sh: ${#bad[@]} file(s) differ from clang-format's layout (scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format.sh: $(git ls-files '*.cc' '*.h' | wc -l) files formatted"
