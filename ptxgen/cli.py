"""``python -m ptxgen``: the command line.

Commands of this package (the DSL):

``list``
    kernel families and their canonical specs.
``dump KERNEL [--set key=value ...] [--target sm_90] [--annotate] [--color auto|always|never] [-o FILE]``
    print the PTX of a canonical spec (or a family with its default spec).
``check KERNEL|FILE.ptx [--target sm_90]``
    assemble with ptxas and print registers, spills, shared and local bytes.

Other commands (``run``, ``chat``, ``serve``, ``info``, ``demo`` ...) are
plugins registered under the ``ptxgen.commands`` entry-point group by the
packages that provide them; the top-level help describes each with the first
line of its function's docstring.  Exit codes: 0 success, 1 a failed check,
2 bad usage (unknown kernel, key or value); an argument error is one
``error:`` line naming the command's ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from . import registry
from .target import TARGETS

__all__ = ["main", "HelpFormatter", "ArgumentParser"]


class UsageError(Exception):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: ``error: MESSAGE (see
    PROG --help)`` and exit code 2, instead of the whole usage first."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where the help text
    already speaks of it or there is none to show (None, False, [])."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or (isinstance(d, list) and not d):
            return text
        return super()._get_help_string(action)


def _resolve(name: str, sets: list[str], target: str | None):
    specs = registry.canonical_specs()
    fams = registry.families()
    if name in specs:
        fam, spec = specs[name]
    elif name in fams:
        # a family name means its first canonical spec (specs may have no
        # defaults for every field, e.g. a GEMV's K)
        fam = fams[name]
        if fam.canonical:
            spec = next(iter(fam.canonical.values()))
        else:
            try:
                spec = fam.spec_cls()
            except (TypeError, ValueError) as e:
                raise UsageError(f"family {name!r} has no canonical spec and no default "
                                 f"spec ({e}); pass a canonical spec name") from None
    else:
        raise UsageError(f"unknown kernel {name!r}; valid: {', '.join(list(specs) + [f for f in fams if f not in specs])}")
    overrides = {}
    for item in sets:
        if "=" not in item:
            raise UsageError(f"--set takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        overrides[key.strip()] = value.strip()
    if target is not None:
        overrides["target"] = target
    try:
        spec = registry.spec_with(spec, overrides)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e).strip('"')) from None
    return fam, spec


def _cmd_list(args) -> int:
    for fam in registry.families().values():
        print(f"{fam.name}: {fam.doc}")
        for cname, spec in fam.canonical.items():
            print(f"    {cname:<28} {spec!r}")
    return 0


def _colorize(text: str, mode: str, stream) -> str:
    if mode == "never" or (mode == "auto" and not (hasattr(stream, "isatty") and stream.isatty())):
        return text
    try:
        from pygments import highlight
        from pygments.formatters import TerminalFormatter
        from pygments.lexers import get_lexer_by_name
    except ImportError:
        if mode == "always":
            raise UsageError("--color always needs pygments: pip install pygments") from None
        return text
    return highlight(text, get_lexer_by_name("ptx"), TerminalFormatter())


def _cmd_dump(args) -> int:
    fam, spec = _resolve(args.kernel, args.set, args.target)
    text = fam.build(spec).to_ptx(annotate=args.annotate)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
        return 0
    sys.stdout.write(_colorize(text, args.color, sys.stdout))
    return 0


def _cmd_check(args) -> int:
    from .ptxas import PtxasError, PtxasNotFound, assemble
    if args.kernel.endswith(".ptx"):
        if not os.path.exists(args.kernel):
            raise UsageError(f"{args.kernel}: no such file")
        if os.path.isdir(args.kernel):
            raise UsageError(f"{args.kernel}: is a directory, not a PTX file")
        with open(args.kernel) as f:
            text = f.read()
        arch = args.target or _target_of(text)
        label = args.kernel
    else:
        fam, spec = _resolve(args.kernel, args.set, args.target)
        text = fam.build(spec).to_ptx()
        arch = spec.target
        label = f"{args.kernel} ({spec!r})"
    try:
        _, reports = assemble(text, arch)
    except PtxasNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PtxasError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{label}: assembles for {arch}")
    print(f"{'kernel':<32}{'regs':>6}{'spill st':>10}{'spill ld':>10}{'stack':>7}{'shared':>8}{'local':>7}")
    for r in reports:
        print(f"{r.name:<32}{r.registers:>6}{r.spill_stores:>10}{r.spill_loads:>10}"
              f"{r.stack_bytes:>7}{r.shared_bytes:>8}{r.local_bytes:>7}")
    return 0


def _target_of(text: str) -> str:
    for line in text.splitlines():
        if line.startswith(".target"):
            return line.split()[1].rstrip(";").split(",")[0]
    return "sm_80"


def _plugins() -> dict:
    return {ep.name: ep for ep in sorted(entry_points(group="ptxgen.commands"),
                                         key=lambda e: e.name)}


#: the order commands are listed in the help (others follow, alphabetically)
_ORDER = ("run", "chat", "serve", "info", "tune", "demo", "list", "dump", "check")

_EPILOG = """\
examples:
  python -m ptxgen run model.gguf -p "Once upon a time" -n 64
  echo "Why is the sky blue?" | python -m ptxgen run model.gguf
  python -m ptxgen chat model.gguf -sys "Answer briefly."
  python -m ptxgen serve model.gguf --port 8080
  python -m ptxgen info model.gguf
  python -m ptxgen dump vector_add

