"""Chat tasks with exact answers, built from the running interpreter's stdlib sources.

Every answer is computed by a program, never written by hand, so a model's reply can be
scored by exact match. The edit kinds (rename, remove_comments, docstring, reorder_args)
mostly copy their input, the free-form kind (write_function) copies little: together they
show where prompt-lookup decoding helps and where it cannot.

All functions here are pure (text in, text out) except the file walkers at the bottom.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import io
import keyword
import multiprocessing
import os
import random
import re
import signal
import sysconfig
import textwrap
import tokenize
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

SYSTEM = (
    "You are a precise Python refactoring assistant. Apply the requested change and "
    "reply with the complete resulting code only, no explanations."
)

KINDS = ("rename", "remove_comments", "docstring", "reorder_args", "write_function")
EDIT_KINDS = KINDS[:4]

HELD_OUT_PERCENT = 8
MIN_LINES, MAX_LINES, MAX_CHARS = 3, 40, 1500

# Directories whose code is tests, an IDE or a dead converter: not the stdlib's own style.
SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)

FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)
# Calls that observe local names as strings: renaming a local would change behaviour.
NAME_INTROSPECTION = frozenset({"locals", "vars", "eval", "exec", "globals"})

# New names for renames: a head, often followed by a tail.
NEW_NAME_HEADS = tuple(
    "item value result node entry buf data count index label text key obj total acc cur "
    "part chunk token src dst out state flag size pos limit record field elem target".split()
)
NEW_NAME_TAILS = ("", "", "", "_val", "_obj", "_list", "_map", "_new", "_ref", "_tmp", "2")


@dataclass(frozen=True)
class Function:
    path: str  # relative to the stdlib root, posix: "json/decoder.py"
    module: str  # "json.decoder"
    qualname: str  # "JSONDecoder.decode"
    source: str  # dedented, no trailing newline

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Task:
    kind: str
    function: str  # "json.decoder:JSONDecoder.decode"
    path: str
    user: str
    answer: str
    system: str = SYSTEM
    variant: int = 0  # 0: the canonical task (held-out, jobs); >= 1: a training variant

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.user}]


# ---------------------------------------------------------------- hashing, split, rng


def stable_hash(text: str) -> int:
    """A hash that is the same in every process and Python version (unlike hash())."""
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:16], 16)


def is_held_out(rel_path: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Hold out whole modules, so no held-out function has siblings in training."""
    return stable_hash(rel_path) % 100 < percent


def function_rng(name: str, purpose: str = "") -> random.Random:
    return random.Random(stable_hash(f"{name}|{purpose}"))


# ---------------------------------------------------------------- small source helpers


def _char_col(line: str, byte_col: int) -> int:
    """ast columns count UTF-8 bytes; tokenize and str slicing count characters."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def _offset(lines: list[str], row: int, byte_col: int) -> int:
    """Absolute character offset in "\\n".join(lines) of an ast (row, byte column)."""
    return sum(len(line) + 1 for line in lines[: row - 1]) + _char_col(lines[row - 1], byte_col)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(src + "\n").readline))


def parse_function(src: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The one function defined by `src`, or ValueError."""
    tree = ast.parse(src)
    if len(tree.body) != 1 or not isinstance(tree.body[0], FUNCTION_NODES):
        raise ValueError("source is not exactly one function")
    return tree.body[0]


def signature_end_row(src: str) -> int:
    """1-based row of the ':' that closes the def header."""
    depth, seen_def = 0, False
    for tok in _tokens(src):
        if tok.type == tokenize.NAME and tok.string == "def":
            seen_def = True
        elif tok.type == tokenize.OP and seen_def:
            if tok.string in "([{":
                depth += 1
            elif tok.string in ")]}":
                depth -= 1
            elif tok.string == ":" and depth == 0:
                return tok.start[0]
    raise ValueError("no def header")


def _docstring_node(fn: ast.AST) -> ast.Expr | None:
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first
    return None


def _require_body_on_own_line(src: str, fn: ast.AST) -> None:
    if fn.body[0].lineno <= signature_end_row(src):
        raise ValueError("body starts on the signature line")


def _require_whole_lines(lines: list[str], node: ast.AST) -> None:
    start_line, end_line = lines[node.lineno - 1], lines[node.end_lineno - 1]
    before = start_line[: _char_col(start_line, node.col_offset)]
    after = end_line[_char_col(end_line, node.end_col_offset) :]
    if before.strip() or after.strip():
        raise ValueError("node shares its lines with other code")


