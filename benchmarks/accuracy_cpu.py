"""Accuracy of prompt logprobs against a float64 forward of the same weights: apcscore fp32 (CPU) and transformers fp32.

    .venv/bin/python benchmarks/accuracy_cpu.py [--texts N]

The default model (SmolLM2-135M-Instruct). Texts: the sample prompts and the first N texts of
datasets/sample_texts.jsonl (cut to 1,024 tokens each). The reference is transformers' forward in float64
(eager attention); each token's logprob under it is compared with apcscore's (`score --prompt-logprobs 0`
through the Python API, batch-invariant native engine) and with transformers' own fp32 forward. Prints the max and
mean |Δ logprob| of each, and how many ranks-1 (argmax) disagree with float64's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def texts(limit: int) -> list[str | list[int]]:
    """The sample prompts (text, or token ids) and the first `limit` sample texts."""
    records = [json.loads(line) for line in (ROOT / "datasets/sample_prompts.jsonl").open()]
    long = [json.loads(line)["text"] for line in (ROOT / "datasets/sample_texts.jsonl").open()][:limit]
    return [r.get("prompt", r.get("prompt_token_ids")) for r in records] + long


def hf_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [T-1] of tokens 1.. under the model, and its argmax ids [T-1], in the model's dtype (float64 out)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    lp = torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), -1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double(), logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--reference-cache", type=Path, help="keep transformers' logprobs in this file (reruns "
                        "then run apcscore only)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from apcscore import EngineConfig, Request, load_engine
    from apcscore.models.locate import resolve_model

    path = resolve_model("smollm2-135m")[0]
    engine = load_engine("smollm2-135m", EngineConfig(dtype="float32"))
    tok = engine.tokenizer
    all_ids = [(t if isinstance(t, list) else tok(t).input_ids)[:1024] for t in texts(args.texts)]
    cache = args.reference_cache
    refs = torch.load(cache) if cache and cache.exists() else None
    if refs is None or refs["ids"] != all_ids:
        hf64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
        hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        refs = {"ids": all_ids, "64": [hf_logprobs(hf64, ids) for ids in all_ids],
                "32": [hf_logprobs(hf32, ids) for ids in all_ids]}
        if cache:
            torch.save(refs, cache)
    start = time.perf_counter()
    outs = {o.request_id: o for o in engine.run([Request(str(i), ids, prompt_logprobs=1)
                                                  for i, ids in enumerate(all_ids)])}
    errs = {"apcscore fp32": [], "transformers fp32": []}
    argmax_off = {"apcscore fp32": 0, "transformers fp32": 0}
    for i, ids in enumerate(all_ids):
        ref, ref_top = refs["64"][i]
        ours = torch.from_numpy(outs[str(i)].prompt_logprobs.token_logprobs).double()
        ours_top = torch.from_numpy(outs[str(i)].prompt_logprobs.top_ids[:, 0])
        theirs, theirs_top = refs["32"][i]
        errs["apcscore fp32"].append((ours - ref).abs())
        errs["transformers fp32"].append((theirs - ref).abs())
        argmax_off["apcscore fp32"] += int((ours_top != ref_top).sum())
        argmax_off["transformers fp32"] += int((theirs_top != ref_top).sum())
    n = sum(len(ids) - 1 for ids in all_ids)
    print(f"{len(all_ids)} texts, {n} scored tokens (run {time.perf_counter() - start:.1f} s); |Δ logprob| vs float64:")
    for name, e in errs.items():
        e = torch.cat(e)
        print(f"  {name:18s} max {e.max():.3e}  mean {e.mean():.3e}  p99.9 {e.quantile(0.999):.3e}  "
              f"argmax differs at {argmax_off[name]} of {n}")
        short = torch.cat(errs[name][:8])
        print(f"  {'':18s} the 8 sample prompts only: max {short.max():.3e}  mean {short.mean():.3e}")


if __name__ == "__main__":
    main()
