// The planner page: sliders in, the server's plan (/dashboard/plan/compute) out.
"use strict";

const CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576];
const CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
const GPU_GB = [16, 24, 40, 48, 80, 94, 141, 180, 192];
const $ = (id) => document.getElementById(id);
const gb = (bytes) => `${(bytes / 1e9).toFixed(1)} GB`;
const tokens = (n) => n >= 1024 ? `${n / 1024}K` : `${n}`;
let asked = 0;

function stops(id, values, initial) {
  const el = $(id);
  el.max = values.length - 1;
  el.value = values.indexOf(initial);
  return () => values[+el.value];
}

const context = stops("context", CONTEXTS, 131072);
const concurrency = stops("concurrency", CONCURRENCY, 8);
const gpu = stops("gpu", GPU_GB, 80);

function request() {
  const custom = $("model").value === "config";
  let config = null;
  if (custom) config = JSON.parse($("config").value || "{}");
  return {model: custom ? null : $("model").value, config, context_len: context(), concurrency: concurrency(),
          weight_dtype: $("weight_dtype").value, kv_dtype: $("kv_dtype").value, gpu_memory: `${gpu()}GB`,
          gpus: +$("gpus").value};
}

function show(p) {
  $("total").textContent = gb(p.total_bytes);
  $("total").dataset.bytes = p.total_bytes;
  $("weights").textContent = `${gb(p.weight_bytes)} (${p.weight_dtype}, ${(p.num_params / 1e9).toFixed(2)}B parameters)`;
  $("weights").dataset.bytes = p.weight_bytes;
  $("kv").textContent = `${gb(p.kv_bytes)} (${p.kv_dtype}, ${tokens(p.context_len)} tokens × ${p.concurrency})`;
  $("kv").dataset.bytes = p.kv_bytes;
  $("kv-token").textContent = `${(p.kv_bytes_per_token / 1024).toFixed(0)} KiB (${p.kv_bytes_per_token} bytes)`;
  $("act").textContent = gb(p.activation_bytes);
  $("gpus-needed").textContent = `${p.gpus} × ${p.gpu_memory / 1e9} GB`;
  $("gpus-needed").dataset.gpus = p.gpus;
  $("verdict").textContent = `${p.gpus} GPU${p.gpus === 1 ? "" : "s"} of ${p.gpu_memory / 1e9} GB, ` +
    `${((100 * p.total_bytes) / (p.gpus * p.gpu_memory)).toFixed(0)}% full`;
  $("fit").textContent = `${p.fit_concurrency} of ${tokens(p.context_len)} tokens on ${p.fit_gpus} × ${p.gpu_memory / 1e9} GB`;
  const whole = Math.max(p.gpus * p.gpu_memory, p.total_bytes);
  $("bar-w").style.width = `${(100 * p.weight_bytes) / whole}%`;
  $("bar-kv").style.width = `${(100 * p.kv_bytes) / whole}%`;
  $("bar-act").style.width = `${(100 * p.activation_bytes) / whole}%`;
  $("ticks").innerHTML = "<i></i>".repeat(Math.min(p.gpus, 64));
}

async function update() {
  $("o-context").textContent = `${tokens(context())} tokens`;
  $("o-concurrency").textContent = concurrency();
  $("o-gpu").textContent = `${gpu()} GB`;
  $("o-gpus").textContent = $("gpus").value;
  $("config-label").hidden = $("model").value !== "config";
  let body;
  try {
    body = JSON.stringify(request());
  } catch (err) {
    $("error").textContent = `config.json: ${err.message}`;
    return;
  }
  const mine = ++asked;
  const r = await MatineeKey.fetch("/dashboard/plan/compute", {method: "POST", body,
                                                               headers: {"Content-Type": "application/json"}});
  const out = await r.json();
  if (mine !== asked) return;   // a later change already asked
  $("error").textContent = r.ok ? "" : out.error.message;
  if (r.ok) show(out);
}

async function start() {
  const r = await MatineeKey.fetch("/dashboard/plan/presets", {});
  const info = await r.json();
  const model = $("model");
  for (const [name, shape] of Object.entries(info.presets)) {
    model.add(new Option(`${name} — ${shape.num_layers} layers, ${shape.num_kv_heads} KV heads × ${shape.head_dim}`, name));
  }
  model.add(new Option("a config.json…", "config"));
  model.value = "70b-gqa";
  for (const id of ["weight_dtype", "kv_dtype"]) {
    const table = id === "weight_dtype" ? info.weight_dtypes : info.dtypes;   // weights also take GGUF types
    for (const d of Object.keys(table)) $(id).add(new Option(`${d} (${+table[d].toFixed(4)} bytes)`, d));
    $(id).value = "bf16";
  }
  for (const el of document.querySelectorAll("input, select, textarea")) el.addEventListener("input", update);
  update();
}

start();