def same_ast(a: str, b: str) -> bool:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))


# ---------------------------------------------------------------- edit: rename


def _walk_own_scope(node: ast.AST):
    """Nodes of a function body, not descending into nested functions, lambdas or classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (*FUNCTION_NODES, ast.Lambda, ast.ClassDef)):
            yield from _walk_own_scope(child)


def _binds_as_plain_string(node: ast.AST, name: str) -> bool:
    """Bindings whose name is a bare str in the ast (no position to rename at)."""
    if isinstance(node, (*FUNCTION_NODES, ast.ClassDef, ast.ExceptHandler)):
        return node.name == name
    if isinstance(node, ast.alias):
        return name in (node.name, node.asname)
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return node.name == name
    if isinstance(node, ast.MatchMapping):
        return node.rest == name
    return False


def _uses_name(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))


def _outer_scope_parts(fn: ast.AST) -> list[ast.AST]:
    """Defaults, annotations and return type: evaluated in the enclosing scope."""
    args = fn.args
    parts = [d for d in args.defaults + args.kw_defaults if d is not None]
    all_args = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
    parts += [a.annotation for a in all_args if a is not None and a.annotation is not None]
    return parts + ([fn.returns] if fn.returns is not None else [])


def _rename_positions(fn: ast.AST, old: str) -> set[tuple[int, int]]:
    """(row, byte column) of every occurrence of local `old` that a rename must change."""
    if fn.name == old or any(_uses_name(part, old) for part in _outer_scope_parts(fn)):
        raise ValueError(f"{old!r} also refers to the enclosing scope")
    args = fn.args
    own_args = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
    positions = {(a.lineno, a.col_offset) for a in own_args if a is not None and a.arg == old}
    for stmt in fn.body:
        for node in ast.walk(stmt):
            if _binds_as_plain_string(node, old):
                raise ValueError(f"{old!r} is bound without a renamable position")
            if isinstance(node, (ast.JoinedStr, ast.ClassDef)) and _uses_name(node, old):
                # f-string internals tokenize differently across Python versions, and a
                # class body turns names into attributes.
                raise ValueError(f"{old!r} is used inside an f-string or class body")
            if isinstance(node, ast.Name) and node.id == old:
                positions.add((node.lineno, node.col_offset))
            elif isinstance(node, ast.arg) and node.arg == old:
                positions.add((node.lineno, node.col_offset))
    return positions


def rename_identifier(src: str, old: str, new: str) -> str:
    """Rename local/parameter `old` to `new`; strings, comments, attributes and keyword
    argument names stay as they are. ValueError where the rename would be unsafe."""
    if not new.isidentifier() or keyword.iskeyword(new):
        raise ValueError(f"{new!r} is not a usable identifier")
    if re.search(rf"\b{re.escape(new)}\b", src):
        raise ValueError(f"{new!r} already occurs in the source")
    fn = parse_function(src)
    lines = src.split("\n")
    wanted = {(row, _char_col(lines[row - 1], col)) for row, col in _rename_positions(fn, old)}
    if not wanted:
        raise ValueError(f"{old!r} does not occur")
    hits = [
        tok.start
        for tok in _tokens(src)
        if tok.type == tokenize.NAME and tok.string == old and tok.start in wanted
    ]
    if len(hits) != len(wanted):
        raise ValueError("ast and token positions disagree")
    for row, col in sorted(hits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "\n".join(lines)


def rename_candidates(src: str) -> list[tuple[str, str]]:
    """(name, "parameter" | "local variable") pairs, in source order, safe to rename."""
    fn = parse_function(src)
    if NAME_INTROSPECTION & {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}:
        return []
    args = fn.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    stores = [
        n.id
        for n in _walk_own_scope(fn)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    ]
    found, seen = [], set()
    for name, role in [(p, "parameter") for p in params] + [(s, "local variable") for s in stores]:
        if name in seen or name in ("self", "cls", "_") or name.startswith("__"):
            continue
        seen.add(name)
        try:
            _rename_positions(fn, name)
        except ValueError:
            continue
        found.append((name, role))
    return found


def _is_fresh(name: str, src: str) -> bool:
    return not re.search(rf"\b{re.escape(name)}\b", src)


def pick_new_name(rng: random.Random, src: str, pool: tuple[str, ...] = ()) -> str:
    """A name that does not occur in `src`: head + tail from the fixed lists, or (half of
    the time, when a `pool` of harvested names is given) a name from the pool."""
    if pool and rng.random() < 0.5:
        for _ in range(20):
            name = rng.choice(pool)
            if _is_fresh(name, src):
                return name
    for _ in range(20):
        name = rng.choice(NEW_NAME_HEADS) + rng.choice(NEW_NAME_TAILS)
        if _is_fresh(name, src):
            return name
    raise ValueError("no fresh name found")


# Never respelled: builtins would turn into undefined names, self/cls are conventions,
# soft keywords and "_" have meanings of their own.
KEPT_NAMES = frozenset(dir(builtins)) | {"self", "cls", "_", "match", "case", "type"}


def respell_identifiers(src: str, rng: random.Random, pool: tuple[str, ...], share: float) -> str:
    """`src` with about `share` of its distinct identifiers (parameters, locals, globals,
    attribute and keyword-argument names) consistently respelled with fresh names from
    `pool`. Kept: the function's own name, builtins, dunders and any name that occurs in
    an f-string (tokenized differently across Python versions). The code keeps its shape
    and stays valid, not necessarily equivalent: training variants show such functions so
    that the exact text of a function recurs far less often than the function."""
    fn = parse_function(src)
    kept = set(KEPT_NAMES) | {fn.name}
    for node in ast.walk(fn):
        if isinstance(node, ast.JoinedStr):
            kept.update(re.findall(r"\w+", ast.get_source_segment(src, node) or ""))
    tokens = _tokens(src)
    names = sorted(
        {
            t.string
            for t in tokens
            if t.type == tokenize.NAME
            and not keyword.iskeyword(t.string)
            and not t.string.startswith("__")
            and t.string not in kept
        }
    )
    if not pool or not names:
        return src
    mapping, taken = {}, set()
    for old in rng.sample(names, max(1, round(share * len(names)))):
        for _ in range(10):
            new = rng.choice(pool)
            if new not in taken and new not in names and _is_fresh(new, src):
                mapping[old] = new
                taken.add(new)
                break
    lines = src.split("\n")
    hits = [t for t in tokens if t.type == tokenize.NAME and t.string in mapping]
    for t in sorted(hits, key=lambda t: t.start, reverse=True):
        row, col = t.start
        line = lines[row - 1]
        lines[row - 1] = line[:col] + mapping[t.string] + line[t.end[1] :]
    result = "\n".join(lines)
    parse_function(result)  # ValueError/SyntaxError: the caller skips the variant
    return result


# ---------------------------------------------------------------- edit: remove_comments


def remove_comments(src: str) -> str:
    """Drop '#' comments: comment-only lines go, trailing comments are cut (and the line
    right-stripped). A '#' inside a string is not a comment and stays."""
    lines = src.split("\n")
    dropped_rows = set()
    for tok in _tokens(src):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        before = lines[row - 1][:col]
        if before.strip():
            lines[row - 1] = before.rstrip()
        else:
            dropped_rows.add(row)
    return "\n".join(line for row, line in enumerate(lines, 1) if row not in dropped_rows)


def comment_slots(src: str) -> list[tuple[int, int, str]]:
    """Where a comment can go without changing the code: (row, col, "line") for a
    comment-only line before the statement that starts on `row` (not the def line), and
    (row, col, "trail") for a trailing comment at the end of a logical line that has none."""
    tokens = _tokens(src)
    lines = src.split("\n")
    commented_rows = {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)
    slots, line_start = [], True
    for tok in tokens:
        if tok.type == tokenize.ENDMARKER:
            break
        if tok.type == tokenize.NEWLINE:
            row, col = tok.start
            # Not after trailing whitespace: removing the comment would strip it too.
            if row not in commented_rows and col == len(lines[row - 1]):
                slots.append((row, col, "trail"))
            line_start = True
        elif tok.type not in skip and line_start:
            if tok.start[0] > 1:
                slots.append((tok.start[0], tok.start[1], "line"))
            line_start = False
    return slots


def inject_comments(src: str, rng: random.Random, pool: tuple[str, ...], count: int) -> str:
    """`src` with `count` comments from `pool` added (comment-only lines and trailing
    comments); remove_comments() of the result equals remove_comments(src), else
    ValueError."""
    slots = comment_slots(src)
    if not pool or not slots:
        raise ValueError("nowhere to put a comment")
    lines = src.split("\n")
    chosen = rng.sample(slots, min(count, len(slots)))
    # Bottom-up, and a row's trailing comment before a line inserted above that row.
    for row, col, where in sorted(chosen, key=lambda s: (s[0], s[2] == "trail"), reverse=True):
        text = "# " + rng.choice(pool)
        line = lines[row - 1]
        if where == "trail":
            lines[row - 1] = line + "  " + text
        else:
            lines.insert(row - 1, _indent(line) + text)
    result = "\n".join(lines)
    if remove_comments(result) != remove_comments(src) or not same_ast(result, src):
        raise ValueError("comment injection changed the code")
    return result


# ---------------------------------------------------------------- edit: docstring


def _check_docstring_text(text: str) -> None:
    if not text or text != text.strip() or '"' in text or "\\" in text or "\n" in text:
        raise ValueError(f"unusable one-line docstring {text!r}")


def set_docstring(src: str, text: str) -> str:
    """Give the function the one-line docstring `text`: replace the existing docstring,
    or insert one right after the def header."""
    _check_docstring_text(text)
    fn = parse_function(src)
    _require_body_on_own_line(src, fn)
    lines = src.split("\n")
    new_line = f'{_indent(lines[fn.body[0].lineno - 1])}"""{text}"""'
    doc = _docstring_node(fn)
    if doc is not None:
        _require_whole_lines(lines, doc)
        lines[doc.lineno - 1 : doc.end_lineno] = [new_line]
    else:
        lines.insert(signature_end_row(src), new_line)
    return "\n".join(lines)


def strip_docstring(src: str) -> str:
    """Remove the docstring and the blank lines right after it."""
    fn = parse_function(src)
    doc = _docstring_node(fn)
    if doc is None or len(fn.body) < 2:
        raise ValueError("no docstring, or nothing but a docstring")
    _require_body_on_own_line(src, fn)
    lines = src.split("\n")
    _require_whole_lines(lines, doc)
    end = doc.end_lineno
    while end < len(lines) and not lines[end].strip():
        end += 1
    del lines[doc.lineno - 1 : end]
    return "\n".join(lines)


def docstring_summary(src: str) -> str | None:
    """The first line of the docstring when it is a clean one-sentence summary."""
    doc = ast.get_docstring(parse_function(src))
    if not doc:
        return None
    first = doc.strip().split("\n")[0].strip()
    try:
        _check_docstring_text(first)
    except ValueError:
        return None
    return first if 10 <= len(first) <= 100 and first.endswith(".") else None


def humanize_name(qualname: str) -> str:
    """'Parser._read_header_line' -> 'Read header line.'"""
    name = qualname.rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        return f"Implement {name}."
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name.strip("_")).replace("_", " ")
    words = spaced.lower().split()
    if not words:
        return "Helper function."
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:] + "."


# ---------------------------------------------------------------- edit: reorder_args


def _positional_params(fn: ast.AST) -> list[tuple[ast.arg, ast.AST | None, str]]:
    """(arg, default or None, group) for positional-only and positional parameters."""
    args = fn.args
    params = args.posonlyargs + args.args
    first_default = len(params) - len(args.defaults)
    return [
        (
            param,
            args.defaults[i - first_default] if i >= first_default else None,
            "posonly" if i < len(args.posonlyargs) else "positional",
        )
        for i, param in enumerate(params)
    ]


def swappable_pairs(src: str) -> list[tuple[str, str]]:
    """Pairs whose swap keeps the signature valid: same group, both with or both
    without a default; a method's self/cls stays first."""
    params = [p for p in _positional_params(parse_function(src)) if p[0].arg not in ("self", "cls")]
    return [
        (a[0].arg, b[0].arg)
        for i, a in enumerate(params)
        for b in params[i + 1 :]
        if a[2] == b[2] and (a[1] is None) == (b[1] is None)
    ]


