"""`python -m kernelgate.executor.parallel RANK SIZE HOST PORT`: a worker rank (started by
kernelgate/distributed/launch.py)."""
from .worker import main

main()
