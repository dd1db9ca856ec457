"""`kernelgate doctor | check | bench OP`: the registry's view of this machine."""
from __future__ import annotations

import functools
import json

from ..errors import KernelgateError


def doctor_report() -> dict:
    from .. import platform, registry
    from ..ops.common import pdl
    plat = platform.current()
    report = {"platform": plat.as_dict(), "collectives": platform.collective_line(plat), "launches": pdl.line(plat),
              "ops": {}}
    for name, op in sorted(registry.ops().items()):
        rows = op.explain()
        chosen = next((i.name for i, r in rows if r is None), None)
        report["ops"][name] = {
            "chosen": chosen,
            "note": op.note(plat) if op.note else None,
            "implementations": [
                {"name": i.name, "provider": i.provider, "priority": i.priority,
                 "platforms": sorted(i.platforms), "chosen": r is None, "reason": r}
                for i, r in rows],
        }
    return report


def doctor(args) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    p = report["platform"]
    sim = f" (simulated; real: {p['real']})" if p["simulated"] else ""
    print(f"platform  {p['platform']}{sim}   device {p['device']} {p['device_name'] or ''} {p['capability'] or ''}")
    print(f"triton    {p['triton']}   side streams: {'yes' if p['streams'] else 'no'}")
    print(report["collectives"])
    print(report["launches"])
    print("libraries " + ", ".join(f"{k}: {v}" for k, v in p["libraries"].items()))
    print()
    print(f"{'op':<36} {'implementation':<22} {'provider':<12} reason")
    for name, entry in report["ops"].items():
        for i, impl in enumerate(entry["implementations"]):
            mark = "-> " if impl["chosen"] else "   "
            reason = "chosen" if impl["chosen"] else impl["reason"]
            print(f"{name if i == 0 else '':<36} {mark}{impl['name']:<19} {impl['provider']:<12} {reason}")
        if entry["note"]:
            print(f"{'':<36}    note: {entry['note']}")
    return 0


def _known(names: list[str], what: str) -> None:
    from .. import registry
    known = registry.ops()
    for n in names:
        if n not in known:
            raise KernelgateError(f"{what}: unknown op {n!r} (known: {', '.join(sorted(known))})")


def bench(args) -> int:
    from .. import registry
    from ..tools import benchmark
    from .progress import Progress
    names = sorted(registry.ops()) if args.op == "all" else [args.op]
    _known(names, "bench")
    # every name asked for is checked before anything is measured
    for flag, asked, known in (("implementation", args.impl, [i for n in names for i in (*registry.get(n).impls,
                                                                                        "native-compiled")]),
                               ("bench case", args.case, [c.id for n in names for c in registry.get(n).bench_cases()])):
        missing = [a for a in asked or [] if a not in known]
        if missing:
            raise KernelgateError(f"bench: {args.op} has no {flag} named {missing[0]!r} "
                                  f"(known: {', '.join(dict.fromkeys(known))})")
    from .. import platform
    plat = platform.current()
    native_compiled = not args.no_compile and platform.default_device().type != "cpu"
    runnable, why = {}, []
    for name in names:
        impls = [i for i in registry.get(name).impls.values() if not args.impl or i.name in args.impl]
        why += [f"{i.name}: {i.unavailable(plat)}" for i in impls if i.unavailable(plat)]
        runnable[name] = any(not i.unavailable(plat) for i in impls) or (
            native_compiled and (not args.impl or "native-compiled" in args.impl))
    if not any(runnable.values()):     # before anything is measured or written
        raise KernelgateError(f"bench: no implementation of {args.op} runs on this platform"
                              + (f" ({'; '.join(why[:4])})" if why else ""))
    wrote = 0
    for name in names:
        cases = [c.id for c in registry.get(name).bench_cases() if not args.case or c.id in args.case]
        if not cases or not runnable[name]:
            continue
        result = None
        # one case at a time, so a long run shows where it is; the copy bandwidth (the
        # reference for GB/s) is measured once, not once per case
        measure = benchmark.copy_bandwidth
        benchmark.copy_bandwidth = functools.lru_cache(maxsize=None)(measure)
        try:
            with Progress(f"bench {name}", len(cases), quiet=False) as bar:
                for case in cases:
                    part = benchmark.run(name, cases=[case], compile_native=not args.no_compile, impls=args.impl)
                    if result is None:
                        result = part
                    else:
                        result["rows"] += part["rows"]
                    bar.advance(1)
        finally:
            benchmark.copy_bandwidth = measure
        if not result["rows"]:        # nothing ran here: the results saved before stay
            continue
        j, m = benchmark.write(result, args.out)
        wrote += 1
        print(benchmark.markdown(result))
        print(f"wrote {j} and {m}")
    if not wrote:
        raise KernelgateError(f"bench: no implementation of {args.op} took any of its cases here; nothing written")
    return 0


def check(args) -> int:
    from .. import platform, registry
    from ..tools.testing import check_impl
    _known(args.op, "check")
    device = platform.default_device()
    failed = passed = skipped = 0
    for name, op in sorted(registry.ops().items()):
        if args.op and name not in args.op:
            continue
        for impl in op.impls.values():
            if impl.name == "native":
                continue
            for case in op.cases():
                for dtype in case.dtypes:
                    label = f"{name}/{impl.name}/{case.id}/{str(dtype)[6:]}"
                    try:
                        skip = check_impl(op, impl, case, dtype, device)
                    except AssertionError as e:
                        failed += 1
                        print(f"FAIL {label}: {e}")
                        continue
                    if skip:
                        skipped += 1
                        if args.verbose:
                            print(f"skip {label}: {skip}")
                    else:
                        passed += 1
                        if args.verbose:
                            print(f"ok   {label}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def add_parsers(sub, common) -> None:
    p = sub.add_parser("doctor", help="show the implementation chosen for every op, and why not the others")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=doctor)

    p = sub.add_parser("bench", help="time every implementation of an op on this device "
                                     "('kernelgate bench serve --help': load a running server)")
    common(p)
    p.add_argument("op", help="op name, or 'all'")
    p.add_argument("--case", action="append", help="only this bench case (repeatable)")
    p.add_argument("--impl", action="append", help="only this implementation (repeatable)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the native reference")
    p.add_argument("--out", default="bench/results", help="folder for JSON + markdown")
    p.set_defaults(fn=bench)

    p = sub.add_parser("check", help="run every implementation against the native reference")
    common(p)
    p.add_argument("op", nargs="*")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(fn=check)
