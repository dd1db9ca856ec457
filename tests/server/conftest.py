"""Fixtures of the real-server tests: one `kernelgate serve` process (built-in model) for the
whole session, shared by the modules and the xdist workers (shared_server.py); the same
seeded built-in model in this process, for offline `generate()` and hand computations."""
import pytest
import torch
from shared_server import MAX_LEN, MAX_SEQS, ROOT, run_folder, shared_server

from kernelgate.cli.model import builtin_model


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """Base URL of the running server; its owner stops it at the end as Ctrl-C does, with a
    stream still running, and checks the stream's end, rc 0 within seconds, no traceback in its
    log and no process left."""
    args = ["--max-num-seqs", str(MAX_SEQS), "--max-model-len", str(MAX_LEN), "--log-level", "warning",
            "--shutdown-timeout", "1"]
    with shared_server(run_folder(tmp_path_factory), args, ROOT, ctrl_c=True) as url:
        yield url


@pytest.fixture(scope="session")
def model():
    return builtin_model()


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """The server process and up to two test workers share the CI machine's 2 cores: more
    intra-op threads than that only fight over them (several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
