// transformers.js (@huggingface/transformers, on onnxruntime-node) on a folder written by
// `gpt2x export --layout transformers.js`: tokenizer ids and greedy generation for each dtype.
// Run by benchmarks/check_interop.py --transformers-js (and tests/onnx/test_transformers_js.py):
//
//     node benchmarks/interop/check.mjs REQUEST.json > RESULT.json
//
// REQUEST: {"root": parent folder, "name": folder name, "dtypes": ["fp32", "q8", "q4"],
//           "prompts": [...], "max_new_tokens": N, "batch": {"input_ids": [[...]], "attention_mask": [[...]]} or null}
// RESULT:  {"versions": {...}, "tokenizer": {"ids": [[...]], "decoded": [...]},
//           "dtypes": {dtype: {"loaded_files": [...], "input_names": [...], "prompts": [{"ids", "tokens", "text"}],
//                              "batch": [[...]] or null, "error": "..." if it failed}}}
// "tokens" are the generated ids only (the prompt cut off); "ids" are transformers.js's own encoding.

import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

import { AutoModelForCausalLM, AutoTokenizer, env, Tensor } from "@huggingface/transformers";

const require = createRequire(import.meta.url);
const request = JSON.parse(readFileSync(process.argv[2], "utf-8"));

env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = request.root;

const versionOf = (pkg) => {
  try {
    return require(`${pkg}/package.json`).version;
  } catch {
    // packages whose "exports" hide package.json: find it beside the resolved entry point
    const entry = require.resolve(pkg);
    const at = entry.lastIndexOf(`node_modules/${pkg}/`);
    return JSON.parse(readFileSync(entry.slice(0, at) + `node_modules/${pkg}/package.json`, "utf-8")).version;
  }
};

const int64 = (rows) => new Tensor("int64", BigInt64Array.from(rows.flat().map(BigInt)), [rows.length, rows[0].length]);
const toNumbers = (t) => t.tolist().map((row) => row.map(Number));

const result = {
  versions: {
    node: process.version,
    "@huggingface/transformers": versionOf("@huggingface/transformers"),
    "onnxruntime-node": versionOf("onnxruntime-node"),
    platform: `${process.platform}-${process.arch}`,
  },
  dtypes: {},
};

const tokenizer = await AutoTokenizer.from_pretrained(request.name);
const ids = request.prompts.map((p) => toNumbers(tokenizer(p, { add_special_tokens: false }).input_ids)[0]);
result.tokenizer = { class: tokenizer.constructor.name, ids, decoded: ids.map((row) => tokenizer.decode(row)) };

for (const dtype of request.dtypes) {
  const entry = { loaded_files: [] };
  result.dtypes[dtype] = entry;
  try {
    const model = await AutoModelForCausalLM.from_pretrained(request.name, {
      dtype,
      device: "cpu",
      progress_callback: (p) => {
        if (p.status === "done" && p.file && !entry.loaded_files.includes(p.file)) entry.loaded_files.push(p.file);
      },
    });
    entry.input_names = model.sessions.model.inputNames;
    entry.output_names = model.sessions.model.outputNames;
    const options = { max_new_tokens: request.max_new_tokens, do_sample: false, num_beams: 1 };
    entry.prompts = [];
    for (const row of ids) {
      const out = await model.generate({ input_ids: int64([row]), attention_mask: int64([row.map(() => 1)]), ...options });
      const tokens = toNumbers(out)[0].slice(row.length);
      entry.prompts.push({ ids: row, tokens, text: tokenizer.decode(tokens) });
    }
    if (request.batch) {
      const { input_ids, attention_mask } = request.batch;
      const out = await model.generate({ input_ids: int64(input_ids), attention_mask: int64(attention_mask), ...options });
      entry.batch = toNumbers(out).map((row) => row.slice(input_ids[0].length));
    }
    await model.dispose();
  } catch (e) {
    entry.error = `${e.name}: ${e.message}`;
  }
}

process.stdout.write(JSON.stringify(result) + "\n");
