// A tool loop with the Vercel AI SDK (`ai` 7) against actorproxy, run by tests/agents/test_agent_clients.py.
//
//   node ai_sdk_agent.mjs <responses|chat|anthropic> <generate|stream> <base URL ending in /v1>
//
// responses: @ai-sdk/openai's default model (the Responses API, store: true: later steps refer to
// earlier output items with item_reference); chat: its chat-completions model; anthropic:
// @ai-sdk/anthropic (Messages). One tool; the loop stops when the model answers without a call
// (or after 8 steps). Prints one JSON line: the steps, their finish reasons, the calls made.
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const [provider, mode, baseURL] = process.argv.slice(2);
const models = {
  responses: () => createOpenAI({ baseURL, apiKey: "unused" })("actorproxy"),
  chat: () => createOpenAI({ baseURL, apiKey: "unused" }).chat("actorproxy"),
  anthropic: () => createAnthropic({ baseURL, apiKey: "unused" })("actorproxy"),
};
if (!models[provider] || !["generate", "stream"].includes(mode) || !baseURL) {
  console.error("usage: node ai_sdk_agent.mjs <responses|chat|anthropic> <generate|stream> <base URL>");
  process.exit(2);
}

const calls = [];
const readNote = tool({
  description: "Read one of the user's notes by its name.",
  inputSchema: jsonSchema({
    type: "object",
    properties: { name: { type: "string", description: "the note's name" } },
    required: ["name"],
    additionalProperties: false,
  }),
  execute: async ({ name }) => {
    calls.push(name);
    return `Note ${JSON.stringify(name)}: the build is green; ship it on Friday.`;
  },
});

const settings = {
  model: models[provider](),
  system: "You are a careful assistant. Use the tools to answer.",
  prompt: "Read my notes and tell me when we ship.",
  tools: { read_note: readNote },
  stopWhen: stepCountIs(8),
  maxRetries: 0,
};
let result;
if (mode === "generate") {
  result = await generateText(settings);
} else {
  let failure;
  const stream = streamText({ ...settings, onError: ({ error }) => { failure = error; } });
  let text = "";
  for await (const delta of stream.textStream) text += delta;
  if (failure) throw failure;
  result = { text, steps: await stream.steps };
}
console.log(JSON.stringify({
  steps: result.steps.length,
  finishReasons: result.steps.map((s) => s.finishReason),
  calls,
  text: result.text,
}));
