#!/usr/bin/env bash
# The release artifacts, from the repository's root, in one command (docs/deploy.md):
#
#   bash dist/release.sh            # into target/dist/ (or $DIST_OUT)
#
# Builds with `--locked`, for the machine's own target (x86_64-unknown-linux-gnu here; an aarch64
# machine gets aarch64-unknown-linux-gnu the same way), and writes:
#   bypass-marker-VERSION-TRIPLE.tar.gz           the binary (`proxy` and `ext-proc`), README,
#                                                 licenses, docs/{sidecar,deploy,envoy}.md and
#                                                 the systemd unit bypass-marker.service
#   libbypass_marker_envoy_module-VERSION-envoy-V1-V2-V3-TRIPLE.so
#                                                 the Envoy dynamic module, named with the Envoy
#                                                 releases tests/envoy/module.sh loads it in
#   bypass_marker-VERSION-wasm32-wasip1.wasm      the proxy-wasm plugin (any machine, any Envoy
#                                                 with a Wasm runtime: no native ABI in its name)
#   bypass-marker-VERSION-oci-ARCH.tar            the image `bypass-marker:VERSION` (Containerfile
#   bypass-marker-envoy-module-VERSION-oci-ARCH.tar  targets bypass-marker, envoy-module and
#   bypass-marker-wasm-VERSION-oci-ARCH.tar       wasm), OCI archives (`podman load -i`, or
#                                                 `skopeo copy oci-archive:FILE
#                                                 docker://REGISTRY/NAME:VERSION`); the wasm one
#                                                 is Istio's Wasm image (/plugin.wasm, one layer)
#   bypass-marker-VERSION.cdx.json                CycloneDX SBOM of the crates compiled into the
#   bypass-marker-envoy-module-VERSION.cdx.json   binary (package bypass-marker), the module and into
#   bypass-marker-wasm-VERSION.cdx.json           the plugin (cargo-cyclonedx, installed if missing)
#   SHA256SUMS                                    `sha256sum -c SHA256SUMS` checks every file above
#
# Needs podman (buildah's build, `podman save --format oci-archive`) and a Rust toolchain with the
# wasm32-wasip1 target (added with rustup if missing).
# Environment:
#   DIST_OUT        where the artifacts go (default target/dist); emptied first
#   BASE_IMAGE      the bypass-marker image's base (Containerfile's default: distroless cc-debian12)
#   COPIER_IMAGE    the static busybox for the module image (Containerfile's default: busybox musl)
#   PODMAN          the podman command (default podman)
#   TOOLS_ROOT      where cargo-cyclonedx is installed if it is not on PATH
#                   (default ~/.cache/tower-bypass-marker-tools)
#   CARGO_TARGET_DIR  as for cargo
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# shellcheck source=tests/versions.sh
source "$root/tests/versions.sh"
# The Envoy releases the module is tested with (tests/envoy/module.sh), oldest first, for the
# module's file name; tests/images/run.sh checks the name.
ENVOY_TESTED="$ENVOY_MODULE_OLDER $ENVOY_LATEST"
# The SBOM tool, pinned. cargo-cyclonedx over cargo-sbom, though its `cargo install --locked` took
# 345 s against cargo-sbom's 308 s (one run each, in a row, on the shared 2-vCPU machine):
# cargo-sbom 0.10 cannot select features, and listed tokio, tonic, hyper and prost in the module's
# SBOM, none of which the module links.
CYCLONEDX_VERSION=0.5.9

