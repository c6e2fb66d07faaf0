"""Which grammar engine for JSON-schema output: per-token mask cost in a batch,
and schema coverage, for llguidance, xgrammar and outlines-core side by side.

Mask computation is host work (a bitmask over the vocabulary after each token),
so this runs on a CPU and needs no model: each of `--rows` rows follows a valid
JSON instance of its schema token by token (the demo tokenizer, or a byte-level
BPE of `--train-vocab` tokens trained here on Python's own sources, to see the
cost at a large model's vocabulary), and each step fills every live row's mask
with the engine's batch call (llguidance `LLExecutor`, xgrammar
`BatchGrammarMatcher`, outlines-core one guide at a time: it has none) and then
advances every row by its token. Coverage: per JSON-schema feature, whether the
engine compiles the schema, accepts a valid instance and rejects an invalid one
(token by token through its masks, as decoding would meet them).

    python bench/grammar_masks.py --train-vocab 100000 --rows 32 --out bench/results/DIR/grammar_masks.json
    python bench/grammar_masks.py --train-vocab 100000 --save-tokenizer DIR   # a tokenizer folder, for `--model DIR`

Engines that are not installed are reported as such. xgrammar imports torch at
the top of its module for its tensor helpers; where torch is missing a stand-in
module is put in its place (its masks go into numpy arrays through DLPack, as
its documentation allows), which is said in the output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's batchgen, run from anywhere

# The schemas the rows follow (those of tests/test_structured.py, and a wider one).
SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                        "address": {"type": "object", "properties": {
                                            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                            "required": ["city", "zip"], "additionalProperties": False}},
      "required": ["name", "address"], "additionalProperties": False},
     {"name": "Ada Lovelace", "address": {"city": "London", "zip": "12345"}}),
    ({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
      "required": ["colour", "size"], "additionalProperties": False},
     {"colour": "green", "size": "XL"}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
                                        "scores": {"type": "array", "items": {"type": "integer"}}},
      "required": ["tags", "scores"], "additionalProperties": False},
     {"tags": ["alpha", "beta", "gamma"], "scores": [1, 22, 333, 4444]}),
    ({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 130},
                                        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                        "ok": {"type": "boolean"}},
      "required": ["age", "ratio", "ok"], "additionalProperties": False},
     {"age": 42, "ratio": 0.25, "ok": True}),
    ({"type": "object", "properties": {
        "title": {"type": "string"}, "summary": {"type": "string"},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "entities": {"type": "array", "items": {"type": "object", "properties": {
            "text": {"type": "string"}, "kind": {"enum": ["person", "place", "org"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["text", "kind", "confidence"], "additionalProperties": False}}},
      "required": ["title", "summary", "sentiment", "entities"], "additionalProperties": False},
     {"title": "Quarterly results", "summary": "Revenue grew in every region; margins held steady.",
      "sentiment": "positive", "entities": [{"text": "Acme Corp", "kind": "org", "confidence": 0.97},
                                            {"text": "Berlin", "kind": "place", "confidence": 0.81}]}),
]  # fmt: skip

# (feature, schema, a valid instance, an invalid one)
FEATURES = [
    ("integer bounds", {"type": "integer", "minimum": 3, "maximum": 9}, 7, 12),
    ("exclusive bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5, 1),
    ("string length", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "ab-123"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2026-01-02T03:04:05Z", "tomorrow"),
    ("format uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "1234"),
    ("enum", {"enum": ["a", 1, None]}, 1, "b"),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("array bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ["a", 1], [1, "a"]),
    ("required + additionalProperties false",
     {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
     {"a": 1}, {"b": 1}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abc"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}, {"a": 1}),
    ("$ref / $defs", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                      "additionalProperties": False}},
                      "type": "array", "items": {"$ref": "#/$defs/p"}}, [{"x": 1}], [{"y": 1}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x", "kids": []}]}),
    ("type list (nullable)", {"type": ["string", "null"]}, None, 3),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"k": 1}, {"k": "v"}),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
]  # fmt: skip


# ---------------------------------------------------------------------------
# Tokenizers


def demo_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "batchgen/demo/tokenizer.json"), eos_token="<|im_end|>")


def trained_tokenizer(vocab: int, cache: Path):
    """A byte-level BPE with the demo's pre-tokenizer, trained on the standard
    library's sources (deterministic, offline), saved in `cache`."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-{vocab}.json"
    if not path.exists():
        demo = json.loads((ROOT / "batchgen/demo/tokenizer.json").read_text())
        tok = Tokenizer(BPE())
        shell = json.loads(tok.to_str())
        shell.update(pre_tokenizer=demo["pre_tokenizer"], decoder=demo["decoder"])
        tok = Tokenizer.from_str(json.dumps(shell))
        lib = Path(json.__file__).parents[1]
        corpus = cache / "corpus.txt"
        cache.mkdir(parents=True, exist_ok=True)
        with open(corpus, "w", encoding="utf-8") as out:
            for p in sorted(lib.rglob("*.py")):
                if "site-packages" not in p.parts:
                    try:
                        out.write(p.read_text(encoding="utf-8"))
                    except (UnicodeDecodeError, OSError):
                        pass
        files = [str(corpus)]
        from tokenizers.pre_tokenizers import ByteLevel

        trainer = BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=ByteLevel.alphabet(), show_progress=False)  # fmt: skip
        tok.train(files, trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def token_bytes(hf) -> list[bytes]:
    """Each id's bytes (byte-level BPE: the GPT-2 byte-to-unicode map undone)."""
    from batchgen.decode.logprobs import bytes_to_unicode

    undo = {c: b for b, c in bytes_to_unicode().items()}
    out = []
    for piece in hf.convert_ids_to_tokens(list(range(len(hf)))):
        if piece in hf.all_special_tokens:
            out.append(piece.encode())
        else:
            out.append(bytes(undo[c] for c in piece))
    return out


# ---------------------------------------------------------------------------
# Engines: compile(schema) -> matcher; fill(matchers, bitmask); allowed(bitmask row, token); consume(m, token)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()
        self.version = llguidance.__version__

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers, bitmask):
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, m, token) -> bool:
        return m.consume_token(token)

    def accepting(self, m) -> bool:
        return m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        self.stub = "torch" not in sys.modules and _torch_missing()
        if self.stub:
            sys.modules["torch"] = _torch_stand_in()
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.version = xgrammar.__version__ if hasattr(xgrammar, "__version__") else _version("xgrammar")

    def compile(self, schema):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask[: len(matchers)])

    def consume(self, m, token) -> bool:
        return m.accept_token(token)

    def accepting(self, m) -> bool:
        return m.is_completed() if hasattr(m, "is_completed") else m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, vocab: int):
        import outlines_core

        self.oc = outlines_core
        pieces: dict = {}
        eos = hf.convert_tokens_to_ids("<|im_end|>")
        for i, b in enumerate(token_bytes(hf)):
            if i != eos and b:
                pieces.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, pieces)
        self.vocab = vocab
        self.version = _version("outlines-core")

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, matchers, bitmask):
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, g, token) -> bool:
        try:
            g.advance(token, return_tokens=False)
            return True
        except Exception:
            return False

    def accepting(self, g) -> bool:
        return g.is_finished() or self.vocabulary.get_eos_token_id() in g.get_tokens()


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _torch_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is None


