"""The campaign: draw cases from a seed, run them, shrink what differs, print reproducers."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from .draw import draw_case, request_features
from .models import FAMILIES
from .run import Finding, Runner, shrink


@dataclass
class Report:
    seed: int
    trials: int = 0
    requests: int = 0
    by_family: dict = field(default_factory=dict)
    by_feature: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # (case, finding, reproducer)
    seconds: float = 0.0

    def summary(self) -> str:
        fam = ", ".join(f"{k} {v}" for k, v in sorted(self.by_family.items()))
        feat = ", ".join(f"{k} {v}" for k, v in sorted(self.by_feature.items()))
        return (f"seed {self.seed}: {self.trials} trials, {self.requests} requests, {len(self.failures)} differing, "
                f"{self.seconds:.0f} s\n  families: {fam}\n  features: {feat}")


def reproducer(case: dict, finding: Finding) -> str:
    """A Python snippet that builds the model, runs the case's engine and generate() alone, and asserts equality
    (run it with ``tests/`` on ``PYTHONPATH``)."""
    return f'''import torch
from transformers import DynamicCache
import hf_paged
from hf_paged import BlockPool
from differential.models import ModelCache, bump_weights, make_prompt
from differential.run import reference, request_returns, Runner

CASE = {json.dumps(case)}
# {finding.kind} in phase {finding.phase}, request {finding.index}: {finding.detail[:300]}
findings = Runner().run(CASE)  # each phase: one engine on a shared pool; every request vs generate() alone
assert not findings, findings
'''


def explicit_reproducer(case: dict, finding: Finding) -> str:
    """The same, spelled out for a one-phase, one-request case without adapters (what most shrink to)."""
    if len(case["phases"]) != 1 or len(case["phases"][0]["requests"]) != 1 or case["engine"]["adapters"]:
        return ""
    e, r = case["engine"], case["phases"][0]["requests"][0]
    spec = ""
    if e["speculative"] == "ngram":
        spec = ', speculative="ngram"'
    elif e["speculative"] == "draft":
        spec = f', speculative=build_draft("{case["family"]}", {case["model_seed"]})'
    seed_kw = f", seed={r['seed']}" if r["seed"] is not None else ""
    manual = f"torch.manual_seed({r['seed']})\n" if r["seed"] is not None else ""
    return f'''import torch
from transformers import DynamicCache
import hf_paged
from hf_paged import BlockPool
from differential.models import build, build_draft, make_prompt  # tiny random models and prompts (tests/)

model = build("{case["family"]}", {case["model_seed"]})
prompt = make_prompt("{case["family"]}", {r["text"]}, {r["images"]}, type_ids={r["type_ids"]})
kwargs = {r["kwargs"]!r}
inputs = dict(prompt) if not isinstance(prompt, list) else {{"input_ids": torch.tensor([prompt])}}
{manual}ref = model.generate(**inputs, **{{k: v for k, v in kwargs.items() if k != "prompt_lookup_num_tokens"}},
                     past_key_values=DynamicCache(config=model.config))[:, inputs["input_ids"].shape[1]:]
manager = hf_paged.init_continuous_batching(
    model, pool=BlockPool(block_size={e["block_size"]}, num_blocks={e["num_blocks"]}, prefix_caching={e["prefix_caching"]}),
    max_batch_tokens={e["max_batch_tokens"]}{spec})
rid = manager.add_request(prompt, **kwargs{seed_kw})
with manager:
    got = manager.get_result(rid, timeout=300).generated_tokens
print("engine", got, "generate() alone", ref.tolist())
assert list(got) == ref[0].tolist()[:len(got)] and len(got) == ref.shape[1]
'''


def campaign(seed: int, trials: int, families=None, max_requests: int = 8, findings_path=None,
             shrink_cases: bool = True, log=None, runner: Runner | None = None, minutes: float | None = None) -> Report:
    """``trials`` cases drawn from ``seed`` (case ``t`` from ``seed * 100_003 + t``), run in one process with
    models cached per (family, seed). A difference is shrunk the first time its kind (family, request features,
    speculation) differs in the campaign; ``minutes``: draw no new case after that long."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    runner = runner or Runner()
    report = Report(seed)
    start = time.perf_counter()
    seen_kinds, shrunk_signatures = set(), set()
    for t in range(trials):
        if minutes is not None and time.perf_counter() - start > minutes * 60:
            break
        case = draw_case(seed * 100_003 + t, runner.hot_tokens, families, max_requests)
        report.trials += 1
        n = sum(len(ph["requests"]) for ph in case["phases"])
        report.requests += n
        report.by_family[case["family"]] = report.by_family.get(case["family"], 0) + n
        for ph in case["phases"]:
            for r in ph["requests"]:
                for f in request_features(r):
                    report.by_feature[f] = report.by_feature.get(f, 0) + 1
        t0 = time.perf_counter()
        try:
            found = runner.run(case)
        except Exception as err:  # noqa: BLE001 -- a case that cannot even run is a finding too
            found = [Finding(0, -1, "error", f"run: {type(err).__name__}: {err}")]
        if log:
            e = case["engine"]
            log(f"trial {t}: {case['family']} x{n} bs={e['block_size']} blocks={e['num_blocks']} "
                f"budget={e['max_batch_tokens']} spec={e['speculative']} lora={e['adapters']} "
                f"phases={len(case['phases'])}: {'ok' if not found else f'{len(found)} differ'} "
                f"({time.perf_counter() - t0:.1f} s)")
        for finding in found[:1]:  # the first difference of a case, shrunk (once per kind of request)
            if log:
                log(f"  {finding.kind} phase {finding.phase} request {finding.index}: {finding.detail[:400]}")
            failing = case["phases"][finding.phase]["requests"][finding.index] if finding.index >= 0 else None
            signature = (FAMILIES[case["family"]], finding.kind, case["engine"]["speculative"] is not None,
                         *(sorted(request_features(failing) & {"beams", "images", "sampled", "seeded", "adapter"})
                           + [failing["type_ids"]] if failing else []))
            again = signature in shrunk_signatures
            shrunk_signatures.add(signature)
            small, small_finding = (shrink(runner, case, finding, budget=30, log=log) if shrink_cases and not again
                                    else (case, finding))
            if shrink_cases and not again:  # does the shrunk case fail alone, in a fresh process's state?
                try:
                    alone = Runner().run(small)
                except Exception as err:  # noqa: BLE001
                    alone = [Finding(0, -1, "error", f"run: {type(err).__name__}: {err}")]
                if not alone:
                    small_finding = Finding(small_finding.phase, small_finding.index, small_finding.kind,
                                            "NOT reproduced alone with fresh models (depends on what ran before in "
                                            "the process, or on timings): " + small_finding.detail)
                    if log:
                        log("  the shrunk case passes alone with fresh models: history- or timing-dependent")
            text = explicit_reproducer(small, small_finding) or reproducer(small, small_finding)
            report.failures.append((case, small_finding, text))
            if log:
                log(text)
            key = (small["family"], small_finding.kind, tuple(sorted(
                f for ph in small["phases"] for r in ph["requests"] for f in request_features(r))))
            if findings_path and key not in seen_kinds:
                seen_kinds.add(key)
                with open(findings_path, "a") as out:
                    out.write(f"\n### seed {seed}, trial {t}: {small['family']} ({FAMILIES[small['family']]}), "
                              f"{small_finding.kind}\n\n{small_finding.detail[:600]}\n\nShrunk reproducer "
                              f"(`PYTHONPATH=tests`):\n\n```python\n{text}```\n")
    report.seconds = time.perf_counter() - start
    return report
