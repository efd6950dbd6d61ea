#!/usr/bin/env bash
# Coverage-guided fuzzing on stable Rust: AFL++ through afl.rs (cargo-afl).
# Installs cargo-afl (pinned, with the AFL++ it bundles, built for the current
# rustc) into a cache outside the repo, builds the AFL binaries of fuzz/
# (feature `afl`), then runs one campaign per target from fuzz/corpus/<target>.
#
# Usage: scripts/fuzz.sh [TARGET...]    (default: every target)
# Env:
#   FUZZ_EXECS   executions per target (afl-fuzz -E; default 1000000)
#   FUZZ_SECONDS wall-clock cap per target (afl-fuzz -V; default 3600)
#   FUZZ_OUT     campaign output (default /tmp/remora-fuzz; never in the repo)
#   FUZZ_JOBS    targets fuzzed at once (default 1; the machine may be shared)
#   REMORA_CACHE cache root (default ~/.cache/remora)
# Afterwards: new crashes are copied to fuzz/crashes/<target>/ (replayed by
# `cargo test -p remora-fuzz`), and each target's summary line (execs, execs/s,
# crashes) is printed and written to $FUZZ_OUT/summary.txt. To grow the
# committed corpus, minimise the queue with scripts/fuzz.sh's `cmin` step:
#   FUZZ_CMIN=1 scripts/fuzz.sh TARGET   (writes $FUZZ_OUT/<target>/cmin)
# then keep a few of those: $FUZZ_OUT/<target>/keep holds the FUZZ_KEEP
# (default 30) inputs of cmin/ up to 4 KiB that cover the most tuples,
# picked greedily; commit them as fuzz/corpus/<target>/afl-<the first 12
# hex digits of their sha256>.
set -euo pipefail
cd "$(dirname "$0")/.."

# Keep in step with fuzz/Cargo.toml (afl = "=...").
CARGO_AFL_VERSION=0.18.2
TARGETS_ALL=(admission_review contract_annotations bootstrap_override sds_request discovery_request discovery_delta xds_response)

log() { printf '[fuzz] %s\n' "$*" >&2; }