def swap_parameters(src: str, first: str, second: str) -> str:
    """Swap two positional parameters (with annotation and default) in the signature only."""
    fn = parse_function(src)
    lines = src.split("\n")
    spans = {}
    for param, default, _group in _positional_params(fn):
        end = default if default is not None else param
        spans[param.arg] = (
            _offset(lines, param.lineno, param.col_offset),
            _offset(lines, end.end_lineno, end.end_col_offset),
        )
    if (first, second) not in swappable_pairs(src) and (second, first) not in swappable_pairs(src):
        raise ValueError(f"cannot swap {first!r} and {second!r}")
    (s1, e1), (s2, e2) = sorted([spans[first], spans[second]])
    result = src[:s1] + src[s2:e2] + src[e1:s2] + src[s1:e1] + src[e2:]
    _check_swap(fn, parse_function(result), first, second)
    return result


def _check_swap(before: ast.AST, after: ast.AST, first: str, second: str) -> None:
    """A parenthesized default, say, would be cut in the wrong place: catch it here."""
    names = [p[0].arg for p in _positional_params(before)]
    i, j = names.index(first), names.index(second)
    names[i], names[j] = names[j], names[i]
    if [p[0].arg for p in _positional_params(after)] != names:
        raise ValueError("swap did not produce the expected parameter order")
    if [ast.dump(s) for s in before.body] != [ast.dump(s) for s in after.body]:
        raise ValueError("swap touched the body")


