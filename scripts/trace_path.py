"""How far one `apcscore score` request is spread (issue 54's goals): run the CLI in this process on a one-record
JSONL under a profiler and print

- the stack from the CLI command function (`cli.score`) down to `Engine.run`, and down to the attention backend's
  `forward` (the first one called), one line per frame;
- the project's own classes met on the way: every class defined under apcscore/ one of whose methods ran with an
  instance (or the class) as its first argument (`self`, `cls`): dataclass-generated `__init__`s and inherited
  methods count, and so does the base class defining a method; a class merely defined by an import does not.
  Counted per package, and with and without the model's layers (its torch.nn.Module classes).

Usage: python scripts/trace_path.py [--model M] [--list] [-- more score options]
(default: the default model, smollm2-135m; a CPU run). The profiler slows the run: about half a minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] / "apcscore"
SELF = {"self", "cls", "_cls"}


def own(filename: str) -> bool:
    return filename.startswith(str(ROOT))


def where(frame) -> str:
    code = frame.f_code
    path = Path(code.co_filename)
    name = str(path.relative_to(ROOT.parent)) if own(code.co_filename) else path.name
    return f"{name}:{frame.f_lineno} {code.co_qualname}"


def stack_below_command(frame) -> list[str]:
    """The frames from the CLI command function (outermost) to `frame` (innermost), outermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        if own(frame.f_code.co_filename) and frame.f_code.co_filename.endswith("cli.py") \
                and frame.f_code.co_name == "score":
            return [where(f) for f in reversed(frames)]
        frame = frame.f_back
    raise RuntimeError("the CLI command function `score` is not on the stack")


class Tracer:
    def __init__(self) -> None:
        self.stacks: dict[str, list[str]] = {}  # "Engine.run" / "attention forward" -> frames
        self.classes: set[type] = set()

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] in SELF:
            first = frame.f_locals.get(code.co_varnames[0])
            # a class as first argument: its classmethods, construction (__new__) and enum look-ups (__call__);
            # not what processes a class as a module defines it (dataclass, abc, typing)
            if not isinstance(first, type):
                first = type(first)
            elif not (own(code.co_filename) or code.co_name in ("__new__", "__call__")):
                first = None
            owner = code.co_qualname.rpartition(".")[0]  # the class defining the method: a base class, a mixin
            for cls in getattr(first, "__mro__", ())[:1 if not own(code.co_filename) else None]:
                if cls.__module__.startswith("apcscore") and (cls is first or cls.__qualname__ == owner):
                    self.classes.add(cls)
        if not own(code.co_filename):
            return
        if code.co_qualname == "Engine.run" and "Engine.run" not in self.stacks:
            self.stacks["Engine.run"] = stack_below_command(frame)
        elif (code.co_name == "forward" and "/attention/" in code.co_filename
              and "attention forward" not in self.stacks):
            self.stacks["attention forward"] = stack_below_command(frame)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="--model for apcscore score (default: the default model)")
    parser.add_argument("--list", action="store_true", help="list every class met")
    parser.add_argument("rest", nargs="*", help="more `apcscore score` options (after --)")
    args = parser.parse_args()

    from apcscore import cli

    tmp = Path(tempfile.mkdtemp(prefix="trace-path-"))
    data = tmp / "one.jsonl"
    data.write_text(json.dumps({"id": "r0", "prompt": "The quick brown fox jumps over the lazy dog."}) + "\n")
    argv = ["apcscore", "score", str(data), "--out", str(tmp / "out.parquet"), "--quiet", "--prompt-logprobs", "1"]
    argv += (["--model", args.model] if args.model else []) + args.rest
    tracer = Tracer()
    sys.argv = argv
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code:
            print(f"apcscore score exited with {exc.code}", file=sys.stderr)
            return 1
    finally:
        sys.setprofile(None)
        threading.setprofile(None)

    print("command:", " ".join(argv[1:]))
    for target, frames in tracer.stacks.items():
        print(f"\nframes from the CLI command to {target}: {len(frames)} ({len(frames) - 1} before it)")
        for i, line in enumerate(frames, 1):
            print(f"  {i:2d} {line}")
    names = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in tracer.classes)
    layers = sum(issubclass(cls, torch.nn.Module) for cls in tracer.classes)
    per_package = collections.Counter(name.split(".")[1] for name in names)
    print(f"\nthe project's own classes met: {len(names)}, {len(names) - layers} without the model's layers "
          f"({layers} torch.nn.Module classes)")
    print("  per package: " + ", ".join(f"{p} {n}" for p, n in sorted(per_package.items())))
    if args.list:
        print("\n".join(f"  {name}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
