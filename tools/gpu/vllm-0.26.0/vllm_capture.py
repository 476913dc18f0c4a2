"""Capture real vLLM response bodies for comparison with specparity's vLLM adapter and emulator.

python3 tools/gpu/vllm-0.26.0/vllm_capture.py OUTDIR BASE_URL NAME=SPEC_URL [NAME=SPEC_URL ...]   (from the checkout's root)

Requests are built with specparity's own completion_body() (the exact body the gate sends), on a
chat prompt and a raw prompt from prompts/default.jsonl, encoded with the fixture tokenizer. Every
request and answer (status, headers of interest, body) lands in OUTDIR/capture-<name>.json, /metrics
expositions in OUTDIR/metrics-<name>-{before,after}.txt.
"""
import json
import sys
import time

import requests

from specparity.engines.server.vllm_wire import (completion_body, parse_completion, parse_metrics,
                                                 parse_prompt_logprobs)

OUT, BASE = sys.argv[1], sys.argv[2]
SPECS = dict(a.split("=", 1) for a in sys.argv[3:])
TOK_DIR = "fixtures/models/target"

from transformers import AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(TOK_DIR)
prompts = {}
for line in open("prompts/default.jsonl", encoding="utf-8"):
    row = json.loads(line)
    if row.get("id") in ("repeat-en-001", "code-en-004", "math-en-001"):
        prompts[row["id"]] = row
encoded = {}
for pid, row in prompts.items():
    if "messages" in row:
        ids = tok.apply_chat_template(row["messages"], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:
        ids = tok(row["prompt"])["input_ids"]
    encoded[pid] = [int(t) for t in ids]


def call(log, method, url, body=None):
    t = time.time()
    try:
        r = requests.request(method, url, json=body, timeout=120)
        try:
            payload = r.json()
        except ValueError:
            payload = r.text
        entry = {"method": method, "url": url, "request": body, "status": r.status_code,
                 "content_type": r.headers.get("content-type"), "seconds": round(time.time() - t, 3),
                 "response": payload}
    except requests.RequestException as exc:
        entry = {"method": method, "url": url, "request": body, "error": repr(exc)}
    log.append(entry)
    return entry


def metrics_text(url):
    try:
        return requests.get(url + "/metrics", timeout=30).text
    except requests.RequestException as exc:
        return f"# ERROR {exc!r}\n"


def settled(url):
    prev = None
    for _ in range(12):
        cur = parse_metrics(metrics_text(url))
        if prev == cur:
            return cur
        prev = cur
        time.sleep(0.25)
    return prev


def info(log, url):
    for path in ("/version", "/v1/models", "/health", "/server_info?config_format=json", "/server_info", "/ping",
                 "/load"):
        call(log, "GET", url + path)


report = {}
servers = {"baseline": BASE, **SPECS}
for name, url in servers.items():
    log = []
    info(log, url)
    before_txt = metrics_text(url)
    open(f"{OUT}/metrics-{name}-before.txt", "w").write(before_txt)
    before = parse_metrics(before_txt)
    model = None
    for e in log:
        if e["url"].endswith("/v1/models") and isinstance(e.get("response"), dict):
            model = e["response"]["data"][0]["id"]
    results = {}
    for pid, ids in encoded.items():
        body = completion_body(model, ids, int(prompts[pid].get("max_new_tokens", 48)), [0, 2], logprobs=8, top_k=0)
        e = call(log, "POST", url + "/v1/completions", body)
        try:
            got, finish, scores, choice = parse_completion(e["response"], 8)
            results[pid] = {"ids": got, "finish": finish, "stop_reason": choice.get("stop_reason"),
                            "parse": "ok"}
        except Exception as exc:  # noqa: BLE001
            results[pid] = {"parse": f"{type(exc).__name__}: {exc}"}
    after = settled(url)
    open(f"{OUT}/metrics-{name}-after.txt", "w").write(metrics_text(url))
    delta = {k: after[k] - before[k] for k in ("proposed", "accepted", "verify_steps")}
    # edge cases
    ids0 = encoded["repeat-en-001"]
    call(log, "POST", url + "/v1/completions", completion_body(model, ids0, 3, [0, 2], logprobs=8, top_k=0))  # length
    call(log, "POST", url + "/v1/completions", completion_body(model, ids0, 8, [0, 2], logprobs=8, top_k=-1))  # top_k -1
    call(log, "POST", url + "/v1/completions", completion_body(model, ids0, 8, [0, 2], logprobs=21, top_k=0))  # > max
    b = completion_body(model, ids0, 8, [0, 2], logprobs=8, top_k=0)
    b["min_p"] = 0.1
    call(log, "POST", url + "/v1/completions", b)  # min_p with/without spec
    b = completion_body(model, ids0, 8, [0, 2], logprobs=8, top_k=0)
    b["return_tokens_as_token_ids"] = False
    call(log, "POST", url + "/v1/completions", b)  # decoded-string keys
    b = completion_body(model, ids0, 8, [], logprobs=8, top_k=0)
    del b["stop_token_ids"]
    call(log, "POST", url + "/v1/completions", b)  # no stop_token_ids: what finishes it
    b = completion_body(model, ids0, 8, [0, 2], logprobs=None, top_k=0)
    call(log, "POST", url + "/v1/completions", b)  # logprobs null
    b = completion_body(model, ids0, 8, [0, 2], logprobs=0, top_k=0)
    call(log, "POST", url + "/v1/completions", b)  # logprobs 0
    # scoring: prompt + the answer's continuation, prompt_logprobs 8, max_tokens 1
    scoring = {}
    for pid, r in results.items():
        if r.get("parse") != "ok":
            continue
        cont = r["ids"]
        body = completion_body(model, encoded[pid] + cont, 1, (), logprobs=None, top_k=0, prompt_logprobs=8)
        e = call(log, "POST", url + "/v1/completions", body)
        try:
            sc = parse_prompt_logprobs(e["response"]["choices"][0].get("prompt_logprobs"), encoded[pid], cont, 8)
            scoring[pid] = {"parse": "ok", "argmax_matches": int(sum(int(a) == int(b) for a, b in
                                                                     zip(sc.top_ids[:, 0], cont))), "n": len(cont)}
        except Exception as exc:  # noqa: BLE001
            scoring[pid] = {"parse": f"{type(exc).__name__}: {exc}"}
    report[name] = {"url": url, "model": model, "results": results, "counters_before": before,
                    "counters_after": after, "delta": delta, "scoring": scoring}
    json.dump(log, open(f"{OUT}/capture-{name}.json", "w"), indent=1, ensure_ascii=False)

base_ids = {pid: r.get("ids") for pid, r in report["baseline"]["results"].items()}
for name in SPECS:
    report[name]["same_as_baseline"] = {pid: r.get("ids") == base_ids.get(pid)
                                        for pid, r in report[name]["results"].items()}
json.dump(report, open(f"{OUT}/capture-summary.json", "w"), indent=1, ensure_ascii=False)
for name, r in report.items():
    print(f"CAPTURE {name}: model={r['model']} delta={r['delta']} results="
          f"{ {p: (v.get('finish'), len(v.get('ids') or []), v['parse'][:60]) for p, v in r['results'].items()} } "
          f"scoring={r['scoring']} same={r.get('same_as_baseline')}")