# ---------------------------------------------------------------- free-form: write_function


def function_header(src: str) -> str:
    """The def header, plus the docstring when there is one."""
    fn = parse_function(src)
    _require_body_on_own_line(src, fn)
    lines = src.split("\n")
    doc = _docstring_node(fn)
    end_row = doc.end_lineno if doc is not None else signature_end_row(src)
    return "\n".join(lines[:end_row])


# ---------------------------------------------------------------- tasks


def fenced(src: str) -> str:
    return f"```python\n{src}\n```"


def _task(
    fn: Function, kind: str, instruction: str, shown: str, answer: str, variant: int = 0
) -> Task:
    user = f"{instruction}\n\n{fenced(shown)}"
    return Task(kind, fn.name, fn.path, user, answer, variant=variant)


def _variant_rng(fn: Function, kind: str, variant: int) -> random.Random:
    return function_rng(fn.name, kind if variant == 0 else f"{kind}#{variant}")


@dataclass(frozen=True)
class Pools:
    """Text harvested from the training functions for augmented training variants: local
    and parameter names, comment texts, one-line docstring summaries (sorted, distinct)."""

    names: tuple[str, ...] = ()
    comments: tuple[str, ...] = ()
    summaries: tuple[str, ...] = ()


def rename_task(fn: Function, variant: int = 0, names: tuple[str, ...] = ()) -> Task | None:
    candidates = rename_candidates(fn.source)
    if not candidates:
        return None
    rng = _variant_rng(fn, "rename", variant)
    old, role = rng.choice(candidates)
    new = pick_new_name(rng, fn.source, names)
    instruction = f"Rename the {role} `{old}` to `{new}` everywhere in this function."
    answer = rename_identifier(fn.source, old, new)
    return _task(fn, "rename", instruction, fn.source, answer, variant)


