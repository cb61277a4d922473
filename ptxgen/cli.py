"""``python -m ptxgen``: list, dump and check kernels.

Commands:

``list``
    kernel families and their canonical specs.
``dump KERNEL [--set key=value ...] [--target sm_90] [--annotate] [--color auto|always|never] [-o FILE]``
    print the PTX of a canonical spec (or a family with its default spec).
``check KERNEL|FILE.ptx [--target sm_90]``
    assemble with ptxas and print registers, spills, shared and local bytes.

Other commands (``run``, ``demo`` ...) are plugins registered under the
``ptxgen.commands`` entry-point group by the packages that provide them.
Exit codes: 0 success, 1 a failed check, 2 bad usage (unknown kernel, key or
value).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from . import registry
from .target import TARGETS

__all__ = ["main", "HelpFormatter"]


class UsageError(Exception):
    pass


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


def build_parser(plugins=None) -> argparse.ArgumentParser:
    fmt = HelpFormatter
    p = argparse.ArgumentParser(prog="python -m ptxgen", formatter_class=fmt,
                                description="ptxgen: build, inspect and check PTX kernels")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("list", help="kernel families and canonical specs", formatter_class=fmt)

    def kernel_args(sp):
        sp.add_argument("kernel", help="canonical spec or family name (see `list`)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field (repeatable)")
        sp.add_argument("--target", choices=list(TARGETS), default=None,
                        help="the PTX target (default: the spec's own)")

    d = sub.add_parser("dump", help="print a kernel's PTX", formatter_class=fmt)
    kernel_args(d)
    d.add_argument("--annotate", action="store_true",
                   help="end each instruction with the Python file:line that built it")
    d.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="syntax colours (auto: on a terminal, with pygments)")
    d.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="write the PTX to FILE instead of stdout")
    c = sub.add_parser("check", help="assemble with ptxas and report resources",
                       formatter_class=fmt)
    c.add_argument("kernel", help="canonical spec or family name (see `list`), or a .ptx file")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field (repeatable)")
    c.add_argument("--target", choices=list(TARGETS), default=None,
                   help="the PTX target (default: the spec's own, or the file's .target)")
    for name, ep in (plugins or {}).items():
        sp = sub.add_parser(name, help=f"(from {ep.value.split(':')[0]})", add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins()
    parser = build_parser(plugins)
    if argv and argv[0] in plugins:
        return int(plugins[argv[0]].load()(argv[1:]) or 0)
    args = parser.parse_args(argv)
    handler = {"list": _cmd_list, "dump": _cmd_dump, "check": _cmd_check}[args.command]
    try:
        return handler(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
