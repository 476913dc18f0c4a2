"""A llama.cpp-protocol fake: answers like ``llama-server`` from the captured bodies.

It speaks the subset of ``llama-server``'s API the ``llamacpp`` engine uses (``GET /health``,
``GET /props``, ``POST /completion``; anything else is a 404 in llama.cpp's error shape) with
cpp-httplib's keep-alive and compact JSON.

Answers are built from the real bodies captured in ``tests/data/llamacpp/`` (see its README): the
envelope (field names, order, ``generation_settings``, ``timings`` keys) is the captured one, and
``tokens``, ``content``, ``completion_probabilities``, ``stop_type`` and ``timings`` are rebuilt
for each request from :class:`~fakes.replay.ReplayModel`. A speculative server returns the
baseline's tokens (drafted tokens accepted, with llama.cpp's ``logprob: 0.0`` and empty
``top_logprobs`` rows), so the gate passes when nothing is wrong::

    with LlamaCppServer(speculative=True, rules=[Rule("http_500", requests={2})]) as spec:
        ... EngineOptions(spec_urls=(spec.url,), ...)

Run it by hand: ``python -m fakes --spec --fault hang@3`` from ``tests/``.
"""

from __future__ import annotations

import copy
import json
import zlib
from typing import Any, Sequence

from fakes.faults import Rule
from fakes.replay import DATA, EOS, ReplayModel, Vocab, ids_bytes, load, shared_vocab
from fakes.server import FakeServer, Reply, Request

ERROR_500 = {"error": {"code": 500, "message": "failed to decode the batch (ret = -3): could not find a KV slot",
                       "type": "server_error"}}
