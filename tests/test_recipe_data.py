"""The recipe's pure task builders, on literal inputs with exact expected outputs."""

from __future__ import annotations

import pytest

from recipe import data
from recipe.tokenizer import CHATML_TEMPLATE, render_chat

SCALE = '''\
def scale(value, factor=2):
    """Scale value by factor."""
    result = value * factor  # value times factor
    obj.value = result
    print("value", f(value=result))
    return [value for _ in range(1)]'''


# ---------------------------------------------------------------- rename


def test_rename_leaves_strings_comments_attributes_and_keywords():
    expected = '''\
def scale(amount, factor=2):
    """Scale value by factor."""
    result = amount * factor  # value times factor
    obj.value = result
    print("value", f(value=result))
    return [amount for _ in range(1)]'''
    assert data.rename_identifier(SCALE, "value", "amount") == expected


def test_rename_reaches_nested_functions_and_lambdas():
    src = "def outer(n):\n    def inner():\n        return n + 1\n    g = lambda n: n\n    return inner() + g(n)"
    expected = "def outer(k):\n    def inner():\n        return k + 1\n    g = lambda k: k\n    return inner() + g(k)"
    assert data.rename_identifier(src, "n", "k") == expected


def test_rename_handles_non_ascii_columns():
    src = 'def f(x):\n    s = "é" + x\n    return s'
    assert (
        data.rename_identifier(src, "s", "text") == 'def f(x):\n    text = "é" + x\n    return text'
    )


@pytest.mark.parametrize(
    "src, old, new",
    [
        ("def f(x):\n    y = x\n    return y", "x", "y"),  # new name already used
        ("def f(x):\n    return f'{x}'", "x", "z"),  # inside an f-string
        ("def f(x, y=x):\n    return y", "x", "z"),  # default refers to the outer x
        ("def f(x):\n    global g\n    g = x\n    return g", "g", "z"),
        ("def f(x):\n    return x", "x", "class"),  # keyword
        ("def f(x):\n    return x", "missing", "z"),
    ],
)
def test_rename_refuses_unsafe_renames(src, old, new):
    with pytest.raises(ValueError):
        data.rename_identifier(src, old, new)


def test_rename_candidates_in_source_order_without_self():
    src = "def m(self, a, *rest, key=None):\n    total = a\n    for item in rest:\n        total += item\n    return total"
    assert data.rename_candidates(src) == [
        ("a", "parameter"),
        ("key", "parameter"),
        ("rest", "parameter"),
        ("total", "local variable"),
        ("item", "local variable"),
    ]


def test_no_rename_candidates_when_locals_are_introspected():
    assert data.rename_candidates("def f(x):\n    y = 1\n    return locals()") == []


# ---------------------------------------------------------------- remove_comments


def test_remove_comments_keeps_hash_inside_strings():
    src = (
        "def f(x):\n"
        "    # leading comment\n"
        '    s = "# not a comment"  # trailing\n'
        "    t = '''\n"
        "    # inside a string\n"
        "    '''\n"
        "    return s + t  # done"
    )
    expected = (
        "def f(x):\n"
        '    s = "# not a comment"\n'
        "    t = '''\n"
        "    # inside a string\n"
        "    '''\n"
        "    return s + t"
    )
    assert data.remove_comments(src) == expected


def test_remove_comments_without_comments_is_identity():
    assert data.remove_comments("def f():\n    return '#'") == "def f():\n    return '#'"


# ---------------------------------------------------------------- docstring


def test_set_docstring_adds_after_the_header():
    src = "def add(a,\n        b):\n    return a + b"
    expected = 'def add(a,\n        b):\n    """Add two numbers."""\n    return a + b'
    assert data.set_docstring(src, "Add two numbers.") == expected


def test_set_docstring_replaces_a_multiline_docstring():
    src = 'def add(a, b):\n    """Add.\n\n    Long text.\n    """\n    return a + b'
    assert (
        data.set_docstring(src, "Sum a and b.")
        == 'def add(a, b):\n    """Sum a and b."""\n    return a + b'
    )


def test_set_docstring_rejects_quotes_and_one_line_bodies():
    with pytest.raises(ValueError):
        data.set_docstring("def f():\n    return 1", 'Say "hi".')
    with pytest.raises(ValueError):
        data.set_docstring("def f(): return 1", "Return one.")


