#!/usr/bin/env bash
# What a results file records of where it came from, in one place: the
# shell scripts (test.sh, images.sh) source this file, and the Rust benches
# (remora_test_support::results) run it.
#   stamp.sh machine   the machine now, as a JSON object
#   stamp.sh dirty     true when tracked files differ from HEAD, else false
# Results files are written by the benches: they do not make the code
# measured dirty, so bench/results is left out; untracked files are too.

# The machine now: cores, CPU model, memory, kernel, load average.
stamp_machine() {
  local cpu mem
  cpu=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo | head -n 1 | sed 's/[\\"]//g')
  mem=$(awk '/^MemTotal:/ {printf "%.3f", $2 / 1048576}' /proc/meminfo)
  printf '{"cores":%d,"cpu":"%s","memory_gib":%s,"kernel":"%s","load_average":"%s"}\n' \
    "$(nproc)" "$cpu" "${mem:-0}" "$(uname -r)" "$(cat /proc/loadavg)"
}

# Whether the checkout around $1 (default: the working directory) is dirty.
stamp_dirty() {
  local root
  root=$(git -C "${1:-.}" rev-parse --show-toplevel 2>/dev/null) || {
    echo false
    return
  }
  if [[ -n "$(git -C "$root" status --porcelain --untracked-files=no -- . ':!bench/results')" ]]; then
    echo true
  else
    echo false
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  case "${1:-}" in
    machine) stamp_machine ;;
    dirty) stamp_dirty "${2:-.}" ;;
    *)
      echo "usage: stamp.sh machine|dirty [dir]" >&2
      exit 2
      ;;
  esac
fi
