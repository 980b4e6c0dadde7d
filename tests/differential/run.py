"""Running a case: its phases' requests in one engine per phase (all on one pool), each request compared with
``generate()`` of that request alone on a ``DynamicCache`` (greedy: equal, or first differing where the reference's
top-2 logits tie; seeded sampling: equal to ``generate()`` after ``torch.manual_seed(seed)``, the documented
guarantee; beams: the ``num_return_sequences`` sequences of ``generate(num_beams=k)``)."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import BlockPool, compat

from .draw import features
from .models import ADAPTER_SPECS, FAMILIES, ModelCache, bump_weights, make_prompt, restore_weights

TIE = 1e-4  # a greedy token may differ only where the reference's top-2 logits are closer than this
TIMEOUT_S = 300


@dataclass
class Finding:
    phase: int
    index: int  # the request's index in its phase
    kind: str  # "tokens", "error", "refused"
    detail: str

    def same_kind(self, other: "Finding") -> bool:
        return self.kind == other.kind


def _inputs(family: str, request: dict):
    prompt = make_prompt(family, request["text"], request["images"], request["type_ids"])
    if isinstance(prompt, list):
        return prompt, {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt),
                                                                                          dtype=torch.long)}
    return prompt, dict(prompt)


def reference_kwargs(request: dict) -> dict:
    """generate()'s keywords for the request alone (speculation is lossless: the reference decodes plainly)."""
    kw = dict(request["kwargs"])
    kw.pop("prompt_lookup_num_tokens", None)
    return kw


