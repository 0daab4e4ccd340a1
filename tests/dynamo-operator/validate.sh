#!/usr/bin/env bash
# Checks examples/dynamo-operator/ offline, twice:
#
# 1. against the DynamoGraphDeployment CRD kept in tests/dynamo-operator/schemas/ (structure only,
#    extracted by tests/envoy-gateway/extract.py from ai-dynamo/dynamo main of 2026-08-21; the
#    1.6.1 tag's CRD could not be had), unknown fields refused, CEL rules evaluated, broken copies
#    refused: tests/envoy-gateway/validate.py --suite dynamo-operator, in the venv that
#    tests/envoy-gateway/validate.sh keeps (jsonschema, cel-python from PyPI);
# 2. with Dynamo's own DGD model (DYNAMO in tests/versions.sh) (tests/dynamo-operator/check_model.py), in the ai-dynamo
#    venv that tests/dynamo/run.sh installs. Without that venv this part is skipped, and says
#    so: run tests/dynamo/run.sh first (CI does).
#
#   bash tests/dynamo-operator/validate.sh
#
# Environment: EG_CACHE, PYTHON (as tests/envoy-gateway/validate.sh), DYNAMO_CACHE (default
# ~/.cache/tower-bypass-marker-dynamo, as tests/dynamo/run.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

# shellcheck source=tests/versions.sh
source tests/versions.sh
bash tests/envoy-gateway/validate.sh dynamo-operator

dynamo_python="${DYNAMO_CACHE:-$HOME/.cache/tower-bypass-marker-dynamo}/venv-$DYNAMO/bin/python"
if [[ -x "$dynamo_python" ]] && "$dynamo_python" -c 'import dynamo.profiler' 2>/dev/null; then
  "$dynamo_python" tests/dynamo-operator/check_model.py
else
  printf 'dynamo-operator: SKIPPED the check with Dynamo %s'"'"'s own DGD model: no ai-dynamo %s venv at %s (tests/dynamo/run.sh makes it)\n' "$DYNAMO" "$DYNAMO" "${dynamo_python%/bin/python}"
fi