def test_strip_docstring_and_summary():
    src = 'def add(a, b):\n    """Return the sum of a and b.\n\n    More.\n    """\n\n    return a + b'
    assert data.strip_docstring(src) == "def add(a, b):\n    return a + b"
    assert data.docstring_summary(src) == "Return the sum of a and b."
    assert data.docstring_summary("def f():\n    'x'\n    return 1") is None


def test_humanize_name():
    assert data.humanize_name("Parser._read_headerLine") == "Read header line."
    assert data.humanize_name("Thing.__repr__") == "Implement __repr__."


# ---------------------------------------------------------------- reorder_args


def test_swap_parameters_moves_annotation_and_default():
    src = "def f(self, a, b=1, c: int = 2, *args, d=3):\n    return a + b + c + d"
    assert data.swappable_pairs(src) == [("b", "c")]
    expected = "def f(self, a, c: int = 2, b=1, *args, d=3):\n    return a + b + c + d"
    assert data.swap_parameters(src, "b", "c") == expected
    assert data.swap_parameters(src, "c", "b") == expected


def test_swap_parameters_across_lines():
    src = "def f(first,\n      second):\n    return first - second"
    assert (
        data.swap_parameters(src, "first", "second")
        == "def f(second,\n      first):\n    return first - second"
    )


def test_swap_parameters_refuses_default_order_violation():
    with pytest.raises(ValueError):
        data.swap_parameters("def f(a, b=1):\n    return a", "a", "b")


# ---------------------------------------------------------------- write_function, extraction


def test_function_header_with_and_without_docstring():
    with_doc = 'def f(\n    x,\n):\n    """Doc."""\n    return x'
    assert data.function_header(with_doc) == 'def f(\n    x,\n):\n    """Doc."""'
    assert data.function_header("def g(y) -> int:\n    return y") == "def g(y) -> int:"


MODULE = """\
import os


def top(a, b):
    c = a + b
    return c


def tiny():
    return 1


class Box:
    def put(self, item):
        self.items.append(item)
        return self

    @property
    def size(self):
        n = len(self.items)
        return n
"""


def test_extract_functions_top_level_and_methods_dedented():
    found = data.extract_functions(MODULE, "pkg/boxes.py")
    assert [(f.module, f.qualname) for f in found] == [
        ("pkg.boxes", "top"),
        ("pkg.boxes", "Box.put"),
        ("pkg.boxes", "Box.size"),
    ]
    assert found[1].source == "def put(self, item):\n    self.items.append(item)\n    return self"
    assert found[1].name == "pkg.boxes:Box.put"
    assert data.extract_functions("def broken(:\n", "x.py") == []


def test_module_name():
    assert data.module_name("json/__init__.py") == "json"
    assert data.module_name("email/mime/text.py") == "email.mime.text"


# ---------------------------------------------------------------- split, determinism


def test_split_is_a_pinned_stable_hash():
    # Pinned: changing the hash would silently move modules between train and held-out.
    assert data.stable_hash("json/decoder.py") == 0xBC8C91CEC2B5901A
    held = ["heapq.py", "glob.py", "uuid.py", "http/client.py"]
    kept = ["json/decoder.py", "ast.py", "csv.py", "argparse.py"]
    assert [data.is_held_out(p) for p in held + kept] == [True] * 4 + [False] * 4


def test_split_holds_out_about_eight_percent():
    held = sum(data.is_held_out(f"pkg{i}/mod.py") for i in range(5000))
    assert 0.06 <= held / 5000 <= 0.10


def test_split_functions_drops_held_out_copies_of_training_code():
    train_path = next(f"m{i}.py" for i in range(100) if not data.is_held_out(f"m{i}.py"))
    held_path = next(f"m{i}.py" for i in range(100) if data.is_held_out(f"m{i}.py"))
    shared = "def f(x):\n    y = x\n    return y"
    fns = [
        data.Function(train_path, "a", "f", shared),
        data.Function(held_path, "b", "f", shared),
        data.Function(held_path, "b", "g", shared.replace("f(", "g(")),
    ]
    train, held = data.split_functions(fns)
    assert [f.path for f in train] == [train_path]
    assert [f.qualname for f in held] == ["g"]


def test_function_rng_is_deterministic():
    assert (
        data.function_rng("json:loads", "rename").random()
        == data.function_rng("json:loads", "rename").random()
    )
    assert (
        data.function_rng("json:loads", "rename").random()
        != data.function_rng("json:dumps", "rename").random()
    )


