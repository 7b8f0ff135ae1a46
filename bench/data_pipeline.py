"""How fast documents become tokens, and how much of a training step the loader takes.

    python bench/data_pipeline.py [--mb 20] [--large-mb 200] [--steps 20] [--repeat 2] [--ranks 4] [--json F]

1. Tokenization throughput: pipezero's cache build (read jsonl, batch-encode, write the memory-mapped
   cache) beside a plain loop over the same generated files (json.loads each line, then
   `tokenizers.Tokenizer.encode_batch` of 1,024 documents at a time, ids read), with the same
   tokenizer.json. Goal: pipezero within 20% of the plain loop.
2. Loader share: the time to make a step's packed global batch and cut it into micro-batches, over
   the step time of a short training run on the same documents. Goal: under 1%.
3. Peak RSS: a child process builds the cache of one generated large jsonl (streamed, so the peak
   should not grow with the file).
4. Ranks at once (`--ranks N`): N processes, as an outside torchrun starts a node's ranks, open the
   same new cache together, beside one process alone: the wall time until the last has it, and how
   many of them tokenized (one should; the others wait on the cache's lock and read its result).

Documents are paragraphs of this interpreter's standard library source (realistic text, no download),
cycled to the requested size. Writes bench/results/data_pipeline/data_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def paragraphs() -> list[str]:
    from pipezero.data import stdlib_files

    out = []
    for f in stdlib_files()[:400]:
        out.extend(p for p in f.read_text(encoding="utf-8", errors="replace").split("\n\n") if len(p) > 40)
    return out


def write_jsonl(path: Path, size: int, paras: list[str], start: int = 0) -> int:
    """Write records of 1-8 paragraphs until `size` bytes; returns the documents written."""
    n, written, i = 0, 0, start
    with path.open("w") as f:
        while written < size:
            k = 1 + (i % 8)
            line = json.dumps({"text": "\n\n".join(paras[(i + j) % len(paras)] for j in range(k))}) + "\n"
            f.write(line)
            written += len(line)
            i += k
            n += 1
    return n


def plain_loop(files: list[Path], tokenizer_json: Path) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    t0, n_tokens = time.perf_counter(), 0
    for path in files:
        batch: list[str] = []
        with path.open() as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == 1024:
                    n_tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
                    batch = []
        if batch:
            n_tokens += sum(len(e.ids) for e in tok.encode_batch(batch))
    return time.perf_counter() - t0, n_tokens


def pipezero_build(folder: Path, tokenizer_json: Path, cache: Path) -> tuple[float, int]:
    from pipezero.config import DataConfig
    from pipezero.data import load_corpus

    os.environ["PIPEZERO_CACHE"] = str(cache)
    t0 = time.perf_counter()
    c = load_corpus(DataConfig(path=[str(folder)], tokenizer=str(tokenizer_json), seq_len=256))
    dt = time.perf_counter() - t0
    n_docs = sum(s.docs.n_docs for s in c.samples)
    return dt, len(c.train) + len(c.heldout) - n_docs  # tokens without the EOS ids pipezero adds


def loader_share(folder: Path, tokenizer_json: Path, out: Path, steps: int) -> dict:
    from pipezero.settings import build_config
    from pipezero.data import load_corpus, microbatches_for_rank
    from pipezero.engine import train

    cfg = build_config(None, {"data.path": str(folder), "data.tokenizer": str(tokenizer_json), "data.seq_len": 256,
                              "model.vocab_size": 4096, "run.max_steps": steps, "run.out": str(out),
                              "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0,
                              "run.save_final": False,
                              "run.eval_batches": 1})
    train(cfg)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]  # not the first
    step_s = sum(r["step_time_s"] for r in records) / len(records)
    corpus = load_corpus(cfg.data)
    g, p = cfg.global_batch, cfg.parallel
    t0 = time.perf_counter()
    for s in range(steps):
        microbatches_for_rank(corpus.batch(s, s * g, cfg.run.seed, g, cfg.data.seq_len), 0, p.dp, p.microbatches)
    load_s = (time.perf_counter() - t0) / steps
    return {"step_s": step_s, "loader_s": load_s, "loader_share": load_s / step_s,
            "layout": f"pp=1 dp=1 M={p.microbatches} B={p.micro_batch_size} T={cfg.data.seq_len} {cfg.model.preset}"}


# The child reads its peak from /proc (VmHWM: this process image's own high-water mark). Its
# ru_maxrss would not do: Linux carries the parent's peak across fork and exec.
CHILD = """
import os, sys, time
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
sys.path.insert(0, {root!r})
os.environ["PIPEZERO_CACHE"] = {cache!r}
from pipezero.config import DataConfig
from pipezero.data import load_corpus
base = hwm()  # after imports (torch, numpy, tokenizers)
t0 = time.perf_counter()
c = load_corpus(DataConfig(path=[{path!r}], tokenizer={tok!r}, seq_len=256))
print(time.perf_counter() - t0, len(c.train) + len(c.heldout),
      hwm(), base)
"""


# A rank of `--ranks`: counts its own builds (BPE training and cache), then opens the corpus.
RANK_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import os
os.environ["PIPEZERO_CACHE"] = {cache!r}
from pipezero.config import DataConfig
from pipezero.data import cache, load_corpus
built = []
real = cache.build
def build(*a, **k):
    built.append(1)
    return real(*a, **k)
cache.build = build
t0 = time.perf_counter()
load_corpus(DataConfig(path=[{path!r}], tokenizer={tok!r}, seq_len=256))
print(time.perf_counter() - t0, len(built))
"""


