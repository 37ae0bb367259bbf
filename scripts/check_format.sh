#!/usr/bin/env bash
# clang-format (the repository's .clang-format, 100 columns) over every C, C++ and CUDA source:
# fails and lists the files that differ; --fix rewrites them. The version is pinned so that CI and
# developers format alike: pip install clang-format==23.1.5
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cpp' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" > /dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'not clang-formatted (bash scripts/check_format.sh --fix):\n'
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "clang-format: ${#files[@]} files clean"
