#!/usr/bin/env python3
"""The Wasm plugin taken out of its image's OCI archive the way Istio and Envoy Gateway take it out
of the image they pull (tests/images/run.sh).

  wasm_image.py ARCHIVE REF OUT

Istio's istio-agent (pkg/wasm/imagefetcher.go) and Envoy Gateway's controller (internal/wasm, the
same code) accept three image formats; the one `podman build` makes is the *compat* variant with
OCI media types: they take the manifest's LAST layer, which must be
`application/vnd.oci.image.layer.v1.tar+gzip`, gunzip it, and read the first tar entry whose base
name is `plugin.wasm`; Envoy Gateway then refuses a file without Wasm's magic and version. Here
the image must also be exactly that one layer (spec-compat.md: "exactly one layer") holding the
plugin and nothing else, so that no later layer can ever hide it. The plugin is written to OUT.
Prints PASS/FAIL lines; exits 1 on a failure.
"""

import gzip
import io
import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import checks  # noqa: E402  (tests/support/checks.py)
from checks import report  # noqa: E402

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_MAGIC = b"\0asm\x01\0\0\0"

def main(archive, ref, out):
    with tarfile.open(archive) as tar:
        def blob(digest):
            return tar.extractfile("blobs/" + digest.replace(":", "/")).read()

        index = json.load(tar.extractfile("index.json"))
        entries = [m for m in index["manifests"]
                   if m.get("annotations", {}).get("org.opencontainers.image.ref.name", "").endswith(ref)]
        if not report(len(entries) == 1, f"the archive holds one manifest for {ref}", f"{index['manifests']}"):
            return
        manifest = json.loads(blob(entries[0]["digest"]))
        media_type = manifest.get("mediaType", entries[0].get("mediaType"))
        report(media_type == OCI_MANIFEST, f"{ref}: an OCI image manifest", media_type)
        layers = manifest["layers"]
        report(len(layers) == 1, f"{ref}: exactly one layer (Istio reads the last one)",
               f"{len(layers)} layers: {[l['mediaType'] for l in layers]}")
        last = layers[-1]
        if not report(last["mediaType"] == OCI_GZIP_LAYER, f"{ref}: the layer is {OCI_GZIP_LAYER}", last["mediaType"]):
            return
        members = tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(last["digest"]))))
        names = [m.name for m in members.getmembers()]
        plugin = next((m for m in members.getmembers() if m.name.rsplit("/", 1)[-1] == "plugin.wasm"), None)
        if not report(plugin is not None and plugin.isfile(), f"{ref}: the layer has a file plugin.wasm", f"{names}"):
            return
        report([n.lstrip("./") for n in names] == ["plugin.wasm"], f"{ref}: plugin.wasm at the root, nothing else", f"{names}")
        data = members.extractfile(plugin).read()
        report(data.startswith(WASM_MAGIC), f"{ref}: plugin.wasm is a Wasm binary, version 1 ({len(data)} bytes)",
               repr(data[:8]))
        with open(out, "wb") as file:
            file.write(data)
        print(f"manifest digest {entries[0]['digest']}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.exit(checks.exit_status())