Each command has its own help: python -m ptxgen COMMAND --help"""


class _TopHelp(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    pass


def _summary(ep) -> str:
    """The first line of a plugin command's docstring (loads its module)."""
    try:
        doc = ep.load().__doc__ or ""
    except Exception as e:  # a broken plugin still gets a line in the help
        return f"(unavailable: {type(e).__name__}: {e})"
    return doc.strip().splitlines()[0].rstrip(".") if doc.strip() else ""


def build_parser(plugins=None, describe: bool = False) -> argparse.ArgumentParser:
    """The top-level parser; ``describe`` loads each plugin command to
    show its summary (only the help needs it)."""
    from .version import __version__
    fmt = HelpFormatter
    p = ArgumentParser(prog="python -m ptxgen", formatter_class=_TopHelp, epilog=_EPILOG,
                       description="ptxgen: a pure-Python PTX JIT for LLM inference kernels,\n"
                                   "and a local runner for GGUF models built on it.")
    p.add_argument("--version", action="version", version=f"ptxgen {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    plugins = plugins or {}
    names = [n for n in _ORDER if n in plugins or n in ("list", "dump", "check")]
    names += sorted(n for n in plugins if n not in names)
    for name in names:
        if name in plugins:
            sp = sub.add_parser(name, add_help=False,
                                help=_summary(plugins[name]) if describe else None)
            sp.add_argument("rest", nargs=argparse.REMAINDER)
        elif name == "list":
            sub.add_parser("list", help="list kernel families and their canonical specs",
                           formatter_class=fmt)
        elif name == "dump":
            _add_dump(sub, fmt)
        else:
            _add_check(sub, fmt)
    return p


def _kernel_args(sp):
    sp.add_argument("kernel", help="canonical spec or family name (see `list`)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec field (repeatable)")
    sp.add_argument("--target", choices=list(TARGETS), default=None,
                    help="the PTX target (default: the spec's own)")


def _add_dump(sub, fmt):
    d = sub.add_parser("dump", help="print a kernel's PTX (for a GGUF file: its decode tape "
                                    "and persistent kernel, see `tape`)", formatter_class=fmt)
    _kernel_args(d)
    d.add_argument("--annotate", action="store_true",
                   help="end each instruction with the Python file:line that built it")
    d.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="syntax colours (auto: on a terminal, with pygments)")
    d.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="write the PTX to FILE instead of stdout")


def _add_check(sub, fmt):
    c = sub.add_parser("check", help="assemble a kernel with ptxas and report its resources",
                       formatter_class=fmt)
    c.add_argument("kernel", help="canonical spec or family name (see `list`), or a .ptx file")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field (repeatable)")
    c.add_argument("--target", choices=list(TARGETS), default=None,
                   help="the PTX target (default: the spec's own, or the file's .target)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins()
    command = None
    if argv and argv[0] in plugins:
        command, rest = plugins[argv[0]], argv[1:]
    elif argv[:1] == ["dump"] and len(argv) > 1 and argv[1].endswith(".gguf") and "tape" in plugins:
        # a model file: its decode step's tape and the persistent kernel that runs it
        command, rest = plugins["tape"], [argv[1], "--ptx", *argv[2:]]
    if command is not None:
        try:
            return int(command.load()(rest) or 0)
        except BrokenPipeError:
            _quiet_stdout()
            return 0
    describe = not argv or argv[0] in ("-h", "--help")
    parser = build_parser(plugins, describe=describe)
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    handler = {"list": _cmd_list, "dump": _cmd_dump, "check": _cmd_check}[args.command]
    try:
        return handler(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 0


def _quiet_stdout():
    """After the reader of stdout went away: point stdout at /dev/null so
    that the interpreter's last flush at exit does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
