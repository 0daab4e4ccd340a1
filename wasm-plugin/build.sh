#!/usr/bin/env bash
# Builds the proxy-wasm plugin for wasm32-wasip1 and delivers it as bypass_marker.wasm (the
# package's lib is `bypass_marker_wasm`: `bypass_marker` is the dynamic module's, which this
# package depends on). Prints the path of the plugin on stdout.
#
#   bash wasm-plugin/build.sh                        # target/wasm32-wasip1/release/bypass_marker.wasm
#   bash wasm-plugin/build.sh --features test-panic  # any other cargo build flags go to cargo
#
# Environment: CARGO_TARGET_DIR. Needs the target: `rustup target add wasm32-wasip1`.
# The release build is optimised across crates (LTO, one codegen unit) and uses Wasm SIMD
# (`simd128`, which V8 has run by default since 2021): the frame scanner's memchr uses it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
args=("$@")
out_dir="$target/wasm32-wasip1/release"
for ((i = 0; i < ${#args[@]}; i++)); do
  if [[ "${args[i]}" == --target-dir ]]; then
    out_dir="${args[i + 1]}/wasm32-wasip1/release"
  fi
done
(
  cd "$root"
  CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 CARGO_PROFILE_RELEASE_PANIC=abort \
    RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+simd128" \
    cargo build --quiet --release --locked --target wasm32-wasip1 -p bypass-marker-wasm "${args[@]}" >&2
)
cp "$out_dir/bypass_marker_wasm.wasm" "$out_dir/bypass_marker.wasm"
printf '%s\n' "$out_dir/bypass_marker.wasm"
