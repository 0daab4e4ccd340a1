// What the openai-node clients of the suites (tests/sdk/client.mjs, tests/dynamo/client.mjs) share:
// their `PASS what` and `FAIL what: why` lines, which tests/support/checks.sh's `run_client`
// counts, as tests/support/checks.py writes them for the Python clients; their command line;
// and their client of the openai package tests/sdk/sdks.sh installed.

import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';

let failures = 0;

// Prints the check's line, counts it if it failed; returns `ok`.
export function report(ok, what, why = '') {
  if (ok) {
    console.log(`PASS ${what}`);
  } else {
    failures += 1;
    console.log(`FAIL ${what}: ${why}`);
  }
  return ok;
}

// 1 if any check failed, else 0.
export function exitStatus() {
  return failures > 0 ? 1 : 0;
}

// The command line: the options every client takes (--sdk-dir, --base-url, --label, --version,
// and --expect, one of `expectations`) and `more` (parseArgs specs; each without a default is
// required). Exits with status 2 on a missing option or another expectation.
export function clientArgs(expectations, more = {}) {
  const options = {
    'sdk-dir': { type: 'string' },
    'base-url': { type: 'string' },
    expect: { type: 'string' },
    label: { type: 'string' },
    version: { type: 'string' },
    ...more,
  };
  const { values: args } = parseArgs({ options });
  for (const [name, spec] of Object.entries(options)) {
    if (spec.default === undefined && !args[name]) {
      console.error(`client.mjs: --${name} is required`);
      process.exit(2);
    }
  }
  if (!expectations.includes(args.expect)) {
    console.error(`client.mjs: --expect must be ${expectations.join(' or ')}, got ${args.expect}`);
    process.exit(2);
  }
  return args;
}

// A client of the openai package installed under --sdk-dir (not one this script's own location
// would resolve) for --base-url, with `options` (apiKey, timeout) and no retries; or null, with a
// failure reported, when that package is not version --version.
export function openAIClient(args, options) {
  const sdkRequire = createRequire(join(args['sdk-dir'], 'package.json'));
  const entry = sdkRequire.resolve('openai');
  const version = JSON.parse(readFileSync(join(dirname(entry), 'package.json'), 'utf8')).version;
  if (version !== args.version) {
    report(false, args.label, `expected openai ${args.version}, loaded ${version}`);
    return null;
  }
  const sdk = sdkRequire(entry);
  const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;
  return new OpenAI({ baseURL: args['base-url'], maxRetries: 0, ...options });
}