def ranks_at_once(folder: Path, tokenizer_json: Path, tmp: Path, n: int) -> dict:
    """One process opening a new cache, then n at once on another new cache (started together)."""
    def start(cache: Path, k: int) -> tuple[float, list[float], int]:
        code = RANK_CHILD.format(root=str(ROOT), cache=str(cache), path=str(folder), tok=str(tokenizer_json))
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(k)]
        outs = [p.communicate()[0].split() for p in procs]
        wall = time.perf_counter() - t0
        return wall, [float(o[-2]) for o in outs], sum(int(o[-1]) for o in outs)

    one_wall, one_load, _ = start(tmp / "cache-one", 1)
    n_wall, n_load, builds = start(tmp / "cache-ranks", n)
    return {"ranks": n, "one_wall_s": one_wall, "one_load_s": one_load[0], "ranks_wall_s": n_wall,
            "ranks_load_s": n_load, "builds": builds, "ranks_over_one": n_wall / one_wall}


def large_file(tmp: Path, tokenizer_json: Path, size_mb: int, paras: list[str]) -> dict:
    path = tmp / "large" / "big.jsonl"
    path.parent.mkdir()
    write_jsonl(path, size_mb << 20, paras)
    code = CHILD.format(root=str(ROOT), cache=str(tmp / "cache-large"), path=str(path), tok=str(tokenizer_json))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, tokens, rss, base = proc.stdout.split()[-4:]
    return {"file_mb": path.stat().st_size / 2**20, "seconds": float(seconds), "tokens": int(tokens),
            "mb_per_s": path.stat().st_size / 2**20 / float(seconds), "peak_rss_mb": int(rss) / 2**20,
            "rss_after_imports_mb": int(base) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=20, help="size of the generated jsonl folder")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--large-mb", type=int, default=200, help="size of the one large jsonl (0: skip)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2, help="tokenization runs of each, alternated; the best counts")
    ap.add_argument("--ranks", type=int, default=4, help="processes opening one new cache at once (0: skip)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "data_pipeline" / "data_pipeline.json")
    args = ap.parse_args()
    from pipezero.data.tokenizer import BPETokenizer

    paras = paragraphs()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        folder = tmp / "docs"
        folder.mkdir()
        files = [folder / f"part{i}.jsonl" for i in range(args.files)]
        n_docs = sum(write_jsonl(f, (args.mb << 20) // args.files, paras, start=i * 997) for i, f in enumerate(files))
        tokenizer_json = tmp / "tokenizer.json"
        BPETokenizer.train(paras[::8], 4096, eos=True).hf.save(str(tokenizer_json))
        runs = []  # alternated, best of each: a shared machine's drift hits both alike
        for i in range(args.repeat):
            runs.append((plain_loop(files, tokenizer_json), pipezero_build(folder, tokenizer_json, tmp / f"cache{i}")))
        (plain_s, plain_tokens), (ours_s, ours_tokens) = (min(r[j] for r in runs) for j in (0, 1))
        result = {
            "cores": os.cpu_count(), "input_mb": args.mb, "documents": n_docs,
            "tokenize": {"repeats": args.repeat, "all_s": [[p[0], o[0]] for p, o in runs], "plain_encode_batch_s": plain_s, "pipezero_cache_build_s": ours_s,
                         "plain_tokens_per_s": plain_tokens / plain_s, "pipezero_tokens_per_s": ours_tokens / ours_s,
                         "pipezero_over_plain": (ours_tokens / ours_s) / (plain_tokens / plain_s),
                         "same_tokens": plain_tokens == ours_tokens},
            "loader": loader_share(folder, tokenizer_json, tmp / "run", args.steps),
        }
        if args.large_mb:
            result["large_file"] = large_file(tmp, tokenizer_json, args.large_mb, paras)
        if args.ranks:
            result["ranks_at_once"] = ranks_at_once(folder, tokenizer_json, tmp, args.ranks)
    result["bench_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    t = result["tokenize"]
    print(f"tokenize {args.mb} MB jsonl ({n_docs:,} docs, {result['cores']} cores): plain encode_batch "
          f"{t['plain_tokens_per_s'] / 1e6:.2f}M tok/s, pipezero cache build {t['pipezero_tokens_per_s'] / 1e6:.2f}M "
          f"tok/s ({t['pipezero_over_plain']:.0%} of plain; same token count: {t['same_tokens']})")
    ld = result["loader"]
    print(f"loader: {ld['loader_s'] * 1e3:.2f} ms of a {ld['step_s'] * 1e3:.0f} ms step = {ld['loader_share']:.2%} "
          f"({ld['layout']})")
    if "large_file" in result:
        lf = result["large_file"]
        print(f"large jsonl {lf['file_mb']:.0f} MB: {lf['seconds']:.1f} s, {lf['mb_per_s']:.1f} MB/s, "
              f"peak RSS {lf['peak_rss_mb']:.0f} MB ({lf['rss_after_imports_mb']:.0f} MB after imports)")
    if "ranks_at_once" in result:
        r = result["ranks_at_once"]
        print(f"{r['ranks']} ranks opening one new cache at once: {r['ranks_wall_s']:.1f} s until the last has it, "
              f"{r['builds']} of them tokenized; one process alone {r['one_wall_s']:.1f} s "
              f"({r['ranks_over_one']:.2f}x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
