"""`kernelgate doctor | check | bench | run | serve | bench serve`.

Every error reaches the user as one line on stderr: rc 2 for a bad flag or argument (argparse
style, and every KernelgateError), rc 1 for anything unexpected (`KERNELGATE_DEBUG=1` shows
its traceback).
"""
from __future__ import annotations

import argparse
import os
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line instead of argparse's usage block."""
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _debug() -> bool:
    from .. import envs
    try:
        return envs.get("KERNELGATE_DEBUG")
    except Exception:  # noqa: BLE001 - the error being reported matters more
        return False


def _apply_common(args) -> None:
    from .. import envs
    envs.check_all()          # every KERNELGATE_* value that is set: one line for a bad one
    if getattr(args, "platform", None):
        os.environ["KERNELGATE_PLATFORM"] = args.platform
    if getattr(args, "force", None):
        prev = os.environ.get("KERNELGATE_FORCE", "")
        os.environ["KERNELGATE_FORCE"] = ",".join(filter(None, [prev, *args.force]))
    from .args import apply_env
    apply_env()


def common(p) -> None:
    p.add_argument("--platform", help="simulate a platform for dispatch (cuda, rocm, xpu, npu, mps, cpu)")
    p.add_argument("--force", action="append", metavar="OP=IMPL", help="force an implementation (repeatable)")


def parser() -> Parser:
    from ..version import __version__
    from . import ops, run, serve, warmup
    ap = Parser(prog="kernelgate", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"kernelgate {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    ops.add_parsers(sub, common)
    run.add_parser(sub, common)
    serve.add_parser(sub, common)
    warmup.add_parser(sub, common)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..errors import KernelgateError
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:          # answered before any flag table is built (no torch import)
        from ..version import __version__
        print(f"kernelgate {__version__}")
        return 0
    try:
        if argv[:2] == ["bench", "serve"]:
            from . import bench_serve
            args = bench_serve.parser(Parser).parse_args(argv[2:])
        else:
            args = parser().parse_args(argv)
            _apply_common(args)
        return args.fn(args)
    except SystemExit as e:            # argparse: --help, --version, a bad flag
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KernelgateError as e:
        print(f"kernelgate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kernelgate: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback on request
        if _debug():
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"kernelgate: error: {type(e).__name__}: {msg} (KERNELGATE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
