// What the openai-node clients of the suites share (tests/sdk/client.mjs, tests/dynamo/client.mjs):
// their command line, their PASS/FAIL lines, and the SDK they load.

import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';

// The command line: `options` as node:util's parseArgs takes them, `required` the names without a
// default, `expects` the values --expect may take. A missing or wrong one exits 2.
export function clientArgs(options, required, expects) {
  const { values: args } = parseArgs({ options: { expect: { type: 'string' }, ...options } });
  for (const name of [...required, 'expect']) {
    if (!args[name]) {
      console.error(`client.mjs: --${name} is required`);
      process.exit(2);
    }
  }
  if (!expects.includes(args.expect)) {
    console.error(`client.mjs: --expect must be ${expects.join(' or ')}, got ${args.expect}`);
    process.exit(2);
  }
  return args;
}

// One `PASS <what>` or `FAIL <what>: <why>` line a check; `failures()` counts the FAILs.
export function reporter() {
  let failures = 0;
  return {
    report(ok, what, why = '') {
      if (ok) {
        console.log(`PASS ${what}`);
      } else {
        failures += 1;
        console.log(`FAIL ${what}: ${why}`);
      }
    },
    failures: () => failures,
  };
}

// The openai package installed under `sdkDir` (not one this script's own location would
// resolve): its client class and the version its package.json says.
export function loadOpenAI(sdkDir) {
  const sdkRequire = createRequire(join(sdkDir, 'package.json'));
  const entry = sdkRequire.resolve('openai');
  const version = JSON.parse(readFileSync(join(dirname(entry), 'package.json'), 'utf8')).version;
  const sdk = sdkRequire(entry);
  return { OpenAI: sdk.OpenAI ?? sdk.default ?? sdk, version };
}
