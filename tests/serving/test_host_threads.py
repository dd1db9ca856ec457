"""A serving process on an accelerator runs torch's host ops on one thread unless OMP_NUM_THREADS
says otherwise; on the CPU the threads are the model's and stay as they are."""
import os
import subprocess
import sys

import torch

from kernelgate.serving.host_threads import ENV, serving_threads


def test_choice():
    assert serving_threads(torch.device("cuda"), {}) == 1
    assert serving_threads(torch.device("xpu:1"), {}) == 1
    assert serving_threads(torch.device("cpu"), {}) is None
    assert serving_threads(torch.device("cuda"), {ENV: "6"}) is None          # the user's count is kept
    assert serving_threads(torch.device("cuda"), {ENV: " "}) == 1             # (blank: unset)


def _run(code: str, env: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != ENV} | env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout


APPLY = ("import os, torch; from kernelgate.serving import host_threads as h; "
         "got = h.apply(torch.device('{dev}'), log=print); print('|', got, torch.get_num_threads(), "
         "os.environ.get('OMP_NUM_THREADS'))")


def test_apply_sets_this_process_and_its_children():
    # a fresh process: torch's thread count is process-wide
    out = _run(APPLY.format(dev="cuda"), {})
    assert "1 torch host thread per process on cuda" in out and out.split("|")[1].split() == ["1", "1", "1"], out
    kept = _run(APPLY.format(dev="cuda"), {ENV: "2"})
    assert kept.split("|")[1].split() == ["None", "2", "2"], kept
    cpu = _run(APPLY.format(dev="cpu"), {})
    default = _run("import torch; print('|', torch.get_num_threads())", {}).split("|")[1].split()[0]
    assert cpu.split("|")[1].split() == ["None", default, "None"], cpu