FUNCTION = data.Function(
    "shapes.py",
    "shapes",
    "area",
    "def area(width, height, scale=1):\n"
    '    """Return the scaled area."""\n'
    "    w = width * scale  # scaled\n"
    "    return w * height",
)


def test_make_tasks_is_deterministic_and_exact():
    tasks = data.make_tasks(FUNCTION, variants=3)
    assert tasks == data.make_tasks(FUNCTION, variants=3)
    kinds = [t.kind for t in tasks]
    assert set(kinds) == set(data.KINDS)
    assert len({t.user for t in tasks}) == len(tasks)
    by_kind = {t.kind: t for t in reversed(tasks)}  # first task of each kind
    assert by_kind["remove_comments"].answer == (
        'def area(width, height, scale=1):\n    """Return the scaled area."""\n'
        "    w = width * scale\n    return w * height"
    )
    assert by_kind["reorder_args"].answer.startswith("def area(height, width, scale=1):\n")
    assert by_kind["write_function"].answer == FUNCTION.source
    assert by_kind["write_function"].user.endswith(
        '```python\ndef area(width, height, scale=1):\n    """Return the scaled area."""\n```'
    )
    for task in tasks:
        assert task.function == "shapes:area" and task.system == data.SYSTEM
        assert task.user.endswith("\n```") and "```python\n" in task.user


def test_rename_task_answer_matches_its_instruction():
    task = data.rename_task(FUNCTION)
    old, new = task.user.split("`")[1], task.user.split("`")[3]
    assert task.answer == data.rename_identifier(FUNCTION.source, old, new)
    assert new not in FUNCTION.source


def test_long_system_prompt_is_fixed_text_with_examples():
    prompt = data.long_system_prompt()
    assert prompt == data.long_system_prompt()
    assert prompt.startswith(data.STYLE_GUIDE[:60])
    assert prompt.count("### Example") == 6
    assert 4000 <= len(prompt) <= 8000


def test_assign_training_systems_mixes_deterministically():
    tasks = [data.Task("rename", f"m:f{i}", "m.py", "u", "a") for i in range(2000)]
    assigned = data.assign_training_systems(tasks)
    assert assigned == data.assign_training_systems(tasks)
    systems = [t.system for t in assigned]
    assert 0.02 <= systems.count(data.long_system_prompt()) / 2000 <= 0.06
    assert 0.02 <= systems.count("") / 2000 <= 0.06
    assert assigned[0].messages()[-1] == {"role": "user", "content": "u"}


