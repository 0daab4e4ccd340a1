// What the openai-node clients of the suites (tests/sdk/client.mjs, tests/dynamo/client.mjs) share:
// their `PASS what` and `FAIL what: why` lines, which tests/support/checks.sh's `run_client`
// counts, as tests/support/checks.py writes them for the Python clients; their required options;
// and their client of the openai package tests/sdk/sdks.sh installed.

import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';

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

// Exits with status 2 unless every option in `names` was given.
export function requireOptions(args, names) {
  for (const name of names) {
    if (!args[name]) {
      console.error(`client.mjs: --${name} is required`);
      process.exit(2);
    }
  }
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