def reference(model, family: str, request: dict):
    """``(sequences, first logits per position or None)``: generate() alone with a DynamicCache."""
    _, inputs = _inputs(family, request)
    kw = reference_kwargs(request)
    if request["seed"] is not None:
        torch.manual_seed(request["seed"])
    beams = kw.get("num_beams", 1) > 1
    with torch.no_grad():
        out = model.generate(**inputs, **kw, return_dict_in_generate=True, output_logits=not beams,
                             **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
    n = inputs["input_ids"].shape[1]
    if beams:
        seqs = []
        for j in range(kw.get("num_return_sequences", 1)):
            length = int((out.beam_indices[j] != -1).sum())
            seqs.append(out.sequences[j, n:n + length].tolist())
        return seqs, None
    return [out.sequences[0, n:].tolist()], [step[0].float() for step in out.logits]


def compare(request: dict, got: list[list[int]], ref: list[list[int]], logits) -> str | None:
    """None if equal (or first differing at a near-tie of a greedy reference), else what differs."""
    if got == ref:
        return None
    greedy = not request["kwargs"].get("do_sample") and request["kwargs"].get("num_beams", 1) == 1
    if greedy and logits is not None and len(got) == 1:
        for i, (g, r) in enumerate(zip(got[0], ref[0])):
            if g != r:
                top2 = logits[i].topk(2).values
                gap = float(top2[0] - top2[1])
                if gap < TIE:
                    return None
                return f"token {i}: engine {g}, generate() alone {r} (top-2 gap {gap:.2e}); engine {got[0]}, " \
                       f"reference {ref[0]}"
    return f"engine {got}, generate() alone {ref}"


class Runner:
    """Runs cases; models come from a :class:`ModelCache` kept for the run."""

    def __init__(self, cache: ModelCache | None = None, verbose: bool = False):
        self.cache = cache or ModelCache()
        self.verbose = verbose
        self._hot = {}

    def hot_tokens(self, family: str, model_seed: int) -> list[int]:
        """Tokens the model emits from a few fixed prompts (EOS ids / bad words / biases that change outputs)."""
        key = (family, model_seed)
        if key not in self._hot:
            model = self.cache.get("model", family, model_seed)
            seen = []
            for start in ([5, 9, 14], [20, 7, 33, 4, 61, 8]):
                with torch.no_grad():
                    out = model.generate(torch.tensor([start]), attention_mask=torch.ones(1, len(start),
                                                                                          dtype=torch.long),
                                         max_new_tokens=8, do_sample=False, eos_token_id=None,
                                         **{compat.GENERATE_CACHE_KWARG: DynamicCache(config=model.config)})
                seen += [t for t in out[0, len(start):].tolist() if t > 2 and t not in seen]
            self._hot[key] = seen[:6]
        return self._hot[key]

    def models(self, case: dict):
        """(engine model, reference model for adapter name -> context, draft or None)."""
        family, seed, engine = case["family"], case["model_seed"], case["engine"]
        base = self.cache.get("model", family, seed)
        peft = self.cache.get("peft", family, seed) if engine["adapters"] else None
        draft = self.cache.get("draft", family, seed) if engine["speculative"] == "draft" else None
        return base, peft, draft

    def run(self, case: dict) -> list[Finding]:
        family, engine = case["family"], case["engine"]
        base, peft, draft = self.models(case)
        engine_model = peft if engine["adapters"] == "peft" else base
        pool = BlockPool(block_size=engine["block_size"], num_blocks=engine["num_blocks"],
                         prefix_caching=engine["prefix_caching"])
        findings, saved = [], []
        try:
            for p, phase in enumerate(case["phases"]):
                if phase["bump"] is not None:
                    saved += bump_weights(base, phase["bump"])
                findings += self._phase(case, p, phase, engine_model, base, peft, draft, pool)
        finally:
            restore_weights(reversed(saved))
        return findings

    def _phase(self, case, p, phase, engine_model, base, peft, draft, pool) -> list[Finding]:
        family, engine = case["family"], case["engine"]
        options = dict(pool=pool, max_batch_tokens=engine["max_batch_tokens"])
        if engine["speculative"]:
            options["speculative"] = draft if engine["speculative"] == "draft" else "ngram"
        manager = hf_paged.init_continuous_batching(engine_model, **options)
        policy = getattr(getattr(manager._core, "speculation", None), "policy", None)
        if policy is not None:  # speculate at every step: the draft path runs whatever the timings
            policy.choose = lambda choices: len(choices) - 1
        if engine["adapters"]:
            for name in ADAPTER_SPECS:
                manager.load_adapter(name, peft, adapter_name=name)
        findings, rids = [], {}
        for i, request in enumerate(phase["requests"]):
            prompt, _ = _inputs(family, request)
            kw = dict(request["kwargs"])
            if request["seed"] is not None:
                kw["seed"] = request["seed"]
            expected = request.get("expect") == "refused"
            try:
                rids[i] = manager.add_request(prompt, request_id=f"r{i}", adapter=request["adapter"], **kw)
            except (ValueError, TypeError, RuntimeError) as err:
                if not expected:
                    findings.append(Finding(p, i, "refused", f"{type(err).__name__}: {err}"))
                elif features is not None and not isinstance(err, features.FeatureRefused):
                    findings.append(Finding(p, i, "refused", f"refused, but not by the feature table: "
                                                             f"{type(err).__name__}: {err}"))
                continue
            if expected:
                findings.append(Finding(p, i, "not refused", "the feature table refuses this combination, "
                                                             "add_request took it"))
                del rids[i]
        results = {}
        try:
            with manager:
                for i, rid in rids.items():
                    n = request_returns(phase["requests"][i])
                    ids = [rid] + [f"{rid}__child#{j}" for j in range(n - 1)]
                    results[i] = [manager.get_result(r, timeout=TIMEOUT_S) for r in ids]
        except Exception as err:  # noqa: BLE001 -- the engine thread's failure is a finding
            return findings + [Finding(p, -1, "error", f"engine: {type(err).__name__}: {err}")]
        for i, outs in results.items():
            request = phase["requests"][i]
            if any(o is None or o.error for o in outs):
                findings.append(Finding(p, i, "error", str([o and o.error for o in outs])))
                continue
            got = [list(o.generated_tokens) for o in outs]
            model = base
            ctx = nullcontext()
            if peft is not None:
                model = peft
                if request["adapter"] is None:
                    ctx = peft.disable_adapter()
                else:
                    peft.set_adapter(request["adapter"])
            with ctx:
                ref, logits = reference(model, family, request)
            diff = compare(request, got, ref, logits)
            if diff:
                findings.append(Finding(p, i, "tokens", diff))
        return findings


def request_returns(request: dict) -> int:
    kw = request["kwargs"]
    return kw.get("num_return_sequences", 1) if kw.get("num_beams", 1) > 1 else 1


# ------------------------------------------------------------------------------------------------ shrinking


def _without(case: dict, p: int, keep) -> dict:
    out = copy.deepcopy(case)
    out["phases"][p]["requests"] = [r for i, r in enumerate(out["phases"][p]["requests"]) if keep(i)]
    return out


def _candidates(case: dict, finding: Finding):
    """Smaller cases, most reducing first: fewer phases, fewer requests, plainer engine, fewer features, shorter
    prompts."""
    p, i = finding.phase, finding.index
    if i >= 0:
        # the failing request alone in its phase (earlier phases kept: they fill the pool)
        yield "only the failing request", _without(case, p, lambda j: j == i), (p, 0)
    if p > 0:
        out = copy.deepcopy(case)
        out["phases"] = out["phases"][p:]
        yield "without earlier phases", out, (0, i)
    for q in range(len(case["phases"])):
        if q != p:
            out = copy.deepcopy(case)
            del out["phases"][q]
            yield f"without phase {q}", out, (p - (q < p), i)
    n = len(case["phases"][p]["requests"])
    for j in range(n):
        if j != i:
            yield f"without request {j}", _without(case, p, lambda k, j=j: k != j), (p, i - (j < i))
    defaults = {"speculative": None, "prefix_caching": False, "max_batch_tokens": 512, "num_blocks": 1024,
                "adapters": None}
    for key, value in defaults.items():
        if case["engine"][key] != value and not (key == "adapters" and any(
                r["adapter"] for ph in case["phases"] for r in ph["requests"])):
            out = copy.deepcopy(case)
            out["engine"][key] = max(value, case["engine"][key]) if key == "num_blocks" else value
            yield f"engine {key}={value}", out, (p, i)
    for q, phase in enumerate(case["phases"]):
        if phase["bump"] is not None:
            out = copy.deepcopy(case)
            out["phases"][q]["bump"] = None
            yield f"no weight change before phase {q}", out, (p, i)
    if i < 0:
        return
    request = case["phases"][p]["requests"][i]
    for key in list(request["kwargs"]):
        if key in ("max_new_tokens", "do_sample", "num_beams"):
            continue
        out = copy.deepcopy(case)
        del out["phases"][p]["requests"][i]["kwargs"][key]
        if key == "eos_token_id":
            out["phases"][p]["requests"][i]["kwargs"].pop("min_new_tokens", None)
        yield f"without {key}", out, (p, i)
    if request["adapter"] is not None:
        out = copy.deepcopy(case)
        out["phases"][p]["requests"][i]["adapter"] = None
        yield "no adapter", out, (p, i)
    if request["kwargs"]["max_new_tokens"] > 1:
        out = copy.deepcopy(case)
        out["phases"][p]["requests"][i]["kwargs"]["max_new_tokens"] = max(1, request["kwargs"]["max_new_tokens"] // 2)
        yield "fewer new tokens", out, (p, i)
    for k in range(len(request["images"])):
        if len(request["images"]) > 1:
            out = copy.deepcopy(case)
            r = out["phases"][p]["requests"][i]
            del r["images"][k]
            r["text"][k:k + 2] = [r["text"][k] + r["text"][k + 1]]
            yield f"without image {k}", out, (p, i)
    for k, run in enumerate(request["text"]):
        if len(run) > 1:
            for cut in (run[len(run) // 2:], run[:len(run) // 2], run[1:]):
                out = copy.deepcopy(case)
                out["phases"][p]["requests"][i]["text"][k] = cut
                yield f"text run {k} shorter", out, (p, i)
        elif len(run) == 1 and (len(request["text"]) > 1 or sum(map(len, request["text"])) > 1):
            out = copy.deepcopy(case)
            out["phases"][p]["requests"][i]["text"][k] = []
            yield f"text run {k} empty", out, (p, i)


def shrink(runner: Runner, case: dict, finding: Finding, budget: int = 60, log=None) -> tuple[dict, Finding]:
    """Greedily take the first smaller case that still fails the same way, until none does (or ``budget`` runs)."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for what, candidate, (p, i) in _candidates(case, finding):
            if runs >= budget:
                break
            if candidate == case:
                continue
            runs += 1
            try:
                found = runner.run(candidate)
            except Exception as err:  # noqa: BLE001 -- a candidate the engine cannot even build is no smaller case
                if log:
                    log(f"    shrink: {what}: raised {type(err).__name__}")
                continue
            same = [f for f in found if f.same_kind(finding) and (f.phase, f.index) == (p, i)]
            same = same or [f for f in found if f.same_kind(finding)]
            if same:
                case, finding, improved = candidate, same[0], True
                if log:
                    log(f"    shrink: {what}: still fails")
                break
    return case, finding