def remove_comments_task(
    fn: Function, variant: int = 0, comments: tuple[str, ...] = ()
) -> Task | None:
    """With a `comments` pool, 1-4 comments are added first: every function can then be
    a remove_comments task, not only the ~20% that have comments."""
    shown = fn.source
    if comments:
        rng = _variant_rng(fn, "remove_comments", variant)
        try:
            shown = inject_comments(fn.source, rng, comments, rng.randint(1, 4))
        except (ValueError, SyntaxError, tokenize.TokenError):
            pass
    answer = remove_comments(shown)
    if answer == shown or not same_ast(answer, shown):
        return None
    instruction = (
        "Remove all `#` comments from this function. Keep everything else, "
        "including docstrings and strings, exactly as it is."
    )
    return _task(fn, "remove_comments", instruction, shown, answer, variant)


def docstring_task(fn: Function, variant: int = 0, summaries: tuple[str, ...] = ()) -> Task | None:
    """The real summary line put back, or a summary made from the name; with a pool of
    `summaries`, 40% of the time another function's summary line instead."""
    rng = _variant_rng(fn, "docstring", variant)
    summary = docstring_summary(fn.source)
    if summaries and rng.random() < 0.4:
        shown, text = fn.source, rng.choice(summaries)
    elif summary is not None and rng.random() < 0.5:
        # Add back the real summary line to the function stripped of its docstring.
        shown, text = strip_docstring(fn.source), summary
    else:
        shown, text = fn.source, humanize_name(fn.qualname)
    answer = set_docstring(shown, text)
    if answer == shown or ast.get_docstring(parse_function(answer)) != text:
        return None
    if _docstring_node(parse_function(shown)) is not None:
        instruction = f'Replace the docstring of this function with the one-line docstring "{text}"'
    else:
        instruction = f'Add the one-line docstring "{text}" to this function.'
    return _task(fn, "docstring", instruction, shown, answer, variant)


