#!/usr/bin/env node
// The openai-node counterpart of tests/sdk/client.py's `sdk` mode (started by tests/sdk/run.sh).
//
//   node client.mjs --sdk-dir DIR --base-url URL/v1 --expect pass|fail-every-stream --label L --version V
//
// The router prepends `event: request_id\n: "<id>"\n\n` to every stream, and Dynamo's marker
// `event: x-bypass-remote-prefill\n: true\n\n` before it on a prefix-cache hit; neither has a data
// line. Loads the openai package installed under DIR and streams, for chat and completions: a cold
// request, the same request again (a prefix-cache hit), again with a spoofed marker in
// nvext.annotations, and again opted in to the marker. With --expect pass (router with the layer,
// which removes both frames unless asked for) the first three must stream the echo model's text;
// with --expect fail-every-stream (router without the layer) every one must fail with the
// SyntaxError that openai-node throws on such a frame, the cold one on the request_id frame, the
// cache hits on the marker too: the Dynamo bug. The opted-in request gets the marker in both
// cases, so it fails too; that proves nvext reaches the router. (client.py's `raw` mode checks the
// bytes behind these errors.)
//
// Prints one `PASS <what>` or `FAIL <what>: <why>` line per check; exits 1 if any check failed.

import { clientArgs, exitStatus, openAIClient, report } from '../support/checks.mjs';

const MAX_TOKENS = 8;
// A spoofed marker in a form the guard strips but that is not an opt-in, and an annotation the
// layer does not know.
const SPOOFED = ['x-bypass-remote-prefill:true', 'sdk-test'];
// The opt-in: the layer forwards the marker to this client (which an SDK cannot parse).
const OPT_IN = ['x-bypass-remote-prefill'];
const MARKER = 'the x-bypass-remote-prefill frame';
const REQUEST_ID = 'the request_id frame';

const args = clientArgs(['pass', 'fail-every-stream']);

// What the simulated echo model answers: the prompt's words, cycled, MAX_TOKENS of them.
function echoText(prompt) {
  const words = prompt.split(/\s+/).filter(Boolean);
  if (words.length === 0) words.push('...');
  return Array.from({ length: MAX_TOKENS }, (_, i) => words[i % words.length]).join(' ');
}

async function main() {
  const client = openAIClient(args, { apiKey: 'sk-simulated', timeout: 20_000 });
  if (!client) return;
  const model = 'sim-llm';

  async function chat(prompt, extra) {
    const stream = await client.chat.completions.create({
      model,
      messages: [{ role: 'user', content: prompt }],
      max_tokens: MAX_TOKENS,
      stream: true,
      // openai-node sends unknown body parameters as they are.
      ...extra,
    });
    let text = '';
    for await (const chunk of stream) {
      if (chunk.choices.length > 0) text += chunk.choices[0].delta.content ?? '';
    }
    return text;
  }

  async function completion(prompt, extra) {
    const stream = await client.completions.create({
      model,
      prompt,
      max_tokens: MAX_TOKENS,
      stream: true,
      ...extra,
    });
    let text = '';
    for await (const chunk of stream) {
      if (chunk.choices.length > 0) text += chunk.choices[0].text ?? '';
    }
    return text;
  }

  const withLayer = args.expect === 'pass';
  const router = withLayer ? 'with layer' : 'without layer';
  // What breaks the SDK on a cache hit without the layer: the marker, first, then request_id.
  const hit = withLayer ? null : `${MARKER} and ${REQUEST_ID}`;
  for (const [endpoint, call] of [
    ['chat', chat],
    ['completions', completion],
  ]) {
    const prompt = `prefix caching for ${args.label}`;
    // [what, extra body, the frame the SDK must fail on, or null if it must stream the text]
    const attempts = [
      ['#1 cold', {}, withLayer ? null : REQUEST_ID],
      ['#2 cache hit', {}, hit],
      ['#3 cache hit, spoofed marker in nvext.annotations', { nvext: { annotations: SPOOFED } }, hit],
      ['#4 cache hit, opted in to the marker via nvext', { nvext: { annotations: OPT_IN } }, withLayer ? MARKER : hit],
    ];
    for (const [name, extra, breaksOn] of attempts) {
      const what = `${args.label} | ${router} | ${endpoint} stream ${name}`;
      let text;
      try {
        text = await call(prompt, extra);
      } catch (err) {
        const failed = `${err?.constructor?.name ?? typeof err}: ${err?.message ?? err}`;
        if (breaksOn === null) {
          report(false, what, `the SDK failed: ${failed}`);
        } else {
          // The bug: the SDK parses the empty data of a frame without data as JSON.
          report(
            err instanceof SyntaxError,
            `${what}: ${breaksOn} received, SDK fails as in Dynamo (${failed})`,
            `expected a SyntaxError, got ${failed}`,
          );
        }
        continue;
      }
      if (breaksOn !== null) {
        report(false, what, `streamed ${JSON.stringify(text)}, but ${breaksOn} must reach and break the SDK`);
      } else {
        const expected = echoText(prompt);
        report(text === expected, `${what}: ${JSON.stringify(text)}`, `expected ${JSON.stringify(expected)}`);
      }
    }
  }
}

try {
  await main();
} catch (err) {
  report(false, args.label, `unexpected error: ${err?.stack ?? err}`);
}
process.exitCode = exitStatus();
