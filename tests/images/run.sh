#!/usr/bin/env bash
# The release command and the three images, end to end, on 127.0.0.1 (docs/deploy.md):
#
#   bash tests/images/run.sh
#
# Installs podman, runc, mmdebstrap and busybox-static with apt if missing (as root, or with
# sudo). No image registry is reachable here, so the images' bases are built from Debian's
# packages of the machine's own release: a distroless-like root (libc6, libgcc-s1, base-files,
# netbase; no shell, no package manager) made by mmdebstrap, and Debian's static busybox, each
# made an image by `podman import`. Then `dist/release.sh` builds every artifact with those bases,
# and the checks:
#   - `sha256sum -c SHA256SUMS` passes and lists every artifact; the module's file name names the
#     Envoy releases tests/envoy/module.sh tests; each OCI archive holds its image; the tarball's
#     binary runs; the SBOMs are CycloneDX and the module's lists no async runtime;
#   - the images' labels (source, version, revision, licenses), user 65532, ENTRYPOINT; no shell
#     and no package manager in the bypass-marker image;
#   - the bypass-marker image, run as examples/k8s/ runs it (`--read-only --user 65532
#     --cap-drop ALL --security-opt no-new-privileges --network host`), serves `proxy` in front of
#     the simulated Dynamo router and of upstream.py: openai-python streams through it (and fails
#     straight to the router: the control), a raw client opted in to the marker gets it byte for
#     byte; the manifest's probes (/health through the proxy, /metrics) answer 200;
#   - `ext-proc` from the same image behind Envoy 1.40.0 (examples/envoy/ext-proc.yaml) filters a
#     stream;
#   - the module copied out of its image the way examples/envoy-gateway/'s init container does
#     (`cp`, a static busybox), its sha256 the one recorded in the image and in SHA256SUMS, loaded by Envoy
#     1.40.0 (examples/envoy/dynamic-module.yaml) for a stream;
#   - the plugin's image is Istio's Wasm image: one gzipped layer holding plugin.wasm and nothing
#     else; the plugin taken out of the OCI archive as Istio and Envoy Gateway take it out of what
#     they pull (wasm_image.py), its sha256 the .wasm's in SHA256SUMS, loaded by Envoy 1.40.0's V8
#     (examples/envoy/wasm.yaml) for a stream;
#   - examples/k8s/ names the images as the release command tags them, and runs them as user 65532;
#     examples/envoy-gateway/ and examples/istio/ pull the module and the plugin by those tags;
#   - every process listens on 127.0.0.1 only; no process or container is left after the run.
# Podman runs with a private store under the run's scratch directory (vfs), the runc runtime,
# cgroupfs and no default ulimits (what this sandbox needs; CONTAINERS_CONF and
# CONTAINERS_STORAGE_CONF), all removed at the end. Ends with `images: N passed, M failed`.
#
# Environment: ENVOY_CACHE, SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR, TOOLS_ROOT (see
# dist/release.sh), IMAGES_KEEP_DIST=DIR (copy the release artifacts there before cleaning up).
set -euo pipefail

SUITE=images LIFETIME=900
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
images_here="$here"
envoy_here="$root/tests/envoy"
# shellcheck source=tests/envoy/servers.sh
source "$envoy_here/servers.sh"

# ---------------------------------------------------------------------------------------------
# Podman, with a private store that goes with $work