log() { printf 'release: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

podman=(${PODMAN:-podman})
target="${CARGO_TARGET_DIR:-$root/target}"
out="${DIST_OUT:-$root/target/dist}"
version="$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "bypass-marker"))')"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# The images' `created`: the commit's date, so that the same commit makes the same labels.
created="$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null || echo unknown)"
# The binary's `bypass_marker_build_info{revision}` (read at compile time; cargo rebuilds when it
# changes).
export BYPASS_MARKER_REVISION="$revision"
# The label `source` is the clone's origin when it is a URL (a local path says nothing to a user).
source_url="$(git remote get-url origin 2>/dev/null || true)"
[[ "$source_url" =~ ^(https?|git|ssh):// ]] || source_url=""
triple="$(rustc -vV | sed -n 's/^host: //p')"
case "$triple" in
  x86_64-*) arch=amd64 ;;
  aarch64-*) arch=arm64 ;;
  *) die "no image architecture known for $triple" ;;
esac
# Reproducible archives: every file's time is the commit's.
epoch="$(git log -1 --format=%ct 2>/dev/null || echo 0)"
log "tower-bypass-marker $version ($revision) for $triple into $out"

# The directory of workspace package $1 (where cargo-cyclonedx writes its SBOM).
package_dir() {
  cargo metadata --format-version 1 --no-deps --locked |
    python3 -c 'import json, os, sys; print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == sys.argv[1]))' "$1"
}
wasm_target=wasm32-wasip1

# The builds, one command each.
started=$SECONDS
log "cargo build --release --locked -p bypass-marker"
cargo build --quiet --release --locked -p bypass-marker
log "cargo build --release --locked -p bypass-marker-envoy-module"
cargo build --quiet --release --locked -p bypass-marker-envoy-module
if ! rustc --print target-libdir --target "$wasm_target" >/dev/null 2>&1 ||
  [[ ! -d "$(rustc --print target-libdir --target "$wasm_target")" ]]; then
  log "rustup target add $wasm_target"
  rustup target add "$wasm_target" >&2
fi
# The plugin's package builds it with its own settings (LTO, Wasm SIMD, `--locked`) and names it
# bypass_marker.wasm; its build.sh prints the path.
plugin_build="$(package_dir bypass-marker-wasm)/build.sh"
log "bash ${plugin_build#"$root/"}  (cargo build --release --locked -p bypass-marker-wasm --target $wasm_target)"
plugin="$(bash "$plugin_build")"
bin="$target/release/bypass-marker"
module="$target/release/libbypass_marker_envoy_module.so"
[[ -x "$bin" && -f "$module" && -f "$plugin" ]] || die "no $bin, $module or $plugin after the builds"
log "built in $((SECONDS - started)) s"