_JSON = "application/json; charset=utf-8"


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class LlamaCppServer(FakeServer):
    """A fake ``llama-server``; see the module docstring."""

    server_version = "llama.cpp"
    extra_headers = (("Keep-Alive", "timeout=5, max=100"),)
    generation_paths = ("/completion",)

    def __init__(self, *, speculative: bool = False, rules: Sequence[Rule] = (), die_after: int | None = None,
                 refuse: bool = False, hang_s: float = 30.0, trickle_s: float = 0.1, draft_n_max: int = 4,
                 total_slots: int = 1, vocab: Vocab | None = None):
        super().__init__(rules=rules, die_after=die_after, refuse=refuse, hang_s=hang_s, trickle_s=trickle_s)
        self.speculative = speculative
        self.draft_n_max = draft_n_max
        self.total_slots = total_slots
        self.vocab = vocab or shared_vocab()
        self.model = ReplayModel(self.vocab)
        self._envelope = load("completion_spec_draft_simple.json" if speculative else "completion_nospec.json")
        self._props = load("props.json")

    # ------------------------------------------------------------------ the protocol
    def prompt_of(self, body: Any) -> list[int]:
        return [int(t) for t in body["prompt"]]

    def limit_of(self, body: Any) -> int:
        return int(body.get("n_predict", -1))

    def bad_json(self, raw: bytes) -> Reply:
        try:
            json.loads(raw)
        except ValueError as exc:
            return self._invalid_request(exc)
        return self._invalid_request(ValueError("not JSON"))

    def error_500(self) -> Reply:
        return Reply(500, _JSON, _compact(ERROR_500))

    def error_400(self) -> Reply:
        return Reply(400, _JSON, (DATA / "error_invalid_token.json").read_bytes())

    @staticmethod
    def _invalid_request(exc: Exception) -> Reply:
        return Reply(400, _JSON, _compact({"error": {"code": 400, "message": f"[json.exception] {exc}",
                                                     "type": "invalid_request_error"}}))

    @staticmethod
    def _not_found() -> Reply:
        return Reply(404, _JSON, _compact({"error": {"code": 404, "message": "File Not Found",
                                                     "type": "not_found_error"}}))

    def route(self, req: Request) -> Reply:
        if req.method == "GET" and req.path == "/health":
            return Reply(200, _JSON, b'{"status":"ok"}')
        if req.method == "GET" and req.path == "/props":
            props = copy.deepcopy(self._props)
            props["total_slots"] = self.total_slots
            if self.speculative:
                props["default_generation_settings"]["params"]["speculative.types"] = "draft-simple"
            return Reply(200, _JSON, _compact(props))
        if req.method == "POST" and req.path == "/completion":
            try:
                body = req.body
                prompt = [int(t) for t in body["prompt"]]
                n_predict = int(body.get("n_predict", -1))
                k = int(body.get("n_probs", 0))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                return self._invalid_request(exc)
            return Reply(200, _JSON, self.completion(body, prompt, n_predict, k, req.fault))
        return self._not_found()

    # ------------------------------------------------------------------ the answer
    def completion(self, req: dict[str, Any], prompt: list[int], n_predict: int, k: int, fault: str | None) -> bytes:
        """A ``/completion`` answer in the captured envelope, rebuilt for this request."""
        limit = n_predict if n_predict >= 0 else 4096
        tokens, rows, stop_type = self.model.greedy(prompt, limit, max(k, 1))
        out_rows = []
        for i, (tok, alts) in enumerate(zip(tokens, rows)):
            entry = self.vocab.piece(tok)
            entry["logprob"] = alts[0][1]
            entry["top_logprobs"] = [{**self.vocab.piece(a), "logprob": lp} for a, lp in alts[:k]]
            out_rows.append(entry)
        draft_n = accepted = 0
        if self.speculative:
            draft_n, accepted, drafted_positions = self._simulate_drafts(prompt, len(tokens))
            for i in drafted_positions:  # accepted draft tokens: the server computed no row for them
                out_rows[i]["logprob"] = 0.0
                out_rows[i]["top_logprobs"] = []
        if fault == "short_limit":
            keep = max(1, min(len(tokens), limit) // 2)  # EOS is only ever last: it is cut off here
            tokens, out_rows, stop_type = tokens[:keep], out_rows[:keep], "limit"
        if fault == "bad_prob_ids" and out_rows:
            stray = next(t for t in self.model.ordinary if t not in tokens)
            out_rows[-1] = {**out_rows[-1], **self.vocab.piece(stray)}
        body = copy.deepcopy(self._envelope)
        body["content"] = self.vocab.text([t for t in tokens if t != EOS])
        body["tokens"] = tokens if req.get("return_tokens") else []
        body["id_slot"] = 0
        body["tokens_predicted"] = len(tokens)
        body["tokens_evaluated"] = len(prompt)
        gs = body["generation_settings"]
        gs["n_predict"], gs["max_tokens"], gs["n_probs"] = n_predict, n_predict, k
        gs["temperature"] = float(req.get("temperature", gs["temperature"]))
        gs["logit_bias"] = [[int(t), b] for t, b in (req.get("logit_bias") or [])] if isinstance(
            req.get("logit_bias"), list) else gs["logit_bias"]
        body["prompt"] = self.vocab.text(prompt)
        body["has_new_line"] = "\n" in body["content"]
        body["truncated"] = False
        body["stop_type"] = stop_type
        body["stopping_word"] = ""
        body["tokens_cached"] = len(prompt) + len(tokens) - 1
        prompt_ms, predicted_ms = 0.16 * len(prompt), 0.43 * max(1, len(tokens))
        timings: dict[str, Any] = {
            "cache_n": 0, "prompt_n": len(prompt), "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, len(prompt)),
            "prompt_per_second": 1000.0 * len(prompt) / prompt_ms if prompt_ms else 0.0,
            "predicted_n": len(tokens), "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, len(tokens)),
            "predicted_per_second": 1000.0 * len(tokens) / predicted_ms,
        }
        if self.speculative:
            timings["draft_n"], timings["draft_n_accepted"] = draft_n, accepted
            if fault == "accepted_gt_drafted":
                timings["draft_n_accepted"] = draft_n + 3
        body["timings"] = timings
        if fault == "no_timings":
            del body["timings"]
        body["completion_probabilities"] = out_rows if k > 0 else []
        return _compact(body)

    def _simulate_drafts(self, prompt: Sequence[int], n: int) -> tuple[int, int, list[int]]:
        """llama.cpp's draft loop, deterministically: the first token comes from the prefill; each
        verify step drafts up to ``draft_n_max`` tokens, accepts a prefix of them (a deterministic
        0..n_max, so every path is taken) and adds one target token. Returns (drafted, accepted,
        positions of accepted draft tokens)."""
        pos, drafted, accepted, positions = 1, 0, 0, []
        seed = zlib.crc32(ids_bytes(prompt))
        step = 0
        while pos < n:
            d = self.draft_n_max
            a = min((seed + 3 * step) % (d + 1), n - pos)
            drafted += d
            accepted += a
            positions.extend(range(pos, pos + a))
            pos += a + 1  # the accepted drafts, then the target's own token
            step += 1
        return drafted, accepted, positions
