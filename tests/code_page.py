"""docs/code.md, written from eval_drafter.py itself: its banners (the sections, where each starts, what it declares),
its declared records, the family classes and the verification rules. tests/test_docs.py fails when the page and
the code differ; after a change, write it again:

    python tests/code_page.py > docs/code.md
"""
import ast
import dataclasses
import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import eval_drafter as ed  # noqa: E402 - the script beside tests/

RECORDS = ("Settings", "Prompt", "Result", "Run", "Drafter")   # what crosses sections, in the order data flows


def sections(src):
    """[(title, first line, names declared there)]: a banner is a `# ----` rule, then `# Title`."""
    lines, tree = src.splitlines(), ast.parse(src)
    starts = [(1, "Preamble: imports, errors, progress and logging")]
    starts += [(i + 2, lines[i + 1][2:].strip()) for i in range(len(lines) - 1)
               if lines[i].startswith("# " + "-" * 20) and lines[i + 1].startswith("# ")]
    declared = {start: [] for start, _ in starts}
    for node in tree.body:
        names = [node.name] if isinstance(node, ast.ClassDef) else \
            [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1] \
            if isinstance(node, ast.Assign) else []
        start = max(s for s, _ in starts if s <= node.lineno)
        declared[start] += names
    return [(title, start, declared[start]) for start, title in starts]


def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def section_table(src):
    out = ["| section | line | what it declares (classes and tables) |", "|---|---|---|"]
    for title, start, names in sections(src):
        name, _, what = title.partition(": ")
        shown = ", ".join(f"`{n}`" for n in names) or "functions only"
        out.append(f"| **{name}**{': ' * bool(what)}{cell(what)} | {start} | {shown} |")
    return out


def record_table():
    out = ["| record | fields | what it is |", "|---|---|---|"]
    for name in RECORDS:
        cls = getattr(ed, name)
        count = len(dataclasses.fields(cls))
        doc = " ".join((cls.__doc__ or "").split())
        out.append(f"| `{name}` | {count} | {cell(doc)} |")
    return out


def hooks(cls):
    """The methods a family class defines itself (its own hooks, overriding its parent's)."""
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("__")] + \
        [n for n, v in vars(cls).items() if isinstance(v, (staticmethod, classmethod))]


def family_table():
    out = ["| family | class | subclass of | its own hooks | served by |", "|---|---|---|---|---|"]
    for name, fam in ed.FAMILIES.items():
        cls = type(fam)
        own = ", ".join(f"`{h}`" for h in sorted(set(hooks(cls)))) or "none: the table's fields alone"
        out.append(f"| {name} | `{cls.__name__}` | `{cls.__bases__[0].__name__}` | {own} | {cell(fam.engines)} |")
    return out


def rule_table():
    out = ["| rule | what it computes | lossy: what it costs |", "|---|---|---|"]
    for name, rule in ed.VERIFY_RULES.items():
        out.append(f"| `{name}` | {cell(rule.computes)} | {cell(rule.cost or 'lossless')} |")
    return out


def smallest_family(with_hook=False):
    """(name, source) of the family class with the fewest source lines (with_hook: of those with a hook of their own):
    the worked examples."""
    sizes = {name: inspect.getsource(type(fam)) for name, fam in ed.FAMILIES.items()
             if hooks(type(fam)) or not with_hook}
    name = min(sizes, key=lambda n: (len(sizes[n].splitlines()), n))
    return name, sizes[name]


def page():
    with open(ed.__file__, encoding="utf-8") as f:
        src = f.read()
    name, source = smallest_family()
    base = type(ed.FAMILIES[name]).__bases__[0].__name__
    hooked, hooked_source = smallest_family(with_hook=True)
    return "\n".join([
        "# Reading the code", "",
        "Written from `eval_drafter.py` by `python tests/code_page.py > docs/code.md`; tests/test_docs.py fails when "
        "this page and the code differ.", "",
        "`eval_drafter.py` reads top to bottom in the order data flows; each banner (`# ----` then `# Title`) opens a "
        "section, every name is defined under the banner that names it, above its first use, and the top docstring "
        "lists the banners (`python ../shared/book.py eval_drafter.py` checks the order).", "",
        "## Sections", "", *section_table(src), "",
        "## The records that cross sections", "",
        "Each is a dataclass with named fields; a field's comment says what it holds. `Settings` takes a field per "
        "flag from the flag table (`FLAGS`) and declares the resolved ones; its JSON (the report's `config`) is its "
        "fields. `Result`'s JSON round trip (the partial file, `--resume`, `--merge`, saved features) is a loop over "
        "its fields, each declaring its codec, so a new field is written and read back without being listed "
        "anywhere else.", "", *record_table(), "",
        "## Drafter families", "",
        "One class a family, registered with `@register(NAME)` into `FAMILIES` and subclassing its nearest relative; "
        "shared code calls the family's hooks (`family(d).hook(...)`) and never names a family. Recognition walks "
        "`FAMILIES` from the last registered to the first.", "", *family_table(), "",
        "## Verification rules", "",
        "`--verify` names rules from `VERIFY_RULES`, one `VerifyRule` each: what it computes, its acceptance given "
        "the text (or an online loop of its own), and, for a lossy rule, what it costs.", "", *rule_table(), "",
        "## Adding a family", "",
        f"A new family is one class in its section, registered and subclassing its nearest relative, overriding the "
        f"hooks where it differs. The smallest today, {name} (a `{base}`):", "",
        "```python", source.rstrip("\n"), "```", "",
        f"The smallest that overrides a hook, {hooked}:", "", "```python", hooked_source.rstrip("\n"), "```", "",
        "## Before a refactor", "",
        "`python tests/golden.py record . OUT_BEFORE` records the CLI's outputs on about twenty scenarios (stdout, "
        "stderr, JSON, partial files, saved features); after it, record again and `python tests/golden.py compare "
        "OUT_BEFORE OUT_AFTER` shows every difference (timings aside).", ""])


if __name__ == "__main__":
    sys.stdout.write(page())