rm -rf "$out"
mkdir -p "$out"
stage="$(mktemp -d "${TMPDIR:-/tmp}/bypass-marker-release.XXXXXX")"
sbom_tmp="bypass-marker-sbom-$$"
# cargo-cyclonedx writes beside every manifest of the workspace: each member's directory.
mapfile -t members < <(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, os, sys; print("\n".join(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"]))')
trap 'rm -rf "$stage"; for m in "${members[@]}"; do rm -f "$m/$sbom_tmp.json"; done' EXIT

# The binary's tarball.
name="bypass-marker-$version-$triple"
mkdir -p "$stage/$name"
cp "$bin" README.md LICENSE-MIT LICENSE-APACHE "$stage/$name/"
# The operator's pages (flags, exit codes, probes, the images) and the systemd unit.
mkdir -p "$stage/$name/docs"
cp docs/sidecar.md docs/deploy.md docs/envoy.md "$stage/$name/docs/"
cp dist/bypass-marker.service "$stage/$name/"
tar -C "$stage" --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -cf - "$name" |
  gzip -9n >"$out/$name.tar.gz"

# The module, named with the Envoy releases it was tested with.
cp "$module" "$out/libbypass_marker_envoy_module-$version-envoy-${ENVOY_TESTED// /-}-$triple.so"

# The plugin: Wasm, the same file on every machine, for every Envoy with a Wasm runtime.
cp "$plugin" "$out/bypass_marker-$version-$wasm_target.wasm"

# The images, from a context holding only what the Containerfile copies (the same layout as the
# repository's root, whatever CARGO_TARGET_DIR is).
mkdir -p "$stage/context/target/release" "$stage/context/target/$wasm_target/release"
cp "$bin" "$module" "$stage/context/target/release/"
cp "$plugin" "$stage/context/target/$wasm_target/release/"
cp Containerfile .containerignore LICENSE-MIT LICENSE-APACHE "$stage/context/"
build_args=(--build-arg "VERSION=$version" --build-arg "REVISION=$revision" --build-arg "CREATED=$created")
[[ -n "$source_url" ]] && build_args+=(--build-arg "SOURCE=$source_url")
[[ -n "${BASE_IMAGE:-}" ]] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[[ -n "${COPIER_IMAGE:-}" ]] && build_args+=(--build-arg "COPIER_IMAGE=$COPIER_IMAGE")
for image in bypass-marker envoy-module wasm; do
  case "$image" in
    bypass-marker) tag="bypass-marker:$version" ;;
    envoy-module) tag="bypass-marker-envoy-module:$version" ;;
    wasm) tag="bypass-marker-wasm:$version" ;;
  esac
  # --no-cache: an image built by hand before (docs/deploy.md) must not lend its layers, whose
  # labels say another revision (podman's cache does not tell build arguments apart in LABEL).
  log "podman build --no-cache --target $image -t $tag"
  "${podman[@]}" build --quiet --no-cache --target "$image" --timestamp "$epoch" "${build_args[@]}" -t "$tag" \
    -f "$stage/context/Containerfile" "$stage/context" >/dev/null
  "${podman[@]}" save --quiet --format oci-archive -o "$out/${tag%%:*}-$version-oci-$arch.tar" "$tag"
  log "$tag: $("${podman[@]}" image inspect --format '{{.Size}}' "$tag") bytes unpacked"
done

# The SBOMs: what is compiled into each artifact, from Cargo.lock, by a maintained tool.
if ! cargo-cyclonedx cyclonedx --version 2>/dev/null | grep -qF " $CYCLONEDX_VERSION"; then
  tools="${TOOLS_ROOT:-$HOME/.cache/tower-bypass-marker-tools}"
  if ! "$tools/bin/cargo-cyclonedx" cyclonedx --version 2>/dev/null | grep -qF " $CYCLONEDX_VERSION"; then
    log "installing cargo-cyclonedx $CYCLONEDX_VERSION into $tools (cargo install --locked; minutes)"
    t=$SECONDS
    cargo install --quiet --locked --version "$CYCLONEDX_VERSION" --root "$tools" cargo-cyclonedx
    log "cargo-cyclonedx installed in $((SECONDS - t)) s"
  fi
  PATH="$tools/bin:$PATH"
fi
# Writes an SBOM beside every manifest of the workspace; keeps the one of package directory $1.
sbom() { # $1 the package's directory, $2 the output file, $3 the target, "${@:4}" feature flags
  local dir="$1" file="$2" for_target="$3" tmp="$sbom_tmp" member
  shift 3
  SOURCE_DATE_EPOCH="$epoch" cargo cyclonedx --manifest-path "$dir/Cargo.toml" --format json \
    --spec-version 1.5 --target "$for_target" --no-build-deps --override-filename "$tmp" "$@" >&2
  mv "$dir/$tmp.json" "$out/$file"
  for member in "${members[@]}"; do rm -f "$member/$tmp.json"; done
}
sbom "$(package_dir bypass-marker)" "bypass-marker-$version.cdx.json" "$triple"
sbom "$(package_dir bypass-marker-envoy-module)" "bypass-marker-envoy-module-$version.cdx.json" "$triple"
sbom "$(package_dir bypass-marker-wasm)" "bypass-marker-wasm-$version.cdx.json" "$wasm_target"

(cd "$out" && sha256sum -- * >SHA256SUMS)
log "done in $((SECONDS - started)) s:"
(cd "$out" && ls -l -- *) >&2