def reorder_args_task(fn: Function, variant: int = 0) -> Task | None:
    pairs = swappable_pairs(fn.source)
    if not pairs:
        return None
    first, second = _variant_rng(fn, "reorder_args", variant).choice(pairs)
    instruction = (
        f"Swap the parameters `{first}` and `{second}` in the signature of this function. "
        "Change only the signature; leave the body and any call sites unchanged."
    )
    answer = swap_parameters(fn.source, first, second)
    return _task(fn, "reorder_args", instruction, fn.source, answer, variant)


def write_function_task(fn: Function, variant: int = 0) -> Task | None:
    header = function_header(fn.source)
    if header == fn.source:
        return None
    return _task(fn, "write_function", write_function_instruction(fn), header, fn.source)


def write_function_instruction(fn: Function) -> str:
    what = "method" if "." in fn.qualname else "function"
    return (
        f"Write the {what} `{fn.qualname}` of the Python standard library module "
        f"`{fn.module}`. It begins like this:"
    )


def augmented_task(kind: str, fn: Function, variant: int, pools: Pools) -> Task | None:
    """Training variant `variant` (>= 1) of an edit kind: the function with 20-60% of its
    identifiers respelled, then the kind's task with choices drawn from the pools."""
    rng = _variant_rng(fn, f"{kind}+respell", variant)
    respelled = respell_identifiers(fn.source, rng, pools.names, rng.uniform(0.2, 0.6))
    shown = replace(fn, source=respelled)
    if kind == "rename":
        return rename_task(shown, variant, pools.names)
    if kind == "remove_comments":
        return remove_comments_task(shown, variant, pools.comments)
    if kind == "docstring":
        return docstring_task(shown, variant, pools.summaries)
    if kind == "reorder_args":
        return reorder_args_task(shown, variant)
    raise ValueError(f"no augmented variants for {kind!r}")


TASK_BUILDERS = {
    "rename": rename_task,
    "remove_comments": remove_comments_task,
    "docstring": docstring_task,
    "reorder_args": reorder_args_task,
    "write_function": write_function_task,
}


# Kinds whose task depends on a random choice (which name, which text, which pair), so
# further variants add new training examples rather than duplicates.
VARIED_KINDS = frozenset({"rename", "docstring", "reorder_args"})


def make_tasks(
    fn: Function, variants: int = 1, pools: Pools | None = None, write_function: bool = True
) -> list[Task]:
    """Every task kind that applies to `fn`, in KINDS order, with up to `variants`
    distinct tasks per kind; deterministic. Variant 0 of each kind is the canonical task
    (pools or not). Without `pools`, further variants exist for the randomized kinds only
    (other choices on the same text); with `pools`, every edit kind gets augmented
    variants (see augmented_task). `write_function=False` leaves the free-form task out."""
    tasks, seen_users = [], set()
    for kind in KINDS:
        if kind == "write_function" and not write_function:
            continue
        varied = kind in (VARIED_KINDS if pools is None else EDIT_KINDS)
        for variant in range(variants if varied else 1):
            try:
                if variant and pools is not None:
                    task = augmented_task(kind, fn, variant, pools)
                else:
                    task = TASK_BUILDERS[kind](fn, variant)
            except (ValueError, SyntaxError, tokenize.TokenError):
                continue
            if task is not None and task.user not in seen_users:
                seen_users.add(task.user)
                tasks.append(task)
    return tasks


def keeps_write_function(fn: Function, percent: int) -> bool:
    """Whether `fn` keeps its write_function task when only `percent`% of functions do."""
    return stable_hash(f"{fn.name}|write_function") % 100 < percent


def _tasks_of(fn: Function, variants: int, pools: Pools | None, write_percent: int) -> list[Task]:
    return make_tasks(fn, variants, pools, keeps_write_function(fn, write_percent))


# ---------------------------------------------------------------- extraction