def _torch_stand_in():
    """Names xgrammar's modules (and tvm_ffi's dtype table) touch at import:
    each unknown name is a class of its own; nothing here computes."""
    torch = types.ModuleType("torch")
    made: dict = {}

    def name_of(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return made.setdefault(attr, types.new_class(attr))

    torch.__getattr__ = name_of
    torch.full = lambda shape, value, dtype=None: np.full(shape, value, np.int32)
    torch.tensor = lambda *a, **k: None
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)
    torch.compiler = types.SimpleNamespace(disable=lambda f=None, **k: f if f else (lambda g: g))
    torch.library = types.SimpleNamespace(custom_op=lambda *a, **k: (lambda f: f), register_fake=lambda *a, **k: (lambda f: f))
    torch.__version__ = "0.0 (stand-in)"
    return torch


# ---------------------------------------------------------------------------


def allowed(bitmask_row: np.ndarray, token: int) -> bool:
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def batch_cost(engine, hf, rows: int, vocab: int, repeats: int) -> dict:
    """Rows following valid instances; seconds of mask fills and of advances per row-token."""
    words = (vocab + 31) // 32
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    compile_s = []
    for schema, _ in SCHEMAS:
        start = time.perf_counter()
        engine.compile(schema)
        compile_s.append(time.perf_counter() - start)
    sequences = [hf.encode(json.dumps(SCHEMAS[i % len(SCHEMAS)][1])) + [eos] for i in range(rows)]
    fill_s = consume_s = 0.0
    row_tokens = steps = rejected = 0
    for _ in range(repeats):
        matchers = [engine.compile(SCHEMAS[i % len(SCHEMAS)][0]) for i in range(rows)]
        bitmask = np.full((rows, words), -1, np.int32)
        for t in range(max(len(s) for s in sequences)):
            live = [i for i in range(rows) if t < len(sequences[i])]
            start = time.perf_counter()
            engine.fill([matchers[i] for i in live], bitmask)
            mid = time.perf_counter()
            for r, i in enumerate(live):
                token = sequences[i][t]
                rejected += not allowed(bitmask[r], token)
                if token != eos:
                    engine.consume(matchers[i], token)
            end = time.perf_counter()
            fill_s += mid - start
            consume_s += end - mid
            row_tokens += len(live)
            steps += 1
    return {
        "rows": rows, "row_tokens": row_tokens, "steps": steps,
        "mask_us_per_row_token": 1e6 * fill_s / row_tokens,
        "advance_us_per_row_token": 1e6 * consume_s / row_tokens,
        "step_ms_at_rows": 1e3 * (fill_s + consume_s) / steps,
        "compile_ms": [round(1e3 * s, 2) for s in compile_s],
        "valid_tokens_masked_out": rejected,
    }  # fmt: skip