# keep TARGET: the FUZZ_KEEP inputs of $out/TARGET/cmin (up to 4 KiB)
# covering the most tuples (afl-showmap's edge:hit-bucket lines), picked
# greedily, into $out/TARGET/keep; says on stderr how many they cover.
keep() {
  local t=$1 maps="$out/$1/maps" f
  rm -rf "$maps" "$out/$t/keep"
  mkdir -p "$maps" "$out/$t/keep"
  for f in "$out/$t/cmin"/*; do
    # Small ones only: the seeds already hold the large shapes.
    [ "$(stat -c %s "$f")" -le 4096 ] || continue
    afl-showmap -q -o "$maps/$(basename "$f")" -- "$bindir/$t" <"$f" >/dev/null 2>&1 || true
  done
  (cd "$maps" && awk -v n="${FUZZ_KEEP:-30}" '
    { tuples[FILENAME] = tuples[FILENAME] " " $0; all[$0] = 1 }
    END {
      for (k = 0; k < n; k++) {
        best = ""; gain = 0
        for (f in tuples) {
          g = 0; m = split(tuples[f], ts, " ")
          for (i = 1; i <= m; i++) if (!(ts[i] in covered)) g++
          if (g > gain) { gain = g; best = f }
        }
        if (best == "") break
        m = split(tuples[best], ts, " ")
        for (i = 1; i <= m; i++) covered[ts[i]] = 1
        delete tuples[best]; print best
      }
      total = 0; for (x in all) total++; c = 0; for (x in covered) c++
      printf "covered %d of the %d tuples of those up to 4 KiB\n", c, total > "/dev/stderr"
    }' *) | while read -r f; do cp "$out/$t/cmin/$f" "$out/$t/keep/"; done
}

cache="${REMORA_CACHE:-$HOME/.cache/remora}/cargo-afl/$CARGO_AFL_VERSION"
export PATH="$cache/bin:$PATH"
# cargo-afl keeps AFL++ and its runtime under the XDG data dir, per rustc version.
export XDG_DATA_HOME="$cache/data"

if [ ! -x "$cache/bin/cargo-afl" ]; then
  log "installing cargo-afl $CARGO_AFL_VERSION into $cache"
  cargo install --locked --root "$cache" "cargo-afl@$CARGO_AFL_VERSION"
fi
# Builds AFL++ from the source bundled with cargo-afl (no network), once per rustc.
if ! ls "$XDG_DATA_HOME"/afl.rs/rustc-"$(rustc --version | awk '{print $2}')"-*/afl.rs-"$CARGO_AFL_VERSION"/afl/bin/afl-fuzz >/dev/null 2>&1; then
  log "building AFL++ for $(rustc --version)"
  cargo afl config --build
fi

# The bundled AFL++ first on PATH: its afl-cmin calls afl-showmap by name, and
# another AFL++ (e.g. Debian's afl++) has incompatible options.
aflbin=$(ls -d "$XDG_DATA_HOME"/afl.rs/rustc-"$(rustc --version | awk '{print $2}')"-*/afl.rs-"$CARGO_AFL_VERSION"/afl/bin | head -1)
export PATH="$aflbin:$PATH"

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${TARGETS_ALL[@]}")
execs="${FUZZ_EXECS:-1000000}"
seconds="${FUZZ_SECONDS:-3600}"
out="${FUZZ_OUT:-/tmp/remora-fuzz}"
jobs="${FUZZ_JOBS:-1}"
mkdir -p "$out"

# Release: the campaign's speed is the point. A target dir of its own, so the
# instrumented build never mixes with the normal one.
log "building the AFL binaries"
# Overflow checks and debug assertions on (an overflow is a bug to find), and
# thin local builds instead of the shipping profile's fat LTO, which would
# only slow the build down.
CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
CARGO_PROFILE_RELEASE_OPT_LEVEL=3 CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true \
CARGO_TARGET_DIR=target/afl cargo afl build --locked --release -p remora-fuzz --features afl \
  $(printf -- '--bin %s ' "${targets[@]}")
bindir=target/afl/release

export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 \
  AFL_NO_AFFINITY=1 AFL_SKIP_CRASHES=1

run() {
  local t=$1 dir="$out/$1"
  rm -rf "$dir"
  mkdir -p "$dir"
  log "$t: up to $execs executions or $seconds s -> $dir"
  # -E stops after that many executions, -V after that many seconds.
  cargo afl fuzz -i "fuzz/corpus/$t" -o "$dir" -E "$execs" -V "$seconds" \
    -- "$bindir/$t" >"$dir/afl.log" 2>&1 || { log "$t: afl-fuzz failed, see $dir/afl.log"; tail -20 "$dir/afl.log" >&2; return 1; }
}

running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run "$t" &
  running=$((running + 1))
done
wait || true

: >"$out/summary.txt"
for t in "${targets[@]}"; do
  stats="$out/$t/default/fuzzer_stats"
  [ -f "$stats" ] || { log "$t: no fuzzer_stats"; continue; }
  get() { sed -n "s/^$1 *: *//p" "$stats"; }
  line=$(printf '%-22s execs=%s execs_per_sec=%s run_time=%ss corpus=%s saved_crashes=%s saved_hangs=%s' \
    "$t" "$(get execs_done)" "$(get execs_per_sec)" "$(get run_time)" "$(get corpus_count)" \
    "$(get saved_crashes)" "$(get saved_hangs)")
  echo "$line" | tee -a "$out/summary.txt"
  mkdir -p "fuzz/crashes/$t"
  for c in "$out/$t"/default/crashes/id:*; do
    [ -e "$c" ] || continue
    # Named by content, so a crash found twice is one file.
    cp "$c" "fuzz/crashes/$t/$(sha256sum "$c" | cut -c1-16)"
    log "$t: crash saved to fuzz/crashes/$t/ ($c)"
  done
  if [ -n "${FUZZ_CMIN:-}" ]; then
    rm -rf "$out/$t/cmin"
    # The bash afl-cmin: the bundled Python one (what `cargo afl cmin` runs)
    # reads no tuples from these binaries' batched traces and keeps 0 files.
    afl-cmin.bash -i "$out/$t/default/queue" -o "$out/$t/cmin" -- "$bindir/$t" \
      >"$out/$t/cmin.log" 2>&1 || { log "$t: afl-cmin failed, see $out/$t/cmin.log"; continue; }
    log "$t: $(ls "$out/$t/cmin" | wc -l) inputs after afl-cmin -> $out/$t/cmin"
    covered=$(keep "$t" 2>&1 >/dev/null)
    log "$t: $(ls "$out/$t/keep" | wc -l) inputs kept ($covered) -> $out/$t/keep"
  fi
done
