// The official OpenAI Node client against a running `llmem serve models/pycoder --chat-template
// chatml` (started by tests/e2e/e2e-serve-node.c, which passes the base URL and the text that
// `llmem run` generates greedily for PROMPT), and the structured outputs also against the same
// model with seeded random weights (`--load-format dummy`, RANDOM_URL), and tool calls in
// Mistral's convention against tiny-mistral-swa with tok-mistral-tools' tokenizer (MISTRAL_URL).
//
//   node serve.test.mjs BASE_URL EXPECTED_TEXT [RANDOM_URL [MISTRAL_URL]]
//
// Exit status 0 when every check passes; each failure is printed.
import assert from "node:assert/strict";
import Ajv from "ajv";
import OpenAI from "openai";

const [baseURL, expected, randomURL, mistralURL] = process.argv.slice(2);
const PROMPT = "def fibonacci(n):\n";
const N = 32;
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused", maxRetries: 0 });
const randomClient = randomURL ? new OpenAI({ baseURL: `${randomURL}/v1`, apiKey: "unused", maxRetries: 0 }) : null;
const mistralClient = mistralURL ? new OpenAI({ baseURL: `${mistralURL}/v1`, apiKey: "unused", maxRetries: 0 }) : null;

// tools: a forced call's arguments validate against the function's schema; the stream's
// tool_call deltas reassemble to the same call; the call and its result go back in the next request
async function toolCallsOn(c, model) {
  const parameters = { type: "object", properties: { city: { type: "string", maxLength: 16 }, days: { type: "integer" } }, required: ["city", "days"], additionalProperties: false };
  const tools = [{ type: "function", function: { name: "forecast", description: "A city's forecast", parameters } }];
  const validate = new Ajv().compile(parameters);
  for (const seed of [1, 2, 3]) {
    const params = {
      model,
      messages: [{ role: "user", content: "Forecast for Oslo?" }],
      tools,
      tool_choice: seed === 3 ? { type: "function", function: { name: "forecast" } } : "required",
      temperature: 1,
      seed,
      max_tokens: 100,
    };
    const r = await c.chat.completions.create(params);
    const call = r.choices[0].message.tool_calls[0];
    assert.equal(r.choices[0].finish_reason, "tool_calls");
    assert.equal(call.type, "function");
    assert.equal(call.function.name, "forecast");
    const args = JSON.parse(call.function.arguments);
    assert.ok(validate(args), `${call.function.arguments}: ${JSON.stringify(validate.errors)}`);
    const stream = await c.chat.completions.create({ ...params, stream: true });
    const calls = [];
    let finish = null;
    for await (const chunk of stream) {
      for (const d of chunk.choices[0]?.delta?.tool_calls ?? []) {
        calls[d.index] ??= { name: "", arguments: "" };
        calls[d.index].name += d.function?.name ?? "";
        calls[d.index].arguments += d.function?.arguments ?? "";
      }
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    assert.equal(finish, "tool_calls");
    assert.deepEqual(calls, [{ name: "forecast", arguments: call.function.arguments }]);
  }
  const r = await c.chat.completions.create({
    model,
    messages: [
      { role: "user", content: "Forecast for Oslo?" },
      { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function", function: { name: "forecast", arguments: '{"city": "Oslo", "days": 2}' } }] },
      { role: "tool", tool_call_id: "call_1", content: "rain" },
    ],
    tools,
    max_tokens: 8,
    temperature: 0,
  });
  assert.equal(typeof r.choices[0].message.content, "string");
}
const greedy = { temperature: 0, ignore_eos: true };

async function metric(name) {
  const text = await (await fetch(`${baseURL}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith(`${name} `));
  assert.ok(line, `no metric ${name}`);
  return Number(line.slice(name.length + 1));
}

async function waitIdle() {
  for (let i = 0; i < 600; i++) {
    if ((await metric("llmem_requests_running")) === 0 && (await metric("llmem_requests_waiting")) === 0)
      return;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.fail("the server does not become idle");
}

async function complete(prompt, extra = {}) {
  const r = await client.completions.create({ model: "pycoder", prompt, max_tokens: N, ...greedy, ...extra });
  return r.choices[0].text;
}

async function streamText(params, create) {
  const stream = await create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = "";
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    text += c.text ?? c.delta?.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
  }
  return { text, usage, finish };
}

const chatParams = (user) => ({
  model: "pycoder",
  messages: [
    { role: "system", content: "You write Python." },
    { role: "user", content: user },
  ],
  max_tokens: 24,
  ...greedy,
});

const tests = {
  async models() {
    const list = await client.models.list();
    assert.deepEqual(list.data.map((m) => m.id), ["pycoder"]);
  },

  async completionEqualsRun() {
    const r = await client.completions.create({ model: "pycoder", prompt: PROMPT, max_tokens: N, ...greedy });
    assert.equal(r.object, "text_completion");
    assert.equal(r.choices[0].text, expected);
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.usage.completion_tokens, N);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + N);
  },

  async completionStream() {
    const s = await streamText({ model: "pycoder", prompt: PROMPT, max_tokens: N, ...greedy }, (p) =>
      client.completions.create(p),
    );
    assert.equal(s.text, expected);
    assert.equal(s.finish, "length");
    assert.equal(s.usage.completion_tokens, N);
  },

  async chatAndChatStream() {
    const r = await client.chat.completions.create(chatParams("def add(a, b):"));
    assert.equal(r.object, "chat.completion");
    assert.equal(r.choices[0].message.role, "assistant");
    assert.ok(r.choices[0].message.content.length > 0);
    assert.equal(r.usage.completion_tokens, 24);
    const s = await streamText(chatParams("def add(a, b):"), (p) => client.chat.completions.create(p));
    assert.equal(s.text, r.choices[0].message.content);
    assert.equal(s.usage.completion_tokens, 24);
    // logprobs, the chat way
    const l = await client.chat.completions.create({ ...chatParams("x = "), max_tokens: 4, logprobs: true, top_logprobs: 2 });
    assert.equal(l.choices[0].logprobs.content.length, 4);
    for (const t of l.choices[0].logprobs.content) {
      assert.equal(t.top_logprobs.length, 2);
      assert.ok(t.logprob <= 0 && t.logprob >= t.top_logprobs[1].logprob);
    }
  },

  async sixteenConcurrentEqualSingle() {
    const prompts = Array.from({ length: 16 }, (_, i) => `def handler_${i}(request):\n`);
    const alone = [];
    for (const p of prompts) alone.push(await complete(p));
    const together = await Promise.all(
      prompts.map((p, i) =>
        i % 2
          ? complete(p)
          : streamText({ model: "pycoder", prompt: p, max_tokens: N, ...greedy }, (q) =>
              client.completions.create(q),
            ).then((s) => s.text),
      ),
    );
    assert.deepEqual(together, alone);
    // and chat, 16 at once
    const chats = Array.from({ length: 16 }, (_, i) => chatParams(`def step_${i}():`));
    const chatAlone = [];
    for (const c of chats) chatAlone.push((await client.chat.completions.create(c)).choices[0].message.content);
    const chatTogether = await Promise.all(
      chats.map((c) => client.chat.completions.create(c).then((r) => r.choices[0].message.content)),
    );
    assert.deepEqual(chatTogether, chatAlone);
  },

  async abortMidStreamFreesKv() {
    await waitIdle();
    const cancelled = await metric('llmem_requests_total{outcome="cancelled"}');
    const stream = await client.completions.create({
      model: "pycoder",
      prompt: PROMPT,
      max_tokens: 1900,
      ...greedy,
      stream: true,
    });
    let chunks = 0;
    for await (const chunk of stream) {
      assert.ok(chunk.choices.length === 1);
      if (++chunks === 3) {
        stream.controller.abort();
        break;
      }
    }
    await waitIdle();
    assert.ok((await metric('llmem_requests_total{outcome="cancelled"}')) >= cancelled + 1);
    assert.equal(await metric("llmem_kv_blocks_used"), await metric("llmem_bank_blocks"));
    assert.ok((await metric("llmem_generation_tokens_total")) > 0);
  },

  // response_format: every output validates against its schema (ajv), 10 schemas × 50 seeds
  // at 20 to 120 tokens, on pycoder and on random weights (the grammar, not the model, makes it
  // valid); each schema's 50 requests at once
  async structuredOutputs() {
    const schemas = [
      { type: "object", properties: { name: { type: "string", maxLength: 10 }, age: { type: "integer" } }, required: ["name", "age"], additionalProperties: false },
      { type: "object", properties: { tags: { type: "array", items: { enum: ["a", "b", "c"] }, minItems: 1, maxItems: 3 } }, required: ["tags"], additionalProperties: false },
      { type: "object", properties: { ok: { type: "boolean" }, note: { type: ["string", "null"] } }, required: ["ok", "note"], additionalProperties: false },
      { type: "object", properties: { v: { anyOf: [{ type: "number" }, { const: "none" }] } }, required: ["v"], additionalProperties: false },
      { $defs: { node: { type: "object", properties: { next: { anyOf: [{ $ref: "#/$defs/node" }, { type: "null" }] } }, required: ["next"], additionalProperties: false } }, $ref: "#/$defs/node" },
      { type: "object", properties: { id: { const: 7 }, kind: { enum: ["x", "y"] } }, required: ["id", "kind"], additionalProperties: false },
      { type: "array", items: { type: "integer" }, minItems: 2, maxItems: 4 },
      { type: "object", properties: { point: { type: "object", properties: { x: { type: "number" }, y: { type: "number" } }, required: ["x", "y"], additionalProperties: false } }, required: ["point"], additionalProperties: false },
      { type: "object", properties: { items: { type: "array", items: { type: "object", properties: { k: { type: "string", maxLength: 4 } }, required: ["k"], additionalProperties: false }, maxItems: 2 } }, required: ["items"], additionalProperties: false },
      { type: "object", properties: { a: { type: "string", minLength: 1, maxLength: 3 }, b: { type: "boolean" } }, required: ["a"], additionalProperties: false },
    ];
    const ajv = new Ajv();
    for (const [who, c] of [["pycoder", client], ["random weights", randomClient]]) {
      if (!c) continue;
      for (const [i, schema] of schemas.entries()) {
        const validate = ajv.compile(schema);
        const seeds = Array.from({ length: 50 }, (_, k) => k + 1);
        const texts = await Promise.all(seeds.map(async (seed) => {
          const r = await c.chat.completions.create({
            model: "pycoder",
            messages: [{ role: "user", content: "Give me JSON." }],
            temperature: 1,
            seed,
            max_tokens: [20, 30, 60, 120][seed % 4],
            response_format: { type: "json_schema", json_schema: { name: `s${i}`, strict: true, schema } },
          });
          return [r.choices[0].message.content, r.choices[0].finish_reason];
        }));
        for (const [k, [text, finish]] of texts.entries()) {
          const what = `${who}, schema ${i}, seed ${seeds[k]} (${finish}): ${JSON.stringify(text)}`;
          let value;
          assert.doesNotThrow(() => { value = JSON.parse(text); }, what);
          assert.ok(validate(value), `${what}: ${ajv.errorsText(validate.errors)}`);
        }
      }
    }
    const r = await client.completions.create({ model: "pycoder", prompt: "x", max_tokens: 40, temperature: 1, seed: 5, response_format: { type: "json_object" } });
    assert.equal(typeof JSON.parse(r.choices[0].text), "object");
  },

  // n: the choices, each its own draws, the prompt prefilled once
  async nChoices() {
    await waitIdle();
    const reused = await metric("llmem_prompt_tokens_reused_total");
    const prompt = PROMPT.repeat(40);
    const r = await client.completions.create({ model: "pycoder", prompt, n: 3, max_tokens: 6, temperature: 1, seed: 9, ignore_eos: true });
    assert.equal(r.choices.length, 3);
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
    assert.equal(r.usage.completion_tokens, 18);
    await waitIdle();
    assert.ok((await metric("llmem_prompt_tokens_reused_total")) - reused >= 2 * (r.usage.prompt_tokens - 16));
  },

  async toolCalls() {
    await toolCallsOn(client, "pycoder");
  },

  // the same through Mistral's convention ([TOOL_CALLS], a control token), on tiny-mistral-swa
  async mistralToolCalls() {
    if (!mistralClient) return;
    const model = (await mistralClient.models.list()).data[0].id;
    await toolCallsOn(mistralClient, model);
  },

  async badRequests() {
    await assert.rejects(
      client.completions.create({ model: "pycoder", prompt: "x", max_tokens: -1 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === "max_tokens",
    );
    await assert.rejects(
      client.completions.create({ model: "pycoder", prompt: "x", temperature: "hot" }),
      (e) => e instanceof OpenAI.BadRequestError && e.code === "invalid_type",
    );
    await assert.rejects(
      client.chat.completions.create({ model: "gpt-4o", messages: [{ role: "user", content: "hi" }] }),
      (e) => e instanceof OpenAI.NotFoundError && e.code === "model_not_found",
    );
    await assert.rejects(
      client.completions.create({ model: "pycoder", prompt: "x", n: 17 }),
      (e) => e.status === 400 && e.param === "n",
    );
    await assert.rejects(
      client.chat.completions.create({
        model: "pycoder",
        messages: [{ role: "user", content: "hi" }],
        response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "string", format: "date" } } },
      }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "response_format" && /format/.test(e.message),
    );
    // still serving
    assert.equal(await complete(PROMPT), expected);
  },
};

let failed = 0;
for (const [name, fn] of Object.entries(tests)) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}: ${e?.stack ?? e}`);
  }
}
console.log(failed ? `${failed} failed` : "all passed");
process.exit(failed ? 1 : 0);