def test_render_chat_matches_the_jinja_template():
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U\nV"}]
    expected = jinja2.Template(CHATML_TEMPLATE).render(
        messages=messages, add_generation_prompt=True
    )
    assert render_chat(messages) == expected
    assert expected.endswith("<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------- augmented training variants

COMMENTED = (
    "def f(x, y=1):\n"
    "    total = x + y  # sum\n"
    "    s = '# kept'\n"
    "    for item in range(total):\n"
    "        total += item\n"
    "    return total, s"
)
POOLS = data.Pools(
    names=("alpha", "beta_count", "gamma"),
    comments=("check the bounds", "see issue 42", "fast path"),
    summaries=("Return the first entry.", "Compute the checksum of a block."),
)


def test_comment_slots_are_statement_starts_and_uncommented_line_ends():
    slots = data.comment_slots(COMMENTED)
    lines = {(row, where) for row, _col, where in slots}
    # Statements start on rows 2-6; row 1 is the def line (no line before it).
    assert {row for row, where in lines if where == "line"} == {2, 3, 4, 5, 6}
    # Every logical line ends in a slot, except row 2, which has a comment already.
    assert {row for row, where in lines if where == "trail"} == {1, 3, 4, 5, 6}
    assert (3, len("    s = '# kept'"), "trail") in slots


def test_inject_comments_only_adds_comments():
    for seed in range(20):
        rng = __import__("random").Random(seed)
        shown = data.inject_comments(COMMENTED, rng, POOLS.comments, 3)
        assert shown != COMMENTED
        assert data.remove_comments(shown) == data.remove_comments(COMMENTED)
        assert data.same_ast(shown, COMMENTED)
        assert shown.count("#") >= COMMENTED.count("#") + 1


def test_inject_comments_places_lines_and_trailing_comments_exactly():
    import random

    class Fixed(random.Random):  # slot order and comment choice made explicit
        def sample(self, population, k):
            return [(2, 0, "line"), (3, len("    s = '# kept'"), "trail")]

        def choice(self, seq):
            return seq[0]

    shown = data.inject_comments(COMMENTED, Fixed(), ("note",), 2)
    assert shown.split("\n")[1:4] == [
        "    # note",
        "    total = x + y  # sum",
        "    s = '# kept'  # note",
    ]


def test_respell_identifiers_is_a_consistent_token_substitution():
    import random
    import tokenize

    src = (
        "def f(self, x, y=1):\n"
        "    total = len(x) + self.offset\n"
        "    print(f'{total}', key=total)\n"
        "    return helper(total, y=y) + x"
    )
    pool = tuple(f"name{i}" for i in range(50))
    for seed in range(10):
        shown = data.respell_identifiers(src, random.Random(seed), pool, 0.6)
        before, after = data._tokens(src), data._tokens(shown)
        assert [t.type for t in before] == [t.type for t in after]
        assert [t.string for t in before if t.type != tokenize.NAME] == [
            t.string for t in after if t.type != tokenize.NAME
        ]
        pairs = {(a.string, b.string) for a, b in zip(before, after) if a.type == tokenize.NAME}
        changed = {(a, b) for a, b in pairs if a != b}
        assert changed and all(b in pool for _, b in changed)
        assert len({a for a, _ in changed}) == len({b for _, b in changed}) == len(changed)
        # The def name, self, builtins and f-string names never change.
        assert not {a for a, _ in changed} & {"f", "self", "len", "print", "total", "def"}
    # Without a pool, nothing changes.
    assert data.respell_identifiers(src, random.Random(0), (), 0.6) == src


def test_augmented_variants_keep_variant_zero_and_exact_answers():
    plain = data.make_tasks(FUNCTION, variants=1)
    augmented = data.make_tasks(FUNCTION, variants=4, pools=POOLS)
    assert augmented == data.make_tasks(FUNCTION, variants=4, pools=POOLS)
    # Variant 0 of every kind is the canonical task, with or without pools.
    assert [t for t in augmented if t.variant == 0] == plain
    extra = [t for t in augmented if t.variant > 0]
    assert {t.kind for t in extra} == set(data.EDIT_KINDS)  # remove_comments too
    assert len({t.user for t in augmented}) == len(augmented)
    for task in extra:
        shown = task.user.split("```python\n", 1)[1].removesuffix("\n```")
        if task.kind == "remove_comments":
            assert task.answer == data.remove_comments(shown) != shown
        elif task.kind == "rename":
            old, new = task.user.split("`")[1], task.user.split("`")[3]
            assert task.answer == data.rename_identifier(shown, old, new)
        elif task.kind == "docstring":
            text = task.user.split('"')[1]
            assert task.answer == data.set_docstring(shown, text)
        else:
            first, second = task.user.split("`")[1], task.user.split("`")[3]
            assert task.answer == data.swap_parameters(shown, first, second)


def test_augmented_variants_use_the_pools():
    fns = [
        data.Function("m.py", "m", f"f{i}", FUNCTION.source.replace("area", f"area{i}"))
        for i in range(30)
    ]
    tasks = data.build_tasks(fns, variants=3, processes=1, pools=POOLS)
    users = "\n".join(t.user for t in tasks)
    assert any(c in users for c in POOLS.comments)
    assert any(s in users for s in POOLS.summaries)
    assert any(n in users for n in POOLS.names)


def test_write_function_percent_keeps_a_stable_share():
    fns = [data.Function("m.py", "m", f"f{i}", FUNCTION.source) for i in range(400)]
    kept = [f for f in fns if data.keeps_write_function(f, 25)]
    assert 0.18 <= len(kept) / 400 <= 0.32
    assert all(data.keeps_write_function(f, 100) for f in fns)
    tasks = data.build_tasks(fns[:40], processes=1, write_function_percent=0)
    assert tasks and "write_function" not in {t.kind for t in tasks}
    tasks = data.build_tasks(fns[:40], processes=1, write_function_percent=100)
    assert sum(t.kind == "write_function" for t in tasks) == 40


def test_harvest_pools_collects_local_names_comments_and_summaries():
    fns = [
        FUNCTION,
        data.Function("m.py", "m", "g", COMMENTED),
        data.Function("m.py", "m", "h", "def h(self, Value):\n    CONST = 1\n    return CONST"),
    ]
    pools = data.harvest_pools(fns, processes=1)
    assert pools.names == ("height", "item", "scale", "total", "width")
    assert pools.comments == ("scaled",)  # "sum" is too short to be worth reusing
    assert pools.summaries == ("Return the scaled area.",)
