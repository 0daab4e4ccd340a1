#!/usr/bin/env bash
# Renders a shipped Envoy bootstrap (examples/envoy/*.yaml) with other values: every line that
# ends in `# template: NAME` gets the value of NAME in place of the value before that comment.
#
#   bash tests/envoy/render.sh examples/envoy/ext-proc.yaml LISTEN_PORT=18000 ADMIN_PORT=18001 > out.yaml
#
# Sourced, it defines `render_bootstrap SRC NAME=VALUE...` (prints the result). Fails if a NAME
# given matches no line, or a value is not a plain token, so a renamed template cannot go unnoticed.

render_bootstrap() {
  local src="$1" pair name value script=()
  shift
  for pair in "$@"; do
    name="${pair%%=*}"
    value="${pair#*=}"
    if [[ ! "$name" =~ ^[A-Z_]+$ || ! "$value" =~ ^[A-Za-z0-9._:/-]+$ ]]; then
      printf 'render_bootstrap: bad assignment %q\n' "$pair" >&2
      return 1
    fi
    if ! grep -Eq "# template: $name\$" "$src"; then
      printf 'render_bootstrap: %s has no "# template: %s" line\n' "$src" "$name" >&2
      return 1
    fi
    # `key: VALUE }  # template: NAME` or `key: VALUE  # template: NAME`.
    script+=(-e "s#^(.*: )[^ ,}]+( *}? *\# template: $name)\$#\\1$value\\2#")
  done
  sed -E "${script[@]}" "$src"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  render_bootstrap "$@"
fi
