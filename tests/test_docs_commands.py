"""Every ``gpuloom COMMAND ...`` line the docs, the scripts and the examples show uses flags that
command has, and names example files that exist: a flag renamed in code and left in the docs is
what a user copies first (defaults written twice drifted twice in the forty-eighth session)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gpuloom.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["README.md", "docs/*.md", "docs/reports/*.md", "scripts/*.sh", "examples/**/*.yaml"]
_COMMAND = re.compile(r"(?:^|[\s`(])(?:\.venv/bin/)?gpuloom\s+(" + "|".join(COMMANDS) + r")\b([^`\n]*)")


def _options() -> dict[str, set[str]]:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for act in sp._actions for o in act.option_strings} for name, sp in subs.choices.items()}


def _command_lines() -> list[tuple[str, int, str, str]]:
    """(file, line, command, the rest of the line) for every gpuloom command written out."""
    found = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            text = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuations joined
            for i, line in enumerate(text.splitlines(), 1):
                for m in _COMMAND.finditer(line):
                    found.append((str(path.relative_to(ROOT)), i, m.group(1), m.group(2).split(" # ")[0]))
    return found


def test_every_documented_command_line_uses_flags_its_command_has():
    options = _options()
    lines = _command_lines()
    assert len(lines) > 100  # the README, reports and scripts name gpuloom commands
    wrong = [(f, i, cmd, flag) for f, i, cmd, rest in lines
             for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest) if flag not in options[cmd]]
    assert not wrong, wrong


def test_every_example_file_a_documented_command_names_exists():
    missing = [(f, i, p) for f, i, _, rest in _command_lines()
               for p in re.findall(r"(?<![\w/.])(examples/[\w./-]+\.(?:yaml|json))", rest) if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_documented_policy_spelling_names_a_policy_and_options_it_takes():
    """``--policy dstack:batch_overhead_ms=1.125,triton`` as the docs write it: each name registered,
    each option one its constructor takes (built, except options naming a JSON file the docs only
    show by name), and none of the service's keys under ``gpuloom serve``, which refuses them."""
    import inspect

    from gpuloom.bench.variants import parse_policy_spec
    from gpuloom.policy import make_policy

    specs = [(f, i, cmd, spec) for f, i, cmd, rest in _command_lines()
             for m in re.finditer(r"--policy[ =]([^\s`\"']+)", rest) for spec in m.group(1).split(",")
             if spec and "$" not in spec]
    assert len(specs) > 10
    wrong = []
    for f, i, cmd, spec in specs:
        try:
            name, options, service = parse_policy_spec(spec)
            files = {k for k, v in options.items() if isinstance(v, str) and v.endswith(".json")}
            cls = type(make_policy(name, **{k: v for k, v in options.items() if k not in files}))
            if not files <= set(inspect.signature(cls).parameters):
                raise ValueError(f"no option {sorted(files)}")
            if cmd == "serve" and service:
                raise ValueError(f"gpuloom serve refuses the service's keys {sorted(service)} in --policy")
        except (ValueError, TypeError) as e:
            wrong.append((f, i, spec, str(e)[:120]))
    assert not wrong, wrong


def test_every_documented_engine_option_parses():
    """``gpuloom bench --engine fuse_epilogues=false`` as the docs write it: keys and values the
    repository takes (``parse_engine_options``)."""
    from gpuloom.engine.options import parse_engine_options

    specs = [(f, i, m.group(1)) for f, i, cmd, rest in _command_lines()
             for m in re.finditer(r"--engine[ =]([^\s`\"'|]+)", rest) if "$" not in m.group(1)]
    assert specs
    wrong = []
    for f, i, spec in specs:
        try:
            parse_engine_options(spec)
        except ValueError as e:
            wrong.append((f, i, spec, str(e)[:120]))
    assert not wrong, wrong
