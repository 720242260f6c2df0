// A call that does not stream, from Node's fetch (undici), with a response-head timeout shorter than the wait,
// run by tests/agents/test_agents_wait_out_a_pause.py.
//
//   node node_fetch_wait.mjs <fetch|ai-sdk> <proxy URL> <headers timeout, ms>
//
// Node's fetch gives up on a response head after `headersTimeout` (300 s by default); here it is shortened
// by a dispatcher of the same kind as fetch's own (undici's Agent, found on fetch's global dispatcher once a
// first call made it). fetch: one chat completion; ai-sdk: the Vercel AI SDK's generateText over
// @ai-sdk/openai's chat model, given that fetch, without its retries (they would only wait again). Prints one JSON line: the status or finish reason, or the error.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText } from "ai";

const [mode, url, timeout] = process.argv.slice(2);
await (await fetch(`${url}/health`)).text();
const Agent = globalThis[Symbol.for("undici.globalDispatcher.1")].constructor;
const dispatcher = new Agent({ headersTimeout: Number(timeout) });
const timed = (input, init) => fetch(input, { ...init, dispatcher });
const started = Date.now();
try {
  if (mode === "fetch") {
    const reply = await timed(`${url}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-session-id": "node-fetch" },
      body: JSON.stringify({ model: "m", max_tokens: 4, messages: [{ role: "user", content: "hi" }] }),
    });
    const body = await reply.json();
    console.log(JSON.stringify({ status: reply.status, finish: body.choices?.[0]?.finish_reason, ms: Date.now() - started }));
  } else {
    const openai = createOpenAI({ baseURL: `${url}/v1`, apiKey: "unused", fetch: timed,
                                  headers: { "x-session-id": "node-ai-sdk" } });
    const result = await generateText({ model: openai.chat("actorproxy"), prompt: "hi", maxOutputTokens: 4,
                                        maxRetries: 0 });
    console.log(JSON.stringify({ status: 200, finish: result.finishReason, ms: Date.now() - started }));
  }
} catch (error) {
  console.log(JSON.stringify({ error: String(error?.cause?.code ?? error?.message ?? error), ms: Date.now() - started }));
  process.exit(1);
}