def coverage(engine, hf, vocab: int) -> dict:
    """Per feature: ok, or what went wrong (compile error, valid rejected, invalid accepted)."""
    words = (vocab + 31) // 32
    out = {}
    for name, schema, good, bad in FEATURES:
        try:
            engine.compile(schema)
        except Exception as e:
            out[name] = f"compile error: {str(e).splitlines()[0][:80]}"
            continue
        verdict = []
        if not _walk(engine, schema, hf.encode(json.dumps(good)), words):
            verdict.append("valid rejected")
        if _walk(engine, schema, hf.encode(json.dumps(bad)), words):
            verdict.append("invalid accepted")
        out[name] = "ok" if not verdict else ", ".join(verdict)
    return out


def _walk(engine, schema, tokens: list[int], words: int) -> bool:
    """Whether every token is allowed by the mask before it and the text is complete."""
    m = engine.compile(schema)
    bitmask = np.full((1, words), -1, np.int32)
    for token in tokens:
        engine.fill([m], bitmask)
        if not allowed(bitmask[0], token) or not engine.consume(m, token):
            return False
    return engine.accepting(m)


def save_tokenizer(hf, out: Path) -> Path:
    """`hf` as a model folder's tokenizer (the demo's chat template beside it): what
    `batchgen bench --shape S --model DIR` reads, to measure a random-weight shape with a
    vocabulary of a real model's size (the demo's has 4,096 tokens; a grammar's masks
    cost by the vocabulary)."""
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text((ROOT / "batchgen/demo/chat_template.jinja").read_text())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-vocab", type=int, default=None, help="a byte-level BPE of this many tokens (else the demo's 4,096)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--cache", type=Path, default=Path("/tmp/batchgen-bench-tokenizers"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--save-tokenizer", type=Path, default=None,
                   help="write the tokenizer as a model folder's (with the demo's chat template) and stop")
    args = p.parse_args(argv)
    hf = trained_tokenizer(args.train_vocab, args.cache) if args.train_vocab else demo_tokenizer()
    if args.save_tokenizer:
        save_tokenizer(hf, args.save_tokenizer)
        return
    vocab = len(hf)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python"] + sys.argv), "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "vocab": vocab, "engines": {}}  # fmt: skip
    for name in args.engines.split(","):
        try:
            engine = ENGINES[name](hf, vocab)
        except ImportError as e:
            result["engines"][name] = {"error": f"not installed ({e})"}
            print(f"{name}: not installed ({e})", file=sys.stderr)
            continue
        entry = {"version": engine.version, "torch_stand_in": getattr(engine, "stub", False)}
        entry["batch"] = batch_cost(engine, hf, args.rows, vocab, args.repeats)
        entry["coverage"] = coverage(engine, hf, vocab)
        b = entry["batch"]
        ok = sum(v == "ok" for v in entry["coverage"].values())
        print(f"{name} {engine.version}: mask {b['mask_us_per_row_token']:.1f} us + advance "
              f"{b['advance_us_per_row_token']:.1f} us per row-token; {b['step_ms_at_rows']:.2f} ms a step at "
              f"{args.rows} rows; compile {b['compile_ms']} ms; coverage {ok}/{len(FEATURES)}; "
              f"valid tokens masked out {b['valid_tokens_masked_out']}", file=sys.stderr)  # fmt: skip
        result["engines"][name] = entry
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
