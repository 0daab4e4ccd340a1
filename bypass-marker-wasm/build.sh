#!/usr/bin/env bash
# Builds the proxy-wasm plugin for wasm32-wasip1 and delivers it as bypass_marker.wasm (the
# package's lib is `bypass_marker_wasm`: `bypass_marker` is the dynamic module's, which this
# package depends on). Prints the path of the plugin on stdout.
#
#   bash bypass-marker-wasm/build.sh                        # target/wasm32-wasip1/release/bypass_marker.wasm
#   bash bypass-marker-wasm/build.sh --features test-panic  # .../bypass_marker-test-panic.wasm
#                                                    # (any other cargo build flags go to cargo)
#
# Environment: CARGO_TARGET_DIR. Needs the target: `rustup target add wasm32-wasip1`.
# The release build is optimised across crates (LTO, one codegen unit) and uses Wasm SIMD
# (`simd128`, which V8 has run by default since 2021): the frame scanner's memchr uses it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
args=("$@")
out_dir="$target/wasm32-wasip1/release"
# A test or benchmark build gets a name of its own (bypass_marker-test-panic.wasm, ...), and starts
# only where its configuration says "build": "<name>" (docs/envoy.md): it cannot be deployed by
# mistake in the release build's place.
name=bypass_marker
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --target-dir) out_dir="${args[i + 1]}/wasm32-wasip1/release" ;;
    --features | -F)
      for build in test-panic floor-call floor-read; do
        [[ ",${args[i + 1]// /,}," == *",$build,"* ]] && name="bypass_marker-$build"
      done
      ;;
  esac
done
(
  cd "$root"
  CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 CARGO_PROFILE_RELEASE_PANIC=abort \
    RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+simd128" \
    cargo build --quiet --release --locked --target wasm32-wasip1 -p bypass-marker-wasm "${args[@]}" >&2
)
cp "$out_dir/bypass_marker_wasm.wasm" "$out_dir/$name.wasm"
printf '%s\n' "$out_dir/$name.wasm"
