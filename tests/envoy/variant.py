#!/usr/bin/env python3
"""Prints a shipped Envoy bootstrap (examples/envoy/dynamic-module.yaml or wasm.yaml) with one
change, for the end-to-end suites (tests/envoy/module.sh, tests/envoy/wasm.sh):

  variant.py BOOTSTRAP buffer     envoy.filters.http.buffer before the module or plugin, and
                                  max-body 100 in its configuration
  variant.py BOOTSTRAP lua        a Lua filter calling body() before it, and max-body 100
  variant.py BOOTSTRAP trailers   enable_trailers on the listener's and the upstream's HTTP/1.1
  variant.py BOOTSTRAP config=JSON  JSON as the module's or plugin's configuration
  variant.py BOOTSTRAP unheld     the plugin without allow_on_headers_stop_iteration (as the
                                  gateways' APIs leave it), and a request_timeout of 3 s

Fails if the bootstrap does not have exactly one of the lines a change needs.
"""

import sys

BEFORE = {
    "buffer": """\
          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 1048576
""",
    "lua": """\
          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_request(handle)
                    handle:body()
                  end
""",
}
FILTERS = ("          - name: envoy.filters.http.dynamic_modules\n", "          - name: envoy.filters.http.wasm\n")
CONFIG = "value: '{\"preset\": \"dynamo\"}'"
TRAILERS = """\
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: { enable_trailers: true }
"""


def one(text, line):
    if text.count(line) != 1:
        raise SystemExit(f"variant.py: {line.strip()!r} is in the bootstrap {text.count(line)} times, not once")


def main():
    path, kind = sys.argv[1:]
    text = open(path).read()
    if kind in BEFORE:
        filters = [f for f in FILTERS if f in text]
        if len(filters) != 1:
            raise SystemExit("variant.py: the bootstrap has neither the module nor the plugin, or both")
        one(text, filters[0])
        one(text, CONFIG)
        text = text.replace(filters[0], BEFORE[kind] + filters[0])
        text = text.replace(CONFIG, "value: '{\"preset\": \"dynamo\", \"max-body\": 100}'")
    elif kind == "trailers":
        hcm, cluster = "          stat_prefix: openai\n", "    connect_timeout: 5s\n"
        one(text, hcm)
        one(text, cluster)
        text = text.replace(hcm, hcm + "          http_protocol_options: { enable_trailers: true }\n")
        text = text.replace(cluster, cluster + TRAILERS)
    elif kind == "unheld":
        allow = "                allow_on_headers_stop_iteration: true\n"
        hcm = "          stat_prefix: openai\n"
        one(text, allow)
        one(text, hcm)
        text = text.replace(allow, "")
        text = text.replace(hcm, hcm + "          request_timeout: 3s\n")
    elif kind.startswith("config="):
        one(text, CONFIG)
        text = text.replace(CONFIG, "value: '" + kind[len("config="):] + "'")
    else:
        raise SystemExit(f"variant.py: unknown change {kind!r}")
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
