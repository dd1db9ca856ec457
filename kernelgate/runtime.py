"""`kernelgate run`: placeholder wiring; the model runtime replaces `main` (issue 7)."""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint folder (default: built-in small model)")


def main(args) -> int:
    from .cli import doctor_report
    for name, entry in doctor_report()["ops"].items():
        print(f"{name:<36} -> {entry['chosen']}")
    print("kernelgate run: the model runtime is not built yet")
    return 1
