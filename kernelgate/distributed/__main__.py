"""`python -m kernelgate.distributed RANK SIZE HOST PORT`: a worker rank (started by launch.py)."""
from .worker import main

main()