started=$SECONDS
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
# Debian's busybox-static is /bin/busybox, statically linked (the `busybox` package's is not).
static_busybox() { [[ -x /bin/busybox && "$(LC_ALL=C ldd /bin/busybox 2>&1 || true)" == *"not a dynamic executable"* ]]; }
static_busybox || missing+=(busybox-static)
if ((${#missing[@]})); then
  as_root=()
  [[ "$(id -u)" -eq 0 ]] || as_root=(sudo)
  log "installing ${missing[*]} with apt"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends podman runc mmdebstrap busybox-static >/dev/null
fi
static_busybox || die "/bin/busybox is not statically linked (install busybox-static)"
log "podman $(podman --version | awk '{print $3}') ready in $((SECONDS - started)) s"

cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
cat >"$work/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$work/storage"
runroot = "$work/run"
EOF
export CONTAINERS_CONF="$work/containers.conf" CONTAINERS_STORAGE_CONF="$work/storage.conf"

# Containers are started in the foreground by `start` (podman run --rm); their conmon is not in
# the group, so they are removed by name here too, before the scratch directory goes.
containers=()
images_cleanup() {
  local c
  stop_all
  for c in "${containers[@]}"; do podman rm --force --time 0 "$c" >/dev/null 2>&1 || true; done
  # Whatever podman left mounted under the private store.
  awk -v w="$work" 'index($2, w) == 1 {print $2}' /proc/self/mounts | sort -r | xargs -r -n 1 umount -l 2>/dev/null || true
  if [[ -n "${IMAGES_KEEP_DIST:-}" && -d "$work/dist" ]]; then
    mkdir -p "$IMAGES_KEEP_DIST" && cp "$work/dist/"* "$IMAGES_KEEP_DIST/" || true
  fi
  rm -rf "$work"
}
trap images_cleanup EXIT
# Starts a container named $1 with podman run's options "${@:2}" (up to the image and its
# arguments), in the foreground under `start`.
run_container() {
  local name="$1-$$"
  shift
  containers+=("$name")
  start "$name" podman run --rm --name "$name" --network host --read-only --user 65532 \
    --cap-drop ALL --security-opt no-new-privileges "$@"
}

# ---------------------------------------------------------------------------------------------
# The bases, from Debian's packages of this machine's release (the binary is built on it, so its
# glibc is the base's)

. /etc/os-release
suite="${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}"
t=$SECONDS
mmdebstrap --quiet --variant=extract --include=libc6,libgcc-s1,base-files,netbase --mode=root \
  "$suite" "$work/base.tar" </dev/null || die "mmdebstrap could not build the base"
base_image="localhost/bypass-marker-base:$suite"
podman import --quiet "$work/base.tar" "$base_image" >/dev/null
mkdir -p "$work/busybox/bin"
cp /bin/busybox "$work/busybox/bin/busybox"
tar -C "$work/busybox" -cf "$work/busybox.tar" bin
copier_image="localhost/busybox-static:$suite"
podman import --quiet "$work/busybox.tar" "$copier_image" >/dev/null
rm -rf "$work/base.tar" "$work/busybox.tar" "$work/busybox"
log "bases ($base_image, $copier_image) made in $((SECONDS - t)) s"

# ---------------------------------------------------------------------------------------------
# By hand first, as docs/deploy.md offers (no revision, no created date: `unknown`), so that the
# release below finds these layers in podman's cache and must not ship their labels (issue 42)

t=$SECONDS
cargo build --quiet --release --locked -p bypass-marker -p bypass-marker-envoy-module
bash "$root/bypass-marker-wasm/build.sh" >/dev/null
hand_version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)"
for pair in bypass-marker:bypass-marker envoy-module:bypass-marker-envoy-module wasm:bypass-marker-wasm; do
  (cd "$root" && podman build --quiet --target "${pair%%:*}" --build-arg "BASE_IMAGE=$base_image" \
    --build-arg "COPIER_IMAGE=$copier_image" -t "${pair##*:}:$hand_version" . >/dev/null) ||
    die "podman build --target ${pair%%:*} (by hand) failed"
done
log "the images built by hand first in $((SECONDS - t)) s"

# ---------------------------------------------------------------------------------------------
# The release command

t=$SECONDS
dist="$work/dist"
DIST_OUT="$dist" BASE_IMAGE="$base_image" COPIER_IMAGE="$copier_image" bash "$root/dist/release.sh" ||
  die "dist/release.sh failed"
log "dist/release.sh done in $((SECONDS - t)) s"

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)"
triple="$(rustc -vV | sed -n 's/^host: //p')"
revision="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
created="$(cd "$root" && TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ)"
image="bypass-marker:$version"
module_image="bypass-marker-envoy-module:$version"
wasm_image="bypass-marker-wasm:$version"

ok=0
status="$(cd "$dist" && sha256sum -c SHA256SUMS 2>&1)" && ok=1
count $ok "sha256sum -c SHA256SUMS: $(tr '\n' ' ' <<<"$status")"
listed="$(awk '{print $2}' "$dist/SHA256SUMS" | sort | tr '\n' ' ')"
present="$(cd "$dist" && ls | grep -vx SHA256SUMS | sort | tr '\n' ' ')"
ok=0
[[ "$listed" == "$present" && $(wc -w <<<"$listed") -eq 9 ]] && ok=1
count $ok "SHA256SUMS lists every artifact (9): $listed"

# The Envoy releases in the module's name are the ones tests/envoy/module.sh runs.
# shellcheck disable=SC2086 # a list of versions
tested="$(printf '%s\n' "$ENVOY_LATEST" $ENVOY_MODULE_OLDER | sort -V | paste -sd ' ')"
ok=0
[[ -f "$dist/libbypass_marker_envoy_module-$version-envoy-${tested// /-}-$triple.so" ]] && ok=1
count $ok "the module is named with the Envoy releases tests/envoy/module.sh loads it in: libbypass_marker_envoy_module-$version-envoy-${tested// /-}-$triple.so"

# The tarball holds the binary the image holds.
mkdir -p "$work/tarball"
tar -C "$work/tarball" -xzf "$dist/bypass-marker-$version-$triple.tar.gz"
tar_bin="$work/tarball/bypass-marker-$version-$triple/bypass-marker"
ok=0
[[ -x "$tar_bin" ]] && "$tar_bin" --version | grep -qx "bypass-marker $version" && ok=1
count $ok "the tarball's bypass-marker runs: $("$tar_bin" --version 2>&1 | head -n 1)"
ok=0
for page in docs/sidecar.md docs/deploy.md docs/envoy.md bypass-marker.service; do
  cmp -s "$root/${page/#bypass-marker.service/dist/bypass-marker.service}" \
    "$work/tarball/bypass-marker-$version-$triple/$page" || { ok=0; break; }
  ok=1
done
count $ok "the tarball ships the operator's pages (docs/sidecar.md, docs/deploy.md, docs/envoy.md) and the systemd unit"

# Each SBOM is CycloneDX and lists what is compiled in.
for pair in "bypass-marker:tokio" "bypass-marker-envoy-module:serde_json" "bypass-marker-wasm:proxy-wasm"; do
  ok=0
  "$python" - "$dist/${pair%%:*}-$version.cdx.json" "${pair##*:}" >"$work/sbom.out" 2>&1 <<'PY' && ok=1
import json, sys
sbom = json.load(open(sys.argv[1]))
assert sbom["bomFormat"] == "CycloneDX", sbom.get("bomFormat")
names = {c["name"] for c in sbom.get("components", [])}
assert sys.argv[2] in names, sorted(names)
forbidden = {"tokio", "tonic", "hyper", "prost"} & names if "module" in sys.argv[1] or "wasm" in sys.argv[1] else set()
assert not forbidden, forbidden
print(f"{len(names)} components")
PY
  count $ok "SBOM ${pair%%:*}-$version.cdx.json is CycloneDX and lists ${pair##*:}: $(tail -n 1 "$work/sbom.out")"
done

# Each OCI archive holds its image: the tag as its ref name, the labels and the user.
for ref in "$image" "$module_image" "$wasm_image"; do
  ok=0
  "$python" - "$dist/${ref%%:*}-$version-oci-"*.tar "$ref" "$version" "$revision" "$created" >"$work/oci.out" 2>&1 <<'PY' && ok=1
import datetime, json, sys, tarfile
archive, ref, version, revision, created = sys.argv[1:6]
with tarfile.open(archive) as tar:
    blob = lambda digest: json.load(tar.extractfile("blobs/" + digest.replace(":", "/")))
    index = json.load(tar.extractfile("index.json"))
    (entry,) = index["manifests"]
    name = entry["annotations"]["org.opencontainers.image.ref.name"]
    assert name.endswith(ref), name
    image = blob(blob(entry["digest"])["config"]["digest"])
    config = image["config"]
    assert config["Labels"]["org.opencontainers.image.version"] == version, config["Labels"]
    # The commit's, although an image built by hand (revision unknown) was in the cache.
    assert config["Labels"]["org.opencontainers.image.revision"] == revision, config["Labels"]
    assert config["Labels"]["org.opencontainers.image.created"] == created, config["Labels"]
    when = lambda text: datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert when(image["created"]) == when(created), (image["created"], created)
    assert config["User"] == "65532:65532", config["User"]
    print(f"{name}, revision {revision}, created {created}")
PY
  count $ok "the OCI archive of $ref holds it, labelled with the commit (built by hand first): $(tail -n 1 "$work/oci.out")"
done

# ---------------------------------------------------------------------------------------------
# The images as built

labels() { podman image inspect --format "{{index .Config.Labels \"org.opencontainers.image.$2\"}}" "$1"; }
for ref in "$image" "$module_image" "$wasm_image"; do
  ok=0
  [[ "$(labels "$ref" version)" == "$version" && "$(labels "$ref" revision)" == "$revision" &&
    "$(labels "$ref" licenses)" == "MIT OR Apache-2.0" && -n "$(labels "$ref" source)" ]] && ok=1
  count $ok "$ref: OCI labels version $(labels "$ref" version), revision $(labels "$ref" revision), licenses $(labels "$ref" licenses), source $(labels "$ref" source)"
  ok=0
  [[ "$(podman image inspect --format '{{.Config.User}}' "$ref")" == 65532:65532 ]] && ok=1
  count $ok "$ref: runs as user 65532:65532"
done
ok=0
[[ "$(podman image inspect --format '{{json .Config.Entrypoint}}' "$image")" == '["bypass-marker"]' ]] && ok=1
count $ok "$image: ENTRYPOINT [\"bypass-marker\"]"
size="$(podman image inspect --format '{{.Size}}' "$image")"
module_size="$(podman image inspect --format '{{.Size}}' "$module_image")"
wasm_size="$(podman image inspect --format '{{.Size}}' "$wasm_image")"
log "image sizes: $image $size bytes, $module_image $module_size bytes, $wasm_image $wasm_size bytes (unpacked)"

# What is in the image, from its filesystem.
files() { # $1 the image, "${@:2}" a command for an image without one (never run); prints its paths
  local c
  c="$(podman create "$@" 2>/dev/null)"
  podman export "$c" | tar -t
  podman rm "$c" >/dev/null
}
files "$image" >"$work/image.files"
bad="$(grep -E '^(usr/)?bin/(sh|bash|dash|busybox)$|(^|/)(apt|apt-get|dpkg)$' "$work/image.files" || true)"
ok=0
[[ -z "$bad" ]] && grep -qx 'usr/local/bin/bypass-marker' "$work/image.files" && ok=1
count $ok "$image: no shell, no package manager ($(wc -l <"$work/image.files") paths)${bad:+; found: $(tr '\n' ' ' <<<"$bad")}"
files "$module_image" >"$work/module.files"
ok=0
grep -qx 'libbypass_marker_envoy_module.so' "$work/module.files" && grep -qx 'libbypass_marker_envoy_module.so.sha256' "$work/module.files" &&
  grep -qx 'bin/cp' "$work/module.files" && ok=1
count $ok "$module_image: /libbypass_marker_envoy_module.so, /libbypass_marker_envoy_module.so.sha256 and /bin/cp: $(tr '\n' ' ' <"$work/module.files")"
files "$wasm_image" /plugin.wasm >"$work/wasm.files"
ok=0
[[ "$(cat "$work/wasm.files")" == plugin.wasm ]] && ok=1
count $ok "$wasm_image: /plugin.wasm and nothing else: $(tr '\n' ' ' <"$work/wasm.files")"

# examples/k8s/ names the images as tagged here, behind a registry of the user's.
ok=0
grep -Eq "^ +image: [a-z0-9.-]+(:[0-9]+)?/$image( |$)" "$root/examples/k8s/dynamo-frontend.yaml" &&
  grep -Eq '^ +runAsUser: 65532$' "$root/examples/k8s/dynamo-frontend.yaml" && ok=1
count $ok "examples/k8s/dynamo-frontend.yaml runs REGISTRY/$image as user 65532"
ok=0
grep -Eq "^ +image: [a-z0-9.-]+(:[0-9]+)?/$module_image( |$)" "$root/examples/envoy-gateway/dynamic-module.yaml" && ok=1
count $ok "examples/envoy-gateway/dynamic-module.yaml copies the module from REGISTRY/$module_image"
ok=0
grep -Eq "^ +url: [a-z0-9.-]+(:[0-9]+)?/$wasm_image$" "$root/examples/envoy-gateway/wasm.yaml" &&
  grep -Eq "^ +url: oci://[a-z0-9.-]+(:[0-9]+)?/$wasm_image$" "$root/examples/istio/wasm-plugin.yaml" &&
  grep -Eq "^ +url: oci://[a-z0-9.-]+(:[0-9]+)?/$wasm_image$" "$root/examples/istio/traffic-extension.yaml" && ok=1
count $ok "examples/envoy-gateway/wasm.yaml and examples/istio/ pull the plugin from REGISTRY/$wasm_image"

# The plugin out of its image's archive as Istio and Envoy Gateway take it out of the image they
# pull (the last layer, gzipped, its plugin.wasm); the same file as the release's .wasm.
mkdir -p "$work/wasm"
run_client "the plugin out of $wasm_image as Istio takes it" "$python" "$images_here/wasm_image.py" \
  "$dist/bypass-marker-wasm-$version-oci-"*.tar "$wasm_image" "$work/wasm/plugin.wasm"
ok=0
[[ -f "$work/wasm/plugin.wasm" && "$(sha256sum <"$work/wasm/plugin.wasm" | cut -d' ' -f1)" == \
  "$(grep -F " bypass_marker-$version-wasm32-wasip1.wasm" "$dist/SHA256SUMS" | cut -d' ' -f1)" ]] && ok=1
count $ok "the plugin out of $wasm_image is the release's bypass_marker-$version-wasm32-wasip1.wasm (SHA256SUMS)"

# ---------------------------------------------------------------------------------------------
# Installs and servers

envoy_ready_in() { wait_for "$last_group" 300 envoy_ready "$1"; }
install_envoy || die "cannot install Envoy $ENVOY_VERSION"
# shellcheck source=tests/sdk/sdks.sh
source "$root/tests/sdk/sdks.sh"
sdk_python="$(install_py "$PY_PINNED")"
build_router
start_upstreams

# The sidecar, as examples/k8s/ runs it.
metrics_port="$(free_port)"
run_container proxy -e BYPASS_MARKER_UPSTREAM="$router_behind" -e BYPASS_MARKER_LISTEN=127.0.0.1:0 \
  -e BYPASS_MARKER_METRICS_LISTEN="127.0.0.1:$metrics_port" -e BYPASS_MARKER_PRESET=dynamo \
  "$image" proxy
wait_for "$last_group" 300 listening "proxy-$$" || die "the proxy container did not start: $(cat "$work/proxy-$$.log")"
proxy="$url"
run_container proxy-upstream "$image" proxy --listen 127.0.0.1:0 --upstream "$upstream"
wait_for "$last_group" 300 listening "proxy-upstream-$$" ||
  die "the second proxy container did not start: $(cat "$work/proxy-upstream-$$.log")"
proxy_upstream="$url"

# The processor from the same image, behind Envoy 1.40.0.
ext_proc_port="$(free_port)"
run_container ext-proc "$image" ext-proc --listen "127.0.0.1:$ext_proc_port" --preset dynamo
wait_for "$last_group" 300 accepts "$ext_proc_port" || die "the ext-proc container did not start: $(cat "$work/ext-proc-$$.log")"
listen="$(free_port)"
admin="$(free_port)"
render_bootstrap "$root/examples/envoy/ext-proc.yaml" LISTEN_PORT="$listen" ADMIN_PORT="$admin" \
  UPSTREAM_PORT="${upstream##*:}" EXT_PROC_PORT="$ext_proc_port" >"$work/envoy-ext-proc.yaml"
start envoy-ext-proc "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level warning -c "$work/envoy-ext-proc.yaml"
envoy_ready_in "$admin" || die "Envoy with ext-proc did not get ready: $(tail -n 20 "$work/envoy-ext-proc.log")"
envoy_ext_proc="http://127.0.0.1:$listen"

# The module, copied out of its image as examples/envoy-gateway/'s init container does (its
# command, `cp` found on the image's PATH), as user 65532 into a volume; then the recorded sha256
# by the image's ENTRYPOINT, the same static cp.
mkdir -p "$work/modules"
chown 65532:65532 "$work/modules"
copy=(podman run --rm --network none --read-only --user 65532 --cap-drop ALL --security-opt no-new-privileges
  -v "$work/modules:/modules")
status=0
{ "${copy[@]}" --entrypoint cp "$module_image" /libbypass_marker_envoy_module.so /modules/libbypass_marker_envoy_module.so &&
  "${copy[@]}" "$module_image" /libbypass_marker_envoy_module.so.sha256 /modules/; } >"$work/copy.log" 2>&1 || status=$?
ok=0
((status == 0)) && (cd "$work/modules" && sha256sum -c --quiet libbypass_marker_envoy_module.so.sha256) &&
  [[ "$(awk '{print $1}' "$work/modules/libbypass_marker_envoy_module.so.sha256")" == \
    "$(grep -F " libbypass_marker_envoy_module-$version-envoy-" "$dist/SHA256SUMS" | awk '{print $1}')" ]] && ok=1
count $ok "the module copied out of $module_image by its cp (status $status) matches its recorded sha256 and SHA256SUMS: $(cat "$work/modules/libbypass_marker_envoy_module.so.sha256" 2>/dev/null) $(cat "$work/copy.log")"
listen="$(free_port)"
admin="$(free_port)"
render_bootstrap "$root/examples/envoy/dynamic-module.yaml" LISTEN_PORT="$listen" ADMIN_PORT="$admin" \
  UPSTREAM_PORT="${upstream##*:}" >"$work/envoy-module.yaml"
ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$work/modules" start envoy-module "$envoy_bin" --disable-hot-restart \
  --concurrency 1 --log-level info -c "$work/envoy-module.yaml"
envoy_ready_in "$admin" || die "Envoy with the module did not get ready: $(tail -n 20 "$work/envoy-module.log")"
envoy_module="http://127.0.0.1:$listen"

# The plugin taken out of its image (above), loaded by Envoy 1.40.0's V8 with the shipped bootstrap.
listen="$(free_port)"
wasm_admin="$(free_port)"
render_bootstrap "$root/examples/envoy/wasm.yaml" LISTEN_PORT="$listen" ADMIN_PORT="$wasm_admin" \
  UPSTREAM_PORT="${upstream##*:}" WASM_FILE="$work/wasm/plugin.wasm" >"$work/envoy-wasm.yaml"
start envoy-wasm "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level info -c "$work/envoy-wasm.yaml"
envoy_ready_in "$wasm_admin" || die "Envoy with the plugin did not get ready: $(tail -n 20 "$work/envoy-wasm.log")"
envoy_wasm="http://127.0.0.1:$listen"
log "servers ready: upstream.py $upstream, router $router_behind (behind the proxy) and $router_direct, proxy containers $proxy and $proxy_upstream, Envoy $envoy_ext_proc (ext-proc container), $envoy_module (module from the image) and $envoy_wasm (plugin from the image)"

# ---------------------------------------------------------------------------------------------
# The checks

# The containers' processes are children of conmon, outside the groups started here: add theirs.
container_groups=()
for c in "${containers[@]}"; do
  pid="$(podman inspect --format '{{.State.Pid}}' "$c" 2>/dev/null || true)"
  [[ -n "$pid" && "$pid" != 0 ]] && container_groups+=("$(ps -o pgid= -p "$pid" | tr -d ' ')")
done
if ((${#container_groups[@]} == ${#containers[@]})); then
  also_listening="the ${#container_groups[@]} containers' too" only_loopback "${groups[@]}" "${container_groups[@]}"
else
  count 0 "every container's process group found: ${#container_groups[@]} of ${#containers[@]}"
fi

sdk_client="$root/tests/sdk/client.py"
run_client "python openai $PY_PINNED through the proxy container" "$sdk_python" "$sdk_client" sdk \
  --base-url "$proxy/v1" --expect pass --label "python openai $PY_PINNED via the image's proxy" --version "$PY_PINNED"
run_client "python openai $PY_PINNED straight to the router" "$sdk_python" "$sdk_client" sdk \
  --base-url "$router_direct/v1" --expect fail-every-stream --label "python openai $PY_PINNED direct" --version "$PY_PINNED"
run_client "raw client through the proxy container" "$python" "$sdk_client" raw --layer-url "$proxy" \
  --no-layer-url "$router_direct"
run_client "one stream through the proxy container" "$python" "$images_here/one_request.py" --url "$proxy_upstream" \
  --upstream "$upstream" --label "the image's proxy"
run_client "one stream through Envoy $ENVOY_LATEST and the ext-proc container" "$python" "$images_here/one_request.py" \
  --url "$envoy_ext_proc" --upstream "$upstream" --label "Envoy $ENVOY_LATEST + the image's ext-proc"
ok=0
grep -q 'Dynamic module ABI version v0.2.0 matched' "$work/envoy-module.log" && ok=1
count $ok "Envoy $ENVOY_LATEST loads the module copied out of $module_image"
run_client "one stream through Envoy $ENVOY_LATEST and the plugin from its image" "$python" "$images_here/one_request.py" \
  --url "$envoy_wasm" --upstream "$upstream" --label "Envoy $ENVOY_LATEST + the image's plugin"
wasm_vms="$("$python" -c '
import sys, urllib.request
stats = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
print(sum(int(l.split(": ")[1]) for l in stats.splitlines() if l.startswith("wasm.envoy.wasm.runtime.v8.active: ")))
' "http://127.0.0.1:$wasm_admin/stats?filter=wasm" 2>&1)"
ok=0
[[ "$wasm_vms" =~ ^[0-9]+$ ]] && ((wasm_vms > 0)) && ok=1
count $ok "Envoy $ENVOY_LATEST runs the plugin out of $wasm_image in V8 (wasm.envoy.wasm.runtime.v8.active: $wasm_vms)"
run_client "one stream through Envoy $ENVOY_LATEST and the module from its image" "$python" "$images_here/one_request.py" \
  --url "$envoy_module" --upstream "$upstream" --label "Envoy $ENVOY_LATEST + the image's module"

# The probes of examples/k8s/: liveness, GET /livez on the metrics port, answers from the proxy alone; readiness,
# GET /health, goes through to the frontend and answers with its status (Dynamo's frontend serves
# /health; the simulated router has none, so the same 404 as straight to it).
probe() { "$python" -c "
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception as e:
    print(repr(e))" "$1"; }
metrics="$(probe "http://127.0.0.1:$metrics_port/livez")"
health="$(probe "$proxy/health")"
health_direct="$(probe "$router_behind/health")"
ok=0
[[ "$metrics" == 200 && "$health" =~ ^[0-9]+$ && "$health" == "$health_direct" ]] && ok=1
count $ok "the manifest's probes reach the proxy container: GET /livez $metrics on the metrics port; GET /health $health through the proxy, $health_direct straight to the frontend"

# The peak: every image and the three containers (vfs copies each one's root whole).
log "disk used by podman's store, the artifacts and the logs: $(du -sh "$work" | cut -f1)"
for c in "${containers[@]}"; do podman stop --time 5 "$c" >/dev/null 2>&1 || true; done
nothing_left
left="$(podman ps --all --format '{{.Names}}')"
ok=0
[[ -z "$left" ]] && ok=1
count $ok "no container left after the run${left:+: $left}"

log "done in $((SECONDS - started)) s"
echo "images: $passed passed, $failed failed"
((failed == 0 && passed > 0))