def module_name(rel_path: str) -> str:
    parts = rel_path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _function_source(lines: list[str], node: ast.AST) -> str | None:
    chunk = lines[node.lineno - 1 : node.end_lineno]
    last = chunk[-1]
    if last[_char_col(last, node.end_col_offset) :].strip():
        return None  # something follows the function on its last line
    text = textwrap.dedent("\n".join(chunk)).rstrip()
    # Tabs and form feeds break column arithmetic; a ``` would end the prompt's fence.
    if "\t" in text or "\f" in text or "```" in text:
        return None
    if not text.startswith(("def ", "async def ")):
        return None
    return text


def _size_ok(text: str) -> bool:
    return MIN_LINES <= text.count("\n") + 1 <= MAX_LINES and len(text) <= MAX_CHARS


def extract_functions(source: str, rel_path: str) -> list[Function]:
    """Top-level functions and methods of top-level classes, of reasonable size."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    named = []
    for node in tree.body:
        if isinstance(node, FUNCTION_NODES):
            named.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            named += [
                (f"{node.name}.{s.name}", s) for s in node.body if isinstance(s, FUNCTION_NODES)
            ]
    lines = source.split("\n")
    module = module_name(rel_path)
    found = []
    for qualname, node in named:
        text = _function_source(lines, node)
        if text is None or not _size_ok(text):
            continue
        try:
            parse_function(text)
        except (SyntaxError, ValueError):
            continue
        found.append(Function(rel_path, module, qualname, text))
    return found


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the stdlib's .py files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        for filename in filenames:
            if filename.endswith(".py"):
                found.append(filename if rel_dir == "." else f"{rel_dir}/{filename}")
    return sorted(found)


def _functions_in_file(args: tuple[str, str]) -> list[Function]:
    root, rel_path = args
    try:
        source = (Path(root) / rel_path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    return extract_functions(source, rel_path)


def _default_signals() -> None:
    """Workers must die on SIGTERM even when the parent handles it (Pool.terminate)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _pool_map(func, items: list, processes: int | None) -> list:
    processes = min(processes or os.cpu_count() or 1, max(1, len(items)))
    if processes <= 1:
        return [func(item) for item in items]
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_default_signals)
    try:
        result = pool.map(func, items, chunksize=max(1, len(items) // (processes * 8)))
        pool.close()  # let workers exit on their own rather than be killed mid-lock
        return result
    finally:
        pool.terminate()
        pool.join()


def collect_functions(root: Path | None = None, processes: int | None = None) -> list[Function]:
    root = Path(root or stdlib_root())
    per_file = _pool_map(
        _functions_in_file, [(str(root), p) for p in stdlib_files(root)], processes
    )
    return [fn for fns in per_file for fn in fns]


def split_functions(functions: list[Function]) -> tuple[list[Function], list[Function]]:
    """(train, held_out) by module; a held-out function whose exact source also occurs in a
    training module is dropped, so held-out scores measure generalization."""
    train = [f for f in functions if not is_held_out(f.path)]
    train_sources = {f.source for f in train}
    held = [f for f in functions if is_held_out(f.path) and f.source not in train_sources]
    return train, held


def build_tasks(
    functions: list[Function],
    variants: int = 1,
    processes: int | None = None,
    pools: Pools | None = None,
    write_function_percent: int = 100,
) -> list[Task]:
    build = partial(_tasks_of, variants=variants, pools=pools, write_percent=write_function_percent)
    per_function = _pool_map(build, functions, processes)
    return [t for ts in per_function for t in ts]


def _harvest(fn: Function) -> tuple[list[str], list[str], str | None]:
    """(names, comment texts, docstring summary) of one function."""
    try:
        tree = parse_function(fn.source)
        comments = [
            tok.string[1:].strip()
            for tok in _tokens(fn.source)
            if tok.type == tokenize.COMMENT
        ]
        summary = docstring_summary(fn.source)
    except (ValueError, SyntaxError, tokenize.TokenError):
        return [], [], None
    args = tree.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [
        n.id
        for n in _walk_own_scope(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    ]
    # Local-looking names only (no CONSTANTS, no dunders).
    names = [
        n
        for n in names
        if 2 <= len(n) <= 24
        and (n[0].islower() or (n[0] == "_" and n[1:2].islower()))
        and not n.startswith("__")
        and n not in ("self", "cls")
    ]
    comments = [
        c
        for c in comments
        if 4 <= len(c) <= 60 and c.isprintable() and "```" not in c and c[0] not in "#!"
    ]
    return names, comments, summary


def harvest_pools(functions: list[Function], processes: int | None = None) -> Pools:
    """Pools for augmented variants, from (training) functions only."""
    names, comments, summaries = set(), set(), set()
    for fn_names, fn_comments, summary in _pool_map(_harvest, functions, processes):
        names.update(fn_names)
        comments.update(fn_comments)
        if summary:
            summaries.add(summary)
    return Pools(tuple(sorted(names)), tuple(sorted(comments)), tuple(sorted(summaries)))


# ---------------------------------------------------------------- system prompts


def _long_system_examples() -> list[tuple[str, str]]:
    """Few-shot (request, reply) pairs on literal functions, so the long system prompt is
    the same text on every Python version."""
    area = Function(
        "shapes.py",
        "shapes",
        "area",
        "def area(width, height, scale=1):\n"
        "    # both sides are scaled\n"
        "    w = width * scale\n"
        "    h = height * scale  # same factor\n"
        "    return w * h",
    )
    merge = Function(
        "config.py",
        "config",
        "Config.merge",
        "def merge(self, other, overwrite=False):\n"
        '    """Merge other into self and return self."""\n'
        "    for key, value in other.items():\n"
        "        if overwrite or key not in self.data:\n"
        "            self.data[key] = value  # keep the newest\n"
        "    return self",
    )
    parse = Function(
        "records.py",
        "records",
        "parse_line",
        "def parse_line(line, sep=',', strip=True):\n"
        "    fields = line.split(sep)\n"
        "    if strip:\n"
        "        fields = [f.strip() for f in fields]\n"
        "    # '#' starts a comment only outside quotes\n"
        "    return [f for f in fields if f and not f.startswith('#')]",
    )
    tasks = [
        rename_task(area),
        remove_comments_task(merge),
        docstring_task(parse),
        reorder_args_task(parse),
        rename_task(merge, variant=1),
        remove_comments_task(area),
    ]
    return [(t.user, t.answer) for t in tasks if t is not None]


STYLE_GUIDE = """\
You are a precise Python refactoring assistant working on a large, old code base. \
Every request names one change to one function. Apply exactly that change and reply \
with the complete resulting function, nothing before it and nothing after it: no \
explanations, no Markdown fences, no notes about what changed.

House rules:
1. Preserve everything the request does not mention: indentation (four spaces), blank \
lines, quoting style, line breaks inside long expressions, trailing commas and the order \
of statements. A reviewer compares your reply with the original line by line, so an \
unrequested change counts as a mistake even when it is an improvement.
2. Renames are scoped: rename the named local variable or parameter wherever it is used \
in the function, including nested functions, lambdas and comprehensions that read it. Do \
not rename attributes with the same spelling (`obj.name`), keyword argument names in \
calls (`f(name=...)`), or words inside strings and comments.
3. Removing comments removes every `#` comment. A line that held only a comment \
disappears; code before a trailing comment stays, without the spaces that preceded the \
`#`. Docstrings are not comments and stay. A `#` inside a string literal is not a \
comment either.
4. Docstrings are one line, in triple double quotes, placed as the first statement of \
the body with the body's indentation. When a docstring already exists, it is replaced \
as a whole, even when it spans several lines.
5. Swapping parameters changes the signature only. Each parameter keeps its own \
annotation and default value. The body and every call site stay as they are.
6. Writing a function from its header means: keep the given header and docstring \
verbatim and write a body in the style of the Python standard library.

Worked examples follow. Each shows a request and the exact reply expected.
"""


def long_system_prompt() -> str:
    """A long shared system prompt (a style guide plus few-shot examples), ~1.5k tokens."""
    parts = [STYLE_GUIDE]
    for n, (request, reply) in enumerate(_long_system_examples(), 1):
        parts.append(f"### Example {n}\nRequest:\n{request}\n\nReply:\n{reply}\n")
    return "\n".join(parts).rstrip()


def assign_training_systems(
    tasks: list[Task], long_percent: int = 4, none_percent: int = 4
) -> list[Task]:
    """Most training tasks use SYSTEM; a few use the long prompt (so long-system jobs work)
    or none at all (so jobs without a header still get answers)."""
    long_system = long_system_prompt()
    assigned = []
    for task in tasks:
        roll = stable_hash(f"{task.function}|{task.kind}|system") % 100
        if roll < long_percent:
            task = replace(task, system=long_system)
        elif roll < long_percent + none_percent:
            task = replace(task, system="")
        assigned.append(task)
    return assigned
