#!/usr/bin/env node
// The openai-node counterpart of tests/dynamo/client.py's `sdk` mode (started by
// tests/dynamo/run.sh).
//
//   node client.mjs --sdk-dir DIR --base-url URL/v1 --expect pass|fail --label L --version V --replies FILE [--via NAME]
//
// Loads the openai package installed under DIR and streams chat and completions from the real
// Dynamo 1.6.1 frontend, each request asking the mocker for a reply of FILE through
// `nvext.annotations: ["output_replay_id:<key>"]`. Dynamo is bypassing remote prefill and starts
// every stream with `event: x-bypass-remote-prefill\n: true\n\n`, a frame without data.
// pass (through the proxy): each request streams its reply. fail (straight to Dynamo): each
// fails with the SyntaxError openai-node throws on that frame.
//
// Prints one `PASS <what>` or `FAIL <what>: <why>` line per check; exits 1 if any check failed.

import { readFileSync } from 'node:fs';
import { clientArgs, exitStatus, openAIClient, report } from '../support/checks.mjs';

const MODEL = 'tiny';
const MAX_TOKENS = 64;

const args = clientArgs(['pass', 'fail'], {
  via: { type: 'string', default: 'the proxy' },
  replies: { type: 'string' },
});
const replies = JSON.parse(readFileSync(args.replies, 'utf8'));
const where = args.expect === 'pass' ? `through ${args.via}` : 'direct to Dynamo';

async function main() {
  const client = openAIClient(args, { apiKey: 'unused', timeout: 30_000 });
  if (!client) return;

  async function chat() {
    const stream = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'user', content: 'Say hello.' }],
      max_tokens: MAX_TOKENS,
      stream: true,
      // openai-node sends unknown body parameters as they are.
      nvext: { annotations: ['output_replay_id:chat'] },
    });
    let text = '';
    for await (const chunk of stream) {
      if (chunk.choices.length > 0) text += chunk.choices[0].delta.content ?? '';
    }
    return text;
  }

  async function completion() {
    const stream = await client.completions.create({
      model: MODEL,
      prompt: 'Say hello.',
      max_tokens: MAX_TOKENS,
      stream: true,
      nvext: { annotations: ['output_replay_id:completion'] },
    });
    let text = '';
    for await (const chunk of stream) {
      if (chunk.choices.length > 0) text += chunk.choices[0].text ?? '';
    }
    return text;
  }

  for (const [endpoint, call] of [
    ['chat', chat],
    ['completion', completion],
  ]) {
    const what = `${args.label} | ${where} | ${endpoint} stream`;
    let text;
    try {
      text = await call();
    } catch (err) {
      const failed = `${err?.constructor?.name ?? typeof err}: ${err?.message ?? err}`;
      if (args.expect === 'pass') {
        report(false, what, `the SDK failed: ${failed}`);
      } else {
        report(err instanceof SyntaxError, `${what}: fails on the marker (${failed})`, `expected a SyntaxError, got ${failed}`);
      }
      continue;
    }
    if (args.expect === 'pass') {
      report(text === replies[endpoint], `${what}: ${JSON.stringify(text)}`, `expected ${JSON.stringify(replies[endpoint])}`);
    } else {
      report(false, what, `streamed ${JSON.stringify(text)}, but the marker must break the SDK`);
    }
  }
}

try {
  await main();
} catch (err) {
  report(false, args.label, `unexpected error: ${err?.stack ?? err}`);
}
process.exitCode = exitStatus();
