"""Demo model, jobs/edits.jsonl, float32: greedy outputs with TurboQuant variants and
with mlx-lm's affine 4-bit cache (group 32: the demo's head_dim) against the
full-precision cache, and the teacher-forced perplexity of the expected answers.

    python bench/turboquant_demo_quality.py [--jobs N] [--every K] [--variants A,B] [--out F]

Prints one line per job and a summary (also written to --out, by default
bench/results/turboquant_demo_quality.json). --every K takes every K-th edit job
(all four kinds) instead of the first N (the first 30 are renames).
"""
import argparse, json, sys, time
from pathlib import Path
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from batchgen import turboquant as tq
from batchgen.bench import answer_nll

ap = argparse.ArgumentParser()
ap.add_argument('--jobs', type=int, default=24)
ap.add_argument('--every', type=int, default=0)
ap.add_argument('--variants', default='')
ap.add_argument('--out', type=Path, default=ROOT / 'bench' / 'results' / 'turboquant_demo_quality.json')
args = ap.parse_args()
model, tok = load(str(ROOT / 'batchgen' / 'demo'))
model.set_dtype(mx.float32)
lines = [json.loads(l) for l in open(ROOT / 'jobs' / 'edits.jsonl')]
hdr = lines[0]['batchgen']
jobs = lines[1:][::args.every] if args.every else lines[1:1 + args.jobs]
answers = {json.loads(l)['id']: json.loads(l)['answer'] for l in open(ROOT / 'jobs' / 'answers' / 'edits.jsonl')}
L = len(model.layers)

def prompt_ids(j):
    msgs = [{"role": "system", "content": hdr['system']}] + j['messages']
    return tok.apply_chat_template(msgs, add_generation_prompt=True)

VARIANTS = {
    'fp32': lambda: [KVCache() for _ in range(L)],
    'mlx4_g32': lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in range(L)],
    'tq4_default': lambda: tq.make_turboquant_cache(model, 4),
    'tq4_k4v4': lambda: tq.make_turboquant_cache(model, 4, key_bits=4, value_bits=4),
    'tq4_k5v3_w16s8': lambda: tq.make_turboquant_cache(model, 4, window=16, sink_tokens=8),
    'tq4_k4v4_w16s8': lambda: tq.make_turboquant_cache(model, 4, key_bits=4, value_bits=4, window=16, sink_tokens=8),
    'tq3_default': lambda: tq.make_turboquant_cache(model, 3),
}
if args.variants:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants.split(',') or k == 'fp32'}

def greedy(ids, cache, n):
    out = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache):
        out.append(int(t))
        if t in tok.eos_token_ids:
            break
    return out

res = {k: {'prefix': [], 'identical': 0, 'bytes': [], 'nll': 0.0} for k in VARIANTS}
ntok = 0
t0 = time.time()
refs = {}
for j in jobs:
    ids = prompt_ids(j)
    ans = tok.encode(answers[j['id']], add_special_tokens=False) + [tok.eos_token_ids and sorted(tok.eos_token_ids)[0]]
    ntok += len(ans)
    for k, make in VARIANTS.items():
        c = make()
        out = greedy(ids, c, j['max_tokens'])
        if k == 'fp32':
            refs[j['id']] = out
        ref = refs[j['id']]
        d = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        same = out == ref
        res[k]['identical'] += same
        res[k]['prefix'].append(1.0 if same else d / max(len(ref), 1))
        res[k]['bytes'].append(sum(x.nbytes for x in c if hasattr(x, 'nbytes')))
        res[k]['nll'] += answer_nll(model, ids, ans, make())
    print('job', j['id'], {k: (r['prefix'][-1], r['bytes'][-1]) for k, r in res.items()}, round(time.time()-t0), flush=True)
summary = {}
for k, r in res.items():
    summary[k] = {'mean_prefix_match': round(float(np.mean(r['prefix'])), 4), 'identical': r['identical'], 'jobs': len(jobs),
                  'kv_bytes_mean': int(np.mean(r['bytes'])), 'answer_ppl': round(float(np.exp(r['nll'] / ntok)), 5)}
fp = summary['fp32']
for k, s in summary.items():
    s['kv_bytes_vs_fp16'] = round(s['kv_bytes_mean'] / (fp['kv_bytes_mean'] / 2), 3)  # fp32 cache halves to fp16
    s['ppl_vs_full'] = round(s['answer_ppl'] / fp['answer_ppl'], 5)
    print(k, s)
print('seconds', round(time.time() - t0, 1))
json.dump(summary, open(args.out, 'w'), indent=2)
